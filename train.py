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
(trainer/constraints.py, Deliberative Searcher Alg. 1); `algo: ppo` replaces step 3 with a critic and
GAE (trainer/ppo.py); `algo: rft` keeps only accepted rollouts and fine-tunes on them (BAPO's
baseline); `reward: bapo` adds BAPO's resampling and stage switch. Several processes
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

One file on purpose (about 530 lines): the whole step, read top to bottom, is what this file is
for; the update math is trainer/grpo.py and trainer/ppo.py, everything else is in trainer/.
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
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from agent.answers import parsed
from agent.bapo import BapoState, bapo_resample_groups
from agent.judge import make_judge
from data import check_prompt_lengths, data_paths, ensure_policy
from eval import rollout_mode, summarize
from report.metrics import batch_metrics, paper_metrics
from rewards import check_reward, score
from rollout import check_chat_template, rollout_batch
from search.client import RetrieverError
from search.tools import check_retriever, make_search_fn
from tiny.world import world_key
from trainer.checkpoint import (
    check_writable,
    latest_checkpoint,
    load_checkpoint_file,
    load_trainer_state,
    log,
    new_run_dir,
    save_checkpoint,
    verified_checkpoint,
    write_samples,
)
from trainer.config import Config, ConfigError, DataError, RunDirError, TrainingFault, config_to_dict, load_config
from trainer.constraints import dual_update, parse_constraints, reward_params, switch_on
from trainer.constraints import restore as restore_constraints
from trainer.constraints import state as constraint_state
from trainer.constraints import step as constraints_step
from trainer.distributed import (
    all_reduce,
    broadcast,
    check_shared_run_dir,
    close,
    full_weights,
    gather_lists,
    init,
    load_from_rank0,
    make_optimizer,
    my_share,
    needs_reference,
    process_layout,
    shard,
    shard_critic,
    shard_reference,
    trainer_threads,
)
from trainer.engine import empty_policy, load_policy, load_tokenizer, make_engine
from trainer.faults import (
    Interrupted,
    check_engine_logprobs,
    interrupted,
    raise_if_interrupted,
    stop_on_signals,
    stopped_answering,
    wait_for_main,
)
from trainer.grpo import group_advantages, grpo_step, kl_penalties, lr_at, memory_savers, rft_select, rft_step
from trainer.judging import check_judge, judge_counts, judge_row
from trainer.lora import add_lora, load_lora, merged_weights
from trainer.plan import print_plan
from trainer.ppo import critic_optimizer, load_critic, ppo_update
from trainer.precision import describe as describe_precision
from trainer.precision import resolve as resolve_precision
from trainer.questions import first_of_each_benchmark, load_questions
from trainer.rundir import check_resume_config, own_run_dir
from trainer.tracking import check_report_to, close_trackers, open_trackers, summary_table, track
from trainer.turns import grpo_turn_advantages, has_turn_rewards

# ---------------------------------------------------------------------------------------------
# The BAPO loop (resampling, stage) and Reliable RFT.


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


def score_shared(records: list[dict], spec: str, params: dict, judge, rank: int, world: int) -> None:
    """rewards.score on every record, each rank scoring the groups of its block (its judge asked
    for all of their verdicts at once, and a group's rewards are computed where the whole group
    is); every rank then has every reward, in place."""
    groups = list(dict.fromkeys(str(r["group_id"]) for r in records))
    owner = {g: k for k in range(world) for g in my_share(groups, k, world)}
    mine = [r for r in records if owner[str(r["group_id"])] == rank]
    if world == 1:
        score(mine, spec, params, judge)
        return
    fault = ""
    try:
        score(mine, spec, params, judge)
    except TrainingFault as e:  # every rank must hear of it, or the others would wait in the gather below
        fault = f"rank {rank}: {e}"
    if fault := next(iter(gather_lists([fault] if fault else [], world)), ""):
        raise TrainingFault(fault)
    index = {id(r): i for i, r in enumerate(records)}  # every rank holds the same records, in the same order
    for i, reward, components in gather_lists([(index[id(r)], r["reward"], r["reward_components"]) for r in mine],
                                              world):  # fmt: skip
        records[i]["reward"], records[i]["reward_components"] = reward, components
        records[i].pop("_parsed", None)  # the parse cache (answers.parsed) is rebuilt from the record alone


def slowest(seconds: float, world: int) -> float:
    """A stage's wall time over the processes: the step waits for the slowest rank."""
    return float(all_reduce(torch.tensor([seconds], dtype=torch.float64), world, "max"))


def stage_peak_gib(world: int) -> float:
    """On a GPU: the most memory torch's allocator held since the last call, in GiB, the largest
    over the processes; then the count restarts, so each call measures one stage. It counts the
    trainer's tensors and, in the same process, vLLM's weights and KV cache (RunParts.engine_gib
    is their share at start). 0.0 on a CPU."""
    if not torch.cuda.is_available():
        return 0.0
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return float(all_reduce(torch.tensor([peak], dtype=torch.float64), world, "max"))


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
    engine_gib: float = 0.0  # GPU memory torch counted for the engine when it started (vLLM's weights, KV cache)

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
            if ev.get("format_ok") == 0.0:  # a trained start never does this: the engine's output is garbage
                print(f"warning: not one validation rollout of the starting policy is well-formed (format 0.00 of "
                      f"{ev['n']}); if it was trained on rollout.protocol {cfg.rollout.protocol!r}, suspect the "
                      f"rollout engine ({cfg.rollout.engine}) and any CPU kernel override (results/cpu_kernels.md)",
                      flush=True)  # fmt: skip
    bar = tqdm(range(p.step0, cfg.train.steps), desc=cfg.train.algo, initial=p.step0, total=cfg.train.steps,
               disable=not p.main)  # fmt: skip
    for step in bar:
        raise_if_interrupted()  # a Ctrl-C whose first raise a __del__ swallowed (faults.stop_on_signals)
        p.timings.clear()
        for group in p.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        switch_on(p.constraints, step, cfg.train.steps)
        t0, gpu = time.time(), {"engine": p.engine_gib, "before": stage_peak_gib(p.world)}  # setup or eval, save
        judged_before = judge_counts(p.judge)
        records, counts = rollout_stage(p, step)  # 1. roll out (and, with filter_groups, score and refill)
        retrieve = p.timings.get("retrieve", 0.0)
        times = {"generate": slowest(time.time() - t0 - retrieve, p.world),
                 "retrieve": slowest(retrieve, p.world)}  # fmt: skip
        gpu["generate"] = stage_peak_gib(p.world)
        t0 = time.time()
        try:
            constraint_row = reward_stage(p, records, judged_before, scored=cfg.train.filter_groups)  # 2. rewards
            times["reward"], t0 = time.time() - t0, time.time()
            stats = update_stage(p, records, step)  # 3-5. advantages, loss, optimizer steps
        except TrainingFault as e:  # a NaN reward, loss or gradient: stop before it reaches a checkpoint
            raise TrainingFault(f"step {step + 1}: {e}. {resume_hint(run)}") from None
        times["train"], t0 = time.time() - t0, time.time()
        gpu["train"] = stage_peak_gib(p.world)  # rewards and the update
        sync_stage(p)  # 6. the new weights into the engine(s)
        times["sync"] = slowest(time.time() - t0, p.world)
        gpu["sync"] = stage_peak_gib(p.world)
        row = step_row(p, step, records, stats, constraint_row | counts, times) if p.main else {}
        if torch.cuda.is_available() and p.main:
            row["gpu_peak_gib"] = gpu
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
    close(p.world)  # the process group: several processes exit cleanly (distributed.close says why)
    return ev


def setup(cfg: Config, run: Path, resume_from: Path | None) -> RunParts:
    """Processes, data, engine, policy (LoRA, FSDP), reference, critic, optimizers, rewards'
    state; then the checkpoint's state when resuming. Bad settings fail before anything slow."""
    rank, world, device = init(cfg.train.dist_timeout)
    if world > 1 and not cfg.train.fsdp:
        raise ConfigError(f"{world} processes need train.fsdp: true (there is no replicated data-parallel mode)")
    tp = cfg.rollout.tensor_parallel_size  # ranks per engine
    if world % tp:
        raise ConfigError(f"rollout.tensor_parallel_size {tp} must divide the number of processes ({world})")
    lora_on = cfg.train.lora_rank > 0
    if lora_on and world > 1:
        raise ConfigError("train.lora_rank runs in one process for now: FSDP over peft's adapters is not wired")
    torch.manual_seed(cfg.train.seed)
    # read before the engine starts: vLLM CPU sets LOCAL_WORLD_SIZE to its tensor-parallel size
    # in this process (vllm/platforms/cpu.py), which a 2-process launch then reads as 1
    here = process_layout(rank, device)
    threads = trainer_threads(cfg.train.threads, cfg.train.cpu_offload, device.type == "cuda",
                              len(os.sched_getaffinity(0)), here["local_world_size"])  # fmt: skip
    torch.set_num_threads(threads)
    constraints = parse_constraints(cfg.train.constraints)  # a bad constraint fails before any work
    if cfg.data.corpus or cfg.data.train:
        data_paths(cfg)  # given files: fail on a bad path before building anything
    check_retriever(cfg.retriever)  # a paper config's server, not started: one line before anything loads
    if rank == 0:  # builds the tiny world once; the other ranks wait, then find it cached
        start_dir = resume_from or ensure_policy(cfg, run)
    wait_for_main(world, "policy")  # rank 0 builds the world / warm start (10-20 min): no dist_timeout
    start_dir = resume_from or ensure_policy(cfg, run)
    paths = data_paths(cfg)
    train_q, val_q = load_questions(paths["train"]), load_questions(paths["val"])  # a bad line fails before any model
    tokenizer = load_tokenizer(start_dir)
    check_chat_template(tokenizer, cfg.rollout, start_dir)  # before any engine starts
    for questions, kind in ((train_q, "train"), (val_q, "val")):  # a prompt too long for the engine: refused here
        check_prompt_lengths(questions, tokenizer, cfg.rollout, paths[kind])
    timings: dict[str, float] = {}
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    # an engine per process (per tensor-parallel group): vLLM's external_launcher joins the
    # launcher's processes; "file": each engine in a process of its own (trainer/engine.py)
    engine = make_engine(
        cfg.rollout.engine, start_dir, cfg.rollout, cfg.model.dtype, seed=cfg.train.seed,
        separate_process=world > 1 and cfg.rollout.weight_sync == "file",
        launcher=world > 1 and cfg.rollout.weight_sync == "memory",
    )  # before bm25s
    engine_gib = (torch.cuda.memory_allocated() - before) / 2**30 if torch.cuda.is_available() else 0.0
    search_fn = make_search_fn(cfg, paths["corpus"], timings)
    where = {"engine": cfg.rollout.engine, "engine_kv_cache_bytes": engine.kv_cache_bytes,
             "retriever": cfg.retriever.url or "in process"}  # fmt: skip
    layout = gather_lists([here | where], world)
    if rank == 0:  # which rank ran where: a several-machine launch, checked after the fact
        (run / "processes.json").write_text(json.dumps(layout, indent=1))
    torch.set_num_threads(threads)  # vLLM's GPU worker drops torch to 1 thread "for serving"
    model, ref, critic = load_models(cfg, run, start_dir, resume_from, device, rank, world)
    trainable = [q for q in model.parameters() if q.requires_grad]  # all of them, or LoRA's adapters
    optimizer = make_optimizer(trainable, cfg.train.lr, cfg.train.weight_decay, cfg.train.optimizer)
    critic_opt = critic_optimizer(critic, cfg.train.critic_lr) if critic is not None else None
    judge = make_judge(cfg.train.judge, cfg.train.judge_model, on_failure="zero", timeout=cfg.train.judge_timeout,
                       concurrency=cfg.train.judge_concurrency) if cfg.train.judge else None  # fmt: skip
    p = RunParts(
        cfg, run, rank, world, tp, tokenizer, engine, search_fn, timings, model, ref, critic, optimizer, critic_opt,
        constraints,
        BapoState(patience=cfg.train.bapo_patience, min_delta=cfg.train.bapo_min_delta)
        if "bapo" in cfg.train.reward else None,
        judge,
        # validation always measures faithfulness; on the tiny world the rule judge does it for any run
        judge or (make_judge("rule") if not cfg.data.corpus else None),
        train_q,
        first_of_each_benchmark(val_q, cfg.eval.max_questions),  # per data_source: the seven, not NQ's first rows
        random.Random(cfg.train.seed),  # the question order
        engine_gib=engine_gib,
    )  # fmt: skip
    if resume_from is not None:
        resume_state(p, resume_from)
    p.trackers = open_trackers(cfg, run, resumed=resume_from is not None) if rank == 0 else []
    return p


def resume_state(p: RunParts, resume_from: Path) -> None:
    """setup's last part when resuming: the checkpoint's optimizers, step, data order and RNG,
    Lagrange multipliers and BAPO stage, into the freshly built parts."""
    state = load_trainer_state(resume_from, p.run, p.optimizer, p.rank, p.world)
    if p.critic_opt is not None:
        p.critic_opt.load_state_dict(load_checkpoint_file(resume_from / f"critic_optimizer.rank{p.rank}.pt"))
    p.step0, p.order = state["step"], state["order"]
    p.rng.setstate(state["data_rng"])
    restore_constraints(p.constraints, state["constraints"])
    if p.bapo is not None:
        p.bapo.__dict__.update(state["bapo"])
    print(f"resumed from {resume_from} at step {p.step0}", flush=True)


def sharded_policy_and_reference(cfg: Config, policy_dir: Path, ref_dir: Path | None, rank: int,
                                 world: int) -> tuple:  # fmt: skip
    """Several processes: the fp32 policy (with its memory savers) and the model.dtype reference
    (None without ref_dir), each built on the meta device and sharded, then filled from rank 0's
    read of its checkpoint: no process holds the whole fp32 policy (7B: 28 GB) in host RAM or
    beside vLLM's share of its GPU (README, "Loading on the box")."""
    model = shard(memory_savers(empty_policy(policy_dir).eval(), cfg), cfg)
    load_from_rank0(model, policy_dir, rank, world, cfg)
    ref = None
    if ref_dir is not None:
        ref = shard_reference(empty_policy(ref_dir, cfg.model.dtype), cfg)
        load_from_rank0(ref, ref_dir, rank, world, cfg)
    return model, ref


def load_models(cfg: Config, run: Path, start_dir: Path, resume_from: Path | None, device, rank: int,
                world: int) -> tuple:  # fmt: skip
    """(policy, frozen reference or None, critic or None), on this process's device, sharded
    with FSDP when there are several processes."""
    lora_on = cfg.train.lora_rank > 0
    # the frozen reference is the starting policy, in model.dtype (no fp32 master)
    ref_dir = (ensure_policy(cfg, run) if resume_from else start_dir) if needs_reference(cfg) else None
    ref = None
    if world > 1:
        model, ref = sharded_policy_and_reference(cfg, start_dir, ref_dir, rank, world)
    else:
        # LoRA resume: the adapters sit on the ORIGINAL base; the checkpoint's model.safetensors is merged
        model = memory_savers(load_policy(ensure_policy(cfg, run) if lora_on and resume_from else start_dir).eval(),
                              cfg).to(device)  # fmt: skip
        if lora_on:
            model = load_lora(model, resume_from) if resume_from else add_lora(
                model, cfg.train.lora_rank, cfg.train.lora_alpha, cfg.train.lora_dropout, cfg.train.lora_targets or None
            )  # fmt: skip
        if ref_dir is not None:
            ref = load_policy(ref_dir, cfg.model.dtype).eval().requires_grad_(False).to(device)
    critic = None
    if cfg.train.algo == "ppo":  # every process reads the critic's checkpoint (its head has no meta build)
        critic = load_critic(resume_from if resume_from else start_dir)
        critic = critic.to(device) if world == 1 else critic
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


def rollout_stage(p: RunParts, step: int) -> tuple[list[dict], dict]:
    """1. G rollouts per question of the step's batch, plus BAPO's resampled groups or, with
    train.filter_groups, the groups that replace those whose rewards are all alike: (records, the
    stage's counts for the step's row)."""
    cfg = p.cfg
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
    if cfg.train.filter_groups:
        records, counts["filter"] = fill_varied_groups(p, records, step)
    p.engine.sleep()  # rollout.sleep_mode: free the GPU memory of vLLM's weights and KV cache for training
    return records, counts


def fill_varied_groups(p: RunParts, records: list[dict], step: int) -> tuple[list[dict], dict]:
    """DAPO's dynamic sampling (DAPO §3.2, eq. 11: keep a group only if 0 < #correct < G; here, if
    its rewards are not all equal, which is the same for EM and also holds for graded rewards):
    score the batch, keep its groups whose rewards differ, and roll out the next questions of the
    data order in place of the others, up to train.filter_max_rounds more rounds. Returns the kept
    groups, at most questions_per_step of them, and the counts: the share of the first batch's
    groups that varied, the extra rounds, the questions rolled out (the oversampling: DAPO's
    num_gen_batches) and the groups trained on. A batch still short after the last round trains on
    the groups it has, said in one line; none at all keeps the first batch as it was (its
    advantages are all 0: the step trains on the KL term alone, as without filtering)."""
    cfg, want = p.cfg, p.cfg.train.questions_per_step
    score_records(p, records)
    kept = varied_groups(records)
    first, rounds, rolled = len(kept), 0, len({r["group_id"] for r in records})
    while len(kept) < want and rounds < cfg.train.filter_max_rounds:
        rounds += 1
        idx, p.order = _next_batch(p.order, len(p.train_q), want - len(kept), p.rng)
        fresh = roll_out(p, [p.train_q[i] for i in idx], cfg.train.seed * 100003 + step + 7_000_003 * rounds)
        check_engine_logprobs(fresh, cfg.rollout.engine, step + 1)
        score_records(p, fresh)
        taken = {g[0]["group_id"] for g in kept}  # a question drawn twice in a step (a small set) counts once
        kept += [g for g in varied_groups(fresh) if g[0]["group_id"] not in taken]
        rolled += len(idx)
    counts = {"varied_first": first / max(1, rolled if rounds == 0 else want), "rounds": rounds,
              "questions": rolled, "groups": min(len(kept), want)}  # fmt: skip
    if len(kept) < want and p.main:
        tqdm.write(f"filter_groups: step {step + 1}: {len(kept)} of {want} groups have rewards that differ after "
                   f"{rounds} more rounds (train.filter_max_rounds); training on "
                   f"{len(kept) if kept else 'the first batch as it was'}")  # fmt: skip
    if not kept:
        return records, counts
    return [r for group in kept[:want] for r in group], counts


def varied_groups(records: list[dict]) -> list[list[dict]]:
    """The groups (in order) whose rollouts' rewards are not all equal: the ones GRPO learns from."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(str(r["group_id"]), []).append(r)
    return [g for g in groups.values() if len({r["reward"] for r in g}) > 1]


def score_records(p: RunParts, records: list[dict]) -> None:
    """rewards.score with the run's parameters (the constraints' lambdas, BAPO's modulator inputs:
    the stage and this batch's IDK ratio, BAPO §4.2), each rank its groups (score_shared)."""
    params = reward_params(p.constraints, p.cfg.train.reward_params)
    if p.bapo is not None:
        params |= {"stage": p.bapo.stage, "idk_ratio": sum(parsed(r).idk for r in records) / len(records)}
    score_shared(records, p.cfg.train.reward, params, p.judge, p.rank, p.world)


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
        trained = [r for r in records if not truncated(r)] if cfg.train.mask_truncated else records
        return ppo_update(p.model, p.ref, p.critic, trained, p.optimizer, p.critic_opt, cfg, pad_id, step, p.rank,
                          p.world) if trained else {}  # fmt: skip
    advantages = group_advantages(
        [r["reward"] for r in records], [r["group_id"] for r in records], cfg.train.adv_eps, cfg.train.adv_std
    )
    for r, a in zip(records, advantages):
        r["advantage"] = a
    if cfg.train.turn_coef and has_turn_rewards(records):  # credit per search step (trainer/turns.py)
        per_position = grpo_turn_advantages(records, advantages, cfg.train.turn_coef, cfg.train.turn_norm,
                                            cfg.train.adv_eps, cfg.train.adv_std)  # fmt: skip
        for r, adv in zip(records, per_position):
            r["advantages"] = adv
    warn_if_no_signal(advantages, records, step, p.main)
    trained = [r for r in records if not truncated(r)] if cfg.train.mask_truncated else records
    stats = grpo_step(p.model, p.ref, trained, p.optimizer, cfg, pad_id, step, p.rank, p.world) if trained else {}
    for r in records:
        r.pop("advantages", None)  # per-token lists would bloat samples/*.jsonl
    return stats | {"adv_nonzero_frac": sum(a != 0 for a in advantages) / len(advantages),
                    **({"truncated_masked": 1 - len(trained) / len(records)} if cfg.train.mask_truncated else {})}


def truncated(record: dict) -> bool:
    """Cut by rollout.max_turns or max_model_len before it answered (train.mask_truncated)."""
    return record.get("finish") in ("max_turns", "length")


def sync_stage(p: RunParts) -> None:
    """6. The new weights into the engine: LoRA's merged into fresh tensors (the policy is never
    touched); several processes: each gathers the full tensors, one at a time, into its own engine."""
    if p.cfg.train.lora_rank > 0:
        weights = merged_weights(p.model)
    else:
        engine_dtype = getattr(torch, p.cfg.model.dtype, None)  # bf16 on the box: gathered in bf16
        weights = (full_weights(p.model, p.rank, every_rank=True, dtype=engine_dtype) if p.world > 1
                   else p.model.state_dict().items())  # fmt: skip
    p.engine.load_weights(weights)


def step_row(p: RunParts, step: int, records: list[dict], stats: dict, constraint_row: dict, times: dict) -> dict:
    """The step's line of metrics.jsonl."""
    gen_tokens = sum(sum(r["loss_mask"]) for r in records)
    groups = len({str(r["group_id"]) for r in records})
    row = {"step": step + 1} | batch_metrics(records) | stats | constraint_row | {
        "lr": lr_at(step, p.cfg),
        "tokens_per_s": gen_tokens / max(times["generate"], 1e-9),
        "groups_alike": 1 - len(varied_groups(records)) / max(1, groups),  # groups with no GRPO signal
        "time": times,
    }  # fmt: skip
    if p.bapo is not None:
        row |= {"bapo_stage": p.bapo.stage, f"idk_rate/{p.bapo.stage}": row["idk_rate"]}
    return row


def run_eval(p: RunParts) -> dict:
    """Greedy, one rollout per question, each engine its block; the metrics of them all."""
    mine = rollout_mode("agentic", p.engine, p.tokenizer, my_share(p.val_q, p.rank // p.tp, p.world // p.tp),
                        p.search_fn, p.cfg)  # fmt: skip
    val_records = gather_lists(mine, p.world, every=p.tp)
    ev = summarize(val_records)  # EM-scored (rollout_mode)
    before = judge_counts(p.judge)
    score_shared(val_records, p.cfg.train.reward, reward_params(p.constraints, p.cfg.train.reward_params), p.judge,
                 p.rank, p.world)  # fmt: skip
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
    return (f"{summary_table(before, last_eval, steps, minutes)}\n"
            f"every metric, step by step: {run / 'metrics.jsonl'}; curves: python eval.py curves {run}")  # fmt: skip


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
        parser.error(str(e))
    except Interrupted as e:
        stopped(e)
    print(f"run directory: {run}", flush=True)
    print(describe_precision(cfg), flush=True)
    t0 = time.time()
    try:
        ev = train(cfg, run, ckpt)
    except (DataError, FileNotFoundError, ConfigError, RunDirError, TrainingFault, RetrieverError) as e:
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
