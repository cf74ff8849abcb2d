"""Reward throughput: 10,000 rule-based rollouts per reward, and the judge over HTTP.

    python benchmarks/bench_rewards.py                                   # rule-based rewards only
    python benchmarks/bench_rewards.py --judge-model cache/tiny-*/policy # + a vLLM judge server

The judge part starts vLLM's OpenAI-compatible server on 127.0.0.1 with the given model and
scores the same prompts at concurrency 1 and 8 (alternated, median of --reps), cache off.
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.judge import make_judge  # noqa: E402
from rewards import compute  # noqa: E402

SEARCHED = ("<think> find it</think><search> Tavi Morek born</search><information>Doc 1(Title: Tavi Morek) Tavi "
            "Morek was born in the city of Velor.</information><think> it says Velor.</think>")  # fmt: skip


def rollouts(n: int) -> list[dict]:
    answers = ["Velor", "Kesh", "I DON'T KNOW", "city of Velor"]
    return [{"response": SEARCHED + f"<confidence> {i % 10 + 1} </confidence><answer> {answers[i % 4]} </answer>",
             "golden_answers": ["Velor"], "group_id": f"g{i // 8}", "question": "Where was Tavi Morek born?"}
            for i in range(n)]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=10_000, help="rollouts per rule-based reward")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (median)")
    ap.add_argument("--judge-model", default="", help="model directory to serve as the judge (skip if empty)")
    ap.add_argument("--judge-prompts", type=int, default=64, help="prompts per judge measurement")
    args = ap.parse_args()
    results = {}
    for name in ("search_r1_em", "search_r1_format", "deliberative", "webfilter", "bapo", "veritas"):
        times = []
        for _ in range(args.reps):
            recs = rollouts(args.n)
            t = time.perf_counter()
            compute(recs, name, {"lam": 0.1, "stage": "plateau"})
            times.append(time.perf_counter() - t)
        results[f"{name}_s_per_{args.n}"] = statistics.median(times)
        print(name, f"{statistics.median(times):.3f} s", flush=True)
    if args.judge_model:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.judge_model, "--host",
               "127.0.0.1", "--port", str(port), "--max-model-len", "512", "--kv-cache-memory-bytes", str(256 * 2**20),
               "--dtype", "float32", "--served-model-name", "judge"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            for _ in range(600):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    time.sleep(1)
            url = f"http://127.0.0.1:{port}/v1"
            base = make_judge(url, "judge")
            prompts = [base.prompt("info_think", info=f"Doc {i}(Title: P{i}) P{i} was born in the city of C{i}.",
                                   think=f"So P{i} was born in C{i}.") for i in range(args.judge_prompts)]  # fmt: skip
            base.verdicts(prompts[:4])  # warm-up
            times = {1: [], 8: []}
            for _ in range(args.reps):
                for c in times:
                    judge = make_judge(url, "judge", concurrency=c)
                    t = time.perf_counter()
                    judge.verdicts(prompts)
                    times[c].append(time.perf_counter() - t)
            for c, ts in times.items():
                results[f"judge_prompts_per_s_concurrency{c}"] = len(prompts) / statistics.median(ts)
            results["judge_concurrency8_over_1"] = statistics.median(times[1]) / statistics.median(times[8])
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
