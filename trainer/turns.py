"""Credit per search step: which tokens each action turn wrote, and the advantages that use a
reward's `turn_rewards` (one value per action turn, None where the reward says nothing of it).

A record's action turns are its policy chunks, in order (rollout.py writes one per generation
call, each with its [start, end) in response_ids); retrieved tokens between them belong to no
turn and stay out of every loss (loss_mask 0). A turn reward lands only on its own turn's
policy tokens:

  GRPO (MT-GRPO, arXiv 2505.11821, as its code mt_grpo_env_trainer.py computes it; docs/design.md §4):

      A_it = A_i + lambda * T_ik      for t a policy token of turn k of rollout i
      A_it = A_i                      elsewhere (turns with no reward, the answer turn)

    A_i the outcome advantage as now (trainer/grpo.group_advantages), lambda `train.turn_coef`,
    T_ik the turn reward r_ik normalised with train.adv_std's rule over `train.turn_norm`:
      "group"       every scored turn of every rollout of the question's group, pooled (default)
      "turn_index"  only the k-th turns of the group (MT-GRPO's literal per-turn normalisation)
    Why pooled is the default: the policy decides when to stop, so the rollouts that reach turn 3
    are a selected subset (often the ones that failed to find the answer earlier); comparing a
    third search only with other third searches rewards it relative to a biased baseline, and a
    turn index reached by one rollout gets no signal at all (verl RFC #7244). Pooled, every search
    of the group is compared with the group's searches as a whole.

        >>> [[round(x, 3) for x in t] for t in turn_terms([[1.0, 0.0], [0.0]], ["q", "q"], "group")]
        [[1.155, -0.577], [-0.577]]

  PPO (StepSearch's StePPO form): the turn's reward lambda * r_ik is added at the turn's last
  policy token, the outcome stays at the last policy token of the rollout, GAE as before
  (trainer/ppo.ppo_advantages).

A batch with no turn reward (or train.turn_coef 0) takes none of these paths: its losses are
bit-identical to the outcome-only trainer's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.batching import autocast, per_position, token_logprobs
from trainer.distributed import compute_device
from trainer.grpo import group_advantages


def turn_spans(record: dict) -> list[tuple[int, int]]:
    """[start, end) in response_ids of each action turn: the record's policy chunks, in order.

    >>> turn_spans({"chunks": [{"role": "policy", "start": 0, "end": 5}, {"role": "tool", "start": 5, "end": 9},
    ...                        {"role": "policy", "start": 9, "end": 12}]})
    [(0, 5), (9, 12)]
    """
    return [(c["start"], c["end"]) for c in record.get("chunks", []) if c.get("role") == "policy"]


def has_turn_rewards(records: list[dict]) -> bool:
    """Does any record carry a turn reward that is not None?"""
    return any(v is not None for r in records for v in (r.get("turn_rewards") or []))


def turn_terms(turn_rewards: list[list], group_ids: list[str], norm: str = "group", eps: float = 1e-6,
               std: str = "group") -> list[list]:  # fmt: skip
    """T_ik: each rollout's turn rewards normalised over its group's scored turns (norm "group")
    or over the group's k-th turns (norm "turn_index"), with group_advantages' rule; None stays
    None (a turn the reward does not score)."""
    values, keys, where = [], [], []
    for i, (rewards, g) in enumerate(zip(turn_rewards, group_ids)):
        for k, v in enumerate(rewards or []):
            if v is not None:
                values.append(float(v))
                keys.append(str(g) if norm == "group" else f"{g}\x00{k}")
                where.append((i, k))
    out = [[None] * len(rewards or []) for rewards in turn_rewards]
    for (i, k), t in zip(where, group_advantages(values, keys, eps, std)):
        out[i][k] = t
    return out


def grpo_turn_advantages(records: list[dict], outcome: list[float], coef: float, norm: str = "group",
                         eps: float = 1e-6, std: str = "group") -> list[list[float]]:  # fmt: skip
    """Per-position advantages (length len(prompt + response) - 1, position t-1 predicting token
    t) of each record: its outcome advantage everywhere, plus coef * T_ik on turn k's positions.
    Retrieved tokens get A_i too, but their loss mask is 0 (they never count)."""
    terms = turn_terms([r.get("turn_rewards") or [] for r in records], [r["group_id"] for r in records], norm, eps,
                       std)  # fmt: skip
    out = []
    for r, a, t in zip(records, outcome, terms):
        n = len(r["prompt_ids"])
        adv = [float(a)] * (n + len(r["response_ids"]) - 1)
        for (start, end), value in zip(turn_spans(r), t):
            if value is not None:
                for pos in range(n + start - 1, n + end - 1):
                    adv[pos] += coef * value
        out.append(adv)
    return out


def last_token_positions(record: dict) -> list[int]:
    """Per action turn, the position (index into the per-position arrays) that predicts its last
    policy token: where PPO puts the turn's reward."""
    n, mask = len(record["prompt_ids"]), record["loss_mask"]
    out = []
    for start, end in turn_spans(record):
        policy = [j for j in range(start, end) if mask[j]]
        out.append(n + policy[-1] - 1 if policy else None)
    return out


def ppo_turn_rewards(records: list[dict], coef: float) -> list[list[tuple[int, float]]]:
    """Per record, (position, coef * r_ik) of each scored turn with a policy token: added to PPO's
    token rewards (trainer/ppo.token_rewards) before GAE."""
    out = []
    for r in records:
        rewards = r.get("turn_rewards") or []
        out.append([(pos, coef * float(v)) for pos, v in zip(last_token_positions(r), rewards)
                    if v is not None and pos is not None])  # fmt: skip
    return out


def answer_logprob_fn(model, tokenizer, micro_batch_tokens: int, bf16: bool = False,
                      lead: str = "\n<answer> ") -> Callable[[list[list[int]], list[str]], list[float]]:  # fmt: skip
    """IG-Search's scorer, given to the rewards as `answer_logprob` (rewards.py's contract):
    prefixes (token ids: a prompt and a response cut after an observation) and answers -> the
    policy's mean log-probability of each answer's tokens after prefix + `lead` (the answer tag),
    no gradient, in token-budget micro-batches. One process only: under FSDP every rank would
    have to forward the same batches (run_setup refuses ig_search with several)."""
    lead_ids = tokenizer.encode(lead, add_special_tokens=False)
    device = compute_device(model)

    def logprobs(ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), autocast(bf16):
            return token_logprobs(model, ids.to(device), attn.to(device))

    def answer_logprob(prefixes: list[list[int]], answers: list[str]) -> list[float]:
        answer_ids = [tokenizer.encode(a, add_special_tokens=False) or [tokenizer.eos_token_id] for a in answers]
        seqs = [list(p) + lead_ids + a for p, a in zip(prefixes, answer_ids)]
        rows = per_position(logprobs, seqs, micro_batch_tokens, tokenizer.pad_token_id)
        return [float(row[-len(a) :].float().mean()) for row, a in zip(rows, answer_ids)]

    return answer_logprob


def turn_reward_means(records: list[dict]) -> dict[str, float]:
    """The step's mean turn reward per turn index (1-based, over the rollouts that scored that
    turn): metrics.jsonl's `turn_reward/<k>`.

    >>> turn_reward_means([{"turn_rewards": [1.0, None]}, {"turn_rewards": [0.0, 0.5]}, {}])
    {'turn_reward/1': 0.5, 'turn_reward/2': 0.5}
    """
    sums: dict[int, list[float]] = {}
    for r in records:
        for k, v in enumerate(r.get("turn_rewards") or []):
            if v is not None:
                sums.setdefault(k, []).append(float(v))
    return {f"turn_reward/{k + 1}": sum(vs) / len(vs) for k, vs in sorted(sums.items())}
