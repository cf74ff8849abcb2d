"""Cross-check against a peer: our GRPO loss, gradients, KL and advantages against TRL's own code.

Two files: this one holds the checks, each section beside the TRL lines it mirrors and the notes
that explain each difference beside the section that measures it; trl_peer.py holds TRL's install
and trainer, the fixed inputs, the two sides' runs on one batch and the table.

    python benchmarks/bench_trl.py     # first run installs TRL into benchmarks/bench_cache/trl_pkgs

TRL 1.16.0 (PINNED below; it needs transformers >= 4.56.2, 5.19.0 here) is never a dependency of
the project: on first run the script installs it with `pip install --no-deps --target
benchmarks/bench_cache/trl_pkgs` (gitignored), together with what `trl.trainer.grpo_trainer`
imports at module level and the venv lacks (datasets, pandas, pyarrow, xxhash, multiprocess and
their small pure-Python needs), and appends that directory to the END of sys.path, so it never
shadows the venv's torch or transformers. The import takes 20-30 s (TRL imports vLLM when present).

Fixed inputs (seed 0): a tiny random Qwen2 (vocab 64, 2 layers), a reference model = the policy
with perturbed weights (k3 mean 0.16, max 6.7), Q = 5 questions x G = 4 rollouts, prompts of 6
tokens, responses of 8-28 tokens with retrieved-token holes (loss_mask 0 = TRL's tool_mask 0),
old logprobs = current + N(0, 0.3) rounded to float32 (ratios 0.41..2.70; 40% of the policy
tokens outside [0.8, 1.28], the clipped branch active on 16%), eps_low = 0.2, eps_high = 0.28
(clip-higher), beta = 0 and 0.04, rewards in five groups including a tie-only one (A = 0).

Ours:
  fp64        train.py's functions combined exactly as `_policy_update` (called by grpo_step)
              combines them: logits[:, :-1] -> log_softmax -> gather; old = where(sampled, old,
              logp.detach()); grpo_token_loss; w = loss_weights(counts, loss_agg, norm); loss =
              (tok_loss * m * w).sum(); backward. Those lines are replicated here (they sit inside
              _policy_update, next to the model call) in float64; _policy_update casts to float32.
  grpo_step   grpo.grpo_step itself, unchanged, float32, several micro-batches
              (micro_batch_tokens = 120), SGD(lr=0) and grad_clip = 1e30 (clip factor exactly 1);
              gradients read from the parameters, loss / KL / clip fraction from its totals.
  advantages  grpo.group_advantages; KL: grpo.kl_estimate(..., "k3").
TRL, its own code on a float64 copy of the same model and the same tensors:
  loss, grad  GRPOTrainer._compute_loss (trl/trainer/grpo_trainer.py) on a GRPOTrainer made with
              object.__new__, given the attributes its __init__ derives from a real GRPOConfig and a
              real (CPU) Accelerator. In the "fp64" rows its _get_per_token_logps_and_entropies is
              replaced on the instance by the log_softmax + gather lines, because TRL's fused LM
              head (trl.trainer.utils.add_fused_lm_head -> trl/kernels/chunked_logprob.py) always
              accumulates in float32; the "TRL fused head" rows run that head end to end, as
              GRPOTrainer installs it, including its own backward (tolerance 1e-5).
  KL, adv.    inline code in _compute_loss / _generate_and_score_completions: those statements are
              cut out of the installed source with inspect (start / end markers; the script stops
              if TRL's code changed) and executed unchanged.
Mode pairs: token-mean <-> dapo and bnpo, seq-mean-token-mean <-> grpo, seq-mean-token-sum-norm
(loss_norm_tokens = 32) <-> dr_grpo (max_completion_length = 32).

rel = max |ours - TRL| / max |TRL| over the compared elements (all parameters for a gradient); a
loss is divided by max(|TRL|, sum_i w_i sum_t m_t |l_t|), since its terms of both signs cancel.
PASS at rel <= 1e-6 for float64 rows, 1e-5 for float32 ones. DIFF = a convention in which TRL
differs, explained in the notes from TRL's source and shown next to the check that passes once
that one convention is aligned; a DIFF probe that stops differing is a FAIL. Exit code 1 on FAIL.
(TRL's nanstd computes Bessel's factor count / (count - 1) in the default float32 dtype, hence
rel ~2e-8 rather than 1e-16 on the aligned advantages.) Mutation check: with eps_low and eps_high
swapped inside grpo_token_loss, all 43 loss / gradient / clip-fraction rows FAIL (exit code 1).

Result, 2026-11-22, `.venv/bin/python benchmarks/bench_trl.py` (trl 1.16.0, transformers 5.19.0,
torch 2.13.0+cpu, 2 shared cores):

ratios pi/pi_old on policy tokens: 0.41..2.70, 40% outside [1-0.2, 1+0.28], clipped branch active on 16%;
k3 mean 0.162, max 6.65

check                                ours <-> TRL                           max|d|       rel    tol  status
-----------------------------------------------------------------------------------------------------------
-- per-token logprobs on policy tokens (TRL: _get_per_token_logps_and_entropies, fused LM head)
logp fp64 (grpo_step's lines)        log_softmax+gather <-> fused head    6.07e-07  8.33e-08  1e-05  PASS
logp fp32 (batching.token_logprobs)       log_softmax+gather <-> fused head    2.38e-06  3.27e-07  1e-05  PASS
-- advantages (grpo.group_advantages <-> the block of GRPOTrainer._generate_and_score_completions)
advantages, adv_eps=1e-6 (default)   std=group <-> scale_rewards=group    3.21e-04  2.14e-04  1e-06  DIFF [1]
advantages, adv_eps=1e-4 (aligned)   std=group <-> scale_rewards=group    2.23e-08  1.49e-08  1e-06  PASS
advantages, adv_eps=1e-6 (default)   std=batch <-> scale_rewards=batch    3.60e-04  2.18e-04  1e-06  DIFF [1]
advantages, adv_eps=1e-4 (aligned)   std=batch <-> scale_rewards=batch    2.95e-08  1.79e-08  1e-06  PASS
advantages, adv_eps=1e-6 (default)   std=none <-> scale_rewards=none      0.00e+00  0.00e+00  1e-06  PASS
-- loss, gradient (all parameters), KL, clipping; one batch; TRL given our fp64 logprobs
loss b=0 fp64                        token-mean <-> dapo                  1.73e-18  2.83e-18  1e-06  PASS
grad b=0 fp64                        token-mean <-> dapo                  0.00e+00  0.00e+00  1e-06  PASS
grad b=0 grpo_step fp32              token-mean <-> dapo                  1.28e-07  1.36e-06  1e-05  PASS
loss b=0 grpo_step totals fp32       token-mean <-> dapo                  2.06e-08  3.36e-08  1e-05  PASS
loss b=0 fp64                        token-mean <-> bnpo                  1.73e-18  2.83e-18  1e-06  PASS
grad b=0 fp64                        token-mean <-> bnpo                  0.00e+00  0.00e+00  1e-06  PASS
grad b=0 grpo_step fp32              token-mean <-> bnpo                  1.28e-07  1.36e-06  1e-05  PASS
loss b=0 fp64                        seq-mean-token-mean <-> grpo         1.04e-17  1.65e-17  1e-06  PASS
grad b=0 fp64                        seq-mean-token-mean <-> grpo         3.47e-18  2.74e-17  1e-06  PASS
grad b=0 grpo_step fp32              seq-mean-token-mean <-> grpo         2.11e-07  1.66e-06  1e-05  PASS
loss b=0 fp64                        seq-mean-token-sum-norm <-> dr_grpo  5.20e-18  1.92e-17  1e-06  PASS
grad b=0 fp64                        seq-mean-token-sum-norm <-> dr_grpo  0.00e+00  0.00e+00  1e-06  PASS
grad b=0 grpo_step fp32              seq-mean-token-sum-norm <-> dr_grpo  5.66e-08  1.37e-06  1e-05  PASS
loss b=0.04 fp64                     token-mean <-> dapo                  1.78e-17  2.89e-17  1e-06  PASS
grad b=0.04 fp64                     token-mean <-> dapo                  0.00e+00  0.00e+00  1e-06  PASS
grad b=0.04 grpo_step fp32           token-mean <-> dapo                  1.46e-07  1.57e-06  1e-05  PASS
loss b=0.04 grpo_step totals fp32    token-mean <-> dapo                  4.75e-08  7.71e-08  1e-05  PASS
KL mean b=0.04 fp64                  grpo_token_loss kl <-> metrics kl    5.55e-17  3.42e-16  1e-06  PASS
KL mean b=0.04 grpo_step fp32        totals kl <-> metrics kl             1.79e-10  1.10e-09  1e-05  PASS
clip fraction b=0.04 grpo_step fp32  clip_frac <-> clip_ratio/region      2.63e-10  1.69e-09  1e-05  PASS
loss b=0.04 fp64                     token-mean <-> bnpo                  1.78e-17  2.89e-17  1e-06  PASS
grad b=0.04 fp64                     token-mean <-> bnpo                  0.00e+00  0.00e+00  1e-06  PASS
grad b=0.04 grpo_step fp32           token-mean <-> bnpo                  1.46e-07  1.57e-06  1e-05  PASS
loss b=0.04 fp64                     seq-mean-token-mean <-> grpo         3.47e-17  5.49e-17  1e-06  PASS
grad b=0.04 fp64                     seq-mean-token-mean <-> grpo         6.94e-18  5.58e-17  1e-06  PASS
grad b=0.04 grpo_step fp32           seq-mean-token-mean <-> grpo         2.14e-07  1.72e-06  1e-05  PASS
loss b=0.04 fp64                     seq-mean-token-sum-norm <-> dr_grpo  1.73e-18  6.37e-18  1e-06  PASS
grad b=0.04 fp64                     seq-mean-token-sum-norm <-> dr_grpo  0.00e+00  0.00e+00  1e-06  PASS
grad b=0.04 grpo_step fp32           seq-mean-token-sum-norm <-> dr_grpo  5.89e-08  1.43e-06  1e-05  PASS
-- the same, end to end: TRL computes logprobs with its fused LM head (float32 accumulators)
loss b=0.04 TRL fused head           token-mean <-> dapo                  1.22e-08  1.99e-08  1e-05  PASS
grad b=0.04 TRL fused head           token-mean <-> dapo                  3.93e-08  4.23e-07  1e-05  PASS
loss b=0.04 TRL fused head           token-mean <-> bnpo                  1.22e-08  1.99e-08  1e-05  PASS
grad b=0.04 TRL fused head           token-mean <-> bnpo                  3.93e-08  4.23e-07  1e-05  PASS
loss b=0.04 TRL fused head           seq-mean-token-mean <-> grpo         1.81e-08  2.86e-08  1e-05  PASS
grad b=0.04 TRL fused head           seq-mean-token-mean <-> grpo         5.70e-08  4.58e-07  1e-05  PASS
loss b=0.04 TRL fused head           seq-mean-token-sum-norm <-> dr_grpo  5.42e-09  1.99e-08  1e-05  PASS
grad b=0.04 TRL fused head           seq-mean-token-sum-norm <-> dr_grpo  1.05e-08  2.56e-07  1e-05  PASS
-- KL k3 per policy token (grpo.kl_estimate <-> the per_token_kl lines of GRPOTrainer._compute_loss)
KL per token fp64                    kl_estimate k3 <-> per_token_kl      0.00e+00  0.00e+00  1e-06  PASS
-- conventions that differ, each next to its aligned check
loss b=0.04, TRL default KL          token-mean <-> dapo                  8.33e-05  1.35e-04  1e-06  DIFF [2]
grad b=0.04, TRL default KL          token-mean <-> dapo                  4.78e-03  5.20e-02  1e-06  DIFF [2]
KL mean, TRL default KL              grpo_token_loss kl <-> metrics kl    2.08e-03  1.30e-02  1e-06  DIFF [2]
KL per token, k3 up to 16            kl_estimate k3 <-> per_token_kl      6.09e+00  3.78e-01  1e-06  DIFF [3]
loss b=0.04, k3 up to 16             token-mean <-> bnpo                  4.90e-02  7.66e-02  1e-06  DIFF [3]
loss b=0.04, k3 up to 16, unclamped  token-mean <-> bnpo                  2.78e-17  4.19e-17  1e-06  PASS
grad b=0.04, k3 up to 16, unclamped  token-mean <-> bnpo                  0.00e+00  0.00e+00  1e-06  PASS
loss b=0.04, loss_norm_tokens=0      seq-mean-token-sum-norm <-> dr_grpo  1.08e-03  1.27e-01  1e-06  DIFF [4]
-- two micro-batches (gradient accumulation 2); ours is the one-batch loss
loss b=0.04, 8+12 rollouts           token-mean <-> dapo                  6.07e-18  9.86e-18  1e-06  PASS
grad b=0.04, 8+12 rollouts           token-mean <-> dapo                  2.43e-17  2.61e-16  1e-06  PASS
loss b=0.04, 8+12 rollouts           token-mean <-> bnpo                  4.70e-03  7.63e-03  1e-06  DIFF [5]
grad b=0.04, 8+12 rollouts           token-mean <-> bnpo                  1.48e-02  1.37e-01  1e-06  DIFF [5]
loss b=0.04, 8+12 rollouts           seq-mean-token-mean <-> grpo         4.26e-04  6.73e-04  1e-06  DIFF [5]
grad b=0.04, 8+12 rollouts           seq-mean-token-mean <-> grpo         2.10e-02  2.00e-01  1e-06  DIFF [5]
loss b=0.04, 8+12 rollouts           seq-mean-token-sum-norm <-> dr_grpo  3.10e-03  1.14e-02  1e-06  DIFF [5]
grad b=0.04, 8+12 rollouts           seq-mean-token-sum-norm <-> dr_grpo  1.02e-02  1.99e-01  1e-06  DIFF [5]
loss b=0.04, 10+10 rollouts          seq-mean-token-mean <-> grpo         2.78e-17  4.39e-17  1e-06  PASS
grad b=0.04, 10+10 rollouts          seq-mean-token-mean <-> grpo         1.39e-17  1.12e-16  1e-06  PASS
loss b=0.04, 10+10 rollouts          seq-mean-token-sum-norm <-> dr_grpo  4.34e-19  1.59e-18  1e-06  PASS
grad b=0.04, 10+10 rollouts          seq-mean-token-sum-norm <-> dr_grpo  3.47e-18  8.45e-17  1e-06  PASS

[1] advantage eps: TRL divides by (std + 1e-4), a literal in
    GRPOTrainer._generate_and_score_completions (trl/trainer/grpo_trainer.py); ours by (std +
    train.adv_eps), default 1e-6. Same centring on the group mean, same unbiased std
    (trl.trainer.utils.nanstd applies Bessel's correction, like our group_advantages); aligned:
    adv_eps = 1e-4.
[2] KL importance weight: TRL's default use_bias_correction_kl=True (GRPOConfig; applied in
    GRPOTrainer._compute_loss) multiplies per_token_kl by the ratio pi/pi_old (DeepSeek-V3.2), which
    also changes the KL gradient on-policy, and logs the weighted KL; ours adds beta * k3
    unweighted. Aligned: use_bias_correction_kl=False (every other b=0.04 row).
[3] k3 clamp: ours clamps k3 to [-10, 10] (grpo.kl_estimate, docs/design.md §4, as verl's low_var_kl);
    TRL's per_token_kl in GRPOTrainer._compute_loss is not clamped. Probe: ref = logp + 3 on every
    5th policy token (k3 = 16.1). Aligned: grpo.kl_estimate without the clamp, patched in this
    process for those rows only.
[4] Dr.GRPO constant: TRL divides by max_completion_length (GRPOTrainer._compute_loss, dr_grpo);
    ours by train.loss_norm_tokens, whose default 0 means rollout.max_model_len (1024, prompt
    included): a constant factor on loss and gradient. Aligned: loss_norm_tokens =
    max_completion_length (every other dr_grpo row).
[5] micro-batches: TRL's grpo / bnpo / dr_grpo normalise each micro-batch by its own sequences or
    tokens and divide by current_gradient_accumulation_steps (GRPOTrainer._compute_loss), exact only
    for equal micro-batches; ours weights every sequence from the whole batch (grpo.loss_weights),
    so the loss does not depend on the split. TRL's dapo divides by num_items_in_batch, the whole
    batch's token count, like our token-mean. Aligned: equal micro-batches (10+10 rollouts).

65 checks: 51 PASS, 14 DIFF (documented conventions), 0 FAIL; wall 57.8 s (of which TRL import 15.8 s)
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

T0 = time.perf_counter()

import torch  # noqa: E402
import transformers  # noqa: E402
from trl_peer import (  # noqa: E402 - it puts the repository on sys.path
    BETA,
    EPS_HIGH,
    EPS_LOW,
    MAXC,
    MODES,
    ROWS,
    Fixture,
    G,
    P,
    Q,
    build_fixture,
    import_trl,
    make_trainer,
    ours_fns,
    ours_grpo_step,
    row,
    section,
    table,
    trl_run,
    trl_snippet,
)

from trainer import grpo  # noqa: E402
from trainer.batching import token_logprobs  # noqa: E402
from trainer.config import Config  # noqa: E402
from trainer.grpo import group_advantages, kl_estimate  # noqa: E402


def check_logprobs(f: Fixture) -> None:
    section("per-token logprobs on policy tokens (TRL: _get_per_token_logps_and_entropies, fused LM head)")
    trainer = make_trainer(f.gt, f.policy)
    inp = f.inputs
    with torch.no_grad():
        trl_logp, _, _ = trainer._get_per_token_logps_and_entropies(
            f.policy, torch.cat([inp["prompt_ids"], inp["completion_ids"]], 1),
            torch.cat([inp["prompt_mask"], inp["completion_mask"]], 1), f.C)  # fmt: skip
        ours32 = token_logprobs(copy.deepcopy(f.policy32), f.ids, f.attn)[:, P - 1 :]
    on = f.on
    row("logp fp64 (grpo_step's lines)", "log_softmax+gather <-> fused head", f.cur_c[on], trl_logp[on], 1e-5)
    row("logp fp32 (batching.token_logprobs)", "log_softmax+gather <-> fused head", ours32[on], trl_logp[on], 1e-5)


def check_advantages(f: Fixture) -> None:
    section("advantages (grpo.group_advantages <-> the block of GRPOTrainer._generate_and_score_completions)")
    adv_src = trl_snippet(f.gt.GRPOTrainer._generate_and_score_completions,
                          "unscorable_mask = torch.isnan(rewards_per_func)",
                          "advantages = torch.nan_to_num(advantages, nan=0.0)")  # fmt: skip
    eps_note = ("advantage eps: TRL divides by (std + 1e-4), a literal in GRPOTrainer._generate_and_score_completions "
                "(trl/trainer/grpo_trainer.py); ours by (std + train.adv_eps), default 1e-6. Same centring on the "
                "group mean, same unbiased std (trl.trainer.utils.nanstd applies Bessel's correction, like our "
                "group_advantages); aligned: adv_eps = 1e-4.")  # fmt: skip
    rewards, groups = [r["reward"] for r in f.records], [r["group_id"] for r in f.records]
    for scale in ("group", "batch", "none"):
        t = make_trainer(f.gt, f.policy, scale_rewards=scale)
        ns = {
            "self": t,
            "torch": torch,
            "nanstd": f.tu.nanstd,
            "num_generations": G,
            "rewards_per_func": torch.tensor(rewards, dtype=torch.float64)[:, None],
            "device": torch.device("cpu"),
        }
        exec(adv_src, ns)  # TRL's statements, unchanged
        pair = f"std={scale} <-> scale_rewards={scale}"
        row("advantages, adv_eps=1e-6 (default)", pair, group_advantages(rewards, groups, std=scale), ns["advantages"],
            1e-6, eps_note if scale != "none" else "")  # fmt: skip
        if scale != "none":
            row("advantages, adv_eps=1e-4 (aligned)", pair, group_advantages(rewards, groups, eps=1e-4, std=scale),
                ns["advantages"], 1e-6)  # fmt: skip


def check_losses(f: Fixture) -> float:
    """Loss, gradient, KL and clipping of one batch, all four aggregations; returns the clip fraction."""
    section("loss, gradient (all parameters), KL, clipping; one batch; TRL given our fp64 logprobs")
    clip = 0.0
    for beta in (0.0, BETA):
        for ours_mode, trl_type in MODES:
            t = make_trainer(f.gt, f.policy, loss_type=trl_type, beta=beta)
            theirs = trl_run(t, f.policy, f.inputs)
            ours = ours_fns(f.policy, f.batch, ours_mode, beta)
            step = ours_grpo_step(f.policy32, f.ref32, f.records, ours_mode, beta)
            pair, b = f"{ours_mode} <-> {trl_type}", f"b={beta:g}"
            row(f"loss {b} fp64", pair, ours["loss"], theirs["loss"], 1e-6, scale=ours["scale"])
            row(f"grad {b} fp64", pair, ours["grad"], theirs["grad"], 1e-6)
            row(f"grad {b} grpo_step fp32", pair, step["grad"], theirs["grad"], 1e-5)
            if trl_type == "dapo":
                row(f"loss {b} grpo_step totals fp32", pair, step["loss"], theirs["loss"], 1e-5, scale=ours["scale"])
            if beta > 0 and trl_type == "dapo":
                kl_mean = theirs["metrics"]["kl"]
                row(f"KL mean {b} fp64", "grpo_token_loss kl <-> metrics kl", ours["kl_mean"], kl_mean, 1e-6)
                row(f"KL mean {b} grpo_step fp32", "totals kl <-> metrics kl", step["kl"], kl_mean, 1e-5)
                row(f"clip fraction {b} grpo_step fp32", "clip_frac <-> clip_ratio/region", step["clip_frac"],
                    theirs["metrics"]["clip_ratio/region_mean"], 1e-5)  # fmt: skip
                clip = step["clip_frac"]

    section("the same, end to end: TRL computes logprobs with its fused LM head (float32 accumulators)")
    for ours_mode, trl_type in MODES:
        t = make_trainer(f.gt, f.policy, loss_type=trl_type, beta=BETA)
        theirs = trl_run(t, f.policy, f.inputs, fused=True)
        ours = ours_fns(f.policy, f.batch, ours_mode, BETA)
        pair = f"{ours_mode} <-> {trl_type}"
        row(f"loss b={BETA:g} TRL fused head", pair, ours["loss"], theirs["loss"], 1e-5, scale=ours["scale"])
        row(f"grad b={BETA:g} TRL fused head", pair, ours["grad"], theirs["grad"], 1e-5)
    return clip


def trl_kl(f: Fixture, inp: dict, bias_kl: bool) -> torch.Tensor:
    """TRL's per_token_kl lines of GRPOTrainer._compute_loss, run on `inp`."""
    kl_src = trl_snippet(f.gt.GRPOTrainer._compute_loss, 'ref_per_token_logps = inputs["ref_per_token_logps"]',
                         "per_token_kl = per_token_kl * coef_1")  # fmt: skip
    t = make_trainer(f.gt, f.policy, bias_kl=bias_kl)
    coef_1 = torch.exp(f.cur_c - inp["old_per_token_logps"])
    ns = {"self": t, "torch": torch, "inputs": inp, "per_token_logps": f.cur_c, "coef_1": coef_1}
    exec(kl_src, ns)
    return ns["per_token_kl"]


def check_kl(f: Fixture) -> tuple[float, float]:
    """k3 per policy token; returns its mean and max on the main inputs."""
    section("KL k3 per policy token (grpo.kl_estimate <-> the per_token_kl lines of GRPOTrainer._compute_loss)")
    ours_kl = kl_estimate(f.cur, f.ref_full, "k3")[:, P - 1 :]
    on = f.on
    kl_mean, kl_max = float(ours_kl[on].mean()), float(ours_kl[on].max())
    assert kl_max < 10, "the main inputs must not reach the k3 clamp (it is probed separately)"
    row("KL per token fp64", "kl_estimate k3 <-> per_token_kl", ours_kl[on], trl_kl(f, f.inputs, False)[on], 1e-6)
    return kl_mean, kl_max


def check_conventions(f: Fixture) -> None:
    """Each convention that differs from TRL's, next to its aligned check."""
    section("conventions that differ, each next to its aligned check")
    bias_note = ("KL importance weight: TRL's default use_bias_correction_kl=True (GRPOConfig; applied in "
                 "GRPOTrainer._compute_loss) multiplies per_token_kl by the ratio pi/pi_old (DeepSeek-V3.2), which "
                 "also changes the KL gradient on-policy, and logs the weighted KL; ours adds beta * k3 unweighted. "
                 "Aligned: use_bias_correction_kl=False (every other b=0.04 row).")  # fmt: skip
    t = make_trainer(f.gt, f.policy, loss_type="dapo", beta=BETA, bias_kl=True)
    theirs = trl_run(t, f.policy, f.inputs)
    ours = ours_fns(f.policy, f.batch, "token-mean", BETA)
    pair = "token-mean <-> dapo"
    row(f"loss b={BETA:g}, TRL default KL", pair, ours["loss"], theirs["loss"], 1e-6, bias_note, ours["scale"])
    row(f"grad b={BETA:g}, TRL default KL", pair, ours["grad"], theirs["grad"], 1e-6, bias_note)
    row("KL mean, TRL default KL", "grpo_token_loss kl <-> metrics kl", ours["kl_mean"], theirs["metrics"]["kl"],
        1e-6, bias_note)  # fmt: skip

    # the k3 clamp: a reference far more confident than the policy on every 5th policy token
    on, cur_c, C = f.on, f.cur_c, f.C
    far = f.inputs["ref_per_token_logps"].clone()
    pick = torch.zeros_like(on)
    pick.view(-1)[on.view(-1).nonzero().squeeze(1)[::5]] = True
    far[pick] = cur_c[pick] + 3.0  # k3 = e^3 - 3 - 1 = 16.1 > 10
    far_inputs = f.inputs | {"ref_per_token_logps": far}
    far_full = f.ref_full.clone()
    far_full[:, P - 1 : P - 1 + C] = far
    clamp_note = ("k3 clamp: ours clamps k3 to [-10, 10] (grpo.kl_estimate, docs/design.md §4, as verl's low_var_kl); "
                  "TRL's per_token_kl in GRPOTrainer._compute_loss is not clamped. Probe: ref = logp + 3 on every "
                  "5th policy token (k3 = 16.1). Aligned: grpo.kl_estimate without the clamp, patched in this "
                  "process for those rows only.")  # fmt: skip
    row("KL per token, k3 up to 16", "kl_estimate k3 <-> per_token_kl",
        kl_estimate(f.cur, far_full, "k3")[:, P - 1 :][on], trl_kl(f, far_inputs, False)[on], 1e-6,
        clamp_note)  # fmt: skip
    t = make_trainer(f.gt, f.policy, loss_type="bnpo", beta=BETA)
    theirs = trl_run(t, f.policy, far_inputs)
    ours = ours_fns(f.policy, f.batch, "token-mean", BETA, ref=far_full)
    pair = "token-mean <-> bnpo"
    row(f"loss b={BETA:g}, k3 up to 16", pair, ours["loss"], theirs["loss"], 1e-6, clamp_note, ours["scale"])
    clamped = grpo.kl_estimate
    grpo.kl_estimate = lambda logp, ref_logp, kind="k3": torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    try:
        ours = ours_fns(f.policy, f.batch, "token-mean", BETA, ref=far_full)
    finally:
        grpo.kl_estimate = clamped
    row(f"loss b={BETA:g}, k3 up to 16, unclamped", pair, ours["loss"], theirs["loss"], 1e-6, scale=ours["scale"])
    row(f"grad b={BETA:g}, k3 up to 16, unclamped", pair, ours["grad"], theirs["grad"], 1e-6)

    # Dr.GRPO's constant with our default loss_norm_tokens = 0
    max_len = Config().rollout.max_model_len
    norm_note = (f"Dr.GRPO constant: TRL divides by max_completion_length (GRPOTrainer._compute_loss, dr_grpo); "
                 f"ours by train.loss_norm_tokens, whose default 0 means rollout.max_model_len ({max_len}, prompt "
                 f"included): a constant factor on loss and gradient. Aligned: loss_norm_tokens = "
                 f"max_completion_length (every other dr_grpo row).")  # fmt: skip
    t = make_trainer(f.gt, f.policy, loss_type="dr_grpo", beta=BETA)
    theirs = trl_run(t, f.policy, f.inputs)
    ours = ours_fns(f.policy, f.batch, "seq-mean-token-sum-norm", BETA, norm=max_len)
    pair = "seq-mean-token-sum-norm <-> dr_grpo"
    row(f"loss b={BETA:g}, loss_norm_tokens=0", pair, ours["loss"], theirs["loss"], 1e-6, norm_note, ours["scale"])


def check_accumulation(f: Fixture) -> None:
    """TRL calls _compute_loss per micro-batch; ours is the one-batch loss whatever the split."""
    section("two micro-batches (gradient accumulation 2); ours is the one-batch loss")
    accum_note = ("micro-batches: TRL's grpo / bnpo / dr_grpo normalise each micro-batch by its own sequences or "
                  "tokens and divide by current_gradient_accumulation_steps (GRPOTrainer._compute_loss), exact "
                  "only for equal micro-batches; ours weights every sequence from the whole batch "
                  "(grpo.loss_weights), so the loss does not depend on the split. TRL's dapo divides by "
                  "num_items_in_batch, the whole batch's token count, like our token-mean. Aligned: equal "
                  "micro-batches (10+10 rollouts).")  # fmt: skip
    halves = {"8+12": [list(range(8)), list(range(8, 20))], "10+10": [list(range(10)), list(range(10, 20))]}
    ours_by_mode = {m: ours_fns(f.policy, f.batch, m, BETA) for m, _ in MODES}
    for split, parts in halves.items():
        for ours_mode, trl_type in MODES:
            if split == "10+10" and trl_type in ("dapo", "bnpo"):
                continue  # equal halves still differ in token count; dapo passes on 8+12 already
            t = make_trainer(f.gt, f.policy, loss_type=trl_type, beta=BETA, accum=2)
            theirs = trl_run(t, f.policy, f.inputs, parts)
            why = accum_note if split == "8+12" and trl_type != "dapo" else ""
            ours, pair = ours_by_mode[ours_mode], f"{ours_mode} <-> {trl_type}"
            row(f"loss b={BETA:g}, {split} rollouts", pair, ours["loss"], theirs["loss"], 1e-6, why, ours["scale"])
            row(f"grad b={BETA:g}, {split} rollouts", pair, ours["grad"], theirs["grad"], 1e-6, why)


def main() -> int:
    t_install = time.perf_counter()
    trl, gt, tu = import_trl()
    t_import = time.perf_counter() - t_install
    torch.set_num_threads(2)
    f = build_fixture(gt, tu)
    comp_mask = f.inputs["completion_mask"]
    print(f"TRL {trl.__version__} from {Path(trl.__file__).parent}  (import {t_import:.1f} s); transformers "
          f"{transformers.__version__}, torch {torch.__version__}\n{len(f.records)} rollouts (G={G}, Q={Q}), "
          f"{int(f.on.sum())} policy tokens of {int(comp_mask.sum())} response tokens, C={f.C}, "
          f"max_completion_length={MAXC}", flush=True)  # fmt: skip
    check_logprobs(f)
    check_advantages(f)
    clip = check_losses(f)
    kl_mean, kl_max = check_kl(f)
    check_conventions(f)
    check_accumulation(f)

    wall = time.perf_counter() - T0
    ratio = torch.exp(f.cur_c - f.inputs["old_per_token_logps"])[f.on]
    outside = float(((ratio < 1 - EPS_LOW) | (ratio > 1 + EPS_HIGH)).double().mean())
    print(f"ratios pi/pi_old on policy tokens: {float(ratio.min()):.2f}..{float(ratio.max()):.2f}, {outside:.0%} "
          f"outside [1-{EPS_LOW}, 1+{EPS_HIGH}], clipped branch active on {clip:.0%};\nk3 mean "
          f"{kl_mean:.3f}, max {kl_max:.2f}\n")  # fmt: skip
    print(table())
    checks = [r for r in ROWS if not isinstance(r, str)]
    fails = sum(r[5].startswith("FAIL") for r in checks)
    print(f"\n{len(checks)} checks: {sum(r[5] == 'PASS' for r in checks)} PASS, "
          f"{sum(r[5] == 'DIFF' for r in checks)} DIFF (documented conventions), {fails} FAIL; "
          f"wall {wall:.1f} s (of which TRL import {t_import:.1f} s)")  # fmt: skip
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
