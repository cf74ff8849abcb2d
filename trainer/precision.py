"""Which number format this machine computes in fast: the `auto` of `model.dtype`, `sft.bf16`
and `train.bf16`.

bf16 is fast only where the hardware does it natively: CUDA GPUs of compute capability 8.0 and
later (A100, H100), and CPUs with AMX or AVX512-BF16 (Intel Sapphire Rapids and later, AMD Zen 4
and later). Elsewhere PyTorch emulates it: on an AMD EPYC with AVX2 only, a bf16 matmul ran at
0.9 GFLOP/s against 146 GFLOP/s in fp32, and the tiny world's SFT took 28 s a step instead of
about 1 s. So `auto` means bf16 where it is native and fp32 otherwise:

    >>> cfg = resolve(load_config("configs/tiny.yaml"))   # config.load_config leaves auto as it is
    >>> describe(cfg)                                  # the one line train.py / eval.py print
    'precision: fp32 (CPU AMD EPYC: no AMX / AVX512-BF16); sft.bf16=false train.bf16=false model.dtype=float32'

What `auto` resolves to, per key:
  sft.bf16, train.bf16   bf16 autocast of forward/backward (master weights stay fp32) iff native
  model.dtype            the weights of the rollout engine and the frozen reference: bfloat16 on a
                         GPU with native bf16, float32 on a CPU (vLLM's CPU backend keeps its
                         weights in this dtype; at the tiny world's 3M parameters the engine is
                         bound by per-token overhead, not matmuls, so fp32 costs nothing there)
A config loaded by config.load_config starts these three keys at auto and keeps them so (reading a
config needs no torch); the scripts resolve them where they print this line. A bare Config() is fp32.
An explicit true / false / dtype always wins. TRAINER_NATIVE_BF16=0 or 1 in the environment
overrides the detection (the test suite sets 0, so it runs the same code on every CPU).
`python -m trainer.precision` prints what this machine does and times a bf16 and an fp32 matmul.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch

ENV_OVERRIDE = "TRAINER_NATIVE_BF16"
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of native bf16 matmuls


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (Linux); empty where /proc/cpuinfo is not there."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def native_bf16() -> tuple[bool, str]:
    """(does this machine compute bf16 natively?, why, in a few words)."""
    forced = os.environ.get(ENV_OVERRIDE, "").strip()
    if forced in ("0", "1"):
        return forced == "1", f"{ENV_OVERRIDE}={forced}"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"GPU {name}: native bf16"
        return False, f"GPU {name}: no native bf16"
    found = sorted(set(CPU_BF16_FLAGS) & cpu_flags())
    if found:
        return True, f"CPU {cpu_name()}: {' / '.join(found)}"
    return False, f"CPU {cpu_name()}: no AMX / AVX512-BF16"


def machine() -> str:
    """The machine a timing was measured on, for reports: "AMD EPYC (fp32: no native bf16)"."""
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else cpu_name()
    return f"{name} ({'native bf16' if native_bf16()[0] else 'fp32: no native bf16'})"


def resolve(cfg, native: bool | None = None, gpu: bool | None = None):
    """Replace every `auto` of cfg (a config.Config) by this machine's choice, in place; returns cfg.
    native / gpu force the answers: the memory plan resolves for the GPU box it plans
    (native=True, gpu=True), not for the machine it runs on."""
    native = native_bf16()[0] if native is None else native
    gpu = torch.cuda.is_available() if gpu is None else gpu
    if cfg.sft.bf16 == "auto":
        cfg.sft.bf16 = native
    if cfg.train.bf16 == "auto":
        cfg.train.bf16 = native
    if cfg.model.dtype == "auto":
        cfg.model.dtype = "bfloat16" if native and gpu else "float32"
    return cfg


def describe(cfg) -> str:
    """One line: what this machine does natively and what the run computes in."""
    native, why = native_bf16()
    flag = lambda b: "true" if b else "false"  # noqa: E731
    return (f"precision: {'bf16' if native else 'fp32'} ({why}); sft.bf16={flag(cfg.sft.bf16)} "
            f"train.bf16={flag(cfg.train.bf16)} model.dtype={cfg.model.dtype}")  # fmt: skip


def matmul_gflops(dtype: torch.dtype, n: int = 1024, reps: int = 5) -> float:
    """GFLOP/s of an n x n x n torch.matmul (2 n^3 FLOPs) in `dtype` on the CPU: the median of
    reps, after two warm-up calls."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        torch.matmul(a, b)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e9


if __name__ == "__main__":  # python -m trainer.precision: what `auto` picks here, and why, measured
    print(f"{machine()}; native bf16: {native_bf16()[1]}")
    fp32, bf16 = matmul_gflops(torch.float32), matmul_gflops(torch.bfloat16)
    print(f"1024 x 1024 matmul on the CPU: fp32 {fp32:.1f} GFLOP/s, bf16 {bf16:.1f} GFLOP/s "
          f"(bf16 / fp32 {bf16 / fp32:.3f})")
