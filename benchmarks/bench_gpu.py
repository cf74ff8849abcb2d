"""A GPU check, ready for a GPU: a few GRPO steps on one CUDA GPU, with the time and memory of each stage.

    python benchmarks/bench_gpu.py                       # 3 steps, configs/tiny.yaml, vLLM if installed
    python benchmarks/bench_gpu.py --steps 5 --set train.bf16=false
    python benchmarks/bench_gpu.py --cpu                 # the same code path on a CPU (a smoke run)

    # the second command: what a GPU machine without vLLM runs (torch and transformers alone):
    # SmolLM2 (convert_gguf.py smollm2) with the transformers engine, bf16 (`auto` on a GPU),
    # its warm start first (40 SFT steps)
    python benchmarks/bench_gpu.py --config configs/smollm2.yaml --engine hf --steps 4 --set sft.steps=40

It runs train.py's loop itself (train.train) on the GPU, with `rollout.engine: vllm` when vLLM
imports and the transformers engine otherwise (`--engine` chooses), and prints per step:
- the time split (generate, retrieve, reward, train, sync), generated tokens per second;
- `gap`: the largest |log pi_engine - log pi_trainer| over the step's sampled tokens (the
  engine's logprobs against the trainer's on the same weights; grpo.grpo_step);
- the peak GPU memory torch's allocator held in each stage (train.stage_peak_gib).
At the end, the memory apart: the engine's (what torch counted for vLLM's weights and KV cache
when it started; 0 for the transformers engine beyond its copy of the weights), the trainer's
peak (the update stage's peak less the engine's resident share) and what the device had in use
(torch.cuda.mem_get_info: every allocator and the CUDA context, vLLM's sleep-mode pool too).
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
from trainer.precision import resolve as resolve_precision  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml", help="config to run (default: the tiny world)")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps")
    parser.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto",
                        help="rollout engine (auto: vllm when it imports, else the transformers engine)")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--cpu", action="store_true", help="allow a run without CUDA (checks the script, not a GPU)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        sys.exit("bench_gpu: no CUDA GPU here (torch.cuda.is_available() is False); --cpu runs the same path on CPU")
    engine = args.engine if args.engine != "auto" else "vllm" if importlib.util.find_spec("vllm") else "hf"
    overrides = [f"train.steps={args.steps}", "train.eval_every=0", "train.save_every=0", "sft.steps=0",
                 f"rollout.engine={engine}", "train.name=bench_gpu", "train.run_dir=runs"] + args.set  # fmt: skip
    cfg = load_config(args.config, overrides)
    resolve_precision(cfg)  # this machine's bf16 / dtype for the `auto` keys
    run = new_run_dir(cfg)
    print(f"machine: {precision.machine()} | engine: {engine} | {precision.describe(cfg)}", flush=True)
    t0 = time.time()
    train(cfg, run)
    wall = time.time() - t0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time" in r]
    print(f"{'step':>4} {'generate':>9} {'retrieve':>9} {'reward':>7} {'train':>7} {'sync':>7} {'tok/s':>8} "
          f"{'gap':>8} {'reward':>7} {'GiB gen':>8} {'GiB train':>9} {'GiB sync':>8}")  # fmt: skip
    for r in rows:
        t, g = r["time"], r.get("gpu_peak_gib", {})
        print(f"{r['step']:>4} {t['generate']:>9.2f} {t['retrieve']:>9.2f} {t['reward']:>7.2f} {t['train']:>7.2f} "
              f"{t['sync']:>7.3f} {r['tokens_per_s']:>8.0f} {r.get('engine_logp_gap', float('nan')):>8.1e} "
              f"{r['reward']:>7.3f} {g.get('generate', 0):>8.2f} {g.get('train', 0):>9.2f} "
              f"{g.get('sync', 0):>8.2f}")  # fmt: skip
    print(f"wall {wall:.1f} s (engine start and world build included)")
    if torch.cuda.is_available() and rows:
        engine_gib = rows[0]["gpu_peak_gib"]["engine"]
        train_peak = max(r["gpu_peak_gib"]["train"] for r in rows)
        free, total = torch.cuda.mem_get_info()
        print(f"GPU memory: engine resident {engine_gib:.2f} GiB | trainer peak {train_peak - engine_gib:.2f} GiB "
              f"(update-stage peak {train_peak:.2f} less the engine's) | device in use at the end "
              f"{(total - free) / 2**30:.2f} of {total / 2**30:.1f} GiB")  # fmt: skip
    print(f"run directory: {run}")


if __name__ == "__main__":
    main()
