"""Tree rollouts' budget against chains at the same number of leaves, read from vLLM's own counters.

    python benchmarks/bench_tree.py --config configs/quickstart.yaml --questions 32 --out results/tree_budget.json

One vLLM engine (the config's warm start), the same validation questions, two runs, each from an
empty prefix cache: `tree` (rollout.tree_m/n/l, default Tree-GRPO's M 2, N 2, L 1: 6 leaves a
question) and `chain` (rollout_batch, group_size = the tree's leaves a question). Per run and per
leaf:

  * prompt tokens: the prompts vLLM was given (RequestOutput.prompt_token_ids), every turn's request;
  * cached tokens: those of them vLLM found in its prefix cache (RequestOutput.num_cached_tokens);
  * prefill tokens: prompt - cached, what it computed;
  * decode tokens: the tokens it generated (CompletionOutput.token_ids);
  * tool calls: the queries the retriever answered (the search function's calls);
  * prefix tokens saved: the response tokens a leaf holds but did not generate or fetch (the copied
    prefix, its record's tree.shared_prefix_len), and how many of the prompt tokens the cache served.

The counters are read off every finished request of engine.step (the loop run_continuous drives),
not estimated from the records.
"""

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data import cached_policy, data_paths  # noqa: E402
from rollout import rollout_batch  # noqa: E402
from rollout_tree import rollout_trees  # noqa: E402
from search.tools import make_search_fn  # noqa: E402
from trainer import precision  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.engine import load_tokenizer, make_engine  # noqa: E402
from trainer.questions import load_questions  # noqa: E402


def counted(engine) -> dict:
    """vLLM's per-request counters, summed over every request that finishes from now on."""
    counts = {"requests": 0, "prompt": 0, "cached": 0, "decode": 0}
    step = engine.llm.llm_engine.step

    def counting_step():
        outs = step()
        for o in outs:
            if o.finished:
                counts["requests"] += 1
                counts["prompt"] += len(o.prompt_token_ids)
                counts["cached"] += o.num_cached_tokens or 0
                counts["decode"] += sum(len(c.token_ids) for c in o.outputs)
        return outs

    engine.llm.llm_engine.step = counting_step
    return counts


def measure(run, engine, calls: list[int]) -> dict:
    engine.llm.reset_prefix_cache()  # no run reuses another's KV blocks
    counts = counted(engine)
    calls.clear()
    t = time.perf_counter()
    records = run()
    seconds = time.perf_counter() - t
    del engine.llm.llm_engine.step  # the class's own step again
    leaves = len(records)
    shared = sum(r.get("tree", {}).get("shared_prefix_len", 0) for r in records)
    per_leaf = {k: v / leaves for k, v in counts.items()}
    return {
        "leaves": leaves,
        "seconds": round(seconds, 2),
        "per_leaf": {**{k: round(v, 2) for k, v in per_leaf.items()},
                     "prefill": round((counts["prompt"] - counts["cached"]) / leaves, 2),
                     "tool_calls": round(sum(calls) / leaves, 3),
                     "response_tokens_held": round(sum(len(r["response_ids"]) for r in records) / leaves, 2),
                     "prefix_tokens_copied": round(shared / leaves, 2)},
        "reward_em": round(sum(r["answer"] is not None and r["answer"].strip().lower() in
                               [g.lower() for g in r["golden_answers"]] for r in records) / leaves, 3),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--questions", type=int, default=32, help="validation questions")
    parser.add_argument("--m", type=int, default=2)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--l", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="also write the JSON report to this file")
    args = parser.parse_args()
    cfg = load_config(args.config)
    precision.resolve(cfg)
    policy = cached_policy(cfg)
    engine = make_engine("vllm", policy, cfg.rollout, cfg.model.dtype, seed=cfg.train.seed)  # before bm25s
    paths = data_paths(cfg)
    inner = make_search_fn(cfg, paths["corpus"], {})
    calls: list[int] = []

    def search_fn(queries):
        calls.append(len(queries))
        return inner(queries)

    tok = load_tokenizer(policy)
    questions = load_questions(paths["val"])[: args.questions]
    tree_cfg = replace(cfg.rollout, tree_m=args.m, tree_n=args.n, tree_l=args.l)
    leaves = args.m * (1 + args.n * args.l)
    rollout_batch(engine, tok, questions[:4], 2, search_fn, cfg.rollout, seed=999)  # warm-up
    report = {"config": args.config, "questions": len(questions), "tree": {"m": args.m, "n": args.n, "l": args.l},
              "leaves_per_question": leaves}  # fmt: skip
    runs = {"tree": lambda: rollout_trees(engine, tok, questions, search_fn, tree_cfg, seed=args.seed),
            "chain": lambda: rollout_batch(engine, tok, questions, leaves, search_fn, cfg.rollout, seed=args.seed)}
    seconds: dict[str, list[float]] = {"tree": [], "chain": []}
    for name in ["tree", "chain", "chain", "tree"]:  # twice each, the order turned: the counters are the
        report[f"{name}_run"] = measure(runs[name], engine, calls)  # same both times, the seconds not
        seconds[name].append(report[f"{name}_run"].pop("seconds"))
    report["seconds"] = seconds  # wall time, 2 reps (the first tree run also compiles new batch shapes)
    t, c = report["tree_run"]["per_leaf"], report["chain_run"]["per_leaf"]
    report["tree_over_chain"] = {k: round(t[k] / c[k], 3) for k in ("prefill", "decode", "tool_calls") if c[k]}
    report["machine"] = precision.machine()
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
