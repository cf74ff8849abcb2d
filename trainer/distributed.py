"""Several processes, one model: FSDP2 sharding, the process group and its collectives, full
weights for vLLM and checkpoints, and what FSDP's sharded parameters change in the optimizer
step (8-bit AdamW steps each process's shard; the gradient norm over every shard).

Which process runs which micro-batch, the gradient accumulation and the no-gradient logprob
pass are trainer/batching.py's; it calls the collectives here (this file imports nothing of it).

The same code runs CPU processes talking over gloo and GPUs talking over NCCL. Each process
holds 1/world of every parameter, gradient and Adam moment; a layer's full weights exist only
while that layer runs (all-gather before, reduce-scatter of the gradients after). train.py's
`grpo_step(..., rank, world)` gives each process its share of every mini-batch.

    accelerate launch --multi_gpu --num_processes 8 train.py --config X   # 8 GPUs, NCCL
    accelerate launch --multi_gpu --num_processes 2 train.py --config X   # no GPU: 2 CPU processes, gloo
    torchrun --nproc_per_node 2 train.py --config X                       # the same thing
    python -m pytest -q tests/test_fsdp.py     # 2-process FSDP step = 1-process step (parity)

`--multi_gpu` is only the name of accelerate's torchrun launcher; with no GPU it starts CPU
processes and `init()` picks gloo. Do not use `accelerate launch --cpu --num_processes 2` on one
machine: accelerate 1.15 then starts a single process (its multi-CPU mode needs mpirun and
`--mpirun_hostfile`); `init()` refuses that launch rather than train with world 1.

Every collective waits at most train.dist_timeout seconds (`init(timeout)`); a process that
stops answering is then named in one line (trainer/faults.py, which also has the signals).

Why torch's `fully_shard` and not accelerate's `Accelerator(fsdp_plugin=...)`: on CPU,
accelerate 1.15 never reaches its FSDP code. With `Accelerator(cpu=True, fsdp_plugin=
FullyShardedDataParallelPlugin(fsdp_version=2))` the distributed type is MULTI_CPU and
`prepare(model)` returns DDP; with `--use_fsdp` and no `cpu=True` it is NO (two unconnected
world-1 processes). The FSDP plugin is honoured for GPU types only. Calling `fully_shard`
ourselves is what accelerate does on GPUs anyway (utils/fsdp_utils.py, fsdp2_prepare_model), and
it keeps one code path for the test on CPU and the run on GPUs.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer import faults
from trainer.config import Config, RunDirError

# Name parts that wrappers add to parameter names (FSDP1, activation checkpointing, torch.compile,
# DDP). FSDP2 adds none, but vLLM's load_weights must never see them whatever wrapped the model.
WRAPPER_PARTS = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "module"}


def init(timeout: float = 600.0) -> tuple[int, int, torch.device]:
    """(rank, world, device) from the variables torchrun / `accelerate launch` set (RANK,
    WORLD_SIZE, LOCAL_RANK); starts the process group when world > 1, whose collectives wait at
    most `timeout` seconds (train.dist_timeout) for the slowest process. Plain `python` is world 1
    with no process group, so single-process code needs no special case."""
    faults.check_launch()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() != "true"
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        # GPUs: NCCL for CUDA tensors and gloo for CPU ones. With cpu_offload the sharded
        # gradients live on the host, and clip_grad_norm_'s all-reduce of their norms needs a CPU
        # backend (NCCL alone: "No backend type associated with device type cpu"); verl does the same
        dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo", device_id=device if use_cuda else None,
                                timeout=datetime.timedelta(seconds=timeout))  # fmt: skip
        faults.watch(rank, timeout)
    return rank, world, device


def broadcast(obj, world: int):
    """Rank 0's Python object on every rank (pickled; e.g. the scored rollout records)."""
    if world == 1:
        return obj
    box = [obj]
    faults.collective(dist.broadcast_object_list, box, 0)
    return box[0]


def my_share(items: list, rank: int, world: int) -> list:
    """Rank `rank`'s contiguous block of `items` (sizes differ by at most one): concatenated in
    rank order, the blocks are `items` again, so gathered results keep the 1-process order.
    my_share(list(range(5)), 0, 2) == [0, 1, 2]; my_share(list(range(5)), 1, 2) == [3, 4]."""
    return items[rank * len(items) // world : (rank + 1) * len(items) // world]


def gather_lists(items: list, world: int, every: int = 1) -> list:
    """Every rank's list, concatenated in rank order, on every rank (pickled). every > 1 (ranks of
    a tensor-parallel group hold the same list): only each group's first rank's list counts."""
    if world == 1:
        return items
    boxes: list = [None] * world
    faults.collective(dist.all_gather_object, boxes, items)
    return [x for k, box in enumerate(boxes) if k % every == 0 for x in box]


def process_layout(rank: int, device: torch.device) -> dict:
    """Where this process runs, from the launcher's variables: rank, host, the machine's index
    (GROUP_RANK: torchrun's node rank, accelerate's --machine_rank), its rank on that machine and
    how many training processes share the machine (LOCAL_WORLD_SIZE: what the per-host settings,
    e.g. the engines' share of a CPU host's KV cache, divide by). train.py writes every rank's
    into the run's processes.json, so a several-machine launch can be checked after the fact."""
    env = os.environ
    return {"rank": rank, "host": socket.gethostname(), "machine": int(env.get("GROUP_RANK", "0")),
            "local_rank": int(env.get("LOCAL_RANK", "0")), "local_world_size": int(env.get("LOCAL_WORLD_SIZE", "1")),
            "device": str(device)}  # fmt: skip


def trainer_threads(threads: int, cpu_offload: bool, cuda: bool, cpus: int, local_world_size: int) -> int:
    """torch's CPU threads in a training process: train.threads, except under cpu_offload on
    GPUs, where AdamW steps the fp32 master weights on the host (7B over 8 GPUs: 0.9B parameters
    per process, each step reading and writing ~16 bytes of each) and 2 threads would leave the
    host's other cores idle while the GPUs wait: then at least this process's share of the cores
    it may run on.

    >>> trainer_threads(2, True, True, 96, 8), trainer_threads(2, True, False, 96, 8)
    (12, 2)
    """
    return max(threads, cpus // max(local_world_size, 1)) if cpu_offload and cuda else threads


def check_shared_run_dir(run: Path, rank: int) -> None:
    """Several machines share one run: rank 0 makes the run directory and writes the metrics,
    samples and full weights; every rank writes its own optimizer shard into the same
    checkpoint. A rank that cannot see rank 0's directory is on a machine without the shared
    filesystem this needs: one line, before any model loads."""
    if not run.is_dir():
        raise RunDirError(f"rank {rank} on {socket.gethostname()} does not see the run directory {run} that rank 0 "
                          "made: several machines need train.run_dir (and world.cache_dir) on a filesystem they all "
                          "see (NFS or the like)")  # fmt: skip


def is_main(rank: int) -> bool:
    return rank == 0


def barrier(world: int) -> None:
    if world > 1:
        faults.collective(dist.barrier)


def close(world: int) -> None:
    """Destroy the process group, and drop the store client, before the process exits. Left to
    the interpreter's shutdown, gloo's threads sometimes outlive it: measured with torch 2.13 on
    2 CPU processes, 2 of 16 launches (at 9eafa61 too) ended in "terminate called without an active
    exception" and SIGABRT after a clean finish; with this call, 0 of 20."""
    faults.forget()
    if world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def needs_reference(cfg: Config) -> bool:
    """The frozen reference is only used for the KL term (loss or reward); without it, skip
    loading a second copy of the model altogether."""
    return cfg.train.kl_coef > 0 and cfg.train.algo != "rft"


def decoder_layers(model) -> torch.nn.ModuleList:
    """The repeated transformer blocks, each its own FSDP unit (only one layer is unsharded at
    a time). HF decoder-only models keep them at `model.model.layers` (Qwen2, Llama, Mistral)."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "backbone.layers"):  # last: ppo.Critic
        module = model
        for name in path.split("."):
            module = getattr(module, name, None)
        if isinstance(module, torch.nn.ModuleList):
            return module
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (looked for model.layers, "
                     "transformer.h, gpt_neox.layers); add its path to distributed.decoder_layers")  # fmt: skip


def _fsdp_kwargs(cfg: Config, reshard_after_forward: bool) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    # bf16 compute, fp32 gradient reduction and fp32 master weights (the optimizer steps fp32);
    # exact_grad_sum: the gradients accumulate and reduce in float64 (batching.accumulating)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cfg.train.bf16 else None,
                              reduce_dtype=torch.float64 if cfg.train.exact_grad_sum else torch.float32)  # fmt: skip
    # Pinned host memory makes the copies to the GPU asynchronous; it needs a GPU, and without
    # one pinning fails ("Cannot access accelerator device when none is available").
    # train.cpu_offload micro_batch is FSDP2's CPUOffloadPolicy: an upload of the fp32 shards at each
    # all-gather, the gradients copied back and summed on the CPU, AdamW on the CPU. phase (verl's
    # way) keeps FSDP's shards on the GPU while they are used and moves the whole state between
    # phases instead (offload_to_host / load_to_device, called by train.py); false keeps it there.
    # Which the paper configs use, and why: docs/box.md, "Memory on the box".
    per_micro_batch = cfg.train.cpu_offload == "micro_batch"
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if per_micro_batch else OffloadPolicy()
    return {"mp_policy": mp, "offload_policy": offload,
            "reshard_after_forward": reshard_after_forward}  # fmt: skip


def _shard_layers(model, kwargs: dict):
    """fully_shard each decoder layer, then the root (embeddings, final norm, lm_head: tied
    weights stay together in the root unit). The reduce-scatter SUMS the processes' gradients
    (FSDP averages by default): each process's loss is already divided by the whole batch's
    token count, so the sum is the 1-process gradient and no loss is scaled by the world size."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return model


def shard(model, cfg: Config, reshard_after_forward: bool = True):
    """FSDP2 on every decoder layer, then on the root. Turn on gradient checkpointing before
    (grpo.memory_savers), so its recomputation happens inside each layer's unsharded window.
    fully_shard moves each unit to this process's device (or keeps its shard on the host with
    cpu_offload). Build the optimizer afterwards: the parameters become DTensors holding this
    process's shard.

    reshard_after_forward=False keeps the gathered weights from forward to backward: one
    all-gather per layer less, at the cost of the full model in memory during the step."""
    return _shard_layers(model, _fsdp_kwargs(cfg, reshard_after_forward))


def shard_critic(critic, cfg: Config):
    """PPO's critic (ppo.Critic: backbone + value head), sharded like the policy: each backbone
    layer its own unit, then the head, then the root. Build its optimizer afterwards.

    The head is a unit of its own that computes in float32 whatever train.bf16 says (values are
    regression targets): in the root, the bf16 policy would cast it to bf16 while Critic.forward
    feeds it float32 hidden states ("mat1 and mat2 must have the same dtype")."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = _fsdp_kwargs(cfg, reshard_after_forward=True)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=kwargs["mp_policy"].reduce_dtype)
    fully_shard(critic.head, **(kwargs | {"mp_policy": fp32}))
    return _shard_layers(critic, kwargs)


def phase_offload(cfg: Config, world: int) -> bool:
    """Whether train.py moves the training state between host and GPU at the phase boundaries:
    train.cpu_offload phase under FSDP (one process runs without FSDP and offloads nothing, as
    trainer/plan.py counts it)."""
    return cfg.train.cpu_offload == "phase" and cfg.train.fsdp and world > 1


def _moved(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """A copy of t on `device` (always a copy, also from the host to the host: the suite, with no
    GPU, then still sees whether FSDP and the optimizer follow the new storage). A DTensor (an
    FSDP shard, AdamW's moments of one) is rebuilt around its moved local shard: DTensor has no
    pin_memory of its own."""
    if hasattr(t, "to_local"):
        local = _moved(t.to_local(), device, pin)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())  # fmt: skip
    if pin:  # GPU -> pinned host in one copy, so the way back can be asynchronous
        return torch.empty_like(t, device="cpu", pin_memory=True).copy_(t)
    return t.to(device, copy=True, non_blocking=t.is_pinned())


@torch.no_grad()
def move_state(models: list, optimizers: list, device: torch.device | str) -> None:
    """Every parameter, gradient and buffer of `models` and every tensor of `optimizers`' state
    (AdamW's moments, 8-bit AdamW's blocks) onto `device`, in place: the Parameter objects stay
    the same (swapped, not replaced), so the optimizers' groups and state keys stay valid. The
    0-dimensional step counters stay where AdamW keeps them (the host, unless capturable). Moving
    to the host of a process with a GPU pins the copies and then returns the GPU's cached blocks
    (vLLM's wake-up maps its pool beside torch's cache). None entries are skipped."""
    device = torch.device(device)
    pin = device.type == "cpu" and torch.cuda.is_available()
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # plain tensors too (DTensors always swap)
    try:
        for model in filter(None, models):
            model._apply(lambda t: _moved(t, device, pin))  # what module.to() runs, with our copy
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    for optimizer in filter(None, optimizers):
        for state in optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state[key] = _moved(value, device, pin)
    if pin:
        torch.cuda.empty_cache()


def offload_to_host(models: list, optimizers: list, host: torch.device | str = "cpu") -> None:
    """train.cpu_offload phase, before a rollout: the training state to host memory (verl's
    offload_fsdp_model_to_cpu and offload_fsdp_optimizer), so vLLM's share has the GPU."""
    move_state(models, optimizers, host)


def load_to_device(models: list, optimizers: list, device: torch.device | str) -> None:
    """train.cpu_offload phase, after the rollout (vLLM asleep): the training state back onto the
    GPU for the update and the sync (verl's load_fsdp_model_to_gpu and load_fsdp_optimizer)."""
    move_state(models, optimizers, device)


def compute_device(model) -> torch.device:
    """Where the forward runs: this process's GPU, even when FSDP offloads parameters to the host."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return next(model.parameters()).device


def all_reduce(x: torch.Tensor, world: int, op: str = "sum") -> torch.Tensor:
    """Sum or max of a small CPU tensor over the processes (a copy; x itself is unchanged)."""
    if world == 1:
        return x
    y = x.clone()  # on the CPU: gloo carries it, under init's "cpu:gloo,cuda:nccl" as well
    faults.collective(dist.all_reduce, y, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return y.cpu()


def make_optimizer(params, lr: float, weight_decay: float, kind: str = "adamw"):
    """AdamW, or bitsandbytes' 8-bit AdamW (1 byte per moment instead of 4; it steps on CPU too).

    bitsandbytes cannot step FSDP2's DTensor parameters ("got mixed torch.Tensor and DTensor"),
    so under FSDP it steps plain Parameters that share storage with each process's local shard:
    a pre-step hook hands them the shards of the gradients and the update lands in the shards in
    place (so the loop clears gradients with model.zero_grad(), which reaches the DTensors).
    Each process keeps the 8-bit state of its shard.

    The shards are looked up again before every step: FSDP2 may give a parameter new local storage
    after the optimizer was made (`reset_sharded_param` at the first forward re-pads an uneven
    shard, e.g. 701 rows over 2 ranks, or re-pins it for offload, when its storage changed, as a
    `load_state_dict(assign=True)` does), and an optimizer holding the old storage would step a
    stale copy while the model never moves. torch 2.13 keeps unchanged storage in place
    (fsdp_param.py, `same_local_tensor`); tests/test_fsdp.py's adamw8bit case has uneven shards
    and checks that the optimizer's shards are the model's after the step and that every weight
    moved."""
    params = list(params)
    if kind != "adamw8bit":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    import bitsandbytes as bnb

    if not any(hasattr(p, "to_local") for p in params):
        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    shards = [torch.nn.Parameter(p.to_local().detach(), requires_grad=True) for p in params]  # same storage
    optimizer = bnb.optim.AdamW8bit(shards, lr=lr, weight_decay=weight_decay)

    def take_gradients(*_):
        for p, s in zip(params, shards):
            local = p.to_local()
            if s.data_ptr() != local.data_ptr() or s.shape != local.shape:  # FSDP gave the shard new storage
                s.data = local.detach()
            s.grad = None if p.grad is None else p.grad.to_local()

    def drop_gradients(*_):  # the parameters' own gradients: model.zero_grad() before the next step
        for s in shards:
            s.grad = None

    optimizer.register_step_pre_hook(take_gradients)
    optimizer.register_step_post_hook(drop_gradients)
    return optimizer


def local_finite(weight: torch.Tensor) -> bool:
    """Whether this process's part of a weight (its FSDP shard, or the whole tensor) is free of NaN
    and inf, checked in chunks of 16M values: isfinite's boolean copy of a whole embedding (0.5 GB
    for a 7B model's) stays small."""
    local = (weight.to_local() if hasattr(weight, "to_local") else weight).detach().reshape(-1)
    return all(bool(torch.isfinite(chunk).all()) for chunk in local.split(1 << 24))


def clip_grad_norm(module, max_norm: float, exact: bool = False, world: int = 1) -> float:
    """Clip the global gradient norm; under FSDP2 the norm is a DTensor over all shards.

    exact: the squares are summed in float64 (each process its shards, then one all-reduce), so
    the norm and the clip factor do not depend on how the gradients are sharded."""
    if not exact:
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in module.parameters()
             if p.grad is not None]  # fmt: skip
    # one host copy, not one per parameter (each .cpu() waits for the GPU)
    local = [g.double().square().sum() for g in grads]
    squares = (torch.stack(local).sum() if local else torch.zeros((), dtype=torch.float64)).cpu()
    norm = float(all_reduce(squares, world).sqrt())
    coef = max_norm / (norm + 1e-6)  # torch's clip_grad_norm_ factor
    if coef < 1:
        for g in grads:
            g.mul_(coef)
    return norm


def load_from_rank0(model, path: Path, rank: int, world: int, cfg: Config, chunk_bytes: int = 256 << 20,
                    rename=None) -> set[str]:  # fmt: skip
    """Fill a sharded model built on the meta device (engine.empty_policy, then shard) with the
    checkpoint at `path`: each process allocates only its shards (to_empty), rank 0 reads the
    safetensors files `chunk_bytes` at a time and broadcasts them tensor by tensor, and each
    process keeps its slice (torch's set_model_state_dict, broadcast_from_rank0; verl's
    meta-device init does the same). Loading 7B on 8 ranks: one read of the checkpoint instead of
    8, and no process holds more than its shards and one chunk (README, "Loading on the box").
    The buffers (rotary frequencies), computed when the model was built, stay where fully_shard
    put them. `rename(file key) -> model key, or None to skip it` (the critic's: ppo.load_sharded_critic);
    returns the model keys loaded."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    files = sorted(Path(path).glob("*.safetensors"))  # model.safetensors, or model-0000k-of-0000n
    if not files:
        raise FileNotFoundError(f"no weights in {path} (expected model.safetensors)")
    buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
    # phase loads onto the GPU like no offload (one model's shards at a time beside vLLM's share);
    # train.py moves the state to the host before the first rollout
    on_host = cfg.train.cpu_offload == "micro_batch" or not torch.cuda.is_available()
    model.to_empty(device="cpu" if on_host else torch.device("cuda", torch.cuda.current_device()))
    for module, name, b in buffers:  # to_empty emptied them too
        module._buffers[name] = b
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    loaded: set[str] = set()
    for file in files:
        chunks: list[list[str]] = [[]]  # rank 0 reads the header and cuts the file's tensors into chunks
        if rank == 0:
            with safe_open(str(file), "pt") as f:
                size = 0
                for key in f.keys():
                    if rename is not None and rename(key) is None:
                        continue
                    shape = f.get_slice(key).get_shape()
                    nbytes = math.prod(shape) * 4  # at most 4 bytes a value
                    if chunks[-1] and size + nbytes > chunk_bytes:
                        chunks.append([])
                        size = 0
                    chunks[-1].append(key)
                    size += nbytes
        with safe_open(str(file), "pt") if rank == 0 else contextlib.nullcontext() as f:
            for keys in broadcast(chunks, world):
                named = [(rename(k) if rename else k, k) for k in keys]
                set_model_state_dict(model, {m: f.get_tensor(k) for m, k in named} if rank == 0 else {},
                                     options=options)  # fmt: skip
                loaded |= {m for m, _ in named}
    if rename is not None:  # the caller fills what the files lack (a fresh value head)
        return loaded
    missing = {plain_name(n) for n, _ in model.named_parameters()} - loaded  # a tied lm_head is named once
    if missing:
        raise FileNotFoundError(f"{path}: no weights for {', '.join(sorted(missing)[:3])} ({len(missing)} in all)")
    return loaded


def shard_reference(ref_model, cfg: Config):
    """The frozen reference policy, sharded like the policy (no gradients, no checkpointing);
    None when the config has no KL term (then do not load it: see needs_reference)."""
    if ref_model is None or not needs_reference(cfg):
        return None
    ref_model.eval().requires_grad_(False)
    return _shard_layers(ref_model, _fsdp_kwargs(cfg, reshard_after_forward=True))


def plain_name(name: str) -> str:
    """A parameter name as Hugging Face and vLLM spell it (no wrapper parts).

    >>> plain_name("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight")
    'model.layers.0.mlp.up_proj.weight'
    """
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def full_weights(model, rank: int = 0, every_rank: bool = False,
                 dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """(name, full tensor) for every entry of the model's state dict, for `engine.load_weights`
    or a checkpoint. Each sharded tensor is all-gathered on its own, so at most one full
    parameter exists beside the shards, never a second copy of the model.

    Rank 0 gets the pairs (every rank does with every_rank: each loads its own engine); other
    ranks get nothing, but EVERY rank must run the loop to its end (the all-gathers are
    collectives: a rank that stops early hangs the others). Names are the plain Hugging Face
    ones, the same keys as `model.state_dict()` of an unsharded model (tied weights appear
    under both names, as there, and are gathered twice: vLLM's layerwise reload needs
    lm_head.weight too, measured: without it the engine's logprobs stayed ~1 nat off after a
    sync, and keeping the first gather for it would hold a full embedding, 2.2 GB in fp32 for
    7B, through the whole sync). `dtype` (the engine's, e.g. bfloat16): each
    shard is cast before its gather, which then moves half the bytes of the fp32 master weights;
    the rounding is per element, so the engine gets the bits its own cast would give."""
    for name, tensor in model.state_dict().items():  # DTensor views of the local shards: no copy
        if hasattr(tensor, "full_tensor"):
            # cpu_offload on GPUs: NCCL wants GPU tensors. The copy first, from FSDP's pinned shard
            # (asynchronous), then the cast on the GPU: cast first, the CPU would make an unpinned
            # bf16 copy to upload synchronously. Read, not run: a CPU mesh moves nothing.
            if tensor.device.type != tensor.device_mesh.device_type:
                tensor = tensor.to(tensor.device_mesh.device_type, non_blocking=True)
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)  # the local shard only: elementwise
            tensor = tensor.full_tensor()
        if rank == 0 or every_rank:
            yield plain_name(name), tensor.detach()


def save_full_state(model, path: str | Path, rank: int = 0) -> None:
    """The full weights as one safetensors file, written by rank 0 (every rank must call it).
    Gathered one tensor at a time into host memory: rank 0 holds one full copy while writing."""
    from safetensors.torch import save_file

    weights = {}
    for name, tensor in full_weights(model, rank):
        weights[name] = tensor.cpu().clone()  # clone: tied weights must not share storage here
    if rank == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(path))
