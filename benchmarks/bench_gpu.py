"""A GPU check, ready for a GPU: a few GRPO steps of the tiny world on one CUDA GPU.

    python benchmarks/bench_gpu.py                       # 3 steps, configs/tiny.yaml, vLLM if installed
    python benchmarks/bench_gpu.py --steps 5 --set train.bf16=false
    python benchmarks/bench_gpu.py --cpu                 # the same code path on a CPU (a smoke run)

It runs train.py's loop itself (train.train) on the GPU, with `rollout.engine: vllm` when vLLM
imports and the transformers engine otherwise, and prints per step the time split (generate,
retrieve, reward, train, sync), the weight-sync seconds and the peak GPU memory
(torch.cuda.max_memory_allocated, the trainer's tensors; vLLM's own pool is reported by vLLM).
The tiny world's SFT warm start is skipped by default (`sft.steps=0`, a random policy writes to
its token budgets: the slowest case); `--set sft.steps=800` trains the real start first.
"""

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from train import train  # noqa: E402
from trainer import precision  # noqa: E402
from trainer.checkpoint import new_run_dir  # noqa: E402
from trainer.config import load_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml", help="config to run (default: the tiny world)")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--cpu", action="store_true", help="allow a run without CUDA (checks the script, not a GPU)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        sys.exit("bench_gpu: no CUDA GPU here (torch.cuda.is_available() is False); --cpu runs the same path on CPU")
    engine = "vllm" if importlib.util.find_spec("vllm") else "hf"
    overrides = [f"train.steps={args.steps}", "train.eval_every=0", "train.save_every=0", "sft.steps=0",
                 f"rollout.engine={engine}", "train.name=bench_gpu", "train.run_dir=runs"] + args.set  # fmt: skip
    cfg = load_config(args.config, overrides)
    run = new_run_dir(cfg)
    print(f"machine: {precision.machine()} | engine: {engine} | {precision.describe(cfg)}", flush=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    train(cfg, run)
    wall = time.time() - t0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time" in r]
    print(f"{'step':>4} {'generate':>9} {'retrieve':>9} {'reward':>7} {'train':>7} {'sync':>7} {'tok/s':>8}")
    for r in rows:
        t = r["time"]
        print(f"{r['step']:>4} {t['generate']:>9.2f} {t['retrieve']:>9.2f} {t['reward']:>7.2f} {t['train']:>7.2f} "
              f"{t['sync']:>7.3f} {r['tokens_per_s']:>8.0f}")  # fmt: skip
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    print(f"wall {wall:.1f} s (engine start and world build included) | peak GPU memory (trainer) {peak:.2f} GiB")
    print(f"run directory: {run}")


if __name__ == "__main__":
    main()
