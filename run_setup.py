"""What a run holds from step to step (RunParts), and how train.py builds it (setup).

    p = setup(cfg, run_dir, resume_from=None)    # processes, data, engine, models, optimizers, judge
    p.engine, p.model, p.ref, p.optimizer, p.train_q, p.step0   # what the stages of train.py read

Bad settings fail before anything slow: a process layout FSDP cannot run, a bad data path, a
retriever server not started, a chat template or a prompt the engine cannot take. The engine
starts before bm25s is imported (docs/design.md §6); with several processes each builds its own
engine, and the policy and reference are sharded and filled from rank 0's read of the checkpoint.
Resuming puts the checkpoint's optimizers, step, data order, RNG, Lagrange multipliers and BAPO
stage back into the parts (resume_state).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from agent.bapo import BapoState
from agent.judge import make_judge
from data import check_prompt_lengths, data_paths, ensure_policy, passage_lookup
from rollout import check_chat_template
from search.meta import check_index
from search.tools import check_retriever, make_search_fn
from trainer.checkpoint import load_checkpoint_file, load_trainer_state
from trainer.config import Config, ConfigError
from trainer.constraints import parse_constraints
from trainer.constraints import restore as restore_constraints
from trainer.distributed import (
    gather_lists,
    init,
    load_from_rank0,
    make_optimizer,
    needs_reference,
    offload_to_host,
    phase_offload,
    process_layout,
    shard,
    shard_reference,
    trainer_threads,
)
from trainer.engine import empty_policy, load_policy, load_tokenizer, make_engine
from trainer.faults import wait_for_main
from trainer.grpo import memory_savers
from trainer.lora import add_lora, load_lora
from trainer.overlap import Pipeline, overlap_on
from trainer.overlap import restore as restore_in_flight
from trainer.ppo import critic_optimizer, load_critic, load_sharded_critic
from trainer.questions import first_of_each_benchmark, load_questions
from trainer.tracking import open_trackers
from trainer.turns import answer_logprob_fn


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
    given: dict = field(default_factory=dict)  # what every reward is given besides the judge (rewards.py)
    pipe: Pipeline | None = None  # train.overlap: the engine's policy version, the rollout in flight
    timeline: Path | None = None  # run/timeline.jsonl (rank 0): each stage's start and end (trainer/overlap.note)

    @property
    def main(self) -> bool:
        return self.rank == 0


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
    if world > 1 and "ig_search" in cfg.train.reward:  # its scorer's forwards would differ per rank under FSDP
        raise ConfigError("train.reward ig_search scores with the policy in one process for now; it cannot run "
                          f"with {world} processes")  # fmt: skip
    if lora_on and world > 1:
        raise ConfigError("train.lora_rank runs in one process for now: FSDP over peft's adapters is not wired")
    overlap = overlap_on(cfg.train)
    if overlap and cfg.rollout.engine == "vllm" and (world > 1 and cfg.rollout.weight_sync == "memory" or tp > 1):
        raise ConfigError("train.overlap runs each rank's engine in a process of its own (tensor_parallel_size 1): "
                          "set rollout.weight_sync: file (docs/overlap.md)")  # fmt: skip
    torch.manual_seed(cfg.train.seed)
    # read before the engine starts: vLLM CPU sets LOCAL_WORLD_SIZE to its tensor-parallel size
    # in this process (vllm/platforms/cpu.py), which a 2-process launch then reads as 1
    here = process_layout(rank, device)
    threads = trainer_threads(cfg.train.threads, cfg.train.cpu_offload == "micro_batch", device.type == "cuda",
                              len(os.sched_getaffinity(0)), here["local_world_size"])  # fmt: skip
    torch.set_num_threads(threads)
    constraints = parse_constraints(cfg.train.constraints)  # a bad constraint fails before any work
    if cfg.data.corpus or cfg.data.train:
        data_paths(cfg)  # given files: fail on a bad path before building anything
    check_retriever(cfg.retriever)  # a paper config's server, not started: one line before anything loads
    check_index(cfg.retriever)  # retriever.index missing, or search_params it cannot take: before the world builds
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
        separate_process=(world > 1 and cfg.rollout.weight_sync == "file") or overlap,
        launcher=world > 1 and cfg.rollout.weight_sync == "memory" and not overlap,
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
    if phase_offload(cfg, world):  # train.cpu_offload phase: on the host until the first update (a resumed
        offload_to_host([model, ref, critic], [])  # optimizer state then loads beside its parameters)
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
    # the rewards' tools: StepSearch's gold passages, IG-Search's scorer (the policy, no gradient)
    p.given = {"passage": passage_lookup(paths["corpus"]),
               "answer_logprob": answer_logprob_fn(model, tokenizer, cfg.train.micro_batch_tokens, cfg.train.bf16)}
    p.timeline = run / "timeline.jsonl" if rank == 0 else None
    p.pipe = Pipeline(version=0, timeline=p.timeline) if overlap else None
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
    if p.pipe is not None:  # the engine starts on the checkpoint's weights; its rollout in flight, finished
        p.pipe.version = p.step0
        restore_in_flight(p.pipe, state.get("in_flight"))
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
    if cfg.train.algo == "ppo" and world > 1:  # built on meta, sharded, filled from rank 0's read
        critic = load_sharded_critic(resume_from if resume_from else start_dir, cfg, rank, world)
    elif cfg.train.algo == "ppo":
        critic = load_critic(resume_from if resume_from else start_dir).to(device)
        memory_savers(critic.backbone, cfg)
    return model, ref, critic
