"""PPO pieces for train.py (`train.algo: ppo`): per-token rewards, GAE, whitening, the critic.

Search-R1's PPO (docs/design.md §4, §9): a critic, a value head on its own copy of the base model,
gives V_t for every position; the sequence reward goes on the last policy token, the k1 KL to
the reference is subtracted on every policy token; GAE (Schulman et al. 2016) turns rewards
and values into advantages, whitened over the batch's policy tokens:

  r_t     = -kl_coef * (logp_old_t - logp_ref_t)  (+ score on the last policy token)
  delta_t = r_t + gamma * V_next(t) - V_t
  A_t     = delta_t + gamma * lam * A_next(t)         R_t = A_t + V_t  (the critic's target)
  value loss = 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2), token-mean

Masking (docs/design.md §7 asks to decide): next(t) is the next *policy* token, not the next position.
Retrieved <information> tokens and padding (mask 0) are not time steps: the recursion passes
V_next and A_next through them unchanged, so a policy token just before an <information> block
bootstraps from the value of the first policy token after it, and a masked position gets the
advantage and return of the next policy token (harmless if a caller forgets the mask; the
losses mask it anyway). After the last policy token V_next = 0 (terminal).

Worked example (gamma = lam = 1, score R = 1, no KL): a response p1 p2 [i1 i2] p3 p4 with an
<information> block i1 i2 and values V = [.2, .4, (.9, .9), .5, .7]:
  p4: delta = 1 + 0 - .7 = .3           A = .3
  p3: delta = 0 + .7 - .5 = .2          A = .2 + .3 = .5
  i2, i1: skipped                       A = .5 (carried), R = .5 + .5 = 1
  p2: delta = 0 + .5 - .4 = .1          A = .1 + .5 = .6
  p1: delta = 0 + .4 - .2 = .2          A = .2 + .6 = .8
so A_t = R - V_t on every policy token and every return is R = 1.

Positions are aligned like train.py: for ids = prompt + response, position t-1 predicts token t,
so per-position arrays have length len(ids) - 1 and the value at position t-1 is the value of
the state ids[:t], before the policy chooses token t.

One PPO step in the trainer, with these functions:
  values   = critic_values(critic, records, micro_batch_tokens, pad_id)        # V_old
  adv, ret = ppo_advantages(records, values, scores, kls, kl_coef, gamma, lam)  # per record
  ... policy step with the per-token advantages ...
  stats    = critic_update(critic, opt, records, values, ret, value_clip, micro_batch_tokens,
                           pad_id, grad_clip, epochs=1, mini_batches=1, seed=0)
             (epochs x mini_batches critic_step calls on the actor's mini-batches, as verl does)
  save_critic(critic, ckpt_dir); critic = load_critic(ckpt_dir or policy_dir)
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from torch import nn

from trainer.batching import (
    accumulating,
    balanced_micro_batches,
    pad_batch,
    pad_rows,
    policy_positions,
    shared_per_position,
)
from trainer.config import Config
from trainer.distributed import (
    all_reduce,
    clip_grad_norm,
    compute_device,
    full_weights,
    load_from_rank0,
    plain_name,
    shard_critic,
)
from trainer.engine import model_dir
from trainer.grpo import ensure_finite, grpo_step, kl_per_position, memory_savers
from trainer.turns import has_turn_rewards, ppo_turn_rewards

HEAD_FILE = "value_head.safetensors"

# ---------------------------------------------------------------------------------------------
# The math: pure functions on [batch, positions] tensors, tested in tests/test_ppo.py.


def token_rewards(
    scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Per-position rewards [B, T]: -kl_coef * kl on policy tokens, plus the sequence score
    on the last policy token of each row (Search-R1 PPO: k1 KL in the reward). A row with no
    policy token gets nothing.

    >>> token_rewards(torch.tensor([1.0]), torch.tensor([[0, 1, 0, 1, 0]]))
    tensor([[0., 0., 0., 1., 0.]])
    """
    mask = mask.float()
    rewards = torch.zeros_like(mask) if kl is None else torch.where(mask > 0, -kl_coef * kl.float(), 0.0)
    # argmax returns the first maximum, so on the flipped mask it finds the last 1
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
    rows = torch.nonzero(mask.sum(1) > 0).squeeze(1)
    rewards[rows, last[rows]] += scores.float()[rows]
    return rewards


@torch.no_grad()
def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over policy tokens only (module docstring): (advantages, returns), both [B, T].

    Masked positions are skipped by the recursion: V_next and A_next pass through them
    unchanged, and they get the next policy token's advantage and return (0 after the last
    policy token). Rewards and values at masked positions are never read.
    """
    keep = mask > 0
    next_value = torch.zeros_like(values[:, 0])  # past the last policy token: terminal, V = 0
    next_adv = torch.zeros_like(values[:, 0])
    advantages, returns = torch.zeros_like(values), torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        # torch.where, not m * x: a nan/inf value at a masked position must not leak through
        next_adv = torch.where(keep[:, t], adv, next_adv)
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        advantages[:, t] = next_adv
        returns[:, t] = next_adv + next_value  # A_t + V_t; the next policy token's on a masked t
    return advantages, returns


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with mean and unbiased var over mask = 1 only (verl's
    masked_whiten); shift_mean=False adds the mean back. Masked positions are transformed
    too (the loss ignores them). With fewer than two masked values the var is taken as 0.
    """
    m = mask.float()
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = ((x - mean) ** 2 * m).sum() / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    return out + mean if not shift_mean else out


def _value_loss_terms(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 0.5 * max(unclipped, clipped) squared error, and where the clipped one won."""
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    unclipped = (values - returns) ** 2
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO2 / Search-R1): masked token-mean of
    0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2), and the clipped fraction.
    The clip keeps one update from moving V further than c from the rollout-time value."""
    m = mask.float()
    loss, clipped = _value_loss_terms(values, old_values, returns, clip)
    n = m.sum().clamp(min=1)
    return (loss * m).sum() / n, (clipped * m).sum() / n


# ---------------------------------------------------------------------------------------------
# Records (rollout.py dicts) <-> per-position tensors.


def ppo_advantages(
    records: list[dict],
    values: list[torch.Tensor],
    scores: list[float],
    kls: list[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten_advantages: bool = True,
    mask_retrieved: bool = True,
    turn_rewards: list[list[tuple[int, float]]] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """token_rewards -> gae -> whiten over the whole batch, per record: (advantages, returns),
    each a list of per-position tensors (length len(ids) - 1) like `values`. `kls` are
    per-position KL(pi_old || ref) estimates (k1 in Search-R1), or None. `turn_rewards`: per
    record, (position, reward) of each scored action turn, added at that turn's last policy token
    (trainer/turns.ppo_turn_rewards; StepSearch's step rewards), or None."""
    masks = [policy_positions(r, mask_retrieved) for r in records]
    width = max(len(m) for m in masks)
    mask = pad_rows(masks, width)
    kl = pad_rows(kls, width) if kls is not None else None
    rewards = token_rewards(torch.tensor(scores, dtype=torch.float32), mask, kl, kl_coef)
    for i, turns in enumerate(turn_rewards or []):
        for pos, value in turns:
            rewards[i, pos] += value
    adv, ret = gae(rewards, pad_rows(values, width), mask, gamma, lam)
    if whiten_advantages:  # batch-level, over policy tokens only (Search-R1 / verl)
        adv = whiten(adv, mask)
    return [adv[i, : len(m)] for i, m in enumerate(masks)], [ret[i, : len(m)] for i, m in enumerate(masks)]


# ---------------------------------------------------------------------------------------------
# The critic: a value head on its own copy of the base model (Search-R1's PPO).


class Critic(nn.Module):
    """Backbone (transformers AutoModel, no LM head) + Linear(hidden, 1) value head.

    The head starts at zero (weight and bias): V = 0 everywhere at step 0, so the first
    advantages are the plain rewards (REINFORCE without a baseline) instead of noise whose
    scale depends on the backbone's hidden-state norms (large in Qwen2.5). The backbone gets
    gradient from the second step on, once the head is non-zero. The head stays in float32
    whatever the backbone's dtype: values are regression targets, bf16 would round them.
    """

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.config.hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Values [B, T-1]: the hidden state at position t-1 (tokens < t) values the choice of
        token t, the alignment of train.py's log-probs. The last position has no next token."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden[:, :-1].float()).squeeze(-1)


def load_critic(path: str | Path, dtype: str = "float32") -> Critic:
    """A critic from a policy directory (fresh zero head on the policy's backbone), a critic
    directory written by save_critic, or a checkpoint directory holding `critic/`."""
    from transformers import AutoModel

    path = Path(path)
    path = model_dir(path / "critic" if (path / "critic" / HEAD_FILE).is_file() else path)
    # from a policy dir transformers reports lm_head.weight UNEXPECTED (untied models): expected
    critic = Critic(AutoModel.from_pretrained(path, dtype=getattr(torch, dtype)))
    if (path / HEAD_FILE).is_file():
        from safetensors.torch import load_file

        critic.head.load_state_dict(load_file(path / HEAD_FILE))
    return critic


def critic_key(key: str) -> str | None:
    """A checkpoint's key as the Critic's: a policy's "model.X" and a saved backbone's "X" are
    "backbone.X", the value head file's "weight" / "bias" are "head.*"; the lm_head is skipped.

    >>> critic_key("model.norm.weight"), critic_key("norm.weight"), critic_key("bias"), critic_key("lm_head.weight")
    ('backbone.norm.weight', 'backbone.norm.weight', 'head.bias', None)
    """
    if key.startswith("lm_head."):
        return None
    if key in ("weight", "bias"):
        return f"head.{key}"
    return "backbone." + key.removeprefix("model.")


def load_sharded_critic(path: str | Path, cfg: Config, rank: int, world: int) -> Critic:
    """load_critic for several processes: built on the meta device, sharded (distributed.shard_critic),
    then filled from rank 0's read of the checkpoint, 256 MB at a time (distributed.load_from_rank0),
    so no process holds the whole float32 critic (7B: 28.3 GB, 8 x that on the box's host at
    once). A policy directory's critic gets the fresh zero value head load_critic gives it. The
    backbone's memory savers (checkpointing) go on before the sharding, as the policy's."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModel

    path = Path(path)
    path = model_dir(path / "critic" if (path / "critic" / HEAD_FILE).is_file() else path)
    with init_empty_weights(include_buffers=False):
        critic = Critic(AutoModel.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32))
    memory_savers(critic.backbone, cfg)
    critic = shard_critic(critic, cfg)
    loaded = load_from_rank0(critic, path, rank, world, cfg, rename=critic_key)
    missing = {plain_name(n) for n, _ in critic.named_parameters()} - loaded
    if missing - {"head.weight", "head.bias"}:
        raise FileNotFoundError(f"{path}: no weights for {', '.join(sorted(missing)[:3])} ({len(missing)} in all)")
    with torch.no_grad():
        for name in missing:  # a policy directory: the zero head of load_critic
            getattr(critic.head, name.split(".")[1]).zero_()
    return critic


def save_critic(critic: Critic, directory: str | Path, rank: int = 0, world: int = 1) -> Path:
    """Write `directory/critic/`: the backbone (save_pretrained, safetensors) and the value
    head as value_head.safetensors. load_critic(directory) restores it. Returns the dir.
    A sharded critic (world > 1) is gathered tensor by tensor: every rank must call this."""
    from safetensors.torch import save_file

    out = Path(directory) / "critic"
    if world > 1:
        state = dict(full_weights(critic, rank))  # collectives on every rank; rank 0 gets the tensors
        if rank != 0:
            return out
        out.mkdir(parents=True, exist_ok=True)
        critic.backbone.config.save_pretrained(out)
        backbone = {k.removeprefix("backbone."): v.contiguous() for k, v in state.items() if k.startswith("backbone.")}
        save_file(backbone, out / "model.safetensors", metadata={"format": "pt"})
        head = {k.removeprefix("head."): v.contiguous() for k, v in state.items() if k.startswith("head.")}
    else:
        critic.backbone.save_pretrained(out, safe_serialization=True)
        head = {k: v.detach().contiguous() for k, v in critic.head.state_dict().items()}
    save_file(head, out / HEAD_FILE)
    return out


def critic_optimizer(critic: Critic, lr: float = 1e-5, weight_decay: float = 0.01) -> torch.optim.Optimizer:
    """AdamW over backbone and head (Search-R1: critic lr 1e-5; weight decay as verl's 0.01)."""
    return torch.optim.AdamW(critic.parameters(), lr=lr, weight_decay=weight_decay)


def critic_values(critic: Critic, records: list[dict], micro_batch_tokens: int, pad_id: int, rank: int = 0,
                  world: int = 1, exact: bool = False) -> list[torch.Tensor]:  # fmt: skip
    """V for every position of every record (float32, length len(ids) - 1), no gradient. With
    several processes each forwards its share and all get every row (shared_per_position)."""
    critic.eval()
    seqs = [r["prompt_ids"] + r["response_ids"] for r in records]
    device = compute_device(critic)  # the GPU, also when FSDP offloads the critic to the host
    return shared_per_position(lambda ids, attn: critic(ids.to(device), attn.to(device)), seqs, micro_batch_tokens,
                               pad_id, rank, world, exact)  # fmt: skip


def critic_step(
    critic: Critic,
    optimizer: torch.optim.Optimizer,
    records: list[dict],
    old_values: list[torch.Tensor],
    returns: list[torch.Tensor],
    cfg_clip: float,
    micro_batch_tokens: int,
    pad_id: int,
    grad_clip: float,
    mask_retrieved: bool = True,
    rank: int = 0,
    world: int = 1,
    exact: bool = False,
) -> dict:
    """One optimizer step of the clipped value loss over the records' policy positions.

    Token-mean over the whole batch, as grpo.grpo_step: each micro-batch adds its masked sum
    divided by the batch's total policy-token count, so micro-batching does not change the
    gradient. With several processes (a sharded critic) each takes its share of the
    micro-batches (FSDP sums the processes' gradients; `exact`: in float64), and runs as many
    micro-batches as the busiest one (zero-weight repeats: the collectives must line up).
    Returns value_loss, value_clip_frac, critic_grad_norm and value_mean (the critic's V on
    policy tokens before the step)."""
    seqs = [r["prompt_ids"] + r["response_ids"] for r in records]
    masks = [policy_positions(r, mask_retrieved) for r in records]
    n_tokens = max(1, sum(sum(m) for m in masks))
    lengths = [len(s) for s in seqs]
    runs = balanced_micro_batches(list(range(len(records))), lengths, micro_batch_tokens, rank, world, exact)
    device = compute_device(critic)  # the GPU, also when FSDP offloads the critic to the host
    critic.train()
    optimizer.zero_grad(set_to_none=True)
    # on the device, read once after the loop (no host sync per micro-batch; grpo._policy_update)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # value_loss, value_clip_frac, value_mean
    for idx, real in accumulating(critic, runs, exact, world):
        ids, attn, _ = pad_batch([seqs[i] for i in idx], [[] for _ in idx], pad_id)
        width = ids.shape[1] - 1
        m = pad_rows([masks[i] for i in idx], width).to(device)
        old = pad_rows([old_values[i] for i in idx], width).to(device)
        ret = pad_rows([returns[i] for i in idx], width).to(device)
        values = critic(ids.to(device), attn.to(device))
        loss, clipped = _value_loss_terms(values, old, ret, cfg_clip)
        ((loss * m).sum() / n_tokens * real).backward()
        with torch.no_grad():
            totals += torch.stack([((x * m).sum() / n_tokens).double() for x in (loss, clipped, values)]) * real
    totals = all_reduce(totals.cpu(), world, "sum")
    ensure_finite(critic, float(totals[0]), "value loss")
    grad_norm = clip_grad_norm(critic, grad_clip, exact, world)
    ensure_finite(critic, grad_norm, "critic gradient norm")
    optimizer.step()
    critic.eval()
    return {"value_loss": float(totals[0]), "value_clip_frac": float(totals[1]), "value_mean": float(totals[2]),
            "critic_grad_norm": grad_norm}  # fmt: skip


def critic_update(
    critic: Critic,
    optimizer: torch.optim.Optimizer,
    records: list[dict],
    old_values: list[torch.Tensor],
    returns: list[torch.Tensor],
    cfg_clip: float,
    micro_batch_tokens: int,
    pad_id: int,
    grad_clip: float,
    mask_retrieved: bool = True,
    rank: int = 0,
    world: int = 1,
    epochs: int = 1,
    mini_batches: int = 1,
    seed: int = 0,
    exact: bool = False,
) -> dict:
    """`epochs` x `mini_batches` critic steps on one batch, as the actor takes (verl's PPO
    mini-batches the critic like the actor: ppo_epochs x ppo_mini_batch_size). The mini-batches
    are the actor's (grpo.grpo_step draws its order from the same Random(seed)), V_old stays
    the values before the first step (the clip's anchor) and the returns are fixed. Returns the
    mean of critic_step's statistics over the steps."""
    rng = random.Random(seed)
    totals: dict[str, float] = {}
    for _ in range(epochs):
        order = list(range(len(records)))
        if mini_batches > 1:
            rng.shuffle(order)
        for part in range(mini_batches):
            mini = order[part::mini_batches]
            stats = critic_step(critic, optimizer, [records[i] for i in mini], [old_values[i] for i in mini],
                                [returns[i] for i in mini], cfg_clip, micro_batch_tokens, pad_id, grad_clip,
                                mask_retrieved, rank, world, exact)  # fmt: skip
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value / (epochs * mini_batches)
    return totals


def ppo_update(model, ref, critic, records, optimizer, critic_opt, cfg: Config, pad_id: int, step: int,
               rank: int = 0, world: int = 1) -> dict:  # fmt: skip
    """PPO (Search-R1 §3.1, its PPO objective with retrieved-token masking; the equations of GAE
    and the value loss are this module's docstring): token rewards (the score on the last policy token,
    minus kl_coef x k1 KL to the reference on every policy token when kl_in_reward), GAE over
    policy tokens with the critic's values, whitened advantages; then the clipped policy step
    and as many critic steps on the returns, on the same mini-batches (ppo.critic_update)."""
    tcfg = cfg.train
    values = critic_values(critic, records, tcfg.micro_batch_tokens, pad_id, rank, world, tcfg.exact_grad_sum)
    kls = kl_per_position(ref, records, cfg, pad_id, rank, world) if tcfg.kl_in_reward and ref is not None else None
    advantages, returns = ppo_advantages(
        records, values, [r["reward"] for r in records], kls, tcfg.kl_coef, tcfg.gae_gamma, tcfg.gae_lambda,
        tcfg.whiten_advantages, tcfg.mask_retrieved,
        ppo_turn_rewards(records, tcfg.turn_coef) if tcfg.turn_coef and has_turn_rewards(records) else None,
    )  # fmt: skip
    for r, adv in zip(records, advantages):
        r["advantages"] = adv.tolist()
    stats = grpo_step(model, ref, records, optimizer, cfg, pad_id, step, rank, world)
    if kls is not None:  # the loss carries no KL term here, so report the reward's
        stats["kl"] = float(sum(k.sum() for k in kls)) / max(1, sum(sum(r["loss_mask"]) for r in records))
    for r in records:
        del r["advantages"]  # per-token lists would bloat samples/*.jsonl
    critic_stats = critic_update(critic, critic_opt, records, values, returns, tcfg.value_clip, tcfg.micro_batch_tokens,
                                 pad_id, tcfg.grad_clip, tcfg.mask_retrieved, rank, world, tcfg.epochs,
                                 tcfg.mini_batches, tcfg.seed * 1000003 + step, tcfg.exact_grad_sum)  # fmt: skip
    return stats | critic_stats
