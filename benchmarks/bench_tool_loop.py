"""The tool loop's cost: multi-turn rollout tokens/s over pure generation of the same tokens.

    python benchmarks/bench_tool_loop.py --config configs/tiny.yaml            # 32 x 8, 3 reps
    python benchmarks/bench_tool_loop.py --config configs/smollm2.yaml --questions 16 --group 5

One vLLM engine, side by side in each repetition (the order rotates):
  * `turns`: rollout.continuous false, every trajectory of a turn waits for the slowest one,
    then all their queries go to the retriever, then the next turn starts;
  * `continuous`: rollout.continuous true (engine.run_continuous), a trajectory's next turn is
    queued as soon as its own tool call returns;
  * `pure`: the ceiling, vLLM generating exactly the policy tokens of those rollouts (same
    prompts, each request `ignore_eos` for its trajectory's policy-token count), no tools.
Rollout tokens/s counts policy tokens (loss_mask 1) over the whole loop's wall time, retrieval
included. The report is the median of each and the ratios to `pure`; `records_identical` says
whether the two schedules gave the same records (token ids, masks, logprobs within 1e-6).
"""

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import precision  # noqa: E402
from config import load_config  # noqa: E402
from data import data_paths, ensure_policy, load_questions, make_search_fn  # noqa: E402
from engine import load_tokenizer, make_engine  # noqa: E402
from rollout import rollout_batch  # noqa: E402


def pure_generation(engine, records: list[dict], seed: int) -> float:
    """Seconds for vLLM to generate each record's policy-token count from its prompt, no tools."""
    from vllm import SamplingParams, TokensPrompt

    params = [SamplingParams(max_tokens=max(1, sum(r["loss_mask"])), ignore_eos=True, logprobs=0, seed=seed + i)
              for i, r in enumerate(records)]  # fmt: skip
    t = time.perf_counter()
    engine.llm.generate([TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in records], params, use_tqdm=False)
    return time.perf_counter() - t


def same_records(a: list[dict], b: list[dict]) -> bool:
    def close(x, y):
        return len(x) == len(y) and all(abs(p - q) <= 1e-6 for p, q in zip(x, y))

    same = lambda x, y: x["response_ids"] == y["response_ids"] and x["loss_mask"] == y["loss_mask"]  # noqa: E731
    return len(a) == len(b) and all(same(x, y) and close(x["logprobs"], y["logprobs"]) for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml", help="config whose policy, world and rollout to use")
    parser.add_argument("--questions", type=int, default=32, help="validation questions per batch")
    parser.add_argument("--group", type=int, default=8, help="rollouts per question")
    parser.add_argument("--reps", type=int, default=3, help="repetitions; each runs all three, in rotating order")
    parser.add_argument("--out", default="", help="also write the JSON report to this file")
    args = parser.parse_args()
    cfg = load_config(args.config)
    precision.resolve(cfg)
    policy = ensure_policy(cfg, Path("runs/bench_tool_loop"))  # the cached start: SFT warm start or model.path
    engine = make_engine("vllm", policy, cfg.rollout, cfg.model.dtype, seed=cfg.train.seed)  # before bm25s
    paths = data_paths(cfg)
    timings: dict[str, float] = {}
    search_fn = make_search_fn(cfg, paths["corpus"], timings)
    tok = load_tokenizer(policy)
    questions = load_questions(paths["val"])[: args.questions]
    speeds: dict[str, list[float]] = {"turns": [], "continuous": [], "pure": []}
    retrieve_share: dict[str, list[float]] = {"turns": [], "continuous": []}
    identical, records = [], {}
    rollout_batch(engine, tok, questions[:4], 2, search_fn, cfg.rollout, seed=999)  # warm-up: compile, caches
    for rep in range(args.reps):
        names = ["turns", "continuous", "pure"]
        names = names[rep % 3 :] + names[: rep % 3]
        if names[0] == "pure":
            names = names[1:] + ["pure"]  # pure needs this rep's records
        for name in names:
            engine.llm.reset_prefix_cache()  # no run reuses another's KV blocks
            if name == "pure":
                recs = records["continuous"]
                dt = pure_generation(engine, recs, rep)
            else:
                timings.clear()
                rcfg = replace(cfg.rollout, continuous=name == "continuous")
                t = time.perf_counter()
                recs = records[name] = rollout_batch(engine, tok, questions, args.group, search_fn, rcfg, seed=rep)
                dt = time.perf_counter() - t
                retrieve_share[name].append(timings.get("retrieve", 0.0) / dt)
            speeds[name].append(sum(sum(r["loss_mask"]) for r in recs) / dt)
        identical.append(same_records(records["turns"], records["continuous"]))
    med = {k: statistics.median(v) for k, v in speeds.items()}
    report = {
        "config": args.config, "questions": args.questions, "group": args.group, "reps": args.reps,
        "policy_tokens_per_batch": sum(sum(r["loss_mask"]) for r in records["continuous"]),
        "tokens_per_s": med, "all": speeds,
        "continuous_over_pure": med["continuous"] / med["pure"], "turns_over_pure": med["turns"] / med["pure"],
        "retrieve_share": {k: statistics.median(v) for k, v in retrieve_share.items()},
        "records_identical": identical, "machine": precision.machine(),
    }  # fmt: skip
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
