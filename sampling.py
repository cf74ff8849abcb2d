"""Which rollouts a step trains on, and their rewards across processes.

    records, resampled = resample_marked_groups(records, questions, roll_out, cfg, step, stage)  # BAPO
    kept, counts = fill_varied_groups(records, 16, 3, score, roll_out_next)   # DAPO's dynamic sampling
    score_shared(records, "em", {}, judge, rank, world)                       # every rank: every reward

BAPO re-rolls the groups with no correct rollout (its §4.2); DAPO drops the groups whose rewards
are all alike, which give GRPO no gradient, and rolls out the next questions in their place
(train.filter_groups). train.py's rollout stage calls them; they roll out through the callables
it hands them, so this file knows nothing of engines.
"""

from __future__ import annotations

from collections.abc import Callable

from agent.bapo import bapo_resample_groups
from rewards import score
from trainer.config import Config, TrainingFault
from trainer.distributed import gather_lists, my_share


def resample_marked_groups(records: list[dict], questions: list[dict], roll_out, cfg: Config, step: int,
                           stage: str = "plateau") -> tuple[list[dict], int]:  # fmt: skip
    """BAPO §4.2: "we dynamically resample groups with no correct rollouts up to k times, until
    the model outputs IDK or provides a correct answer", in the plateau stage (train.resample_stage;
    "always": both stages). The new rollouts join their group (train.resample_mode "enlarge":
    App. B.2's larger effective group, G up to G (k + 1)) or replace it ("replace"). Marked:
    agent/bapo.bapo_resample_groups with the reward's own parameters, so "correct" is judged as the
    reward judges it. `roll_out(questions, seed)` rolls out G rollouts per question.
    Returns (records, number of groups rolled out again)."""
    if cfg.train.resample_stage == "plateau" and stage != "plateau":
        return records, 0
    count = 0
    for attempt in range(1, cfg.train.resample_groups + 1):
        marked = set(bapo_resample_groups(records, **cfg.train.reward_params))
        if not marked:
            break
        again = [q for q in questions if cfg.data.name + ":" + str(q["id"]) in marked]
        fresh = roll_out(again, cfg.train.seed * 100003 + step + 1_000_000 * attempt)
        if cfg.train.resample_mode == "replace":
            records = [r for r in records if str(r["group_id"]) not in marked]
        records = records + fresh
        count += len(marked)
    return records, count


def score_shared(records: list[dict], spec: str, params: dict, judge, rank: int, world: int,
                 given: dict | None = None) -> None:  # fmt: skip
    """rewards.score on every record, each rank scoring the groups of its block (its judge asked
    for all of their verdicts at once, and a group's rewards are computed where the whole group
    is); every rank then has every reward, in place."""
    groups = list(dict.fromkeys(str(r["group_id"]) for r in records))
    owner = {g: k for k in range(world) for g in my_share(groups, k, world)}
    mine = [r for r in records if owner[str(r["group_id"])] == rank]
    if world == 1:
        score(mine, spec, params, judge, given)
        return
    fault = ""
    try:
        score(mine, spec, params, judge, given)
    except TrainingFault as e:  # every rank must hear of it, or the others would wait in the gather below
        fault = f"rank {rank}: {e}"
    if fault := next(iter(gather_lists([fault] if fault else [], world)), ""):
        raise TrainingFault(fault)
    index = {id(r): i for i, r in enumerate(records)}  # every rank holds the same records, in the same order
    scored = [(index[id(r)], r["reward"], r["reward_components"], r.get("turn_rewards")) for r in mine]
    for i, reward, components, turns in gather_lists(scored, world):
        records[i]["reward"], records[i]["reward_components"] = reward, components
        if turns is not None:
            records[i]["turn_rewards"] = turns
        records[i].pop("_parsed", None)  # the parse cache (answers.parsed) is rebuilt from the record alone


def fill_varied_groups(records: list[dict], want: int, max_rounds: int, score: Callable[[list[dict]], None],
                       roll_out_next: Callable[[int, int], list[dict]],
                       turns: str | None = None) -> tuple[list[dict], dict]:  # fmt: skip
    """DAPO's dynamic sampling (DAPO §3.2: keep a group only if 0 < #correct < G; here, if its
    rewards are not all equal, the same rule for EM and one that also holds for graded rewards):
    score the batch, keep its groups whose rewards differ, and roll out the next questions of the
    data order in place of the others (`roll_out_next(n, round)`), up to max_rounds more rounds.
    `turns` (train.turn_norm when the step trains on turn rewards, train.turn_coef > 0): a group
    whose outcomes tie but whose turn rewards differ is kept too, as its turns carry the signal
    (varied_groups). Returns the kept groups, at most `want` of them, and the counts: the share of
    the first batch's groups that varied, the extra rounds, the questions rolled out (the
    oversampling: DAPO's num_gen_batches) and the groups trained on. A batch still short after the
    last round trains on the groups it has (train.py says so in one line); none at all keeps the
    first batch as it was (its advantages are all 0: the step trains on the KL term alone, as
    unfiltered).

    >>> rec = lambda g, r: {"group_id": g, "reward": r}
    >>> batch = [rec("a", 1.0), rec("a", 1.0), rec("b", 0.0), rec("b", 1.0)]
    >>> kept, counts = fill_varied_groups(batch, 2, 1, lambda rs: None, lambda n, k: [rec("c", 0.0), rec("c", 1.0)])
    >>> [r["group_id"] for r in kept], counts["varied_first"], counts["rounds"], counts["questions"]
    (['b', 'b', 'c', 'c'], 0.5, 1, 3)
    """
    score(records)
    kept = varied_groups(records, turns)
    first, rounds, rolled = len(kept), 0, len({r["group_id"] for r in records})
    while len(kept) < want and rounds < max_rounds:
        rounds += 1
        fresh = roll_out_next(want - len(kept), rounds)
        score(fresh)
        taken = {g[0]["group_id"] for g in kept}  # a question drawn twice in a step (a small set) counts once
        kept += [g for g in varied_groups(fresh, turns) if g[0]["group_id"] not in taken]
        rolled += len({r["group_id"] for r in fresh})
    counts = {"varied_first": first / max(1, want), "rounds": rounds, "questions": rolled,
              "groups": min(len(kept), want)}  # fmt: skip
    if not kept:
        return records, counts
    return [r for group in kept[:want] for r in group], counts


def truncated(record: dict) -> bool:
    """Cut by rollout.max_turns or max_model_len before it answered (train.mask_truncated)."""
    return record.get("finish") in ("max_turns", "length")


def trained_records(records: list[dict], cfg: Config) -> list[dict]:
    """The records the step's loss takes: all of them, or with train.mask_truncated those not cut
    before they answered (TRL's mask_truncated_completions). When that leaves none, the step would
    train nothing, save the same weights and go on: a TrainingFault instead, naming the limit that
    cut them (a policy that never answers within it will not learn to, masked from every loss)."""
    if not cfg.train.mask_truncated:
        return records
    kept = [r for r in records if not truncated(r)]
    if kept:
        return kept
    turns = sum(r.get("finish") == "max_turns" for r in records)
    cut = [f"{turns} by rollout.max_turns={cfg.rollout.max_turns}"] * bool(turns)
    cut += [f"{len(records) - turns} by length (rollout.max_tokens_per_turn={cfg.rollout.max_tokens_per_turn}, "
            f"rollout.max_model_len={cfg.rollout.max_model_len})"] * (turns < len(records))  # fmt: skip
    raise TrainingFault(f"every one of the {len(records)} rollouts was cut before it answered ({', '.join(cut)}) and "
                        "train.mask_truncated leaves them all out of the loss: nothing to train on. Raise the limit "
                        "that cut them, or set train.mask_truncated=false to train on them as scored")  # fmt: skip


def varied_groups(records: list[dict], turns: str | None = None) -> list[list[dict]]:
    """The groups (in order) whose rollouts' rewards are not all equal: the ones GRPO learns from.
    With `turns` (the train.turn_norm of a step that trains on turn rewards), also those whose
    scored turn rewards differ where trainer/turns.turn_terms compares them: pooled over the group
    ("group"), or among the group's k-th turns ("turn_index").

    >>> rec = lambda t: {"group_id": "a", "reward": 1.0, "turn_rewards": t}  # outcomes tie
    >>> tie = [rec([1.0, None]), rec([None, 0.0])]
    >>> len(varied_groups(tie)), len(varied_groups(tie, "group")), len(varied_groups(tie, "turn_index"))
    (0, 1, 0)
    """
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(str(r["group_id"]), []).append(r)
    return [g for g in groups.values() if len({r["reward"] for r in g}) > 1 or (turns and _turns_differ(g, turns))]


def _turns_differ(group: list[dict], norm: str) -> bool:
    """Do the group's scored turn rewards differ where turn_terms normalises them (norm "group": all
    of them pooled; "turn_index": the k-th turns of the group, for some k)?"""
    values: dict[int, set] = {}
    for r in group:
        for k, v in enumerate(r.get("turn_rewards") or []):
            if v is not None:
                values.setdefault(0 if norm == "group" else k, set()).add(v)
    return any(len(vs) > 1 for vs in values.values())
