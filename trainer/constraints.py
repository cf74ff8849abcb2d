"""Lagrangian constraints on GRPO: the Deliberative Searcher's dual update, for any number of
constraints named in config.

Deliberative Searcher (§2.1, eq. 3-4, Algorithm 1) solves  max_theta min_{lambda >= 0}
R(theta) + sum_i lambda_i (U_i(theta) - a_i)  by alternating a GRPO step on theta with a
multiplicative-weights step on each dual variable:

    lambda <- lambda * exp(eta * (a - U))        (constraint U >= a; "<=" flips the sign)

so lambda grows while the constraint is violated and shrinks once it holds. Paper defaults
(§3.2): lambda0 = 0.01, eta = 0.1, a = 0.9, and the constrained term is off for the first
quarter of training; lambda starts at lambda0 when it comes on. Worked example: U = 0.5 below
a = 0.9 gives lambda * exp(0.1 * 0.4) = 1.041 lambda per step, about x1.5 in 10 steps; U = 0.95
gives 0.995 lambda per step.

A constraint in `train.constraints` (YAML list of mappings):

    - name: reliability          # names the logged series lambda/<name>, constraint/<name>
      stat: reward/reliability   # a batch mean of a reward component (or an eval metric)
      threshold: 0.9             # a
      direction: ">="            # U >= a  (or "<=")
      lambda0: 0.01
      eta: 0.1
      warmup_frac: 0.25          # share of the steps with the term off
      fixed_lambda: null         # a number: the fixed-lambda ablation (no dual update)
      lambda_max: null           # a number: lambda is kept <= it (a bounded dual variable)
      measure: train             # U from the training batch, or "val" (each evaluation)
      param: lam                 # the reward parameter that receives lambda (deliberative's
                                 # eq. 6 lambda r_reliab); empty: the trainer adds
                                 # lambda * (c_i - a) (sign-flipped for "<=") to each reward

U on the training batch comes from the rollouts of the policy just before the update, so the
lambda used at step k+1 has seen U(theta_k): one step later than Algorithm 1's U(theta_{k+1}),
which would need a second rollout per step.

Why bound lambda: in eq. 6 a wrong, unsure answer earns 0.1 + lambda and a right, unsure one
0.9 + 0.1, so once lambda > 0.9 a policy whose confidence cannot follow its correctness is
paid to be wrong (measured: results/LOG.md, Deliberative Searcher: validation EM 0.525 -> 0.260
between steps 10 and 20 as lambda passed 2). `lambda_max: 0.8` keeps the order right > wrong at
every confidence, though among unsure answers the correctness signal is still only 0.1.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from trainer.config import ConfigError


@dataclass
class Constraint:
    name: str
    stat: str
    threshold: float = 0.9
    direction: str = ">="
    lambda0: float = 0.01
    eta: float = 0.1
    warmup_frac: float = 0.25
    fixed_lambda: float | None = None
    lambda_max: float | None = None
    measure: str = "train"
    param: str = ""
    lam: float = 0.0  # the dual variable; set to lambda0 when the term comes on
    active: bool = False
    last_value: float | None = None  # the latest U


def parse_constraints(specs: list) -> list[Constraint]:
    """Constraints from config; an unknown or missing key, or a bad value, names the constraint."""
    allowed = {f.name for f in fields(Constraint)} - {"lam", "active", "last_value"}
    out = []
    for n, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise ConfigError(f"train.constraints[{n}] must be a mapping, got {spec!r}")
        where = f"train.constraints[{n}] ({spec.get('name', '?')})"
        unknown = set(spec) - allowed
        if unknown:
            raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(allowed))})")
        for key in ("name", "stat"):
            if not spec.get(key):
                raise ConfigError(f"{where}: '{key}' is required")
        c = Constraint(**spec)
        if c.direction not in (">=", "<="):
            raise ConfigError(f"{where}: direction must be '>=' or '<=', got {c.direction!r}")
        if c.measure not in ("train", "val"):
            raise ConfigError(f"{where}: measure must be 'train' or 'val', got {c.measure!r}")
        if c.lambda0 <= 0 or c.eta < 0:
            raise ConfigError(f"{where}: lambda0 must be > 0 and eta >= 0")
        if c.lambda_max is not None and c.lambda_max < c.lambda0:
            raise ConfigError(f"{where}: lambda_max ({c.lambda_max}) must be >= lambda0 ({c.lambda0})")
        out.append(c)
    return out


def switch_on(constraints: list[Constraint], step: int, total_steps: int) -> None:
    """Turn each constraint's term on once its warm-up share of the steps has passed."""
    for c in constraints:
        if not c.active and step >= c.warmup_frac * total_steps:
            c.active = True
            c.lam = c.fixed_lambda if c.fixed_lambda is not None else c.lambda0


def current_lambda(c: Constraint) -> float:
    """The multiplier applied to the reward now: 0 during warm-up."""
    return c.lam if c.active else 0.0


def dual_update(c: Constraint, value: float) -> float:
    """lambda <- lambda exp(eta (a - U)) for U >= a (exp(eta (U - a)) for U <= a), then at
    most lambda_max; records U. A fixed-lambda constraint, or one still warming up, only records U."""
    c.last_value = value
    if c.active and c.fixed_lambda is None:
        gap = c.threshold - value if c.direction == ">=" else value - c.threshold
        c.lam *= math.exp(c.eta * gap)
        if c.lambda_max is not None:
            c.lam = min(c.lam, c.lambda_max)
    return c.lam


def batch_statistic(stat: str, records: list[dict]) -> float:
    """The batch mean of a reward component: stat 'reward/<key>' reads reward_components[key]
    (a missing component counts 0), 'reward' the final reward."""
    if stat == "reward":
        return sum(r["reward"] for r in records) / len(records)
    key = stat.removeprefix("reward/")
    return sum(float(r["reward_components"].get(key, 0.0)) for r in records) / len(records)


def apply_to_rewards(constraints: list[Constraint], records: list[dict]) -> None:
    """For constraints without a reward `param`: r_i += lambda * (c_i - a) (negated for '<='),
    the per-rollout form of lambda (U - a) whose batch mean is the Lagrangian's term."""
    for c in constraints:
        lam = current_lambda(c)
        if c.param or lam == 0.0:
            continue
        sign = 1.0 if c.direction == ">=" else -1.0
        for r in records:
            value = batch_statistic(c.stat, [r])
            r["reward"] += lam * sign * (value - c.threshold)


def step(constraints: list[Constraint], records: list[dict]) -> dict:
    """One training step's constraint work on the scored batch, in Algorithm 1's order:

      1. U_i of each train-measured constraint, from the rewards as scored: before any
         Lagrangian term is added, so a constraint on stat `reward` sees R, not R + lambda (U - a);
      2. the term of each constraint without a `param`, added to the rewards (apply_to_rewards);
      3. the dual update of each train-measured constraint with its U_i.

    Returns the log row: lambda/<name> as this step's rewards used it (the updated value is the
    next step's) and constraint/<name> = U_i.

    >>> c = Constraint(name="r", stat="reward", active=True, lam=0.5, threshold=0.9)
    >>> records = [{"reward": 1.0}, {"reward": 0.0}]
    >>> row = step([c], records)
    >>> row, [r["reward"] for r in records]  # U = 0.5 from the raw rewards; terms 0.5 (c_i - 0.9)
    ({'lambda/r': 0.5, 'constraint/r': 0.5}, [1.05, -0.45])
    """
    row = {f"lambda/{c.name}": current_lambda(c) for c in constraints}
    measured = [(c, batch_statistic(c.stat, records)) for c in constraints if c.measure == "train"]
    apply_to_rewards(constraints, records)
    for c, value in measured:
        dual_update(c, value)
    return row | {f"constraint/{c.name}": c.last_value for c in constraints if c.last_value is not None}


def reward_params(constraints: list[Constraint], params: dict) -> dict:
    """The reward's parameters with each `param` constraint's current lambda filled in."""
    return dict(params) | {c.param: current_lambda(c) for c in constraints if c.param}


def state(constraints: list[Constraint]) -> list[dict]:
    return [asdict(c) for c in constraints]


def restore(constraints: list[Constraint], saved: list[dict]) -> None:
    """Put back lambda, the on/off state and U from a checkpoint (matched by name)."""
    by_name = {s["name"]: s for s in saved}
    for c in constraints:
        if c.name in by_name:
            s = by_name[c.name]
            c.lam, c.active, c.last_value = s["lam"], s["active"], s["last_value"]
