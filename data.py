"""Where a run's inputs come from: the starting policy, the question files, the search tool.

    paths = data_paths(cfg)            # corpus / train / val / test: `data.*`, or the tiny world's cache
    questions = load_questions(paths["train"])      # FlashRAG jsonl, checked line by line
    search_fn = make_search_fn(cfg, paths["corpus"], timings)   # queries -> rendered hits
    policy_dir = ensure_policy(cfg, run_dir)        # model.path, or the tiny world's SFT policy

Used by train.py, eval.py and the benchmarks. Empty `data.*` and `model.path` mean the embedded
tiny world (DESIGN.md §5), built once into `cache/` by world.py.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from config import Config, DataError


def ensure_policy(cfg: Config, run_dir: Path) -> Path:
    """The starting policy: `model.path` if given, else the tiny world's cached SFT policy.

    The tiny world is built in a child process: its teacher uses bm25s (numba), which must not
    be imported in a process that will start vLLM afterwards (DESIGN.md §6).
    """
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path has no model: {path / 'config.json'} not found")
        return path
    from world import world_dir

    policy = world_dir(cfg) / "policy"
    if not (policy / "DONE").exists():
        print(f"building the tiny world and SFT warm start in {policy.parent} (cached) ...", flush=True)
        subprocess.run(
            [sys.executable, str(Path(__file__).with_name("world.py")), "--config", str(run_dir / "config.yaml")],
            check=True,
        )
    return policy


def data_paths(cfg: Config) -> dict[str, Path]:
    """corpus/train/val/test files: the `data` section, or the tiny world's cache when empty."""
    from world import world_dir

    paths = {}
    for kind in ("corpus", "train", "val", "test"):
        given = getattr(cfg.data, kind)
        paths[kind] = Path(given) if given else world_dir(cfg) / f"{kind}.jsonl"
    for kind in ("corpus", "train", "val"):
        if not paths[kind].is_file():
            raise FileNotFoundError(f"{kind} file not found: {paths[kind]}")
    return paths


def load_questions(path: Path) -> list[dict]:
    """FlashRAG jsonl; an empty question is an error that names the line."""
    from world import read_jsonl

    questions = read_jsonl(path)
    for n, q in enumerate(questions, 1):
        if not str(q.get("question", "")).strip():
            raise DataError(f"{path}:{n}: empty question (id {q.get('id')!r})")
        if not q.get("golden_answers"):
            raise DataError(f"{path}:{n}: no golden_answers (id {q.get('id')!r})")
    if not questions:
        raise DataError(f"{path}: no questions")
    return questions


def make_search_fn(cfg: Config, corpus_path: Path, timings: dict):
    """Batched search tool: list of queries -> rendered hits, in process or over HTTP
    (retriever.open_search). Imports bm25s: call after vLLM has started."""
    from retriever import format_hits, open_search

    search = open_search(cfg.retriever, corpus_path)

    def search_fn(queries: list[str]) -> list[str]:
        t = time.time()
        out = [format_hits(h) for h in search(queries, cfg.retriever.topk)]
        timings["retrieve"] = timings.get("retrieve", 0.0) + time.time() - t
        return out

    return search_fn
