"""Peak host RAM per rank while 2 processes load and shard the policy and its reference
(issue 33, item 1): every rank reading the whole checkpoint (`--path every-rank`, what train.py
did before) against rank 0 reading it and each rank keeping its slice (`--path rank0`,
distributed.load_from_rank0 on a meta-device build, what train.py does now).

    python benchmarks/bench_load_memory.py                    # SmolLM2-135M-Instruct, both paths
    python benchmarks/bench_load_memory.py --reps 3

Each repetition is a fresh `torchrun --nproc_per_node 2` of this file (gloo, one thread each,
MALLOC_MMAP_THRESHOLD_=65536 so freed tensors leave the RSS). The checkpoint is saved in bf16,
as the hub's Qwen2.5 ones are; the reference is bf16, as the paper configs' model.dtype. Each
rank prints its RSS before loading (torch, transformers and the process group imported), its
peak while loading (VmHWM, which counts the pages of the mmap'd checkpoint, and the peak of its
anonymous memory, its own tensors, sampled every 2 ms) and its RSS after: the fp32 policy and
the bf16 reference, as train.py loads them with a KL term. The gathered weights of both paths
must be the checkpoint's bit for bit
(checked on rank 0). Results: results/memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_memory import current_rss, ensure_model, load_average  # noqa: E402

from run_setup import sharded_policy_and_reference  # noqa: E402
from trainer import distributed  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.engine import load_policy  # noqa: E402
from trainer.grpo import memory_savers  # noqa: E402
from trainer.precision import resolve as resolve_precision  # noqa: E402

GB = 1e9


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rss_anon() -> int:
    """This process's anonymous resident memory (its tensors), bytes: RSS without the pages of
    the files it has mmap'd (safetensors are read through mmap; those pages are the page cache's,
    shared by every process reading the file, and dropped under pressure)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def sample_peak(stop: threading.Event, peak: list) -> None:
    while not stop.wait(0.002):
        peak[0] = max(peak[0], rss_anon())


def child(path: str, model_dir: Path) -> None:
    """One rank: load policy and reference along `path`, then report."""
    rank, world, _ = distributed.init()
    torch.set_num_threads(1)
    cfg = load_config(None, ["train.fsdp=true", "train.kl_coef=0.001", "train.grad_checkpointing=true",
                             "model.dtype=bfloat16"])  # fmt: skip  # the paper configs' reference dtype
    resolve_precision(cfg)  # this machine's bf16 / dtype for the `auto` keys
    distributed.barrier(world)
    before, anon_before = current_rss(), rss_anon()
    reset_peak()
    stop, anon_peak = threading.Event(), [anon_before]
    sampler = threading.Thread(target=sample_peak, args=(stop, anon_peak), daemon=True)
    sampler.start()
    if path == "every-rank":
        model = distributed.shard(memory_savers(load_policy(model_dir).eval(), cfg), cfg)
        ref = distributed.shard_reference(load_policy(model_dir, cfg.model.dtype), cfg)
    else:
        model, ref = sharded_policy_and_reference(cfg, model_dir, model_dir, rank, world)
    peak, after = vm_hwm(), current_rss()
    stop.set()
    sampler.join()
    same, saved = True, load_file(str(model_dir / "model.safetensors")) if rank == 0 else {}
    for net in (model, ref):
        for name, w in distributed.full_weights(net, rank):  # every rank runs the gathers; rank 0 gets them
            if name in saved:
                same &= torch.equal(w, saved[name].to(w.dtype))  # bf16 -> fp32 is exact
    row = {"path": path, "rank": rank, "before_gb": before / GB, "peak_gb": peak / GB, "after_gb": after / GB,
           "rise_gb": (peak - before) / GB, "anon_rise_gb": (anon_peak[0] - anon_before) / GB}  # fmt: skip
    if rank == 0:
        row["weights_equal_checkpoint"] = same
    print("ROW " + json.dumps(row), flush=True)
    distributed.close(world)


def bf16_copy(fp32_dir: Path) -> Path:
    """The model saved in bfloat16, as the hub's Qwen2.5 checkpoints are (built once): the
    trainer's fp32 master weights are then a conversion, not a view of the file."""
    out = fp32_dir.parent / (fp32_dir.name + "-bf16")
    if not (out / "model.safetensors").is_file():
        model = load_policy(fp32_dir, "bfloat16")
        model.save_pretrained(out)
        for f in fp32_dir.iterdir():
            if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
                (out / f.name).write_bytes(f.read_bytes())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", choices=["every-rank", "rank0"], nargs="+", default=["every-rank", "rank0"],
                        help="loading path(s) to measure")  # fmt: skip
    parser.add_argument("--reps", type=int, default=1, help="fresh 2-process launches per path")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, Path(args.model))
    model_dir = bf16_copy(ensure_model())
    print(f"model {model_dir}, load average {load_average()}", flush=True)
    env = os.environ | {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    for rep in range(args.reps):
        for path in args.path:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(29700 + rep), __file__, "--child", path, "--model", str(model_dir)]  # fmt: skip
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            rows = [json.loads(line[4:]) for line in out.stdout.splitlines() if line.startswith("ROW ")]
            if out.returncode or len(rows) != 2:
                sys.exit(f"{path}: launch failed\n{out.stderr[-3000:]}")
            for r in sorted(rows, key=lambda r: r["rank"]):
                same = r.get("weights_equal_checkpoint")
                extra = "" if same is None else f"  weights = checkpoint: {same}"
                print(f"rep {rep} {path:10s} rank {r['rank']}: before {r['before_gb']:.2f} GB, "
                      f"peak {r['peak_gb']:.2f} GB (+{r['rise_gb']:.2f}; anonymous +{r['anon_rise_gb']:.2f}), "
                      f"after {r['after_gb']:.2f} GB{extra}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
