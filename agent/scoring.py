"""Scoring a batch with a reward spec: rewards.py's compute and score, the part a fork never edits.

Each term of the spec runs on every record (a group reward, marked `fn.group = True`, on each
group's list), its output is checked, and the terms are summed with their weights, turn rewards
turn by turn:

    >>> _add_turns([None, 0.5], [1.0, None], 2.0)
    [2.0, 0.5]

The check: whatever a reward does wrong stops the step with one line (TrainingFault) naming the
reward and the record (its index in the batch, question_id, sample and group_id), before the
advantages and the optimizer, and before anything is written: passed on, one NaN makes its
group's advantages, the loss and every weight NaN; a string or a numpy scalar fails only when
the samples are written, after the optimizer step; 0 in its place would teach a reward that was
never computed. Refused: a reward that raises (the exception, its innermost line); one that does
not return a dict with str keys (a group reward: a list of one per rollout of the group); a
"reward" that is not a real number (a str such as "0.5", a bool, None), not finite, or beyond
+-LIMIT (an int such as 10**400 included); a component that is not a real number or not finite;
turn_rewards that are not a list of one value (a real number or None) per action turn of the
record. A numpy scalar is a real number: taken, as a float; so is a bool component (1.0 / 0.0).
"""

from __future__ import annotations

import math
import numbers
import traceback
from pathlib import Path

import numpy as np

from agent.steps import action_turns
from trainer import reward_spec
from trainer.config import TrainingFault

# The largest |reward| or |turn reward| taken: GRPO's std squares the rewards of a group (and MT-GRPO
# its turn rewards), which overflows float64 past ~1e154 into an inf std, then advantages of 0 (or
# NaN) without a word. No reward that means anything comes near it.
LIMIT = 1e100


def compute(records: list[dict], spec: str, terms: list[tuple[float, str]], params: dict, judge,
            table: dict) -> list[dict]:  # fmt: skip
    """rewards.compute's work: each term of the spec (its function from `table`, or module:function)
    on every record or group, checked (module docstring), summed with its weight; with the judge
    (or the stand-in) that judge.asked_at_once gives it."""
    out = [{"reward": 0.0, "components": {}} for _ in records]
    for w, name in terms:
        parts = _checked(name, _call(name, reward_spec.reward_fn(name, table), records, judge, params), records)
        for o, (value, components, turns) in zip(out, parts):
            o["reward"] += w * value
            if len(terms) == 1:
                o["components"] = components
            else:  # each term's scalar, and its own components beside it
                o["components"][name] = value
                o["components"] |= {f"{name}/{k}": v for k, v in components.items() if k != "reward"}
            if turns is not None:
                o["turn_rewards"] = _add_turns(o.get("turn_rewards"), turns, w)
    # a weighted sum that overflowed, or went out of range
    _refuse([(i, _bad_sum(spec, o)) for i, o in enumerate(out)], records)
    return out


def _call(name: str, fn, records: list[dict], judge, params: dict) -> list:
    """The reward's output for each record (a group reward: called on each group, one dict per
    rollout back in the records' order). A reward that raises, or a group reward that does not
    give one dict per rollout, is a TrainingFault naming the reward and the record."""
    if not getattr(fn, "group", False):
        parts = []
        for i, r in enumerate(records):
            try:
                parts.append(fn(r, judge=judge, **params))
            except TrainingFault:  # the reward's own line (ig_search without the policy's scorer)
                raise
            except Exception as e:
                raise TrainingFault(f"reward {name!r} raised {_said(e)} on {record_name(records, i)}") from None
        return parts
    parts = [None] * len(records)
    for idx in _group_by(records).values():
        where = f"the group of {record_name(records, idx[0])}"
        try:
            got = fn([records[i] for i in idx], judge=judge, **params)
        except TrainingFault:
            raise
        except Exception as e:
            raise TrainingFault(f"group reward {name!r} raised {_said(e)} on {where}") from None
        if not isinstance(got, (list, tuple)) or len(got) != len(idx):
            what = f"{len(got)} results" if isinstance(got, (list, tuple)) else f"a {type(got).__name__}"
            raise TrainingFault(f"group reward {name!r} returned {what} for a group of {len(idx)} rollouts ({where}): "
                                f"a list of one dict per rollout, in the group's order, is needed")  # fmt: skip
        for i, comp in zip(idx, got):
            parts[i] = comp
    return parts


def _checked(name: str, parts: list, records: list[dict]) -> list[tuple[float, dict, list | None]]:
    """(reward, components, turn rewards) of each record, every number a float; the first fault of
    any record refused (_refuse) naming the reward, the record and how many records share it."""
    out, bad = [], []
    for i, comp in enumerate(parts):
        try:
            out.append(_one(name, comp, records[i]))
        except ValueError as e:
            bad.append((i, str(e)))
    _refuse(bad, records)
    return out


def _one(name: str, comp, record: dict) -> tuple[float, dict, list | None]:
    """One reward's output for one record: (reward, components with "reward" in its place, turn
    rewards), numbers as floats; or ValueError saying what is wrong with it."""
    head = f"non-numeric reward from {name!r}"
    if not isinstance(comp, dict):
        raise ValueError(f"{head}: {_short(comp)}, a {type(comp).__name__} (a dict with a numeric 'reward' is needed)")
    if "reward" not in comp:
        raise ValueError(f"{head}: no 'reward' key in {_short(comp)}")
    if (key := next((k for k in comp if not isinstance(k, str)), None)) is not None:  # json writes str keys only
        raise ValueError(f"reward {name!r} gave a component named {_short(key)}, a {type(key).__name__} (a str is "
                         f"needed)")  # fmt: skip
    components = {k: _real(v, name, k) for k, v in comp.items() if k != "turn_rewards"}
    turns = comp.get("turn_rewards")
    if turns is not None:
        if not isinstance(turns, list):
            raise ValueError(f"turn_rewards from {name!r} must be a list (one value per action turn), got "
                             f"{type(turns).__name__}")  # fmt: skip
        if len(turns) != action_turns(record):
            raise ValueError(f"reward {name!r} gave {len(turns)} turn rewards for a rollout of {action_turns(record)} "
                             f"action turns: one value per action turn, None for a turn it does not score")  # fmt: skip
        turns = [None if v is None else _real(v, name, "turn_rewards") for v in turns]
    return components["reward"], components, turns


def _real(v, name: str, key: str) -> float:
    """v as a float: a real number (int, float, numpy's; a bool only as a component), finite and,
    for what reaches the advantages (the reward, a turn reward), within +-LIMIT. Else ValueError
    saying what it is."""
    what = {"reward": "reward from", "turn_rewards": "turn reward from"}.get(key, f"reward component {key!r} of")
    if isinstance(v, (bool, np.bool_)) and key not in ("reward", "turn_rewards"):
        return float(v)  # a flag, logged as the rate of records that set it
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise ValueError(f"non-numeric {what} {name!r}: {_short(v)}, a {type(v).__name__} (a real number is needed)")
    try:
        x = float(v)
    except (OverflowError, ValueError, TypeError):  # an int such as 10**400
        bits = f"an int of {v.bit_length()} bits" if isinstance(v, int) else _short(v)
        raise ValueError(f"non-finite {what} {name!r}: {bits} (beyond a float)") from None
    if not math.isfinite(x):
        raise ValueError(f"non-finite {what} {name!r}: {x}")
    if abs(x) > LIMIT and key in ("reward", "turn_rewards"):
        raise ValueError(f"{what} {name!r} out of range: {x:g} (beyond +-{LIMIT:g}, where the advantages overflow)")
    return x


def _bad_sum(spec: str, o: dict) -> str:
    """'' when the weighted sum of a record (its reward, its turn rewards) is finite and within
    +-LIMIT, else what _refuse says of it."""
    values = [o["reward"], *(v for v in o.get("turn_rewards") or [] if v is not None)]
    if wrong := next((v for v in values if not math.isfinite(v)), None):
        return f"non-finite reward from {spec!r}: {wrong}"
    if far := next((v for v in values if abs(v) > LIMIT), None):
        return f"reward from {spec!r} out of range: {far:g} (beyond +-{LIMIT:g}, where the advantages overflow)"
    return ""


def _refuse(bad: list[tuple[int, str]], records: list[dict]) -> None:
    """A TrainingFault of one line for the first fault of `bad` ((record index, message) pairs; ''
    for none), with how many records had one."""
    bad = [(i, m) for i, m in bad if m]
    if not bad:
        return
    i, message = bad[0]
    raise TrainingFault(f"{message} for {len(bad)} of {len(records)} rollouts (first: {record_name(records, i)}), "
                        f"not passed on to the advantages; check the reward function or its judge")  # fmt: skip


def record_name(records: list[dict], i: int) -> str:
    """How a message names records[i]: its place in the batch (a line of rewards.py's --input)
    and what identifies it, as 'record 5 (question_id 'q3', sample 1, group_id 'tiny:q3')'."""
    r = records[i] if isinstance(records[i], dict) else {}
    ids = [f"{k} {r[k]!r}" for k in ("question_id", "id", "sample", "group_id") if k in r]
    return f"record {i}" + (f" ({', '.join(ids)})" if ids else "")


def _said(e: Exception) -> str:
    """'ZeroDivisionError: division by zero at my_reward.py:12 in score': the exception's first
    line and the innermost line of the traceback (the reward's own code, or what it called)."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    text = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}{': ' + text if text else ''}{where}"


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _add_turns(total: list | None, turns: list, w: float) -> list:
    """total + w x turns, turn by turn; None + None stays None (a turn nothing scores)."""
    total = list(total or [None] * len(turns))
    return [a if b is None else (b * w if a is None else a + w * b) for a, b in zip(total, turns)]


def _group_by(records: list[dict]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(str(r.get("group_id", r.get("id", i))), []).append(i)
    return groups
