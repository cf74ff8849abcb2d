"""BAPO's boundary machinery around its reward (rewards.bapo, BAPO eq. 3, 5, 6 and §4.2).

    BapoState             the adaptive modulator's stage: exploration -> plateau after `patience`
                          validation scores without improvement (train.py feeds it)
    bapo_correct          R_correct (eq. 3): F1 with a valid format, -1 otherwise
    bapo_solved           is a rollout "correct" for eq. 5's group test and for resampling
    bapo_resample_groups  the groups train.py rolls out again: none correct, none said IDK

The reward itself, R_correct + R_IDK gated by the modulator, stays in rewards.py's table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agent.answers import char_f1, exact_match, f1_score, golden_of, parsed


@dataclass
class BapoState:
    """The adaptive modulator's stage (§4.2), driven by the trainer's validation signal."""

    stage: str = "exploration"  # -> "plateau" after `patience` evaluations without improvement
    best: float = -math.inf
    since_best: int = 0
    patience: int = 5  # docs/design.md §4: 5 evaluations (the paper: "e.g. 5 consecutive steps")
    min_delta: float = 0.0  # a score must beat the best by more than this to count as improvement

    def update(self, val_score: float) -> str:
        """Feed one validation score; returns the (possibly switched) stage.

        >>> s = BapoState(patience=1, min_delta=0.05)
        >>> [s.update(v) for v in (0.49, 0.52)]  # +0.03 is not an improvement of more than 0.05
        ['exploration', 'plateau']
        """
        if val_score > self.best + self.min_delta:
            self.best, self.since_best = val_score, 0
        else:
            self.since_best += 1
        if self.stage == "exploration" and self.since_best >= self.patience:
            self.stage = "plateau"
        return self.stage


def bapo_correct(record: dict, f1_unit: str = "char", **_) -> float:
    """R_correct (eq. 3): F1 with a valid format, -1 otherwise. The paper's F1 is character-level
    (BAPO §2.2); f1_unit="word" gives SQuAD's. An IDK answer scores 0 (char-F1 of "I DON'T KNOW"
    against a name is usually > 0; the paper is silent)."""
    p = parsed(record)
    if not p.format_ok:
        return -1.0
    if p.idk:
        return 0.0
    return (f1_score if f1_unit == "word" else char_f1)(p.answer, golden_of(record))


def bapo_solved(record: dict, f1_unit: str = "char", correct: str = "em", **_) -> bool:
    """Is this rollout "correct" for eq. 5's group test and for resampling ("no correct rollout")?

    correct "em" (the default): a well-formed answer that matches a golden answer exactly
    (after SQuAD normalisation). "reward": R_correct > 0, eq. 5 read literally. With the paper's
    character F1 the literal reading almost never finds a group with no correct rollout: two
    different names share letters (char-F1 of "Paris" against "Berlin" is 0.36), so R_IDK and
    the resampling would go inert. EM keeps the paper's meaning, "no rollout found the answer",
    in any F1 unit; R_correct itself (the reward) stays F1.
    """
    if correct == "reward":
        return bapo_correct(record, f1_unit) > 0
    p = parsed(record)
    return p.format_ok and not p.idk and exact_match(p.answer, golden_of(record)) >= 1


def bapo_resample_groups(records: list[dict], f1_unit: str = "char", correct: str = "em", **_) -> list[str]:
    """Group ids to roll out again (BAPO §4.2, up to k = 2 more times, the trainer counts):
    no rollout correct (bapo_solved) and none said IDK. Takes the reward's own parameters
    (train.reward_params), so "correct" is judged as the reward judges it."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(str(r.get("group_id")), []).append(r)
    return [g for g, rs in groups.items() if not any(bapo_solved(r, f1_unit, correct) or parsed(r).idk for r in rs)]
