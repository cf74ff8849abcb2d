"""Experiment tracking: the scalars of metrics.jsonl, step by step, in TensorBoard and / or
Weights & Biases (`train.report_to`), and the short table a run prints when it ends.

    train:
      report_to: [tensorboard]          # RUN_DIR/tensorboard/: `tensorboard --logdir runs/`
      report_to: [tensorboard, wandb]   # W&B as well; WANDB_MODE=offline works without a network

Each metrics row is flattened the way TensorBoard groups tags: {"time": {"generate": 1.2}} is
`time/generate`, the validation metrics are `eval/em`, `eval/em_2hop`, ...; strings and lists
(BAPO's stage name) are left out. So the same numbers as metrics.jsonl, under the same names:

    >>> flat_scalars({"step": 3, "reward": 0.5, "time": {"sync": 0.1}, "bapo_stage": "plateau"})
    {'reward': 0.5, 'time/sync': 0.1}
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

from trainer.config import Config, ConfigError, config_to_dict
from trainer.distributed import all_reduce

try:
    from torch.utils.tensorboard import SummaryWriter
except ImportError:  # the tensorboard package is not installed: report_to: [tensorboard] says so
    SummaryWriter = None
# wandb is imported only by a run that reports to it: its import costs ~0.8 s (2-core AMD EPYC)
# in every train.py process, a config error's one line included
HAVE_WANDB = importlib.util.find_spec("wandb") is not None

def flat_scalars(row: dict, prefix: str = "") -> dict[str, float]:
    """Every finite number of a metrics row (nested dicts joined with '/'), but the step itself."""
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flat_scalars(value, f"{name}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and name != "step":
            if math.isfinite(value):
                out[name] = float(value)
    return out


def check_report_to(cfg: Config) -> None:
    """A tracker whose package is missing fails before anything slow starts (names are checked by
    config.load_config)."""
    for name in cfg.train.report_to:
        if name == "tensorboard" and SummaryWriter is None:
            raise ConfigError("train.report_to: tensorboard needs the tensorboard package (pip install tensorboard)")
        if name == "wandb" and not HAVE_WANDB:
            raise ConfigError("train.report_to: wandb needs the wandb package (pip install wandb)")


def open_trackers(cfg: Config, run: Path, resumed: bool) -> list:
    """The trackers of `train.report_to` for this run directory (TensorBoard writes into
    RUN_DIR/tensorboard; W&B names the run after the directory and resumes it on --resume)."""
    check_report_to(cfg)
    trackers = []
    if "tensorboard" in cfg.train.report_to:
        trackers.append(SummaryWriter(log_dir=str(run / "tensorboard")))
    if "wandb" in cfg.train.report_to:
        import wandb  # only here: see HAVE_WANDB

        trackers.append(wandb.init(project=cfg.train.wandb_project, name=run.name, id=run.name, dir=str(run),
                                   config=config_to_dict(cfg), resume="allow" if resumed else None))  # fmt: skip
    return trackers


def track(trackers: list, row: dict) -> None:
    """Send one metrics row (with its "step") to every tracker."""
    scalars, step = flat_scalars(row), int(row["step"])
    for t in trackers:
        if SummaryWriter is not None and isinstance(t, SummaryWriter):
            for name, value in scalars.items():
                t.add_scalar(name, value, step)
            t.flush()
        else:  # a wandb Run
            t.log(scalars, step=step)


def close_trackers(trackers: list) -> None:
    for t in trackers:
        if SummaryWriter is not None and isinstance(t, SummaryWriter):
            t.close()
        else:
            t.finish()


SUMMARY_KEYS = (  # (metric, label): what the end-of-run table shows, where the evaluation has it
    ("em", "EM, all"),
    ("em_1hop", "EM, 1-hop"),
    ("em_2hop", "EM, 2-hop"),
    ("em_answerable", "EM, answerable"),
    ("idk_unanswerable", "IDK, unanswerable"),
    ("searches_per_question", "searches / question"),
    ("searches_2hop", "searches / 2-hop q"),
    ("ds_reliability", "reliability"),
    ("info_think", "info-think"),
)


def summary_table(before: dict, after: dict, steps: int, minutes: float) -> str:
    """The short human table at the end of a run: validation before -> after, per benchmark (the
    validation file's data_sources, eval.summarize) and per question type.

    >>> print(summary_table({"em": 0.1, "em_2hop": 0.0}, {"em": 0.5, "em_2hop": 0.4}, 20, 3.2))
    validation after 20 steps (3.2 min)   before   after
      EM, all                              0.100   0.500  (+0.400)
      EM, 2-hop                            0.000   0.400  (+0.400)
    """
    lines = [f"{f'validation after {steps} steps ({minutes:.1f} min)':<37} {'before':>6}   {'after':>5}"]
    per_benchmark = [(k, f"EM, {k.removeprefix('em/')}") for k in sorted(after) if k.startswith("em/")]
    for key, label in [*SUMMARY_KEYS[:1], *per_benchmark, *SUMMARY_KEYS[1:]]:
        b = before.get(key)
        if key in after and (key.startswith("em") or after[key] or b):  # 0 -> 0: a metric this run has not
            first = f"{b:6.3f}" if b is not None else f"{'–':>6}"
            delta = f"  ({after[key] - b:+.3f})" if b is not None else ""
            lines.append(f"  {label:<35} {first}   {after[key]:.3f}{delta}")
    return "\n".join(lines)


# The quick start's effect on the tiny world: 2-hop EM up by 0.5 or more in 9 of 10 seeds
# (results/quickstart_seeds.md). Under half of it, the effect did not appear.
EFFECT_2HOP = 0.25
# A start that copies the answer off the passage gets most 1-hop questions (0.79-0.84 measured);
# one that does not, almost none (<= 0.05, results/quickstart_seeds.md): 0.5 tells them apart.
COPIES_1HOP = 0.5


def effect_note(before: dict, after: dict, steps: int) -> str:
    """One plain line under the end-of-run table when validation did not improve: 2-hop EM up by
    less than EFFECT_2HOP (a tiny-world run), else EM not up at all; "" otherwise. It says what to
    try, since a run that learned nothing looks, in its table, much like one that did.

    >>> effect_note({"em_2hop": 0.04}, {"em_2hop": 0.10}, 10)[:62]
    'the effect did not appear: 2-hop EM rose by +0.060 in 10 steps'
    >>> "raise sft.steps" in effect_note({"em_1hop": 0.03, "em_2hop": 0.03}, {"em_2hop": 0.02}, 20)
    True
    >>> effect_note({"em_2hop": 0.07}, {"em_2hop": 0.76}, 10)
    ''
    """
    key = "em_2hop" if "em_2hop" in before and "em_2hop" in after else "em"
    if key not in before or key not in after:
        return ""
    gain = after[key] - before[key]
    if gain >= (EFFECT_2HOP if key == "em_2hop" else 1e-9):
        return ""
    what = "2-hop EM" if key == "em_2hop" else "EM"
    head = f"the effect did not appear: {what} rose by {gain:+.3f} in {steps} steps. "
    if before.get("em_1hop", 1.0) < COPIES_1HOP:  # the start cannot copy an answer off a passage
        return head + (f"The start answers {before['em_1hop']:.2f} of 1-hop questions: its SFT did not learn to copy "
                       "from the passage; raise sft.steps (results/quickstart_seeds.md)")  # fmt: skip
    return head + (f"Try more steps (--set train.steps={2 * max(steps, 5)}) or another --set train.seed=1: when "
                   "the second search is found varies by run (results/quickstart_seeds.md)")  # fmt: skip


# The step's times and GPU memory, as the metrics row gives them (train.py).


def slowest(seconds: float, world: int) -> float:
    """A stage's wall time over the processes: the step waits for the slowest rank."""
    return float(all_reduce(torch.tensor([seconds], dtype=torch.float64), world, "max"))


def stage_peak_gib(world: int) -> float:
    """On a GPU: the most memory torch's allocator held since the last call, in GiB, the largest
    over the processes; then the count restarts, so each call measures one stage. It counts the
    trainer's tensors and, in the same process, vLLM's weights and KV cache (run_setup.RunParts.engine_gib
    is their share at start). 0.0 on a CPU."""
    if not torch.cuda.is_available():
        return 0.0
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return float(all_reduce(torch.tensor([peak], dtype=torch.float64), world, "max"))
