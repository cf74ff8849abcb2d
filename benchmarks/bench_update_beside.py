"""The update's seconds beside each rollout engine, on one fixed batch (issue 35, item 4).

    python benchmarks/bench_update_beside.py --config configs/smollm2.yaml --engine hf \
        --set sft.warm_start=false --set rollout.max_turns=0 --save-batch /tmp/batch.jsonl
    python benchmarks/bench_update_beside.py --config configs/smollm2.yaml --engine vllm \
        --set sft.warm_start=false --set rollout.max_turns=0 --batch /tmp/batch.jsonl --reps 2

One process, set up as train.py sets it up (run_setup.setup: the engine first, then the retriever,
the policy and its optimizer). It rolls out one step's questions (generation tokens/s, the
engine's own batch), then takes `--reps` GRPO updates (train.update_stage, the stage that
metrics.jsonl times as "train") on the batch in `--batch` (the records of an earlier run,
e.g. the one `--save-batch` wrote), so both engines are timed on the same tokens. Prints one
JSON line: the engine, torch's threads and the main thread's CPUs after setup, generation
tokens/s, and the update's seconds, wall and CPU (this process, all threads).
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import load_config  # noqa: E402
from trainer.precision import resolve as resolve_precision  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/smollm2.yaml")
    parser.add_argument("--engine", choices=("vllm", "hf"), required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--batch", help="records (jsonl) to update on; default: this process' own rollouts")
    parser.add_argument("--save-batch", help="write this process' scored rollouts here (jsonl)")
    parser.add_argument("--reps", type=int, default=2, help="updates to time")
    parser.add_argument("--gen-questions", type=int, help="questions to roll out (default: train.questions_per_step)")
    args = parser.parse_args()
    import torch

    import train
    from trainer.checkpoint import new_run_dir
    from trainer.judging import judge_counts

    run_dir = tempfile.mkdtemp(prefix="bench_update_")
    cfg = load_config(args.config, [*args.set, f"rollout.engine={args.engine}", f"train.run_dir={run_dir}"])
    resolve_precision(cfg)  # this machine's bf16 / dtype for the `auto` keys
    cfg.train.questions_per_step = args.gen_questions or cfg.train.questions_per_step
    p = train.setup(cfg, new_run_dir(cfg), None)
    threads, cpus = torch.get_num_threads(), sorted(os.sched_getaffinity(0))
    real = torch.set_num_threads is torch._C.set_num_threads  # vLLM CPU in process swaps it for a no-op
    t = time.time()
    records, _ = train.rollout_stage(p, 0)
    gen_s = time.time() - t - p.timings.get("retrieve", 0.0)
    gen_tokens = sum(sum(r["loss_mask"]) for r in records)
    train.reward_stage(p, records, judge_counts(p.judge))
    if args.save_batch:
        with open(args.save_batch, "w") as f:
            f.writelines(json.dumps({k: v for k, v in r.items() if not k.startswith("_")}) + "\n" for r in records)
    if args.batch:
        records = [json.loads(line) for line in open(args.batch)]
    updates = []
    for rep in range(args.reps):
        t, c = time.time(), time.process_time()
        train.update_stage(p, records, rep)
        updates.append({"wall_s": round(time.time() - t, 2), "cpu_s": round(time.process_time() - c, 2)})
    p.engine.close()
    print(json.dumps({
        "engine": args.engine, "torch_threads": threads, "cpus": cpus, "real_set_num_threads": real,
        "gen_tokens": gen_tokens, "gen_tokens_per_s": round(gen_tokens / gen_s, 1), "batch_rollouts": len(records),
        "batch_tokens": sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in records),
        "batch_policy_tokens": sum(sum(r["loss_mask"]) for r in records),
        "update": updates, "load": round(os.getloadavg()[0], 1),
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
