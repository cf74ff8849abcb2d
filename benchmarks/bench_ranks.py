"""One process against two: rollout and weight-sync seconds per step of train.py itself.

    python benchmarks/bench_ranks.py --config configs/tiny.yaml [--steps 4] [--out results/x.json]
    python benchmarks/bench_ranks.py --set train.exact_grad_sum=true    # what float64 sums cost

Three short runs of the same config and seed, one after the other (nothing else running):
  * `1 process`: one engine generates every rollout, the weights sync in memory;
  * `2 processes, memory`: torchrun, FSDP; each rank's own vLLM engine (external_launcher) rolls
    out half of each step's questions and loads the full weights from memory;
  * `2 processes, file`: the same, each engine in a process of its own, the weights through a
    safetensors file in /dev/shm (`rollout.weight_sync: file`, the fallback and the old channel).
The report is the median over steps 2.. (step 1 pays for compilation) of time.generate,
time.sync and time.train from each run's metrics.jsonl, and the runs' mean rewards (with the same
seed they sample the same rollouts, so the rewards agree).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer import precision  # noqa: E402


def run(name: str, launcher: list[str], config: str, overrides: list[str], tmp: Path) -> dict:
    sets = [a for o in overrides + [f"train.run_dir={tmp / name}", f"train.name={name}"] for a in ("--set", o)]
    subprocess.run(launcher + ["train.py", "--config", config] + sets, cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    metrics = next((tmp / name).glob(f"{name}-*")) / "metrics.jsonl"
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "time" in r]
    later = rows[1:] or rows
    return {
        "generate_s": statistics.median(r["time"]["generate"] for r in later),
        "sync_s": statistics.median(r["time"]["sync"] for r in later),
        "train_s": statistics.median(r["time"]["train"] for r in later),
        "reward": [round(r["reward"], 4) for r in rows],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml", help="config to train (default: the tiny world)")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per run")
    parser.add_argument("--out", default="", help="also write the JSON report to this file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (repeatable): train.exact_grad_sum=true")  # fmt: skip
    args = parser.parse_args()
    common = [f"train.steps={args.steps}", "train.eval_every=0", "train.save_every=0", "train.fsdp=true"] + args.set
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    report = {"machine": precision.machine(), "config": args.config, "steps": args.steps, "set": args.set}
    with tempfile.TemporaryDirectory() as tmp:
        report["1 process"] = run("one", [sys.executable], args.config, common + ["train.fsdp=false"], Path(tmp))
        report["2 processes, memory"] = run("two-memory", torchrun, args.config,
                                            common + ["rollout.weight_sync=memory"], Path(tmp))  # fmt: skip
        report["2 processes, file"] = run("two-file", torchrun, args.config, common + ["rollout.weight_sync=file"],
                                          Path(tmp))  # fmt: skip
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
