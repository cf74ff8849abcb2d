"""Scoring a batch with a reward spec: rewards.py's compute and score, the part a fork never edits.

Each term of the spec runs on every record (a group reward, marked `fn.group = True`, on each
group's list), its output is checked (a non-numeric or non-finite reward, component or turn
reward stops the step: TrainingFault naming the reward and a group), and the terms are summed
with their weights, turn rewards turn by turn:

    >>> _add_turns([None, 0.5], [1.0, None], 2.0)
    [2.0, 0.5]
"""

from __future__ import annotations

import math

from trainer import reward_spec
from trainer.config import TrainingFault


def compute(records: list[dict], spec: str, terms: list[tuple[float, str]], params: dict, judge,
            table: dict) -> list[dict]:  # fmt: skip
    """rewards.compute's work: each term of the spec (its function from `table`, or module:function)
    on every record or group, checked finite, summed with its weight; with the judge (or the
    stand-in) that judge.asked_at_once gives it."""
    out = [{"reward": 0.0, "components": {}} for _ in records]
    for w, name in terms:
        fn = reward_spec.reward_fn(name, table)
        if getattr(fn, "group", False):
            parts = [None] * len(records)
            for idx in _group_by(records).values():
                for i, comp in zip(idx, fn([records[i] for i in idx], judge=judge, **params)):
                    parts[i] = comp
        else:
            parts = [fn(r, judge=judge, **params) for r in records]
        _check_finite(name, parts, records)
        for o, comp in zip(out, parts):
            value = float(comp["reward"])
            o["reward"] += w * value
            numeric = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in comp.items()
                       if k != "turn_rewards"}  # fmt: skip
            if len(terms) == 1:
                o["components"] = numeric
            else:  # each term's scalar, and its own components beside it
                o["components"][name] = value
                o["components"] |= {f"{name}/{k}": v for k, v in numeric.items() if k != "reward"}
            if comp.get("turn_rewards") is not None:
                o["turn_rewards"] = _add_turns(o.get("turn_rewards"), comp["turn_rewards"], w)
    _check_finite(spec, out, records)  # a weighted sum that overflowed
    return out


def _add_turns(total: list | None, turns: list, w: float) -> list:
    """total + w x turns, turn by turn; None + None stays None (a turn nothing scores)."""
    total = list(total or [None] * len(turns))
    return [a if b is None else (b * w if a is None else a + w * b) for a, b in zip(total, turns)]


def _group_by(records: list[dict]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(str(r.get("group_id", r.get("id", i))), []).append(i)
    return groups


def _check_finite(name: str, parts: list[dict], records: list[dict]) -> None:
    """A non-finite (or non-numeric) reward or numeric component stops the step with a
    TrainingFault naming the reward, how many rollouts and one group: passed on, one NaN would
    make its group's advantages, then the loss and every weight, NaN (and 0 in its place would
    teach the policy a reward that was never computed)."""
    bad = []
    for i, comp in enumerate(parts):
        try:
            values = [("reward", float(comp["reward"]))]
        except (TypeError, ValueError, KeyError):
            gid = records[i].get("group_id")
            raise TrainingFault(f"non-numeric reward from {name!r}: {comp!r} for a rollout of group_id {gid!r} "
                                f"(a dict with a numeric 'reward' is needed)") from None  # fmt: skip
        values += [(k, v) for k, v in comp.items() if k != "reward" and isinstance(v, (int, float))]
        turns = comp.get("turn_rewards")
        if turns is not None and not isinstance(turns, list):
            raise TrainingFault(f"turn_rewards from {name!r} must be a list (one value per action turn), got "
                                f"{type(turns).__name__}")  # fmt: skip
        values += [("turn_rewards", float(v)) for v in turns or [] if v is not None]
        wrong = [(k, v) for k, v in values if not math.isfinite(v)]
        if wrong:
            bad.append((i, *wrong[0]))
    if bad:
        i, key, value = bad[0]
        what = "non-finite reward" + (f" component {key!r} of" if key != "reward" else " from") + f" {name!r}"
        raise TrainingFault(f"{what}: {value} for {len(bad)} of {len(records)} rollouts (first: group_id "
                            f"{records[i].get('group_id')!r}), not passed on to the advantages; check the reward "
                            f"function or its judge")  # fmt: skip
