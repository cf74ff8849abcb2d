"""Evaluate a policy: greedy rollouts on a question split, EM and F1 per question type.

    python eval.py --config configs/tiny.yaml                       # the cached SFT policy, val
    python eval.py --config configs/tiny.yaml --model runs/tiny-X/checkpoints/step_30 --split test
    python eval.py curves runs/tiny-X                               # PNG curves of a run (plots.py)

Metrics (each computed from rollout records, DESIGN.md §2):
  em            exact match after SQuAD normalisation (rewards.exact_match)
  f1            word-level F1, best over the golden answers (rewards.f1_score)
  format_ok     share of rollouts that ended with an <answer> block
  searches      mean number of executed searches per question
reported overall and per `metadata.type` (the tiny world: 1hop, 2hop), e.g.
  {"n": 400, "em": 0.61, "em_1hop": 0.93, "em_2hop": 0.29, "searches_2hop": 1.4, ...}
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from config import Config, ConfigError, DataError, load_config
from rewards import score
from rollout import rollout_batch


def summarize(records: list[dict]) -> dict:
    """Mean EM / F1 / format / searches, overall and per question type."""
    if not records:
        raise ValueError("no rollouts to summarise (empty dataset?)")
    by_type: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_type[""].append(r)
        by_type[r.get("metadata", {}).get("type", "")].append(r)
    out: dict[str, float] = {"n": len(records)}
    for kind, rs in sorted(by_type.items()):
        suffix = f"_{kind}" if kind else ""
        n = len(rs)
        out[f"em{suffix}"] = sum(r["reward_components"]["em"] for r in rs) / n
        out[f"f1{suffix}"] = sum(r["reward_components"]["f1"] for r in rs) / n
        out[f"format_ok{suffix}"] = sum(r["reward_components"]["format_ok"] for r in rs) / n
        out[f"searches{suffix}"] = sum(r["num_searches"] for r in rs) / n
    return out


def evaluate(engine, tokenizer, questions: list[dict], search_fn, cfg: Config, records_out: list | None = None) -> dict:
    """Greedy (temperature 0) rollouts, one per question, scored with the EM reward."""
    records = rollout_batch(engine, tokenizer, questions, 1, search_fn, cfg.rollout, greedy=True)
    score(records, "em")
    if records_out is not None:
        records_out.extend(records)
    return summarize(records)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["curves"]:  # python eval.py curves RUN_DIR: training curves as PNGs (plots.py)
        from plots import main as curves_main

        return curves_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (the data and retriever to use)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--model", help="model directory or checkpoint (default: the config's starting policy)")
    parser.add_argument("--split", default="val", choices=["train", "val", "test"], help="question split")
    parser.add_argument("--out", help="write the scored rollouts to this jsonl file")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
    except (ConfigError, FileNotFoundError) as e:
        parser.error(str(e))
    from data import data_paths, load_questions, make_search_fn
    from engine import load_tokenizer, make_engine

    if args.model:
        model_dir = Path(args.model)
        if not model_dir.exists():
            parser.error(f"model directory not found: {model_dir}")
    else:
        from world import world_dir

        model_dir = Path(cfg.model.path) if cfg.model.path else world_dir(cfg) / "policy"
    try:
        paths = data_paths(cfg)
        questions = load_questions(paths[args.split])
    except (DataError, FileNotFoundError) as e:
        parser.error(str(e))
    if cfg.eval.max_questions:
        questions = questions[: cfg.eval.max_questions]
    engine = make_engine(cfg.rollout.engine, model_dir, cfg.rollout)  # before the retriever (bm25s)
    search_fn = make_search_fn(cfg, paths["corpus"], {})
    records: list[dict] = []
    metrics = evaluate(engine, load_tokenizer(model_dir), questions, search_fn, cfg, records)
    if args.out:
        with open(args.out, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    print(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
