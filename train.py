"""Train a search agent with GRPO: roll out, score, take a masked clipped step, sync vLLM.

    python train.py --config configs/tiny.yaml                 # the embedded tiny world, CPU
    python train.py --config configs/tiny.yaml --set train.steps=5 --set rollout.engine=hf
    python train.py --resume runs/tiny-20261122-010203         # continue a killed run
    python train.py --config configs/tiny_ppo.yaml             # PPO; also tiny_lagrangian.yaml
    python train.py --config X --plan                          # per-GPU memory plan, no model loaded

One step, top to bottom: `train()` calls one function per stage (rollout_stage, reward_stage,
update_stage with grpo_step / ppo_update / rft_step, sync_stage, then run_eval and save_stage):

  1. rollout   G trajectories per question with the current policy (rollout.py), searching
               the corpus mid-thought; records keep token ids, loss mask and sampling logprobs
  2. reward    r_i = EM(answer_i, golden) (Search-R1 §3.4), or any `train.reward` of rewards.py
  3. advantage A_i = (r_i - mean(r_group)) / (std(r_group) + eps)   (GRPO, DESIGN.md §4),
               the same A_i for every token of rollout i; a group with equal rewards has A = 0
  4. loss      per policy token t (loss_mask = 1; retrieved tokens never count):
                 rho_t = exp(log pi_theta - log pi_old)          pi_old = the engine's logprobs
                 pg_t  = -min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A)
                 kl_t  = exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]   (k3)
               loss = sum_t m_t (pg_t + beta kl_t) / sum_t m_t   over the whole batch
               (token-mean; micro-batches divide by the batch's token count, not their own)
               Options (config train.*): kl_estimator k1/k2/k3, kl_in_reward, adv_std
               group/batch/none, loss_agg (token-mean, seq-mean-token-mean, Dr.GRPO's
               seq-mean-token-sum-norm), clip_eps_high (clip-higher), dual_clip, entropy_coef.
  5. update    AdamW (or 8-bit AdamW), gradient-norm clip; `epochs` x `mini_batches` updates per
               batch, pi_old then recomputed by the trainer
  6. sync      push the new weights into the vLLM engine (engine.load_weights)

Variants of the same loop (config train.*): `constraints` add Lagrange multipliers to the reward
(constraints.py, Deliberative Searcher Alg. 1); `algo: ppo` replaces step 3 with a critic and
GAE (ppo.py); `algo: rft` keeps only accepted rollouts and fine-tunes on them (BAPO's
baseline); `reward: bapo` adds BAPO's resampling and stage switch. Several processes
(`accelerate launch --multi_gpu`, distributed.py): each rank's own engine rolls out a block of
the step's questions (whole groups) and each rank scores the groups it rolled out; the records
are gathered, so every rank computes the same advantages, constraint terms and metrics as one
process would; every rank runs step 5 on its FSDP shard, and step 6 gathers the full weights one
tensor at a time into every rank's engine. Evaluation is sharded the same way.

Worked example of step 3: a group of 4 rewards [1, 0, 0, 1] has mean 0.5 and std 0.577, so
the advantages are [+0.866, -0.866, -0.866, +0.866].

The run directory `runs/<name>-<time>/` holds config.yaml (resolved), metrics.jsonl (one line
per step, plus eval lines), samples/step_<k>.jsonl (rollout records) and checkpoints/step_<k>/
(checkpoint.py: weights, optimizer, RNG, data order, lambda, ...). `python eval.py curves RUN`
draws it.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from answers import parsed
from checkpoint import (
    check_writable,
    latest_checkpoint,
    load_checkpoint_file,
    load_trainer_state,
    log,
    new_run_dir,
    save_checkpoint,
    verify_checkpoint,
    write_samples,
)
from config import Config, ConfigError, DataError, RunDirError, load_config
from constraints import dual_update, parse_constraints, reward_params, switch_on
from constraints import restore as restore_constraints
from constraints import state as constraint_state
from constraints import step as constraints_step
from data import data_paths, ensure_policy, load_questions, make_search_fn
from distributed import (
    all_reduce,
    balanced_micro_batches,
    barrier,
    broadcast,
    clip_grad_norm,
    full_weights,
    gather_lists,
    init,
    make_optimizer,
    my_share,
    needs_reference,
    shard,
    shard_critic,
    shard_reference,
)
from engine import load_policy, load_tokenizer, make_engine
from eval import rollout_mode, summarize
from judge import make_judge
from lora import add_lora, load_lora, merged_weights
from metrics import batch_metrics, paper_metrics
from plan import print_plan
from ppo import critic_optimizer, critic_update, critic_values, load_critic, ppo_advantages
from precision import describe as describe_precision
from rewards import BapoState, bapo_resample_groups, score
from rollout import check_chat_template, rollout_batch
from sft import pad_batch, pad_rows, per_position, policy_positions, token_logprobs
from tracking import check_report_to, close_trackers, open_trackers, summary_table, track

# ---------------------------------------------------------------------------------------------
# The GRPO math (DESIGN.md §4). Pure functions on tensors, tested in tests/test_grpo.py.


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
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi (Schulman 2020; DESIGN §4):
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
    """Per-sequence weight w_i so that the loss is sum_i w_i sum_t m_it l_it (DESIGN §4):

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


def sequence_tensors(records: list[dict], mask_retrieved: bool = True) -> list[dict]:
    """Per rollout, the per-position arrays the loss needs (position t-1 predicts token t, so
    each has len(prompt + response) - 1 entries):

      ids         prompt + response token ids
      loss_mask   1 where the loss counts: sampled tokens (mask_retrieved) or the whole response
      sampled     1 where the engine sampled the token (it has a logprob); 0 on prompt/retrieved
      engine_logp the engine's logprob of each sampled token (pi_old as vLLM computed it)
      adv         the advantage of each position (GRPO: the rollout's A_i everywhere; PPO: GAE)
    """
    out = []
    for r in records:
        n = len(r["prompt_ids"])
        sampled = policy_positions(r)
        adv = r["advantages"] if "advantages" in r else [float(r.get("advantage", 0.0))] * len(sampled)
        out.append({
            "ids": r["prompt_ids"] + r["response_ids"],
            "loss_mask": torch.tensor(policy_positions(r, mask_retrieved), dtype=torch.float32),
            "sampled": torch.tensor(sampled, dtype=torch.float32),
            "engine_logp": torch.tensor(([0.0] * n + list(r["logprobs"]))[1:], dtype=torch.float32),
            "adv": torch.as_tensor(adv, dtype=torch.float32),
        })  # fmt: skip
    return out


def batch_logprobs(model, seqs: list[dict], micro_batch_tokens: int, pad_id: int, bf16: bool = False) -> list:
    """log pi(token t | tokens < t) of every position of every sequence, no gradient: the
    reference model's logprobs, or pi_old recomputed by the trainer before the first update."""
    device = _compute_device(model)

    def logprobs(ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        with _autocast(bf16):
            return token_logprobs(model, ids.to(device), attn.to(device))

    return per_position(logprobs, [s["ids"] for s in seqs], micro_batch_tokens, pad_id)


def _compute_device(model) -> torch.device:
    """Where the forward runs: this process's GPU, even when FSDP offloads parameters to the host."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return next(model.parameters()).device


def _autocast(bf16: bool):
    return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16, enabled=bf16)


def grpo_step(model, ref_model, records: list[dict], optimizer, cfg: Config, pad_id: int,
              step: int = 0, rank: int = 0, world: int = 1) -> dict:  # fmt: skip
    """`epochs` x `mini_batches` optimizer steps on one batch of scored rollouts (`advantage`
    or per-position `advantages` set). Returns the batch means of loss, KL, clip fraction,
    entropy, gradient norm.

    pi_old is the engine's sampling logprob for a single on-policy update; with several
    updates (or `recompute_old_logprobs`) it is recomputed by the trainer before the first one,
    so the ratio compares trainer with trainer. `is_correction` C then weights each token by
    min(pi_trainer_old / pi_engine, C) (truncated importance sampling: the engine's numerics
    differ from the trainer's). With `world` > 1 processes (FSDP), each takes its share of
    every mini-batch; weights are computed on the whole mini-batch, so the loss does not depend
    on the number of processes.
    """
    tcfg = cfg.train
    seqs = sequence_tensors(records, tcfg.mask_retrieved)
    kl_coef = 0.0 if tcfg.kl_in_reward else tcfg.kl_coef  # in the reward already (kl_penalties)
    mbt = tcfg.micro_batch_tokens
    ref = batch_logprobs(ref_model, seqs, mbt, pad_id, tcfg.bf16) if ref_model is not None and kl_coef > 0 else None
    updates = tcfg.epochs * tcfg.mini_batches
    recompute = updates > 1 or tcfg.recompute_old_logprobs or tcfg.is_correction > 0
    old = batch_logprobs(model, seqs, mbt, pad_id, tcfg.bf16) if recompute else [s["engine_logp"] for s in seqs]
    is_weight = [torch.ones_like(s["engine_logp"]) for s in seqs]
    if tcfg.is_correction > 0:
        is_weight = [torch.exp(o - s["engine_logp"]).clamp(max=tcfg.is_correction) * s["sampled"] + (1 - s["sampled"])
                     for o, s in zip(old, seqs)]  # fmt: skip
    rng = random.Random(tcfg.seed * 1000003 + step)  # mini-batch order: a function of the step (exact resume)
    totals = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "entropy": 0.0, "grad_norm": 0.0}
    n_tokens_all = 0.0
    engine_gap = None
    model.train()
    for _ in range(tcfg.epochs):
        order = list(range(len(seqs)))
        if tcfg.mini_batches > 1:
            rng.shuffle(order)
        for part in range(tcfg.mini_batches):
            mini = order[part :: tcfg.mini_batches]
            stats = _policy_update(model, seqs, mini, old, ref, is_weight, optimizer, cfg, pad_id, kl_coef, rank, world)
            for key in totals:
                totals[key] += stats[key] / updates
            n_tokens_all += stats["policy_tokens"] / updates
            if engine_gap is None:  # before the first optimizer step the trainer holds the engine's weights
                engine_gap = stats["engine_logp_gap"]
    model.eval()
    # engine_logp_gap: how far the engine's sampling logprobs are from the trainer's on the same
    # weights (at temperature 1, top_p 1): below 1e-4 in fp32 (up to 8e-5 on SmolLM2's 30 layers);
    # large means a stale sync
    return totals | {"policy_tokens": n_tokens_all, "engine_logp_gap": engine_gap or 0.0}


def _policy_update(model, seqs, mini, old, ref, is_weight, optimizer, cfg, pad_id, kl_coef, rank, world) -> dict:
    """One optimizer step on the mini-batch `mini` (indices into seqs); this process does the
    micro-batches of its share, padded with zero-weight repeats so every process runs the same
    number of forward passes (FSDP's collectives must line up)."""
    tcfg = cfg.train
    device = _compute_device(model)
    counts = [float(seqs[i]["loss_mask"].sum()) for i in mini]
    n_tokens = sum(counts)  # the token-mean denominator of the whole mini-batch
    norm = tcfg.loss_norm_tokens or cfg.rollout.max_model_len
    weight = dict(zip(mini, loss_weights([int(c) for c in counts], tcfg.loss_agg, norm)))
    share = mini[rank::world]
    runs = balanced_micro_batches(share, [len(seqs[i]["ids"]) for i in share], tcfg.micro_batch_tokens, world, mini[:1])
    model.zero_grad(set_to_none=True)  # not optimizer's: see make_optimizer
    sums = torch.zeros(4)  # loss, kl, clipped, entropy: sums over policy tokens
    gap = torch.zeros(())  # max |log pi_trainer - log pi_engine| over sampled tokens
    for idx, real in runs:
        width = max(len(seqs[i]["ids"]) for i in idx)
        ids, attn, _ = pad_batch([seqs[i]["ids"] for i in idx], [[0] for _ in idx], pad_id)
        ids, attn = ids.to(device), attn.to(device)
        m = pad_rows([seqs[i]["loss_mask"] for i in idx], width - 1).to(device)
        # x world: FSDP averages gradients over processes; x real: a padding repeat adds nothing
        w = torch.tensor([weight[i] for i in idx], device=device)[:, None] * world * real
        with _autocast(tcfg.bf16):
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logp_all = torch.log_softmax(logits.float(), -1)
        logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
        sampled = pad_rows([seqs[i]["sampled"] for i in idx], width - 1).to(device)
        # Retrieved tokens were never sampled, so there is no pi_old for them; in the no-mask
        # ablation they are trained on-policy: old = current (ratio 1, gradient of logp).
        old_logp = torch.where(sampled > 0, pad_rows([old[i] for i in idx], width - 1).to(device), logp.detach())
        engine_logp = pad_rows([seqs[i]["engine_logp"] for i in idx], width - 1).to(device)
        gap = torch.maximum(gap, ((logp.detach() - engine_logp).abs() * sampled).max().cpu())
        ref_logp = pad_rows([ref[i] for i in idx], width - 1).to(device) if ref is not None else None
        adv = pad_rows([seqs[i]["adv"] for i in idx], width - 1).to(device)
        tok_loss, kl, clipped = grpo_token_loss(
            logp, old_logp, adv, ref_logp, tcfg.clip_eps, kl_coef, tcfg.clip_eps_high, tcfg.dual_clip,
            tcfg.kl_estimator, pad_rows([is_weight[i] for i in idx], width - 1).to(device),
        )  # fmt: skip
        with torch.set_grad_enabled(tcfg.entropy_coef > 0):
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        loss = ((tok_loss - tcfg.entropy_coef * entropy) * m * w).sum()
        loss.backward()
        with torch.no_grad():
            for j, value in enumerate((tok_loss, kl, clipped, entropy)):
                sums[j] += float((value * m).sum()) * real
    sums, gap = all_reduce(sums, world, "sum"), all_reduce(gap, world, "max")
    grad_norm = clip_grad_norm(model, tcfg.grad_clip)
    optimizer.step()
    denom = max(n_tokens, 1.0)
    return {"loss": float(sums[0]) / denom, "kl": float(sums[1]) / denom, "clip_frac": float(sums[2]) / denom,
            "entropy": float(sums[3]) / denom, "grad_norm": grad_norm, "policy_tokens": n_tokens,
            "engine_logp_gap": float(gap)}  # fmt: skip


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


def kl_per_position(ref_model, records: list[dict], cfg: Config, pad_id: int) -> list[torch.Tensor]:
    """KL_t(pi_old || ref) on every sampled token of each rollout (0 elsewhere), pi_old being the
    engine's sampling logprobs: the KL that `kl_in_reward` puts into the reward."""
    seqs = sequence_tensors(records)
    ref = batch_logprobs(ref_model, seqs, cfg.train.micro_batch_tokens, pad_id, cfg.train.bf16)
    return [kl_estimate(s["engine_logp"], r, cfg.train.kl_estimator) * s["sampled"] for s, r in zip(seqs, ref)]


def kl_penalties(ref_model, records: list[dict], cfg: Config, pad_id: int) -> list[float]:
    """sum_t KL_t per rollout (kl_per_position): what GRPO's `kl_in_reward` subtracts from the
    reward (times kl_coef) before the advantages."""
    return [float(k.sum()) for k in kl_per_position(ref_model, records, cfg, pad_id)]


# ---------------------------------------------------------------------------------------------
# The BAPO loop (resampling, stage) and Reliable RFT.


def resample_marked_groups(records: list[dict], questions: list[dict], roll_out, cfg: Config, step: int,
                           stage: str = "plateau") -> tuple[list[dict], int]:  # fmt: skip
    """BAPO §4.2: "we dynamically resample groups with no correct rollouts up to k times, until
    the model outputs IDK or provides a correct answer", in the plateau stage (train.resample_stage;
    "always": both stages). The new rollouts join their group (train.resample_mode "enlarge":
    App. B.2's larger effective group, G up to G (k + 1)) or replace it ("replace"). Marked:
    rewards.bapo_resample_groups with the reward's own parameters, so "correct" is judged as the
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


def score_shared(records: list[dict], spec: str, params: dict, judge, rank: int, world: int) -> None:
    """rewards.score on every record, each rank scoring the groups of its block (a judge is asked
    once per record, and a group's rewards are computed where the whole group is); every rank
    then has every reward, in place."""
    groups = list(dict.fromkeys(str(r["group_id"]) for r in records))
    owner = {g: k for k in range(world) for g in my_share(groups, k, world)}
    mine = [r for r in records if owner[str(r["group_id"])] == rank]
    score(mine, spec, params, judge)
    if world == 1:
        return
    index = {id(r): i for i, r in enumerate(records)}  # every rank holds the same records, in the same order
    for i, reward, components in gather_lists([(index[id(r)], r["reward"], r["reward_components"]) for r in mine],
                                              world):  # fmt: skip
        records[i]["reward"], records[i]["reward_components"] = reward, components
        records[i].pop("_parsed", None)  # the parse cache (answers.parsed) is rebuilt from the record alone


def slowest(seconds: float, world: int) -> float:
    """A stage's wall time over the processes: the step waits for the slowest rank."""
    return float(all_reduce(torch.tensor([seconds], dtype=torch.float64), world, "max"))


def rft_select(records: list[dict], accept: float) -> list[dict]:
    """Reliable RFT (BAPO's baseline): keep the rollouts the reward accepts (reward >= accept);
    for a question with none, keep one that says "I don't know" if there is one."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(str(r["group_id"]), []).append(r)
    kept = []
    for rs in groups.values():
        good = [r for r in rs if r["reward"] >= accept]
        kept += good or [r for r in rs if parsed(r).idk][:1]
    return kept


def rft_step(model, records: list[dict], optimizer, cfg: Config, pad_id: int, step: int) -> dict:
    """Fine-tune on the kept rollouts: the policy loss with A = 1 and pi_old recomputed (= pi_theta),
    whose gradient at the first update is the token-mean NLL gradient of the kept policy tokens."""
    for r in records:
        r["advantage"] = 1.0
    sft_cfg = copy.deepcopy(cfg)
    sft_cfg.train.recompute_old_logprobs, sft_cfg.train.kl_coef, sft_cfg.train.is_correction = True, 0.0, 0.0
    return grpo_step(model, None, records, optimizer, sft_cfg, pad_id, step)


# ---------------------------------------------------------------------------------------------


@dataclass
class RunParts:
    """What a run holds from step to step: built once by `setup`, read by the stages below."""

    cfg: Config
    run: Path
    rank: int
    world: int
    tp: int  # ranks per engine (rollout.tensor_parallel_size)
    tokenizer: object
    engine: object
    search_fn: object
    timings: dict
    model: torch.nn.Module
    ref: torch.nn.Module | None
    critic: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    critic_opt: torch.optim.Optimizer | None
    constraints: list
    bapo: BapoState | None
    judge: object
    measure_judge: object
    train_q: list[dict]
    val_q: list[dict]
    rng: random.Random
    order: list[int] = field(default_factory=list)
    step0: int = 0
    trackers: list = field(default_factory=list)

    @property
    def main(self) -> bool:
        return self.rank == 0


def train(cfg: Config, run: Path, resume_from: Path | None = None) -> dict:
    """The loop, one step per iteration: roll out, score, update, sync, log (and evaluate, save).
    With several processes (`accelerate launch --multi_gpu` / torchrun, train.fsdp), every rank
    rolls out, scores and evaluates its share of the questions with its own engine, every rank
    sees the whole batch, and takes its share of the update (FSDP)."""
    p = setup(cfg, run, resume_from)
    ev = {}
    if p.step0 == 0 and cfg.train.eval_every > 0:
        ev = run_eval(p)
        if p.main:
            log(run, {"step": 0, "eval": ev})
            track(p.trackers, {"step": 0, "eval": ev})
            print(f"step 0 eval: {json.dumps(ev)}", flush=True)
    bar = tqdm(range(p.step0, cfg.train.steps), desc=cfg.train.algo, initial=p.step0, total=cfg.train.steps,
               disable=not p.main)  # fmt: skip
    for step in bar:
        p.timings.clear()
        for group in p.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        switch_on(p.constraints, step, cfg.train.steps)
        batch_idx, p.order = _next_batch(p.order, len(p.train_q), cfg.train.questions_per_step, p.rng)
        t0 = time.time()
        records, resampled = rollout_stage(p, [p.train_q[i] for i in batch_idx], step)  # 1. roll out
        retrieve = p.timings.get("retrieve", 0.0)
        times = {"generate": slowest(time.time() - t0 - retrieve, p.world),
                 "retrieve": slowest(retrieve, p.world)}  # fmt: skip
        t0 = time.time()
        constraint_row = reward_stage(p, records)  # 2. rewards, constraint terms
        times["reward"], t0 = time.time() - t0, time.time()
        stats = update_stage(p, records, step)  # 3-5. advantages, loss, optimizer steps
        times["train"], t0 = time.time() - t0, time.time()
        sync_stage(p)  # 6. the new weights into the engine(s)
        times["sync"] = slowest(time.time() - t0, p.world)
        row = step_row(p, step, records, stats, constraint_row, times, resampled) if p.main else {}
        if cfg.train.eval_every > 0 and ((step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.steps):
            ev = run_eval(p)  # every rank: each evaluates its share, all update the same state
            after_eval(p, ev)
            row["eval"] = ev
        if p.main:
            write_samples(run, step + 1, records[: cfg.train.samples_per_step])
            log(run, row)
            track(p.trackers, row)
            bar.set_postfix(reward=f"{row['reward']:.2f}", searches=f"{row['searches_per_question']:.2f}")
        if (cfg.train.save_every > 0 and (step + 1) % cfg.train.save_every == 0) or step + 1 == cfg.train.steps:
            save_stage(p, step)
    close_trackers(p.trackers)
    p.engine.close()
    return ev


def setup(cfg: Config, run: Path, resume_from: Path | None) -> RunParts:
    """Processes, data, engine, policy (LoRA, FSDP), reference, critic, optimizers, rewards'
    state; then the checkpoint's state when resuming. Bad settings fail before anything slow."""
    rank, world, device = init()
    if world > 1 and not cfg.train.fsdp:
        raise ConfigError(f"{world} processes need train.fsdp: true (there is no replicated data-parallel mode)")
    tp = cfg.rollout.tensor_parallel_size  # ranks per engine
    if world % tp:
        raise ConfigError(f"rollout.tensor_parallel_size {tp} must divide the number of processes ({world})")
    lora_on = cfg.train.lora_rank > 0
    if lora_on and world > 1:
        raise ConfigError("train.lora_rank runs in one process for now: FSDP over peft's adapters is not wired")
    torch.manual_seed(cfg.train.seed)
    torch.set_num_threads(cfg.train.threads)
    constraints = parse_constraints(cfg.train.constraints)  # a bad constraint fails before any work
    if cfg.data.corpus or cfg.data.train:
        data_paths(cfg)  # given files: fail on a bad path before building anything
    if rank == 0:  # builds the tiny world once; the other ranks wait, then find it cached
        start_dir = resume_from or ensure_policy(cfg, run)
    barrier(world)
    start_dir = resume_from or ensure_policy(cfg, run)
    paths = data_paths(cfg)
    train_q, val_q = load_questions(paths["train"]), load_questions(paths["val"])  # a bad line fails before any model
    tokenizer = load_tokenizer(start_dir)
    check_chat_template(tokenizer, cfg.rollout, start_dir)  # before any engine starts
    timings: dict[str, float] = {}
    # an engine per process (per tensor-parallel group): vLLM's external_launcher joins the
    # launcher's processes; "file": each engine in a process of its own (engine.py)
    engine = make_engine(
        cfg.rollout.engine, start_dir, cfg.rollout, cfg.model.dtype, seed=cfg.train.seed,
        separate_process=world > 1 and cfg.rollout.weight_sync == "file",
        launcher=world > 1 and cfg.rollout.weight_sync == "memory",
    )  # before bm25s
    search_fn = make_search_fn(cfg, paths["corpus"], timings)
    torch.set_num_threads(cfg.train.threads)  # vLLM drops torch to 1 thread "for serving"
    model, ref, critic = load_models(cfg, run, start_dir, resume_from, device, world)
    trainable = [q for q in model.parameters() if q.requires_grad]  # all of them, or LoRA's adapters
    optimizer = make_optimizer(trainable, cfg.train.lr, cfg.train.weight_decay, cfg.train.optimizer)
    critic_opt = critic_optimizer(critic, cfg.train.critic_lr) if critic is not None else None
    judge = make_judge(cfg.train.judge, cfg.train.judge_model, on_failure="zero") if cfg.train.judge else None
    p = RunParts(
        cfg, run, rank, world, tp, tokenizer, engine, search_fn, timings, model, ref, critic, optimizer, critic_opt,
        constraints,
        BapoState(patience=cfg.train.bapo_patience, min_delta=cfg.train.bapo_min_delta)
        if "bapo" in cfg.train.reward else None,
        judge,
        # validation always measures faithfulness; on the tiny world the rule judge does it for any run
        judge or (make_judge("rule") if not cfg.data.corpus else None),
        train_q,
        val_q[: cfg.eval.max_questions] if cfg.eval.max_questions else val_q,
        random.Random(cfg.train.seed),  # the question order
    )  # fmt: skip
    if resume_from is not None:
        state = load_trainer_state(resume_from, run, optimizer, rank, world)
        if critic_opt is not None:
            critic_opt.load_state_dict(load_checkpoint_file(resume_from / f"critic_optimizer.rank{rank}.pt"))
        p.step0, p.order = state["step"], state["order"]
        p.rng.setstate(state["data_rng"])
        restore_constraints(constraints, state["constraints"])
        if p.bapo is not None:
            p.bapo.__dict__.update(state["bapo"])
        print(f"resumed from {resume_from} at step {p.step0}", flush=True)
    p.trackers = open_trackers(cfg, run, resumed=resume_from is not None) if rank == 0 else []
    return p


def load_models(cfg: Config, run: Path, start_dir: Path, resume_from: Path | None, device, world: int) -> tuple:
    """(policy, frozen reference or None, critic or None), on this process's device, sharded
    with FSDP when there are several processes."""
    lora_on = cfg.train.lora_rank > 0
    # LoRA resume: the adapters sit on the ORIGINAL base; the checkpoint's model.safetensors is merged
    model = memory_savers(load_policy(ensure_policy(cfg, run) if lora_on and resume_from else start_dir).eval(), cfg)
    model = model.to(device)
    if lora_on:
        model = load_lora(model, resume_from) if resume_from else add_lora(
            model, cfg.train.lora_rank, cfg.train.lora_alpha, cfg.train.lora_dropout, cfg.train.lora_targets or None
        )  # fmt: skip
    ref = None
    if needs_reference(cfg):  # the frozen reference is the starting policy
        ref_dir = ensure_policy(cfg, run) if resume_from else start_dir  # frozen: model.dtype, no fp32 master
        ref = load_policy(ref_dir, cfg.model.dtype).eval().requires_grad_(False)
        ref = ref.to(device)
    if world > 1:
        model, ref = shard(model, cfg), shard_reference(ref, cfg)
    critic = None
    if cfg.train.algo == "ppo":
        critic = load_critic(resume_from if resume_from else start_dir).to(device)
        memory_savers(critic.backbone, cfg)
        if world > 1:
            critic = shard_critic(critic, cfg)
    return model, ref, critic


def roll_out(p: RunParts, qs: list[dict], seed: int) -> list[dict]:
    """Each engine rolls out its block of qs (whole groups); every rank gets all the records, in
    the order of qs, as one process would have them."""
    mine = my_share(qs, p.rank // p.tp, p.world // p.tp)
    records = rollout_batch(p.engine, p.tokenizer, mine, p.cfg.train.group_size, p.search_fn, p.cfg.rollout, seed=seed,
                            group_prefix=p.cfg.data.name + ":")  # fmt: skip
    return gather_lists(records, p.world, every=p.tp)


def rollout_stage(p: RunParts, questions: list[dict], step: int) -> tuple[list[dict], int]:
    """1. G rollouts per question (and BAPO's resampled groups): (records, groups resampled)."""
    cfg = p.cfg
    records = roll_out(p, questions, cfg.train.seed * 100003 + step)
    resampled = 0
    if cfg.train.resample_groups > 0:
        records, resampled = resample_marked_groups(records, questions, lambda qs, seed: roll_out(p, qs, seed), cfg,
                                                    step, p.bapo.stage if p.bapo else "plateau")  # fmt: skip
    p.engine.sleep()  # rollout.sleep_mode: free the GPU memory of vLLM's weights and KV cache for training
    return records, resampled


def reward_stage(p: RunParts, records: list[dict]) -> dict:
    """2. Rewards (each rank its groups), then the constraints' U, terms and dual update, then
    the KL penalty when it is part of the reward. Returns the constraints' metrics."""
    cfg = p.cfg
    params = reward_params(p.constraints, cfg.train.reward_params)
    if p.bapo is not None:  # the modulator's inputs: the stage and this batch's IDK ratio (BAPO §4.2)
        params |= {"stage": p.bapo.stage, "idk_ratio": sum(parsed(r).idk for r in records) / len(records)}
    score_shared(records, cfg.train.reward, params, p.judge, p.rank, p.world)
    constraint_row = constraints_step(p.constraints, records)  # U, then the terms, then the dual update
    if cfg.train.kl_in_reward and p.ref is not None and cfg.train.algo == "grpo":
        for r, kl in zip(records, kl_penalties(p.ref, records, cfg, p.tokenizer.pad_token_id)):
            r["kl_penalty"] = kl
            r["reward"] -= cfg.train.kl_coef * kl
    return constraint_row


def update_stage(p: RunParts, records: list[dict], step: int) -> dict:
    """3-5. The algorithm's update: GRPO (group advantages, grpo_step), PPO (critic, GAE,
    ppo_update) or RFT (accepted rollouts, rft_step). Returns its statistics."""
    cfg, pad_id = p.cfg, p.tokenizer.pad_token_id
    if cfg.train.algo == "rft":
        kept = rft_select(records, cfg.train.rft_accept)
        stats = rft_step(p.model, kept, p.optimizer, cfg, pad_id, step) if kept else {}
        return stats | {"rft_kept": len(kept) / len(records)}
    if cfg.train.algo == "ppo":
        return ppo_update(p.model, p.ref, p.critic, records, p.optimizer, p.critic_opt, cfg, pad_id, step, p.rank,
                          p.world)  # fmt: skip
    advantages = group_advantages(
        [r["reward"] for r in records], [r["group_id"] for r in records], cfg.train.adv_eps, cfg.train.adv_std
    )
    for r, a in zip(records, advantages):
        r["advantage"] = a
    warn_if_no_signal(advantages, records, step, p.main)
    stats = grpo_step(p.model, p.ref, records, p.optimizer, cfg, pad_id, step, p.rank, p.world)
    return stats | {"adv_nonzero_frac": sum(a != 0 for a in advantages) / len(advantages)}


def sync_stage(p: RunParts) -> None:
    """6. The new weights into the engine: LoRA's merged into fresh tensors (the policy is never
    touched); several processes: each gathers the full tensors, one at a time, into its own engine."""
    if p.cfg.train.lora_rank > 0:
        weights = merged_weights(p.model)
    else:
        weights = full_weights(p.model, p.rank, every_rank=True) if p.world > 1 else p.model.state_dict().items()
    p.engine.load_weights(weights)


def step_row(p: RunParts, step: int, records: list[dict], stats: dict, constraint_row: dict, times: dict,
             resampled: int) -> dict:  # fmt: skip
    """The step's line of metrics.jsonl."""
    gen_tokens = sum(sum(r["loss_mask"]) for r in records)
    row = {"step": step + 1} | batch_metrics(records) | stats | constraint_row | {
        "lr": lr_at(step, p.cfg),
        "tokens_per_s": gen_tokens / max(times["generate"], 1e-9),
        "time": times,
    }  # fmt: skip
    if p.cfg.train.resample_groups > 0:
        row["resampled_groups"] = resampled
    if p.bapo is not None:
        row |= {"bapo_stage": p.bapo.stage, f"idk_rate/{p.bapo.stage}": row["idk_rate"]}
    return row


def run_eval(p: RunParts) -> dict:
    """Greedy, one rollout per question, each engine its block; the metrics of them all."""
    mine = rollout_mode("agentic", p.engine, p.tokenizer, my_share(p.val_q, p.rank // p.tp, p.world // p.tp),
                        p.search_fn, p.cfg)  # fmt: skip
    val_records = gather_lists(mine, p.world, every=p.tp)
    ev = summarize(val_records)  # EM-scored (rollout_mode)
    score_shared(val_records, p.cfg.train.reward, reward_params(p.constraints, p.cfg.train.reward_params), p.judge,
                 p.rank, p.world)  # fmt: skip
    ev |= {k: v for k, v in batch_metrics(val_records).items() if k.startswith("reward/") or k == "idk_rate"}
    return ev | broadcast(paper_metrics(val_records, p.measure_judge) if p.main else None, p.world)


def after_eval(p: RunParts, ev: dict) -> None:
    """Validation-measured constraints take their dual step; BAPO's stage may switch."""
    for c in p.constraints:
        if c.measure == "val":
            dual_update(c, float(ev.get(c.stat, ev.get(c.stat.removeprefix("reward/"), 0.0))))
    if p.bapo is not None:
        p.bapo.update(ev["em"])  # the validation score whose plateau switches the stage


def save_stage(p: RunParts, step: int) -> None:
    """A checkpoint after step: weights, optimizer(s), data order and RNG, lambda, BAPO stage."""
    trainer_state = {
        "order": p.order, "data_rng": p.rng.getstate(), "constraints": constraint_state(p.constraints),
        "bapo": vars(p.bapo) if p.bapo else None,
    }  # fmt: skip
    save_checkpoint(p.run, step + 1, p.model, p.tokenizer, p.optimizer, trainer_state, p.cfg.train.keep_checkpoints,
                    p.critic, p.rank, p.world, p.critic_opt)  # fmt: skip


def ppo_update(model, ref, critic, records, optimizer, critic_opt, cfg: Config, pad_id: int, step: int,
               rank: int = 0, world: int = 1) -> dict:  # fmt: skip
    """PPO (Search-R1's best runs, ppo.py): token rewards (the score on the last policy token,
    minus kl_coef x k1 KL to the reference on every policy token when kl_in_reward), GAE over
    policy tokens with the critic's values, whitened advantages; then the clipped policy step
    and as many critic steps on the returns, on the same mini-batches (ppo.critic_update)."""
    tcfg = cfg.train
    values = critic_values(critic, records, tcfg.micro_batch_tokens, pad_id)
    kls = kl_per_position(ref, records, cfg, pad_id) if tcfg.kl_in_reward and ref is not None else None
    advantages, returns = ppo_advantages(
        records, values, [r["reward"] for r in records], kls, tcfg.kl_coef, tcfg.gae_gamma, tcfg.gae_lambda,
        tcfg.whiten_advantages, tcfg.mask_retrieved,
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
                                 tcfg.mini_batches, tcfg.seed * 1000003 + step)  # fmt: skip
    return stats | critic_stats


def _next_batch(order: list[int], n: int, k: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """Take k question indices from a shuffled epoch order, starting a new epoch when short."""
    if len(order) < k:
        fresh = list(range(n))
        rng.shuffle(fresh)
        order = order + fresh
    return order[:k], order[k:]


def warn_if_no_signal(advantages: list[float], records: list[dict], step: int, show: bool) -> None:
    """Every advantage 0 means every group scored all its rollouts alike: the step trains on the
    KL term alone. Said once a step, since a real model that cannot yet write the protocol's tags
    scores 0 on every rollout and would otherwise train on nothing, silently."""
    if show and not any(advantages):
        rewards = sorted({round(r["reward"], 3) for r in records})
        tqdm.write(f"warning: step {step + 1}: every advantage is 0 (each group's rollouts scored alike, rewards "
                   f"{rewards[:5]}): no learning signal, only the KL term. If the policy cannot write the "
                   f"protocol's tags yet, warm-start it first (README, Bring your own model)")  # fmt: skip


def end_of_run_summary(run: Path, last_eval: dict, minutes: float) -> str:
    """The validation table before -> after (tracking.summary_table) and where the rest is."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    before = next((r["eval"] for r in rows if r["step"] == 0 and "eval" in r), {})
    steps = max((r["step"] for r in rows), default=0)
    return (f"{summary_table(before, last_eval, steps, minutes)}\n"
            f"every metric, step by step: {run / 'metrics.jsonl'}; curves: python plots.py {run}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="GRPO training of a search agent (see the module docstring for the step).",
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML config, e.g. configs/tiny.yaml (defaults if omitted)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override one config key, e.g. --set train.lr=1e-4 (repeatable; unknown keys are errors)",
    )  # fmt: skip
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    parser.add_argument(
        "--plan", action="store_true",
        help="print the per-GPU memory plan for this config (hardware.*) and whether it fits; loads no model",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.plan:
        try:
            sys.exit(0 if print_plan(load_config(args.config, args.set, resolve_auto=False)) else 1)
        except (ConfigError, FileNotFoundError) as e:
            parser.error(str(e))
    try:
        if args.resume:
            run = Path(args.resume)
            cfg = load_config(run / "config.yaml", args.set)
            ckpt = latest_checkpoint(run)
            if ckpt is None:
                raise ConfigError(f"no checkpoint to resume in {run / 'checkpoints'}")
            verify_checkpoint(ckpt)  # a tampered or broken checkpoint fails here, before any model loads
            check_writable(run)  # and so does a read-only run directory
        else:
            cfg = load_config(args.config, args.set)
            parse_constraints(cfg.train.constraints)
            check_report_to(cfg)
            rank, world, _ = init()  # several processes: rank 0 names the run directory
            run, ckpt = Path(broadcast(str(new_run_dir(cfg)) if rank == 0 else "", world)), None
    except (ConfigError, FileNotFoundError, RunDirError) as e:  # RunDirError: run_dir read-only, bad checkpoint
        parser.error(str(e))
    print(f"run directory: {run}", flush=True)
    print(describe_precision(cfg), flush=True)
    t0 = time.time()
    try:
        ev = train(cfg, run, ckpt)
    except (DataError, FileNotFoundError, ConfigError, RunDirError) as e:  # RunDirError: disk full, say
        sys.exit(f"error: {e}")
    if ev:
        print(end_of_run_summary(run, ev, (time.time() - t0) / 60))


if __name__ == "__main__":
    main()
