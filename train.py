"""Train a search agent with GRPO: roll out, score, take a masked clipped step, sync vLLM.

    python train.py --config configs/tiny.yaml                 # the embedded tiny world, CPU
    python train.py --config configs/tiny.yaml --set train.steps=5 --set rollout.engine=hf
    python train.py --resume runs/tiny-20261122-010203         # continue a killed run
    python train.py --config configs/tiny_ppo.yaml             # PPO; also configs/experiments/tiny_lagrangian.yaml
    python train.py --config X --plan                          # per-GPU memory plan, no model loaded

One step, top to bottom: `train()` calls one function per stage (rollout_stage, reward_stage,
update_stage with grpo_step / ppo_update / rft_step, sync_stage, then run_eval and save_stage):

  1. rollout   G trajectories per question with the current policy (rollout.py), searching
               the corpus mid-thought; records keep token ids, loss mask and sampling logprobs
  2. reward    r_i = EM(answer_i, golden) (Search-R1 §3.4), or any `train.reward` of rewards.py
  3. advantage A_i = (r_i - mean(r_group)) / (std(r_group) + eps)   (GRPO, docs/design.md §4),
               the same A_i for every token of rollout i; a group with equal rewards has A = 0;
               a reward's turn_rewards add lambda T_ik on turn k's tokens (trainer/turns.py)
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
(trainer/constraints.py, Deliberative Searcher Alg. 1); `algo: ppo` replaces step 3 with a critic and
GAE (trainer/ppo.py); `algo: rft` keeps only accepted rollouts and fine-tunes on them (BAPO's
baseline); `reward: bapo` adds BAPO's resampling and stage switch; `overlap` rolls out step k+1 in
a thread beside step k's update, on the engine in its own process, syncing between rollouts
(overlapped_rollout, trainer/overlap.py, docs/overlap.md). Several processes
(`accelerate launch --multi_gpu`, trainer/distributed.py): each rank's own engine rolls out a block of
the step's questions (whole groups) and each rank scores the groups it rolled out; the records
are gathered, so every rank computes the same advantages, constraint terms and metrics as one
process would; every rank runs step 5 on its FSDP shard, and step 6 gathers the full weights one
tensor at a time into every rank's engine. Evaluation is sharded the same way.

Worked example of step 3: a group of 4 rewards [1, 0, 0, 1] has mean 0.5 and std 0.577, so
the advantages are [+0.866, -0.866, -0.866, +0.866].

The run directory `runs/<name>-<time>/` holds config.yaml (resolved), metrics.jsonl (one line
per step, plus eval lines), samples/step_<k>.jsonl (rollout records) and checkpoints/step_<k>/
(trainer/checkpoint.py: weights, optimizer, RNG, data order, lambda, ...). `python eval.py curves RUN`
draws it.

The step, read top to bottom, is this file; one GRPO update reads on in trainer/grpo.py (the loss)
and trainer/batching.py (micro-batches, accumulation). What a run holds and how it is built is
run_setup.py; which rollouts a step trains on (BAPO's resampling, DAPO's dynamic sampling) is
sampling.py; the rest is in trainer/.
"""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_while_starting(signum: int, _frame) -> None:
    """Ctrl-C or SIGTERM while the imports below load (several seconds): one line, not the
    traceback of whichever import it landed in; nothing has been written yet. main() hands the
    signals to trainer.faults.stop_on_signals once the run starts."""
    sys.stderr.write(f"interrupted while starting ({signal.Signals(signum).name}): nothing was written\n")
    os._exit(128 + signum)


if __name__ == "__main__":  # a script only: a test or benchmark importing train.py keeps its own handlers
    for _signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_signal, _interrupted_while_starting)

import argparse
import json
import random
import time
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from agent.answers import parsed
from eval import rollout_mode, summarize
from report.metrics import batch_metrics, paper_metrics
from rewards import REWARDS, check_reward
from rollout import rollout_batch
from rollout_tree import rollout_trees
from run_setup import RunParts, setup
from sampling import fill_varied_groups, resample_marked_groups, score_shared, trained_records, varied_groups
from search.client import RetrieverError
from tiny.world import world_key
from trainer.checkpoint import (
    check_writable,
    latest_checkpoint,
    load_checkpoint_file,
    log,
    new_run_dir,
    save_checkpoint,
    verified_checkpoint,
    write_samples,
)
from trainer.config import Config, ConfigError, DataError, RunDirError, TrainingFault, config_to_dict, load_config
from trainer.constraints import dual_update, parse_constraints, reward_params, switch_on
from trainer.constraints import state as constraint_state
from trainer.constraints import step as constraints_step
from trainer.distributed import (
    broadcast,
    check_shared_run_dir,
    close,
    compute_device,
    full_weights,
    gather_lists,
    init,
    load_to_device,
    my_share,
    offload_to_host,
    phase_offload,
)
from trainer.faults import (
    Interrupted,
    check_engine_logprobs,
    interrupted,
    raise_if_interrupted,
    stop_on_signals,
    stopped_answering,
)
from trainer.grpo import group_advantages, grpo_step, kl_penalties, lr_at, rft_select, rft_step
from trainer.judging import check_judge, judge_counts, judge_row
from trainer.lora import merged_weights
from trainer.overlap import (
    check_in_flight,
    check_staleness,
    collect,
    in_flight_state,
    note,
    overlap_on,
    settle,
    start,
)
from trainer.plan import print_plan
from trainer.ppo import ppo_update
from trainer.precision import describe as describe_precision
from trainer.precision import resolve as resolve_precision
from trainer.reward_spec import judge_note
from trainer.rundir import check_resume_config, discard_unstarted, own_run_dir
from trainer.sync_check import check_sync, probe_dtypes, probe_ids, sync_bound, trainer_probe_logprobs
from trainer.tracking import (
    check_report_to,
    close_trackers,
    effect_note,
    slowest,
    stage_peak_gib,
    summary_table,
    track,
)
from trainer.tree import tree_advantages
from trainer.turns import grpo_turn_advantages, has_turn_rewards, turn_reward_means

# ---------------------------------------------------------------------------------------------


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
            if ev.get("format_ok") == 0.0:  # a trained start never does this: the engine's output is garbage
                print(f"warning: not one validation rollout of the starting policy is well-formed (format 0.00 of "
                      f"{ev['n']}); if it was trained on rollout.protocol {cfg.rollout.protocol!r}, suspect the "
                      f"rollout engine ({cfg.rollout.engine}) and any CPU kernel override (results/cpu_kernels.md)",
                      flush=True)  # fmt: skip
    bar = tqdm(range(p.step0, cfg.train.steps), desc=cfg.train.algo, initial=p.step0, total=cfg.train.steps,
               disable=not p.main)  # fmt: skip
    for step in bar:
        raise_if_interrupted()  # a Ctrl-C whose first raise a __del__ swallowed (faults.stop_on_signals)
        if p.pipe is None:  # train.overlap: a rollout in flight counts its searches itself (overlapped_rollout)
            p.timings.clear()
        for group in p.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        switch_on(p.constraints, step, cfg.train.steps)
        t0, gpu = time.time(), {"engine": p.engine_gib, "before": stage_peak_gib(p.world)}  # setup or eval, save
        judged_before = judge_counts(p.judge)
        try:
            records, counts = rollout_stage(p, step)  # 1. roll out (and, with filter_groups, score and refill)
            times = rollout_times(p, step, t0)
            gpu["generate"] = stage_peak_gib(p.world)
            t0 = time.time()
            if phase_offload(cfg, p.world):  # vLLM asleep: the training state back for rewards (KL) and update
                load_to_device([p.model, p.ref, p.critic], [p.optimizer, p.critic_opt], compute_device(p.model))
            constraint_row = reward_stage(p, records, judged_before, scored=cfg.train.filter_groups)  # 2. rewards
            times["reward"], t0 = time.time() - t0, note(p.timeline, step, "trainer", "reward", t0, time.time())
            stats = update_stage(p, records, step)  # 3-5. advantages, loss, optimizer steps
        except TrainingFault as e:  # a bad reward, a NaN loss or gradient: stop before it reaches a checkpoint
            said = str(e) if str(e).startswith(f"step {step + 1}:") else f"step {step + 1}: {e}"  # engine's has it
            raise TrainingFault(f"{said}. {resume_hint(run)}") from None
        times["train"], t0 = time.time() - t0, note(p.timeline, step, "trainer", "train", t0, time.time())
        gpu["train"] = stage_peak_gib(p.world)  # rewards and the update
        if p.pipe is None:  # train.overlap syncs when the engine is idle: in the next step's rollout_stage
            checked_sync(p, step, records)  # 6. the new weights into the engine(s), checked there
            times["sync"] = slowest(time.time() - t0, p.world)
        gpu["sync"] = stage_peak_gib(p.world)
        row = step_row(p, step, records, stats, constraint_row | counts, times) if p.main else {}
        if torch.cuda.is_available() and p.main:
            row["gpu_peak_gib"] = gpu
        if cfg.train.eval_every > 0 and ((step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.steps):
            if p.pipe is not None:  # the rollout in flight finished first, then this step's weights in
                settle_and_sync(p, step, records)
            t0 = time.time()
            ev = run_eval(p)  # every rank: each evaluates its share, all update the same state
            note(p.timeline, step, "trainer", "eval", t0, time.time())
            after_eval(p, ev)
            row["eval"] = ev
        if p.main:
            keep = None if cfg.train.samples_per_step == "all" else cfg.train.samples_per_step  # None: every rollout
            write_samples(run, step + 1, records[:keep])
            log(run, row)
            track(p.trackers, row)
            bar.set_postfix(reward=f"{row['reward']:.2f}", searches=f"{row['searches_per_question']:.2f}")
        if (cfg.train.save_every > 0 and (step + 1) % cfg.train.save_every == 0) or step + 1 == cfg.train.steps:
            if p.pipe is not None:  # the checkpoint keeps the rollout in flight, finished (trainer/overlap.py)
                settle(p.pipe, partial(gather_records, p))
            t0 = time.time()
            save_stage(p, step)
            note(p.timeline, step, "trainer", "save", t0, time.time())
    close_trackers(p.trackers)
    p.engine.close()
    close(p.world)  # the process group: several processes exit cleanly (distributed.close says why)
    return ev


def gather_records(p: RunParts, mine: list[dict]) -> list[dict]:
    """Every rank's records, in rank order (one copy per tensor-parallel group)."""
    return gather_lists(mine, p.world, every=p.tp)


def roll_out(p: RunParts, qs: list[dict], seed: int) -> list[dict]:
    """Each engine rolls out its block of qs (whole groups); every rank gets all the records, in
    the order of qs, as one process would have them."""
    return gather_records(p, roll_out_mine(p, qs, seed))


def roll_out_mine(p: RunParts, qs: list[dict], seed: int) -> list[dict]:
    """This engine's block of qs rolled out; no collective (train.overlap runs it in a thread)."""
    mine = my_share(qs, p.rank // p.tp, p.world // p.tp)
    if p.cfg.rollout.tree_m:  # tree rollouts (rollout_tree.py): group_size leaves per question
        return rollout_trees(p.engine, p.tokenizer, mine, p.search_fn, p.cfg.rollout, seed=seed,
                             group_prefix=p.cfg.data.name + ":")  # fmt: skip
    return rollout_batch(p.engine, p.tokenizer, mine, p.cfg.train.group_size, p.search_fn, p.cfg.rollout, seed=seed,
                         group_prefix=p.cfg.data.name + ":")  # fmt: skip


def rollout_stage(p: RunParts, step: int) -> tuple[list[dict], dict]:
    """1. G rollouts per question of the step's batch, plus BAPO's resampled groups or, with
    train.filter_groups, the groups that replace those whose rewards are all alike: (records, the
    stage's counts for the step's row). With train.overlap: overlapped_rollout."""
    cfg = p.cfg
    if p.pipe is not None:
        return overlapped_rollout(p, step), {}
    batch_idx, p.order = _next_batch(p.order, len(p.train_q), cfg.train.questions_per_step, p.rng)
    questions = [p.train_q[i] for i in batch_idx]
    records = roll_out(p, questions, cfg.train.seed * 100003 + step)
    check_engine_logprobs(records, cfg.rollout.engine, step + 1)  # NaN from the engine: named as its own
    counts = {}
    if cfg.train.resample_groups > 0:
        stage = p.bapo.stage if p.bapo else "plateau"
        records, counts["resampled_groups"] = resample_marked_groups(records, questions,
                                                                     lambda qs, seed: roll_out(p, qs, seed), cfg,
                                                                     step, stage)  # fmt: skip
    if cfg.train.filter_groups:  # DAPO's dynamic sampling: groups with no GRPO signal replaced
        turns = cfg.train.turn_norm if cfg.train.turn_coef else None  # outcomes tie, turns differ: a signal
        records, counts["filter"] = fill_varied_groups(records, cfg.train.questions_per_step,
                                                       cfg.train.filter_max_rounds, lambda rs: score_records(p, rs),
                                                       lambda n, k: roll_out_next(p, n, step, k), turns)  # fmt: skip
        if counts["filter"]["groups"] < cfg.train.questions_per_step and p.main:
            tqdm.write(f"filter_groups: step {step + 1}: {counts['filter']['groups']} of {cfg.train.questions_per_step}"
                       f" groups have (turn) rewards that differ after {counts['filter']['rounds']} more rounds "
                       "(train.filter_max_rounds); training on those (none: on the first batch as it was)")  # fmt: skip
    for r in records:  # [first response token, policy version]: all of it by this step's policy (trainer/overlap.py)
        r["versions"] = [[0, step]]
    p.engine.sleep()  # rollout.sleep_mode: free the GPU memory of vLLM's weights and KV cache for training
    return records, counts


def overlapped_rollout(p: RunParts, step: int) -> list[dict]:
    """1. with train.overlap (trainer/overlap.py): the records of the rollout started during the
    step before (at the first step, started now and waited for), within train.max_staleness; then,
    the engine idle, this step's policy into it (the weight check included), and the next step's
    rollout started in a thread, to run beside this step's rewards and update."""
    cfg, pipe = p.cfg, p.pipe
    if pipe.pending is None:  # nothing rolled out ahead: the first step (of a run, or of a resume without one)
        start_rollout(p, step)
    records = collect(pipe, partial(gather_records, p))
    check_staleness(records, step, cfg.train.max_staleness)
    check_engine_logprobs(records, cfg.rollout.engine, step + 1)
    if pipe.version < step:  # the previous step's update into the engine ("step k+1: weight check" if it fails)
        t0 = time.time()
        sync_stage(p, step, records)
        pipe.version = step
        pipe.sync_seconds = note(p.timeline, step, "trainer", "sync", t0, time.time()) - t0
    if step + 1 < cfg.train.steps:
        start_rollout(p, step + 1)
    return records


def start_rollout(p: RunParts, step: int) -> None:
    """Take step's questions from the data order here (the main thread, so a checkpoint's order
    matches), and roll them out in a thread (trainer/overlap.start), counting its searches' time."""
    idx, p.order = _next_batch(p.order, len(p.train_q), p.cfg.train.questions_per_step, p.rng)
    questions, seed = [p.train_q[i] for i in idx], p.cfg.train.seed * 100003 + step
    start(p.pipe, step, lambda: roll_out_mine(p, questions, seed), lambda: p.timings.get("retrieve", 0.0))


def rollout_times(p: RunParts, step: int, t0: float) -> dict:
    """The rollout's seconds for the step's row: generate (less the searches) and retrieve; with
    train.overlap, those of the rollout run in the thread, plus how long the trainer waited for it
    and the sync done before the next one started."""
    if p.pipe is None:
        note(p.timeline, step, "engine", "rollout", t0, time.time())
        retrieve = p.timings.get("retrieve", 0.0)
        return {"generate": slowest(time.time() - t0 - retrieve, p.world), "retrieve": slowest(retrieve, p.world)}
    got, synced = p.pipe.collected, p.pipe.sync_seconds
    p.pipe.sync_seconds = 0.0
    return {"generate": slowest(got.seconds - got.retrieve, p.world), "retrieve": slowest(got.retrieve, p.world),
            "wait": slowest(got.waited, p.world), "sync": slowest(synced, p.world)}  # fmt: skip


def settle_and_sync(p: RunParts, step: int, records: list[dict]) -> None:
    """train.overlap, before an evaluation: the rollout in flight finished (kept for the next
    step), then this step's weights into the engine, so validation sees the policy it names."""
    settle(p.pipe, partial(gather_records, p))
    if p.pipe.version < step + 1:
        checked_sync(p, step, records)
        p.pipe.version = step + 1


def checked_sync(p: RunParts, step: int, records: list[dict]) -> None:
    """sync_stage, its TrainingFault (the engine does not serve the weights) saying where to resume."""
    t0 = time.time()
    try:
        sync_stage(p, step, records)
    except TrainingFault as e:
        raise TrainingFault(f"{e}. {resume_hint(p.run)}") from None
    note(p.timeline, step, "trainer", "sync", t0, time.time())


def roll_out_next(p: RunParts, n: int, step: int, round_: int) -> list[dict]:
    """The next n questions of the data order, rolled out (filter_groups' refills, a seed each round)."""
    idx, p.order = _next_batch(p.order, len(p.train_q), n, p.rng)
    records = roll_out(p, [p.train_q[i] for i in idx], p.cfg.train.seed * 100003 + step + 7_000_003 * round_)
    check_engine_logprobs(records, p.cfg.rollout.engine, step + 1)
    return records


def score_records(p: RunParts, records: list[dict]) -> None:
    """rewards.score with the run's parameters (the constraints' lambdas, BAPO's modulator inputs:
    the stage and this batch's IDK ratio, BAPO §4.2), each rank its groups (score_shared)."""
    params = reward_params(p.constraints, p.cfg.train.reward_params)
    if p.bapo is not None:
        params |= {"stage": p.bapo.stage, "idk_ratio": sum(parsed(r).idk for r in records) / len(records)}
    score_shared(records, p.cfg.train.reward, params, p.judge, p.rank, p.world, p.given)


def reward_stage(p: RunParts, records: list[dict], judged_before: dict, scored: bool = False) -> dict:
    """2. Rewards (each rank its groups; a judge's verdicts asked in one batch; already scored
    where filter_groups needed them), then the constraints' U, terms and dual update, then the KL
    penalty when it is part of the reward. Returns the judge's and the constraints' metrics. Too
    many failed verdicts stop the step here, before any optimizer step (check_judge)."""
    cfg = p.cfg
    if not scored:
        score_records(p, records)
    judged = judge_row(p.judge, judged_before, p.world)
    check_judge(p.judge, judged, cfg.train.judge_max_failure_rate, p.world)
    constraint_row = judged | constraints_step(p.constraints, records)  # U, then the terms, then the dual update
    if cfg.train.kl_in_reward and p.ref is not None and cfg.train.algo == "grpo":
        for r, kl in zip(records, kl_penalties(p.ref, records, cfg, p.tokenizer.pad_token_id, p.rank, p.world)):
            r["kl_penalty"] = kl
            r["reward"] -= cfg.train.kl_coef * kl
    return constraint_row


def update_stage(p: RunParts, records: list[dict], step: int) -> dict:
    """3-5. The algorithm's update: GRPO (group advantages, grpo_step), PPO (critic, GAE,
    ppo_update) or RFT (accepted rollouts, rft_step). Returns its statistics."""
    cfg, pad_id = p.cfg, p.tokenizer.pad_token_id
    if cfg.train.algo == "rft":
        kept = rft_select(records, cfg.train.rft_accept, [parsed(r).idk for r in records])
        stats = rft_step(p.model, kept, p.optimizer, cfg, pad_id, step) if kept else {}
        return stats | {"rft_kept": len(kept) / len(records)}
    if cfg.train.algo == "ppo":
        trained = trained_records(records, cfg)  # train.mask_truncated: none left is a TrainingFault
        return ppo_update(p.model, p.ref, p.critic, trained, p.optimizer, p.critic_opt, cfg, pad_id, step, p.rank,
                          p.world)  # fmt: skip
    trained = trained_records(records, cfg)  # the same records, advantages set below
    rewards, groups = [r["reward"] for r in records], [r["group_id"] for r in records]
    if cfg.rollout.tree_m:  # Tree-GRPO: inter- plus intra-tree (trainer/tree.py)
        trees = [r["tree"]["tree_id"] for r in records]
        advantages = tree_advantages(rewards, groups, trees, cfg.train.adv_eps, cfg.train.adv_std)
    else:
        advantages = group_advantages(rewards, groups, cfg.train.adv_eps, cfg.train.adv_std)
    for r, a in zip(records, advantages):
        r["advantage"] = a
    if cfg.train.turn_coef and has_turn_rewards(records):  # credit per search step (trainer/turns.py)
        per_position = grpo_turn_advantages(records, advantages, cfg.train.turn_coef, cfg.train.turn_norm,
                                            cfg.train.adv_eps, cfg.train.adv_std)  # fmt: skip
        for r, adv in zip(records, per_position):
            r["advantages"] = adv
    else:  # with turn rewards, equal outcomes still leave the turns' signal
        warn_if_no_signal(advantages, records, step, p.main)
    stats = grpo_step(p.model, p.ref, trained, p.optimizer, cfg, pad_id, step, p.rank, p.world)
    for r in records:
        r.pop("advantages", None)  # per-token lists would bloat samples/*.jsonl
    return stats | {"adv_nonzero_frac": sum(a != 0 for a in advantages) / len(advantages),
                    **({"truncated_masked": 1 - len(trained) / len(records)} if cfg.train.mask_truncated else {})}


def sync_stage(p: RunParts, step: int, records: list[dict]) -> None:
    """6. The new weights into the engine: LoRA's merged into fresh tensors (the policy is never
    touched); several processes: each gathers the full tensors, one at a time, into its own engine.
    Every train.sync_check_every steps, the engine is then shown to serve them: its logprobs on a
    probe (the step's first rollout) against the trainer's, or a TrainingFault (trainer/sync_check.py)."""
    every = p.cfg.train.sync_check_every
    probe = probe_ids(records[0]) if every > 0 and (step + 1) % every == 0 else None
    expected = trainer_probe_logprobs(p.model, probe) if probe else None  # before the model may go to the host
    if p.cfg.train.lora_rank > 0:
        weights = merged_weights(p.model)
    else:
        engine_dtype = getattr(torch, p.cfg.model.dtype, None)  # bf16 on the box: gathered in bf16
        weights = (full_weights(p.model, p.rank, every_rank=True, dtype=engine_dtype) if p.world > 1
                   else p.model.state_dict().items())  # fmt: skip
    # train.cpu_offload phase: the state to the host once the engine has the weights, before its
    # KV cache returns for the next rollout (run_setup.setup put it there before the first)
    models, optimizers = [p.model, p.ref, p.critic], [p.optimizer, p.critic_opt]
    to_host = (lambda: offload_to_host(models, optimizers)) if phase_offload(p.cfg, p.world) else None
    p.engine.load_weights(weights, before_kv_cache=to_host)
    if probe:
        bound = sync_bound(probe_dtypes(p.model, p.cfg, p.world), p.model.config.vocab_size)
        check_sync(p.engine, probe, expected, bound, step + 1, p.world)


def step_row(p: RunParts, step: int, records: list[dict], stats: dict, constraint_row: dict, times: dict) -> dict:
    """The step's line of metrics.jsonl."""
    gen_tokens = sum(sum(r["loss_mask"]) for r in records)
    groups = len({str(r["group_id"]) for r in records})
    row = {"step": step + 1} | batch_metrics(records) | stats | constraint_row | {
        "lr": lr_at(step, p.cfg),
        "tokens_per_s": gen_tokens / max(times["generate"], 1e-9),
        "groups_alike": 1 - len(varied_groups(records)) / max(1, groups),  # outcome rewards all equal: A_i = 0
        "time": times,
    }  # fmt: skip
    row |= turn_reward_means(records)  # per turn index, where the reward gives turn_rewards
    if p.bapo is not None:
        row |= {"bapo_stage": p.bapo.stage, f"idk_rate/{p.bapo.stage}": row["idk_rate"]}
    return row


def run_eval(p: RunParts) -> dict:
    """Greedy, one rollout per question, each engine its block; the metrics of them all."""
    mine = rollout_mode("agentic", p.engine, p.tokenizer, my_share(p.val_q, p.rank // p.tp, p.world // p.tp),
                        p.search_fn, p.cfg)  # fmt: skip
    val_records = gather_records(p, mine)
    ev = summarize(val_records)  # EM-scored (rollout_mode)
    before = judge_counts(p.judge)
    score_shared(val_records, p.cfg.train.reward, reward_params(p.constraints, p.cfg.train.reward_params), p.judge,
                 p.rank, p.world, p.given)  # fmt: skip
    ev |= {k: v for k, v in batch_metrics(val_records).items() if k.startswith("reward/") or k == "idk_rate"}
    ev |= broadcast(paper_metrics(val_records, p.measure_judge) if p.main else None, p.world)
    # logged, not stopped on: validation trains nothing, and the next step stops on a dead judge anyway
    return ev | judge_row(p.judge, before, p.world)


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
        "in_flight": in_flight_state(p.pipe) if p.pipe is not None else None,  # train.overlap: its records
    }  # fmt: skip
    save_checkpoint(p.run, step + 1, p.model, p.tokenizer, p.optimizer, trainer_state, p.cfg.train.keep_checkpoints,
                    p.critic, p.rank, p.world, p.critic_opt, config_to_dict(p.cfg))  # fmt: skip


def resume_hint(run: Path) -> str:
    """Where a stopped run can go on from: its newest checkpoint, which nothing after it overwrote."""
    ckpt = latest_checkpoint(run)
    if ckpt is None:
        return "No checkpoint was written yet"
    return f"The last good checkpoint is {ckpt}: python train.py --resume {run}"


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
    note = effect_note(before, last_eval, steps)  # a run that learned nothing says so, and what to try
    return (f"{summary_table(before, last_eval, steps, minutes)}\n" + (f"{note}\n" if note else "")
            + f"every metric, step by step: {run / 'metrics.jsonl'}; curves: python eval.py curves {run}")


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
            sys.exit(0 if print_plan(load_config(args.config, args.set)) else 1)
        except (ConfigError, FileNotFoundError) as e:
            parser.error(str(e))
    run = None

    def stopped(e: Interrupted) -> None:
        """Ctrl-C, kill, a launcher stopping its processes: one line from rank 0 saying where the run
        can go on from (a checkpoint being written stays a .tmp directory, which resume passes
        over), and exit 128 + the signal's number (130 SIGINT, 143 SIGTERM) on every rank."""
        if int(os.environ.get("RANK", "0")) == 0:
            where = f" ({run}). {resume_hint(run)}" if run else ""
            print(f"interrupted by {e}{where}", file=sys.stderr, flush=True)
        sys.exit(128 + e.signum)

    stop_on_signals()  # SIGINT, SIGTERM: Interrupted, wherever the run is
    try:
        if args.resume:
            run = Path(args.resume)
            cfg = resolve_precision(load_config(run / "config.yaml", args.set))
            check_reward(cfg.train.reward, cfg.train.reward_params, cfg.train.constraints)  # before any engine
            own_run_dir(run)  # one process per run directory: a second is refused, naming the pid that owns it
            # the newest checkpoint that reads back whole, checked before any model loads; a newer broken one
            # is passed over in one line (and left in place), and none intact fails here in one line
            ckpt, passed_over = verified_checkpoint(run)
            if ckpt is None:
                raise ConfigError(f"no checkpoint to resume in {run / 'checkpoints'}")
            if passed_over:
                print(passed_over, flush=True)
            check_writable(run)  # a read-only run directory fails here too
            # before a change is recorded: a rollout in flight resumes only in overlap mode
            check_in_flight(load_checkpoint_file(ckpt / "trainer_state.pt"), ckpt, overlap_on(cfg.train))
            check_resume_config(run, ckpt, cfg, args.set, world_key)  # vs the checkpoint's config: no silent change
        else:
            cfg = resolve_precision(load_config(args.config, args.set))  # before its config.yaml is written
            parse_constraints(cfg.train.constraints)
            check_reward(cfg.train.reward, cfg.train.reward_params, cfg.train.constraints)
            check_report_to(cfg)
            rank, world, _ = init(cfg.train.dist_timeout)  # several processes: rank 0 names the run directory
            run, ckpt = Path(broadcast(str(new_run_dir(cfg)) if rank == 0 else "", world)), None
            check_shared_run_dir(run, rank)  # several machines: one filesystem, or one line here
            own_run_dir(run)
    except (ConfigError, FileNotFoundError, RunDirError) as e:  # RunDirError: run_dir read-only, bad checkpoint
        if run is not None and not args.resume:
            discard_unstarted(run)  # a refused fresh run leaves no directory (a resumed one is never touched)
        parser.error(str(e))
    except Interrupted as e:
        stopped(e)
    if int(os.environ.get("RANK", "0")) == 0:  # said once, not once per process
        print(f"run directory: {run}", flush=True)
        print(describe_precision(cfg), flush=True)
        if note := judge_note(cfg.train.reward, cfg.train.reward_params, REWARDS, cfg.train.judge):
            print(note, flush=True)  # a judge's terms scored without one: said before anything slow
    t0 = time.time()
    try:
        ev = train(cfg, run, ckpt)
    except (DataError, FileNotFoundError, ConfigError, RunDirError, TrainingFault, RetrieverError) as e:
        if not args.resume and not isinstance(e, TrainingFault | RetrieverError):  # those come once steps run
            discard_unstarted(run)  # a refused fresh run leaves no directory (a resumed one is never touched)
        sys.exit(f"error: {e}")  # RunDirError: disk full; TrainingFault: a NaN, a rank that stopped answering
    except RuntimeError as e:  # a collective inside FSDP that timed out: the rank that stopped answering
        if (stop := interrupted()) is not None:
            stopped(stop)  # the other ranks left that collective for the same signal
        if (fault := stopped_answering(e)) is None:
            raise
        sys.exit(f"error: {fault}. {resume_hint(run)}")
    except Interrupted as e:
        stopped(e)
    if ev:
        print(end_of_run_summary(run, ev, (time.time() - t0) / 60))


if __name__ == "__main__":
    main()
