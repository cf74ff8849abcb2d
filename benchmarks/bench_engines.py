"""Rollout throughput: vLLM engine vs transformers engine on the same tiny-world batch.

    python benchmarks/bench_engines.py --config configs/tiny.yaml [--questions 32 --group 4 --reps 3]

Both engines load the same policy (the cached SFT warm start), roll out the same questions
with the same retriever, alternating engine order over `--reps` repetitions; the report is
the median policy tokens per second of each and their ratio (docs/design.md §8).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import load_config  # noqa: E402
from trainer.precision import resolve as resolve_precision  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml", help="config whose world/policy to use")
    parser.add_argument("--questions", type=int, default=32, help="questions per batch")
    parser.add_argument("--group", type=int, default=4, help="rollouts per question")
    parser.add_argument("--reps", type=int, default=3, help="alternating repetitions per engine")
    args = parser.parse_args()
    cfg = load_config(args.config)
    resolve_precision(cfg)  # this machine's bf16 / dtype for the `auto` keys
    from data import data_paths
    from rollout import rollout_batch
    from search.tools import make_search_fn
    from tiny.world import world_dir
    from trainer.engine import load_tokenizer, make_engine
    from trainer.questions import load_questions

    policy = Path(cfg.model.path) if cfg.model.path else world_dir(cfg) / "policy"
    engines = {"vllm": make_engine("vllm", policy, cfg.rollout), "hf": make_engine("hf", policy, cfg.rollout)}
    paths = data_paths(cfg)
    search_fn = make_search_fn(cfg, paths["corpus"], {})
    tok = load_tokenizer(policy)
    questions = load_questions(paths["val"])[: args.questions]
    speeds: dict[str, list[float]] = {k: [] for k in engines}
    for rep in range(args.reps):
        for name in ["vllm", "hf"] if rep % 2 == 0 else ["hf", "vllm"]:
            t = time.time()
            recs = rollout_batch(engines[name], tok, questions, args.group, search_fn, cfg.rollout, seed=rep)
            dt = time.time() - t
            speeds[name].append(sum(sum(r["loss_mask"]) for r in recs) / dt)
    med = {k: statistics.median(v) for k, v in speeds.items()}
    print(json.dumps({"tokens_per_s": med, "all": speeds, "vllm_over_hf": med["vllm"] / med["hf"]}, indent=1))


if __name__ == "__main__":
    main()
