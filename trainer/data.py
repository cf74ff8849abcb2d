"""Where a run's inputs come from: the starting policy, the question files, the search tool.

    paths = data_paths(cfg)            # corpus / train / val / test: `data.*`, or the tiny world's cache
    questions = load_questions(paths["train"])      # FlashRAG jsonl, checked line by line
    policy_dir = ensure_policy(cfg, run_dir)        # model.path, or the tiny world's SFT policy
    start = starting_policy(cfg)                    # the same directory, without building anything

Used by train.py, eval.py and the benchmarks. Empty `data.*` and `model.path` mean the embedded
tiny world (DESIGN.md §5), built once into `cache/` by `python -m tiny.sft`. This is the one
module of the trainer that reaches into `tiny/`; the search tools are search/tools.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tiny.warm_start import warm_start_dir
from tiny.world import ensure_world_data, world_data_dir, world_dir
from trainer.config import Config, DataError

ROOT = Path(__file__).resolve().parents[1]  # the repository, so `python -m tiny.sft` runs from any directory


def run_module(module: str, *args: str) -> None:
    """`python -m module args` in a child process, in this directory, the repository importable."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    subprocess.run([sys.executable, "-m", module, *args], check=True, env=os.environ | {"PYTHONPATH": path})


def starting_policy(cfg: Config) -> Path:
    """Where the run starts from: `model.path` (or its cached warm start), else the tiny world's
    SFT policy. Builds nothing (ensure_policy does)."""
    if cfg.model.path:
        return warm_start_dir(cfg) / "policy" if cfg.sft.warm_start else Path(cfg.model.path)
    return world_dir(cfg) / "policy"


def ensure_policy(cfg: Config, run_dir: Path) -> Path:
    """The starting policy: `model.path` if given (after its warm start with `sft.warm_start`),
    else the tiny world's cached SFT policy.

    Both warm starts are built in a child process: the teacher uses bm25s (numba), which must not
    be imported in a process that will start vLLM afterwards (DESIGN.md §6).
    """
    policy = starting_policy(cfg)
    if cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        raise FileNotFoundError(f"model.path has no model: {Path(cfg.model.path) / 'config.json'} not found")
    if (cfg.model.path and not cfg.sft.warm_start) or (policy / "DONE").exists():
        return policy
    if cfg.model.path:
        print(f"warm start: fine-tuning {cfg.model.path} on the tiny world's teacher into {policy.parent} "
              "(cached) ...", flush=True)  # fmt: skip
        run_module("tiny.warm_start", "--config", str(run_dir / "config.yaml"))
    else:
        print(f"building the tiny world and SFT warm start in {policy.parent} (cached) ...", flush=True)
        run_module("tiny.sft", "--config", str(run_dir / "config.yaml"))
    return policy


def data_paths(cfg: Config) -> dict[str, Path]:
    """corpus/train/val/test files: the `data` section, or, where it is empty, the tiny world's.
    With the tiny policy they sit in its cache (world.world_dir); with a `model.path` of yours,
    in a cache keyed on the world alone (world.world_data_dir, written here on first use), so any
    model trains and evaluates on the tiny world with no `data.*` set."""
    tiny = world_dir(cfg)
    if cfg.model.path and not all(getattr(cfg.data, kind) for kind in ("corpus", "train", "val", "test")):
        tiny = ensure_world_data(cfg, world_data_dir(cfg))
    paths = {}
    for kind in ("corpus", "train", "val", "test"):
        given = getattr(cfg.data, kind)
        paths[kind] = Path(given) if given else tiny / f"{kind}.jsonl"
    for kind in ("corpus", "train", "val"):
        if not paths[kind].is_file():
            raise FileNotFoundError(f"{kind} file not found: {paths[kind]}")
    return paths


def load_questions(path: Path) -> list[dict]:
    """FlashRAG jsonl or Search-R1 parquet; a line that is not a JSON object, an empty question, or
    `golden_answers` missing or not a list is an error that names the line (the row for parquet)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"question file not found: {path}")
    if path.suffix == ".parquet":
        numbered = list(enumerate(read_parquet_questions(path), 1))
    else:
        numbered = _read_jsonl_numbered(path)
    for n, q in numbered:
        if not str(q.get("question", "")).strip():
            raise DataError(f"{path}:{n}: empty question (id {q.get('id')!r})")
        if not q.get("golden_answers"):
            raise DataError(f"{path}:{n}: no golden_answers (id {q.get('id')!r})")
        if not isinstance(q["golden_answers"], list):  # a bare string would be scored letter by letter
            raise DataError(f"{path}:{n}: golden_answers must be a list, got {q['golden_answers']!r} "
                            f"(id {q.get('id')!r})")  # fmt: skip
    if not numbered:
        raise DataError(f"{path}: no questions")
    return [q for _, q in numbered]


def _read_jsonl_numbered(path: Path) -> list[tuple[int, dict]]:
    """(line number in the file, object) per non-blank line; a bad line is a DataError naming it
    (world.read_jsonl would raise json's own error, which names neither the file nor, with blank
    lines skipped, the right line)."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{n}: not a JSON object (got {type(row).__name__})")
                out.append((n, row))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason})") from None
    return out


def read_parquet_questions(path: Path) -> list[dict]:
    """Search-R1's parquet (scripts/data_process/nq_search.py) as FlashRAG-style dicts.

    Its rows keep the FlashRAG columns (id, question, golden_answers) beside verl's own
    (data_source, prompt, reward_model.ground_truth.target, extra_info.index); the plain
    question is preferred: `prompt` holds it wrapped in Search-R1's instruction.
      {"id": "test_0", "question": "who wrote ...", "golden_answers": ["x"], "data_source": "nq"}
    -> {"id": "test_0", "question": "who wrote ...", "golden_answers": ["x"], "metadata": {"dataset": "nq"}}
    """
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: cannot read it as parquet ({str(e).splitlines()[0] if str(e) else e!r})") from None
    out = []
    for n, row in enumerate(rows):
        truth = (row.get("reward_model") or {}).get("ground_truth") or {}
        golden = row.get("golden_answers") or truth.get("target") or []
        question = row.get("question") or ((row.get("prompt") or [{}])[-1].get("content", ""))
        qid = row.get("id") or (row.get("extra_info") or {}).get("index", n)
        meta = dict(row.get("metadata") or {}) | ({"dataset": row["data_source"]} if row.get("data_source") else {})
        golden = golden if isinstance(golden, str) else list(golden)  # list("Paris"): letters; refused later
        out.append({"id": str(qid), "question": question, "golden_answers": golden, "metadata": meta})
    return out
