"""A judge's verdicts in a training step, counted over the processes, and the stop when too many
failed: a judge scoring failures 0 (on_failure "zero") would otherwise train on zeros as if it had
said no (train.py's reward_stage; the judge itself is agent/judge.py).

    before = judge_counts(judge)
    ...score the step's records...
    row = judge_row(judge, before, world)   # {"judge/failures": 3, "judge/verdicts": 128, "judge/failure_rate": 0.023}
    check_judge(judge, row, cfg.train.judge_max_failure_rate, world)   # TrainingFault over the limit
"""

from __future__ import annotations

import torch

from trainer.config import TrainingFault
from trainer.distributed import all_reduce, gather_lists


def judge_counts(judge) -> tuple[int, int]:
    """(failed verdicts, verdicts asked) so far by this process's judge; (0, 0) without one."""
    return (getattr(judge, "failures", 0), getattr(judge, "asked", 0)) if judge is not None else (0, 0)


def judge_row(judge, before: tuple[int, int], world: int) -> dict:
    """The judge since `before` (judge_counts), over the processes: judge/failures, judge/verdicts
    (asked) and judge/failure_rate (failures / verdicts, 0 when none were asked); {} without a
    judge. Every rank calls it (a collective)."""
    if judge is None:
        return {}
    now = judge_counts(judge)
    delta = torch.tensor([now[0] - before[0], now[1] - before[1]], dtype=torch.float64)
    failed, asked = (int(x) for x in all_reduce(delta, world).tolist())
    return {"judge/failures": failed, "judge/verdicts": asked, "judge/failure_rate": failed / asked if asked else 0.0}


def check_judge(judge, row: dict, limit: float, world: int) -> None:
    """A TrainingFault when more than `limit` (train.judge_max_failure_rate) of the step's verdicts
    failed, naming the judge, the rate, the key and the last failure's cause. Every rank calls it."""
    if row.get("judge/failure_rate", 0.0) <= limit:
        return
    mine = getattr(judge, "last_failure", "")
    cause = next(iter(gather_lists([mine] if mine else [], world)), "not recorded")
    where = getattr(judge, "url", "") or judge.model
    raise TrainingFault(f"judge {where}: {row['judge/failures']} of {row['judge/verdicts']} verdicts failed "
                        f"({row['judge/failure_rate']:.0%}), more than train.judge_max_failure_rate {limit:g}; "
                        f"not training on their zeros. Last failure: {' '.join(cause.split())}")  # fmt: skip
