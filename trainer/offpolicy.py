"""The off-policy corrections of the GRPO loss (trainer/grpo.py applies them, in this order):

  importance_weights   truncated IS, train.is_correction C > 0: each sampled token weighted by
                       min(pi_old / pi_engine, C), since the engine's numerics differ from the
                       trainer's (Yao et al. 2025; verl's TIS)
  stale_correction     train.overlap's stale tokens (sampled by an older policy version): AReaL's
                       decoupled PPO, pi_prox the trainer's, the weight pi_prox / pi_behav capped

Worked example: a stale token the engine sampled at log p -1.0, whose proximal log p is -0.5,
gets weight min(exp(0.5), 2) = 1.65 and its ratio clipped around pi_prox (tests/test_overlap.py).
"""

from __future__ import annotations

import torch

from trainer.batching import batch_logprobs
from trainer.config import Config

# train.overlap: the truncation C of a stale token's importance weight pi_prox / pi_behav when
# train.is_correction is 0 (verl's TIS and ms-swift's rollout correction default to 2)
STALE_IS_CAP = 2.0


def recomputes_old(cfg: Config) -> bool:
    """pi_old from the trainer: several updates, recompute_old_logprobs or is_correction."""
    tcfg = cfg.train
    return tcfg.epochs * tcfg.mini_batches > 1 or tcfg.recompute_old_logprobs or tcfg.is_correction > 0


def stale_correction(model, seqs: list[dict], old: list[torch.Tensor], is_weight: list[torch.Tensor], cfg: Config,
                     pad_id: int, rank: int = 0, world: int = 1) -> tuple[list, list]:  # fmt: skip
    """The decoupled PPO objective of AReaL (Fu et al. 2025, arXiv 2505.24298, §5: "decoupled PPO")
    on the tokens an older policy sampled (seq "stale", train.overlap), per token t:

        pg_t = -min(pi_prox / pi_behav, C) * min(u_t A, clip(u_t, 1 - eps, 1 + eps) A),
        u_t  = pi_theta / pi_prox

    pi_behav the engine's sampling logprob (the policy version that generated the token), pi_prox
    the trainer's before this step's first update (recomputed here unless it already was), C =
    train.is_correction, or STALE_IS_CAP when that is 0: the importance weight truncated as in
    truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training", verl's rollout correction). The clip then bounds the step against pi_prox, not
    against the stale policy. Fresh tokens keep today's pi_old and weight, so a batch with no stale
    token returns (old, is_weight) untouched: the loss and gradients of the synchronous loop, bit
    for bit (tests/test_overlap.py)."""
    if not any(bool(s["stale"].any()) for s in seqs):
        return old, is_weight
    tcfg = cfg.train
    prox = old if recomputes_old(cfg) else batch_logprobs(
        model, seqs, tcfg.micro_batch_tokens, pad_id, tcfg.bf16, rank=rank, world=world, exact=tcfg.exact_grad_sum)
    truncated = importance_weights(prox, seqs, tcfg.is_correction or STALE_IS_CAP)  # pi_prox / pi_behav, capped
    old = [torch.where(s["stale"] > 0, p, o) for s, p, o in zip(seqs, prox, old)]
    is_weight = [torch.where(s["stale"] > 0, t, w) for s, t, w in zip(seqs, truncated, is_weight)]
    return old, is_weight


def importance_weights(old: list[torch.Tensor], seqs: list[dict], cap: float) -> list[torch.Tensor]:
    """Truncated importance sampling (train.is_correction C > 0): min(pi_old / pi_engine, C) on
    every sampled token, 1 elsewhere; C = 0: 1 everywhere."""
    if cap > 0:
        return [torch.exp(o - s["engine_logp"]).clamp(max=cap) * s["sampled"] + (1 - s["sampled"])
                for o, s in zip(old, seqs)]  # fmt: skip
    return [torch.ones_like(s["engine_logp"]) for s in seqs]
