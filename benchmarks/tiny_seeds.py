"""Learning claims on the tiny world: one config, several seeds, a table of start vs end.

    python benchmarks/tiny_seeds.py --config configs/tiny.yaml --seeds 0 1 2
    python benchmarks/tiny_seeds.py --config configs/tiny_ppo.yaml --seeds 0 1 2 --parallel 2
    python benchmarks/tiny_seeds.py --config configs/experiments/tiny_lagrangian.yaml --seeds 0 1 2 \
        --keys em_1hop em_2hop reward/reliability reward/acc --train-keys lambda/reliability

Runs `train.py` once per seed (same cached SFT start, different rollout sampling), then prints
greedy validation metrics (`--keys`, from the eval lines of metrics.jsonl) at step 0 (the SFT
policy) and at the last step, training-batch series (`--train-keys`) at the first and last
step, and the wall time of each run (curves in each RUN/curves/), as a markdown table with mean ± spread (spread = max -
min over seeds). `--parallel 2` runs two seeds at once with one torch thread each: on two
cores that is faster than one run with two threads, and two processes with two threads each
on two cores is far slower (spinning thread pools; README "Notes").

`--seed-keys train.seed world.seed` sets each listed key to the seed: with `world.seed` each seed
builds its own world and SFT start (cached under world.cache_dir), which stands in for the other
numeric paths a CPU may take (results/quickstart_seeds.md). Each run's row is printed as one JSON
line as soon as it finishes, so a long sweep leaves its results behind if it is stopped.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_seed(args, seed: int, threads: int) -> subprocess.Popen:
    name = f"{args.name}{seed}"
    seeds = sum((["--set", f"{k}={seed}"] for k in args.seed_keys), [])
    cmd = [sys.executable, "train.py", "--config", args.config, *seeds, "--set", f"train.name={name}",
           "--set", f"train.threads={threads}",
           *sum((["--set", s] for s in args.set), [])]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def collect(args, seed: int, minutes: float) -> dict:
    run = max((ROOT / "runs").glob(f"{args.name}{seed}-*"), key=lambda p: p.stat().st_mtime)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval" in r]
    steps = [r for r in rows if "reward" in r]
    return {"seed": seed, "run": str(run), "minutes": minutes, "start": evals[0]["eval"], "end": evals[-1]["eval"],
            "train_start": steps[0], "train_end": steps[-1]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml", help="training config")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="train.seed values")
    parser.add_argument("--seed-keys", nargs="+", default=["train.seed"], metavar="KEY",
                        help="keys set to each seed (train.seed world.seed: a world and SFT start each)")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra overrides")
    parser.add_argument("--name", default="seed", help="run name prefix (runs/<name><seed>-<time>)")
    parser.add_argument("--keys", nargs="+", default=["em_1hop", "em_2hop", "searches_2hop"],
                        help="eval metrics to tabulate")  # fmt: skip
    parser.add_argument("--train-keys", nargs="*", default=[], help="training-batch metrics (first vs last step)")
    parser.add_argument("--parallel", type=int, default=1, help="seeds run at once (each with one torch thread)")
    parser.add_argument("--threads", type=int, help="torch threads per run (default: 1 with --parallel > 1, else 2)")
    args = parser.parse_args()
    threads = args.threads or (1 if args.parallel > 1 else 2)
    rows = []
    pending = list(args.seeds)
    while pending:
        batch, pending = pending[: args.parallel], pending[args.parallel :]
        t = time.time()
        procs = {seed: run_seed(args, seed, threads) for seed in batch}
        for seed, proc in procs.items():
            _, err = proc.communicate()
            if proc.returncode != 0:
                sys.exit(f"seed {seed} failed:\n{err[-3000:]}")
            rows.append(collect(args, seed, (time.time() - t) / 60))
            print(json.dumps({k: v for k, v in rows[-1].items() if not k.startswith("train_")}), flush=True)
            subprocess.run(
                [sys.executable, "eval.py", "curves", rows[-1]["run"]], cwd=ROOT, check=True, stdout=subprocess.DEVNULL
            )  # fmt: skip  (RUN/curves/*.png)
    fmt = lambda v: f"{statistics.mean(v):.3f} ± {max(v) - min(v):.3f}"  # noqa: E731
    print("| metric | start | end | change |\n|---|---|---|---|")
    for key, start, end in [(k, "start", "end") for k in args.keys] + [(k, "train_start", "train_end")
                                                                        for k in args.train_keys]:  # fmt: skip
        a = [r[start].get(key, float("nan")) for r in rows]
        b = [r[end].get(key, float("nan")) for r in rows]
        print(f"| {key} | {fmt(a)} | {fmt(b)} | {fmt([y - x for x, y in zip(a, b)])} |")
    print(f"| minutes per run | | {statistics.mean(r['minutes'] for r in rows):.1f} | |")


if __name__ == "__main__":
    main()
