"""The foundation's learning claim: GRPO with search on the tiny world, several seeds.

    python benchmarks/tiny_seeds.py --config configs/tiny.yaml --seeds 0 1 2

Runs `train.py` once per seed (same cached SFT start, different rollout sampling), then prints
greedy validation EM per question type at step 0 (the SFT policy) and at the last step, the
mean number of searches per 2-hop question, and the wall time of each run, as a markdown table
with mean ± spread (spread = max - min over seeds).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml", help="training config")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="train.seed values")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra overrides")
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        name = f"seed{seed}"
        t = time.time()
        cmd = [sys.executable, "train.py", "--config", args.config, "--set", f"train.seed={seed}",
               "--set", f"train.name={name}", *sum((["--set", s] for s in args.set), [])]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True)
        minutes = (time.time() - t) / 60
        run = max((ROOT / "runs").glob(f"{name}-*"), key=lambda p: p.stat().st_mtime)
        evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval" in r]
        start, end = evals[0]["eval"], evals[-1]["eval"]
        rows.append({"seed": seed, "run": str(run), "minutes": minutes, "start": start, "end": end})
    keys = ["em_1hop", "em_2hop", "searches_2hop"]
    print("| metric | SFT start | after GRPO | change |\n|---|---|---|---|")
    for k in keys:
        a = [r["start"][k] for r in rows]
        b = [r["end"][k] for r in rows]
        d = [y - x for x, y in zip(a, b)]
        fmt = lambda v: f"{statistics.mean(v):.3f} ± {max(v) - min(v):.3f}"  # noqa: E731
        print(f"| {k} | {fmt(a)} | {fmt(b)} | {fmt(d)} |")
    print(f"| minutes per run | | {statistics.mean(r['minutes'] for r in rows):.1f} | |")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
