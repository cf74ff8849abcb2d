"""The GRPO update (and Reliable RFT through it): advantages, the masked clipped loss, the step.

    advantages = group_advantages(rewards, group_ids)          # step 3 of train.py's loop
    stats = grpo_step(model, ref_model, records, optimizer, cfg, pad_id, step)   # steps 4-5

The equations (GRPO with a search engine, Search-R1 §3.1: the retrieved tokens masked out of
the loss and of its KL term; with docs/design.md §4's options):

  advantage  A_i = (r_i - mean(r_group)) / (std(r_group) + eps), the same A_i for every token of
             rollout i; a group with equal rewards has A = 0 (adv_std: group / batch / none)
  loss       per policy token t (loss_mask = 1; retrieved tokens never count):
               rho_t = exp(log pi_theta - log pi_old)          pi_old = the engine's logprobs
               pg_t  = -min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A)
               kl_t  = exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]   (k3)
             loss = sum_t m_t (pg_t + beta kl_t) / sum_t m_t   over the whole batch
             (token-mean; micro-batches divide by the batch's token count, not their own)

Worked example: a group of 4 rewards [1, 0, 0, 1] has mean 0.5 and std 0.577, so the
advantages are [+0.866, -0.866, -0.866, +0.866]. Every function here is tested by hand in
tests/test_grpo.py (and the masking in tests/test_masking.py).

One update reads in three files: train.py (update_stage), here (grpo_step, then _policy_update:
the loss as above, with the padded rows, the policy's forward and the statistics in small
helpers below it) and trainer/batching.py (which process runs which micro-batch, the gradient
accumulation, the no-gradient logprob pass of pi_ref and pi_old).
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass

import torch

from trainer.batching import (
    accumulating,
    autocast,
    balanced_micro_batches,
    batch_logprobs,
    logprobs_and_entropy,
    pad_batch,
    pad_rows,
    policy_positions,
)
from trainer.config import Config, TrainingFault
from trainer.distributed import all_reduce, clip_grad_norm, compute_device, local_finite
from trainer.offpolicy import importance_weights, recomputes_old, stale_correction
from trainer.overlap import token_versions


def group_advantages(rewards: list[float], group_ids: list[str], eps: float = 1e-6, std: str = "group") -> list[float]:
    """GRPO: (r - mean of the group) / (std + eps); equal rewards give 0.

    std "group" (GRPO), "batch" (one std over the whole batch) or "none" (Dr.GRPO: r - mean).

    >>> [round(a, 3) for a in group_advantages([1, 0, 0, 1], ["q"] * 4)]
    [0.866, -0.866, -0.866, 0.866]
    >>> group_advantages([1, 0, 0, 1], ["q"] * 4, std="none")
    [0.5, -0.5, -0.5, 0.5]
    """
    groups: dict[str, list[float]] = {}
    for r, g in zip(rewards, group_ids):
        groups.setdefault(g, []).append(r)
    mean = {g: sum(rs) / len(rs) for g, rs in groups.items()}
    centred = [r - mean[g] for r, g in zip(rewards, group_ids)]
    if std == "none":
        return centred

    def unbiased_std(xs: list[float]) -> float:  # as torch.std
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1))

    if std == "batch":
        s = unbiased_std(list(rewards))
        return [c / (s + eps) for c in centred]
    sd = {g: unbiased_std(rs) for g, rs in groups.items()}
    return [c / (sd[g] + eps) for c, g in zip(centred, group_ids)]


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi (Schulman 2020; docs/design.md §4):
    k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 ("low_var_kl") = exp(ref - logp) - (ref - logp) - 1,
    clamped to [-10, 10]. k1 is unbiased but noisy, k3 unbiased and >= 0, k2 biased but low-variance."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    return (torch.exp(-log_ratio) + log_ratio - 1).clamp(-10, 10)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return kl_estimate(logp, ref_logp, "k3")


def grpo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    ref_logp: torch.Tensor | None,
    clip_eps: float,
    kl_coef: float,
    clip_eps_high: float = 0.0,
    dual_clip: float = 0.0,
    kl_kind: str = "k3",
    is_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss (w * PPO-clip policy term + beta * KL), its KL part and whether it clipped.

    pg = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)); eps_high = eps_low unless given
    (DAPO's clip-higher). Dual-clip (c > 1, for A < 0 only) caps pg at -c A, so a huge ratio on a
    bad token cannot blow the loss up. `is_weight` w (truncated importance sampling,
    train.is_correction) corrects the policy-gradient term only, as verl's rollout correction
    does: the KL term is a penalty on the trainer's own logprobs, not an estimate under the
    engine's sampling distribution.
    """
    ratio = torch.exp(logp - old_logp)
    high = clip_eps_high or clip_eps
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_eps, 1 + high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip > 1:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    was_clipped = (loss != unclipped).float()
    if is_weight is not None:
        loss = loss * is_weight
    kl = kl_estimate(logp, ref_logp, kl_kind) if ref_logp is not None else torch.zeros_like(logp)
    return loss + kl_coef * kl, kl, was_clipped


def loss_weights(policy_tokens: list[int], mode: str, norm: int) -> list[float]:
    """Per-sequence weight w_i so that the loss is sum_i w_i sum_t m_it l_it (docs/design.md §4):

      token-mean               w_i = 1 / sum_j n_j           (every policy token counts the same)
      seq-mean-token-mean      w_i = 1 / (N n_i)             (every rollout counts the same)
      seq-mean-token-sum-norm  w_i = 1 / (N norm)            (Dr.GRPO: no length bias)

    >>> loss_weights([1, 3], "seq-mean-token-mean", 0)
    [0.5, 0.16666666666666666]
    """
    n = len(policy_tokens)
    if mode == "seq-mean-token-mean":
        return [1.0 / (n * max(1, k)) for k in policy_tokens]
    if mode == "seq-mean-token-sum-norm":
        return [1.0 / (n * norm)] * n
    return [1.0 / max(1, sum(policy_tokens))] * n


def sequence_tensors(records: list[dict], mask_retrieved: bool = True, version: int | None = None) -> list[dict]:
    """Per rollout, the per-position arrays the loss needs (position t-1 predicts token t, so
    each has len(prompt + response) - 1 entries):

      ids         prompt + response token ids
      loss_mask   1 where the loss counts: sampled tokens (mask_retrieved) or the whole response
      sampled     1 where the engine sampled the token (it has a logprob); 0 on prompt/retrieved
      engine_logp the engine's logprob of each sampled token (pi_old as vLLM computed it)
      adv         the advantage of each position (GRPO: the rollout's A_i everywhere; PPO: GAE)
      stale       1 where a sampled token's policy version (record "versions", train.overlap) is
                  older than `version`, the trainer's; 0 everywhere without them
    """
    out = []
    for r in records:
        n = len(r["prompt_ids"])
        sampled = torch.tensor(policy_positions(r), dtype=torch.float32)
        adv = r["advantages"] if "advantages" in r else [float(r.get("advantage", 0.0))] * len(sampled)
        stale = torch.zeros(len(sampled))
        if version is not None and "versions" in r:
            stale = torch.tensor(([0] * n + [int(v < version) for v in token_versions(r)])[1:]) * sampled
        out.append({
            "ids": r["prompt_ids"] + r["response_ids"],
            "loss_mask": torch.tensor(policy_positions(r, mask_retrieved), dtype=torch.float32),
            "sampled": sampled,
            "engine_logp": torch.tensor(([0.0] * n + list(r["logprobs"]))[1:], dtype=torch.float32),
            "adv": torch.as_tensor(adv, dtype=torch.float32),
            "stale": stale,
        })  # fmt: skip
    return out


def grpo_step(model, ref_model, records: list[dict], optimizer, cfg: Config, pad_id: int,
              step: int = 0, rank: int = 0, world: int = 1) -> dict:  # fmt: skip
    """`epochs` x `mini_batches` optimizer steps on one batch of scored rollouts (`advantage`
    or per-position `advantages` set). Returns the batch means of loss, KL, clip fraction,
    entropy, gradient norm. The loss (Search-R1 §3.1's GRPO objective, token-mean form):

        loss = sum_i sum_t m_it [ -min(rho_it A_i, clip(rho_it, 1-eps, 1+eps) A_i) + beta KL_it ]
               / sum_i sum_t m_it,       rho_it = pi_theta / pi_old at token t of rollout i

    with m_it the loss mask (0 on retrieved tokens) and the aggregation of `train.loss_agg`.

    pi_old is the engine's sampling logprob for a single on-policy update; with several
    updates (or `recompute_old_logprobs`) it is recomputed by the trainer before the first one,
    so the ratio compares trainer with trainer. `is_correction` C then weights each token by
    min(pi_trainer_old / pi_engine, C) (truncated importance sampling: the engine's numerics
    differ from the trainer's). Tokens an older policy sampled (train.overlap: record versions
    older than `step`, the trainer's version) take the decoupled loss of stale_correction. With
    `world` > 1 processes (FSDP), each takes its share of
    every mini-batch; weights are computed on the whole mini-batch, so the loss does not depend
    on the number of processes.
    """
    tcfg = cfg.train
    seqs = sequence_tensors(records, tcfg.mask_retrieved, version=step)
    kl_coef = 0.0 if tcfg.kl_in_reward else tcfg.kl_coef  # in the reward already (kl_penalties)
    ref, old = _reference_and_old_logprobs(model, ref_model, seqs, cfg, pad_id, kl_coef, rank, world)
    is_weight = importance_weights(old, seqs, tcfg.is_correction)
    old, is_weight = stale_correction(model, seqs, old, is_weight, cfg, pad_id, rank, world)
    rng = random.Random(tcfg.seed * 1000003 + step)  # mini-batch order: a function of the step (exact resume)
    updates = []
    model.train()
    for _ in range(tcfg.epochs):
        order = list(range(len(seqs)))
        if tcfg.mini_batches > 1:
            rng.shuffle(order)
        for part in range(tcfg.mini_batches):
            mini = order[part :: tcfg.mini_batches]
            updates.append(_policy_update(model, seqs, mini, old, ref, is_weight, optimizer, cfg, pad_id, kl_coef,
                                          rank, world))  # fmt: skip
    model.eval()
    return _batch_means(updates)


def _policy_update(model, seqs, mini, old, ref, is_weight, optimizer, cfg, pad_id, kl_coef, rank, world) -> dict:
    """One optimizer step on the mini-batch `mini` (indices into seqs), of the loss

        sum_i w_i sum_t m_it (l_it - c H_it),   l_it = grpo_token_loss(...) (policy term + beta KL)

    w_i the loss_weights of the whole mini-batch, m_it the loss mask, c the entropy_coef, H_it the
    entropy. This process does its share of the mini-batch's micro-batches, padded with
    zero-weight repeats (`real` 0) so every process runs the same number of forward passes (FSDP's
    collectives must line up); each backward adds its micro-batch's part of the gradient
    (batching.balanced_micro_batches, accumulating). The rows of a micro-batch are _micro_batch's,
    the forward _policy_logprobs', the statistics _UpdateStats'."""
    tcfg = cfg.train
    device = compute_device(model)
    weight, n_tokens = _sequence_weights(seqs, mini, cfg)
    lengths = [len(seqs[i]["ids"]) for i in mini]
    runs = balanced_micro_batches(mini, lengths, tcfg.micro_batch_tokens, rank, world, tcfg.exact_grad_sum)
    model.zero_grad(set_to_none=True)  # not optimizer's: see make_optimizer
    stats = _UpdateStats(device)
    for idx, real in accumulating(model, runs, tcfg.exact_grad_sum, world):
        b = _micro_batch(seqs, idx, old, ref, is_weight, weight, real, pad_id, device)
        logp, entropy = _policy_logprobs(model, b, tcfg.bf16, tcfg.entropy_coef > 0)
        # Retrieved tokens were never sampled, so there is no pi_old for them; in the no-mask
        # ablation they are trained on-policy: old = current (ratio 1, gradient of logp).
        old_logp = torch.where(b.sampled > 0, b.old_logp, logp.detach())
        tok_loss, kl, clipped = grpo_token_loss(
            logp, old_logp, b.adv, b.ref_logp, tcfg.clip_eps, kl_coef, tcfg.clip_eps_high, tcfg.dual_clip,
            tcfg.kl_estimator, b.is_weight,
        )  # fmt: skip
        loss = ((tok_loss - tcfg.entropy_coef * entropy) * b.mask * b.weight).sum()
        loss.backward()
        stats.add(b, real, logp, tok_loss, kl, clipped, entropy)
    loss_sum = stats.reduce(world)
    ensure_finite(model, loss_sum, "loss")  # summed over every process: each rank raises alike
    grad_norm = clip_grad_norm(model, tcfg.grad_clip, tcfg.exact_grad_sum, world)
    ensure_finite(model, grad_norm, "gradient norm")
    optimizer.step()
    return stats.means(n_tokens, grad_norm)


# ---------------------------------------------------------------------------------------------
# Beside the loss: what grpo_step and _policy_update hand it (pi_ref and pi_old, importance
# weights, the padded rows of a micro-batch, the policy's forward) and what they report.


def _reference_and_old_logprobs(model, ref_model, seqs: list[dict], cfg: Config, pad_id: int, kl_coef: float,
                                rank: int, world: int) -> tuple[list | None, list]:  # fmt: skip
    """log pi_ref of every position (None without a KL term in the loss) and log pi_old: the
    engine's sampling logprobs for a single on-policy update, else the trainer's recomputed before
    the first one (several updates, recompute_old_logprobs or is_correction). With several
    processes each forwards its share of the batch (batching.batch_logprobs)."""
    tcfg = cfg.train
    mbt = tcfg.micro_batch_tokens
    shared = {"rank": rank, "world": world, "exact": tcfg.exact_grad_sum}  # each process forwards its share
    ref = batch_logprobs(ref_model, seqs, mbt, pad_id, tcfg.bf16, **shared) if ref_model is not None and kl_coef > 0 \
        else None  # fmt: skip
    old = batch_logprobs(model, seqs, mbt, pad_id, tcfg.bf16, **shared) if recomputes_old(cfg) else \
        [s["engine_logp"] for s in seqs]  # fmt: skip
    return ref, old


def _sequence_weights(seqs: list[dict], mini: list[int], cfg: Config) -> tuple[dict, float]:
    """({index: w_i} of loss_weights over the whole mini-batch, its count of policy tokens: the
    token-mean denominator), whichever process runs which of its micro-batches."""
    counts = [float(seqs[i]["loss_mask"].sum()) for i in mini]
    norm = cfg.train.loss_norm_tokens or cfg.rollout.max_model_len
    return dict(zip(mini, loss_weights([int(c) for c in counts], cfg.train.loss_agg, norm))), sum(counts)


@dataclass
class _MicroBatch:
    """One micro-batch on the compute device: ids and attn [B, T] (right-padded), each other row
    [B, T-1] (position t-1 predicts token t); `first`, the first position whose logprob is used."""

    ids: torch.Tensor
    attn: torch.Tensor
    first: int
    mask: torch.Tensor  # m_it: 1 on the tokens the loss counts
    weight: torch.Tensor  # [B, 1] w_i, times 0 for a repeat (it adds nothing)
    sampled: torch.Tensor  # 1 where the engine sampled the token
    old_logp: torch.Tensor  # pi_old (meaningful where sampled)
    engine_logp: torch.Tensor
    ref_logp: torch.Tensor | None
    adv: torch.Tensor
    is_weight: torch.Tensor


def _micro_batch(seqs, idx, old, ref, is_weight, weight, real, pad_id, device) -> _MicroBatch:
    width = max(len(seqs[i]["ids"]) for i in idx)
    ids, attn, _ = pad_batch([seqs[i]["ids"] for i in idx], [[0] for _ in idx], pad_id)

    def rows(values: list) -> torch.Tensor:
        return pad_rows(values, width - 1).to(device)

    return _MicroBatch(
        ids=ids.to(device), attn=attn.to(device), first=min(min(_first_scored(seqs[i]) for i in idx), width - 2),
        mask=rows([seqs[i]["loss_mask"] for i in idx]),
        weight=torch.tensor([weight[i] for i in idx], device=device)[:, None] * real,
        sampled=rows([seqs[i]["sampled"] for i in idx]), old_logp=rows([old[i] for i in idx]),
        engine_logp=rows([seqs[i]["engine_logp"] for i in idx]),
        ref_logp=rows([ref[i] for i in idx]) if ref is not None else None,
        adv=rows([seqs[i]["adv"] for i in idx]), is_weight=rows([is_weight[i] for i in idx]),
    )  # fmt: skip


def _first_scored(seq: dict) -> int:
    """The first position whose logprob the update uses (a loss or a sampled token); before it,
    the prompt's positions."""
    scored = torch.nonzero(seq["loss_mask"] + seq["sampled"])
    return int(scored[0]) if len(scored) else len(seq["loss_mask"])


def _policy_logprobs(model, b: _MicroBatch, bf16: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi_theta and the entropy of every position [B, T-1], float32. Logits only from the first
    scored position on (prompts take none: HF's logits_to_keep), 0 before it, and the
    full-vocabulary float32 log-softmax only where the entropy's gradient needs it."""
    width = b.ids.shape[1]
    with autocast(bf16):
        logits = model(input_ids=b.ids, attention_mask=b.attn, logits_to_keep=width - b.first).logits[:, :-1]
    logp, entropy = logprobs_and_entropy(logits, b.ids[:, b.first + 1 :], entropy_grad)
    del logits
    return torch.nn.functional.pad(logp, (b.first, 0)), torch.nn.functional.pad(entropy, (b.first, 0))


class _UpdateStats:
    """An update's statistics: float64 sums over the policy tokens of the loss, KL, clipped and
    entropy, and the largest |log pi_trainer - log pi_engine| over sampled tokens. Kept on the
    compute device and read once after the loop (a float() per micro-batch would wait for the GPU
    at every micro-batch), then summed (maxed) over the processes."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, kl, clipped, entropy
        self.gap = torch.zeros((), device=device)

    @torch.no_grad()
    def add(self, b: _MicroBatch, real: float, logp: torch.Tensor, *values: torch.Tensor) -> None:
        self.gap = torch.maximum(self.gap, ((logp.detach() - b.engine_logp).abs() * b.sampled).max())
        self.sums += torch.stack([(value * b.mask).sum().double() for value in values]) * real

    def reduce(self, world: int) -> float:
        """Sum and max over the processes; returns the loss's sum."""
        self.sums, self.gap = all_reduce(self.sums.cpu(), world, "sum"), all_reduce(self.gap.cpu(), world, "max")
        return float(self.sums[0])

    def means(self, n_tokens: float, grad_norm: float) -> dict:
        denom, sums = max(n_tokens, 1.0), self.sums
        return {"loss": float(sums[0]) / denom, "kl": float(sums[1]) / denom, "clip_frac": float(sums[2]) / denom,
                "entropy": float(sums[3]) / denom, "grad_norm": grad_norm, "policy_tokens": n_tokens,
                "engine_logp_gap": float(self.gap)}  # fmt: skip


def _batch_means(updates: list[dict]) -> dict:
    """The means over the batch's updates, but engine_logp_gap: the first update's, before any
    optimizer step, when the trainer holds the engine's weights. It is how far the engine's
    sampling logprobs are from the trainer's on the same weights (at temperature 1, top_p 1):
    below 1e-4 in fp32 (up to 8e-5 on SmolLM2's 30 layers); large means a stale sync."""
    means = dict.fromkeys(("loss", "kl", "clip_frac", "entropy", "grad_norm", "policy_tokens"), 0.0)
    for stats in updates:
        for key in means:
            means[key] += stats[key] / len(updates)
    return means | {"engine_logp_gap": (updates[0]["engine_logp_gap"] if updates else None) or 0.0}


def ensure_finite(model, value: float, what: str) -> None:
    """Stop the step before the optimizer touches the weights when `value` (the loss, or the
    gradient norm, both reduced over every process so each rank stops alike) is NaN or inf. One
    NaN reward or weight would otherwise spread to every weight in a single AdamW step, and the
    next checkpoint would keep it. The gradients are dropped; the message names the first
    non-finite weight when that is the cause, so the user knows whether to look at the data
    (rewards, advantages) or at the model."""
    if math.isfinite(value):
        return
    model.zero_grad(set_to_none=True)
    bad = next((name for name, w in model.named_parameters() if not local_finite(w)), None)
    cause = f"the weight {bad} is already non-finite" if bad else "the weights are finite: see rewards, advantages"
    raise TrainingFault(f"non-finite {what} ({value}); {cause}; the optimizer step was skipped, weights unchanged")


def memory_savers(model, cfg: Config):
    """Gradient checkpointing by config: keep only each layer's input and recompute the rest in
    the backward pass (about a third more compute for a fraction of the activation memory)."""
    if cfg.train.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up over `warmup_frac` of the steps, then constant (Search-R1's schedule) or,
    with `lr_schedule: cosine`, a half cosine from lr towards 0 (BAPO's RFT, Table 5). A function
    of the step, so a resumed run needs no scheduler state.

    steps 10, warmup_frac 0.2, lr 1: constant 0.5 1 1 1 ...; cosine 0.5 1 0.97 0.88 ... 0.03"""
    warm = cfg.train.warmup_frac * cfg.train.steps
    if warm >= 1 and step + 1 < warm:
        return cfg.train.lr * (step + 1) / warm
    if cfg.train.lr_schedule == "cosine":
        start = math.ceil(warm) - 1 if warm >= 1 else 0  # the first step at full lr
        progress = (step - start) / max(1, cfg.train.steps - start)
        return cfg.train.lr * 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.train.lr


def kl_per_position(ref_model, records: list[dict], cfg: Config, pad_id: int, rank: int = 0,
                    world: int = 1) -> list[torch.Tensor]:  # fmt: skip
    """KL_t(pi_old || ref) on every sampled token of each rollout (0 elsewhere), pi_old being the
    engine's sampling logprobs: the KL that `kl_in_reward` puts into the reward."""
    seqs = sequence_tensors(records)
    ref = batch_logprobs(ref_model, seqs, cfg.train.micro_batch_tokens, pad_id, cfg.train.bf16, rank, world,
                         cfg.train.exact_grad_sum)  # fmt: skip
    return [kl_estimate(s["engine_logp"], r, cfg.train.kl_estimator) * s["sampled"] for s, r in zip(seqs, ref)]


def kl_penalties(ref_model, records: list[dict], cfg: Config, pad_id: int, rank: int = 0,
                 world: int = 1) -> list[float]:  # fmt: skip
    """sum_t KL_t per rollout (kl_per_position): what GRPO's `kl_in_reward` subtracts from the
    reward (times kl_coef) before the advantages."""
    return [float(k.sum()) for k in kl_per_position(ref_model, records, cfg, pad_id, rank, world)]


# ---------------------------------------------------------------------------------------------
# Reliable RFT (BAPO's baseline): fine-tuning on the accepted rollouts through the same step.


def rft_select(records: list[dict], accept: float, idk: list[bool]) -> list[dict]:
    """Reliable RFT (BAPO's baseline): keep the rollouts the reward accepts (reward >= accept);
    for a question with none, keep the first whose `idk` flag (one per record: the answer says
    "I don't know", agent.answers.parsed(r).idk, which train.py reads) is set, if one is."""
    groups: dict[str, list[tuple[dict, bool]]] = {}
    for r, said_idk in zip(records, idk, strict=True):
        groups.setdefault(str(r["group_id"]), []).append((r, said_idk))
    kept = []
    for rs in groups.values():
        good = [r for r, _ in rs if r["reward"] >= accept]
        kept += good or [r for r, said_idk in rs if said_idk][:1]
    return kept


def rft_step(model, records: list[dict], optimizer, cfg: Config, pad_id: int, step: int) -> dict:
    """Fine-tune on the kept rollouts: the policy loss with A = 1 and pi_old recomputed (= pi_theta),
    whose gradient at the first update is the token-mean NLL gradient of the kept policy tokens."""
    for r in records:
        r["advantage"] = 1.0
    sft_cfg = copy.deepcopy(cfg)
    sft_cfg.train.recompute_old_logprobs, sft_cfg.train.kl_coef, sft_cfg.train.is_correction = True, 0.0, 0.0
    return grpo_step(model, None, records, optimizer, sft_cfg, pad_id, step)
