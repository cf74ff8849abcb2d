"""Where a run's inputs come from: the starting policy, the question files, the search tool.

    paths = data_paths(cfg)            # corpus / train / val / test: `data.*`, or the tiny world's cache
    questions = load_questions(paths["train"])      # FlashRAG jsonl, checked line by line
    policy_dir = ensure_policy(cfg, run_dir)        # model.path, or the tiny world's SFT policy
    start = starting_policy(cfg)                    # the same directory, without building anything
    check_prompt_lengths(questions, tokenizer, cfg.rollout, paths["train"])  # prompts fit max_model_len

Used by train.py, eval.py and the benchmarks. Empty `data.*` and `model.path` mean the embedded
tiny world (docs/design.md §5), built once into `cache/` by `python -m tiny.sft`. This is the one
module of the trainer that reaches into `tiny/`; the search tools are search/tools.py. A bad
question file is a DataError naming path:line, before any model loads (the prompt lengths: once
the tokenizer is loaded, still before any engine starts).
"""

from __future__ import annotations

import codecs
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from agent import protocols
from rollout import prompt_ids
from tiny.warm_start import warm_start_dir
from tiny.world import ensure_world_data, world_data_dir, world_dir
from trainer.config import Config, DataError, RolloutConfig, json_type

ROOT = Path(__file__).resolve().parents[1]  # the repository, so `python -m tiny.sft` runs from any directory


def run_module(module: str, *args: str, what: str, log: Path) -> None:
    """`python -m module args` in a child process, in this directory, the repository importable.

    Its stdout and progress bars show as they come; its stderr is also kept in `log`. A child that
    fails is one DataError line: `what` failed, the child's own last error line, and the log. Its
    traceback stays in the log, off the screen: stderr is shown up to the traceback's first line.
    """
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    log.parent.mkdir(parents=True, exist_ok=True)
    decode = codecs.getincrementaldecoder("utf-8")("replace").decode
    held, showing, last = "", True, "\n"  # held: an end that may begin a traceback; last: last character shown
    with open(log, "wb") as kept:
        child = subprocess.Popen([sys.executable, "-m", module, *args], stderr=subprocess.PIPE,
                                 env=os.environ | {"PYTHONPATH": path})  # fmt: skip
        try:
            for chunk in iter(lambda: child.stderr.read1(1 << 16), b""):
                kept.write(chunk)
                kept.flush()
                if not showing:
                    continue
                text = held + decode(chunk)
                cut = text.find(TRACEBACK)
                showing = cut < 0
                if cut < 0:  # hold back the longest end that TRACEBACK starts with, until the next chunk
                    cut = len(text) - next((k for k in range(len(TRACEBACK) - 1, 0, -1)
                                            if text.endswith(TRACEBACK[:k])), 0)  # fmt: skip
                shown, held = text[:cut], text[cut:] if showing else ""
                sys.stderr.write(shown)
                sys.stderr.flush()
                last = shown[-1:] or last
            code = child.wait()
        except BaseException:  # Ctrl-C (the child got it too) or a failed write: no child left behind
            child.kill()
            child.wait()
            raise
    sys.stderr.write(held + ("\n" if (held[-1:] or last) != "\n" else ""))  # a bar cut short: end its line
    if code:
        lines = log.read_bytes().decode("utf-8", "replace").replace("\r", "\n").splitlines()
        last_error = next((x.strip() for x in reversed(lines) if x.strip()), "")
        status = f"exit status {code}" if code > 0 else f"killed by signal {-code}"
        raise DataError(f"{what} failed ({status}){': ' + last_error if last_error else ''}; full log: {log}")


TRACEBACK = "Traceback (most recent call last):"  # where a child's stderr stops being shown (run_module)


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
    be imported in a process that will start vLLM afterwards (docs/design.md §6).
    """
    policy = starting_policy(cfg)
    if cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        raise FileNotFoundError(f"model.path has no model: {Path(cfg.model.path) / 'config.json'} not found")
    if (cfg.model.path and not cfg.sft.warm_start) or (policy / "DONE").exists():
        return policy
    if cfg.model.path:
        print(f"warm start: fine-tuning {cfg.model.path} on the tiny world's teacher into {policy.parent} "
              "(cached) ...", flush=True)  # fmt: skip
        run_module("tiny.warm_start", "--config", str(run_dir / "config.yaml"), what="the warm start of model.path",
                   log=policy.parent / "build.log")  # fmt: skip
    else:
        print(f"building the tiny world and SFT warm start in {policy.parent} (cached) ...", flush=True)
        run_module("tiny.sft", "--config", str(run_dir / "config.yaml"), what="building the tiny world's SFT start",
                   log=policy.parent / "build.log")  # fmt: skip
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
    """FlashRAG jsonl or Search-R1 parquet; a line that is not UTF-8 or not a JSON object, a
    question that is not a non-empty string, `golden_answers` missing or not a list, metadata that
    is not an object, an id missing or seen before within its benchmark is an error that names the
    line (the row for parquet). Null metadata loads as {}.

    Ids must be unique within a benchmark: they name the GRPO groups, and two questions under one
    id would be scored as one group (advantages across unrelated questions). FlashRAG numbers ids
    per split (`train_0`, `test_0`, ...), so Search-R1's merged parquets repeat them across
    sources by construction; a row with a `data_source` is therefore identified within it, its id
    written `<data_source>/<id>` ("nq/train_0", "hotpotqa/train_0")."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"question file not found: {path}")
    if path.suffix == ".parquet":
        numbered = list(enumerate(read_parquet_questions(path), 1))
    else:
        numbered = _read_jsonl_numbered(path)
    first_line: dict[str, int] = {}  # id -> the line it was first seen on
    numbers = 0  # golden answers written as JSON numbers, read as text
    for n, q in numbered:
        question = q.get("question")
        if not isinstance(question, str):  # 42 or null would crash the rollout after the engine started
            raise DataError(f"{path}:{n}: question must be a string, got {json_type(question)} (id {q.get('id')!r})")
        if not question.strip():
            raise DataError(f"{path}:{n}: empty question (id {q.get('id')!r})")
        if not q.get("golden_answers"):
            raise DataError(f"{path}:{n}: no golden_answers (id {q.get('id')!r})")
        if not isinstance(q["golden_answers"], list):  # a bare string would be scored letter by letter
            raise DataError(f"{path}:{n}: golden_answers must be a list, got {q['golden_answers']!r} "
                            f"(id {q.get('id')!r})")  # fmt: skip
        numbers += _golden_as_text(q, f"{path}:{n}")
        if q.get("metadata") is None:  # FlashRAG rows without metadata, or a null one
            q["metadata"] = {}
        elif not isinstance(q["metadata"], dict):
            raise DataError(f"{path}:{n}: metadata must be an object, got {json_type(q['metadata'])}")
        if q.get("id") is None:
            raise DataError(f"{path}:{n}: no id (the rollouts of a question are grouped by its id)")
        qid = str(q["id"])  # as rollout.py's group ids see it: 7 and "7" are one id
        if qid in first_line:
            raise DataError(f"{path}:{n}: duplicate id {qid!r} (first at line {first_line[qid]})")
        first_line[qid] = n
    if not numbered:
        raise DataError(f"{path}: no questions")
    if numbers:
        print(f"{path}: {numbers} golden answer(s) written as numbers, read as text (1990 -> \"1990\")", flush=True)
    return [q for _, q in numbered]


def _golden_as_text(q: dict, where: str) -> int:
    """Each golden answer as a non-empty string, in place; returns how many were numbers. The scorers
    compare text: a number would never match ("1990" vs 1990 scored EM 0 in 88e794b) and an empty
    answer never can, so anything else (null, "", a list, an object, a boolean) names its line."""
    converted = 0
    for i, g in enumerate(q["golden_answers"]):
        if isinstance(g, int | float) and not isinstance(g, bool) and math.isfinite(g):
            q["golden_answers"][i], converted = str(g), converted + 1
        elif not isinstance(g, str) or not g.strip():
            raise DataError(f"{where}: golden answer {i + 1} must be a non-empty string or a number, got "
                            f"{json_type(g)} (id {q.get('id')!r})")  # fmt: skip
    return converted


SPLITS = ("train", "dev", "test", "val", "validation")  # FlashRAG's file names: <dataset>/<split>.jsonl


def benchmark_name(path: Path) -> str:
    """The benchmark a question file holds, for tables and logs: FlashRAG's layout names it by its
    folder (`nq/test.jsonl` -> "nq", `hotpotqa/dev.jsonl` -> "hotpotqa"), any other file by its stem
    (`data/nq_test.jsonl` -> "nq_test"). A parquet's rows name theirs (`data_source`, benchmarks())."""
    path = Path(path)
    return path.parent.name if path.stem in SPLITS and path.parent.name else path.stem


def benchmarks(paths: list[Path], max_questions: int = 0) -> dict[str, list[dict]]:
    """name -> questions, one entry per benchmark in the files: a FlashRAG file is one (named by
    benchmark_name), a Search-R1 parquet one per `data_source` (its merged test.parquet: seven).
    Two inputs that would share a name are a DataError in one line; `max_questions` (> 0) keeps the
    first that many of each benchmark.

    >>> benchmarks([Path("flashrag/nq/test.jsonl"), Path("flashrag/hotpotqa/dev.jsonl")])  # doctest: +SKIP
    {"nq": [...], "hotpotqa": [...]}
    """
    out: dict[str, list[dict]] = {}
    source: dict[str, Path] = {}
    for path in paths:
        groups: dict[str, list[dict]] = {}
        for q in load_questions(path):
            name = str(q["metadata"].get("dataset") or "") if path.suffix == ".parquet" else ""
            groups.setdefault(name or benchmark_name(path), []).append(q)
        for name, qs in groups.items():
            if name in out:
                raise DataError(f"{path} and {source[name]} both hold a benchmark named {name!r}: "
                                "pass one of them, or rename a file or its folder")  # fmt: skip
            out[name], source[name] = qs[:max_questions] if max_questions else qs, path
    return out


def first_of_each_benchmark(questions: list[dict], n: int) -> list[dict]:
    """The first `n` questions of each benchmark (`metadata.dataset`; a file without one is one
    benchmark), in file order; n 0 keeps all. Validation on Search-R1's test.parquet with
    eval.max_questions 100 measures its seven benchmarks, not the first 100 rows (all NQ)."""
    if not n:
        return questions
    seen: dict[str, int] = {}
    kept = []
    for q in questions:
        name = str((q.get("metadata") or {}).get("dataset") or "")
        seen[name] = seen.get(name, 0) + 1
        if seen[name] <= n:
            kept.append(q)
    return kept


FIRST_TURN_ROOM = 8  # rollout.py ends a rollout with fewer tokens of room than this before it generates


def check_prompt_lengths(questions: list[dict], tokenizer, cfg: RolloutConfig, path: Path) -> None:
    """Every question's first prompt, built as rollout.py builds it (rollout.prompt_ids: template,
    chat template, protocol instructions), must leave the rollout room to generate: at most
    rollout.max_model_len - FIRST_TURN_ROOM tokens. A longer one is a DataError naming path:line
    (questions: load_questions(path), in its order); run it before any engine starts.

    Unchecked, such a question is never generated for (the rollout ends it at once, finish
    "length"), but its prompt still goes through every forward pass: a 1 MB question made a
    reference forward over a million tokens in one micro-batch. The bound is the rollout's own, not
    max_model_len - max_tokens_per_turn: a prompt with less room than a full turn still gets a
    shorter first turn, as later turns do.

    Cost: each question alone is tokenised in one batched call; the exact prompt only for a
    question within SLACK tokens of the bound (text tokenised whole differs from its parts
    tokenised apart only where they meet). 20,000 short questions take about a second; a 1 MB one,
    a few. No character count could stand in for this: how many characters a token covers depends
    on the tokenizer (its vocabulary and normalizer), so none bounds tokens for every tokenizer.
    """
    proto = protocols.get(cfg.protocol)
    limit = cfg.max_model_len - FIRST_TURN_ROOM
    most_bytes = limit * max_token_bytes(tokenizer) * NORMALIZED_SHRINK  # more cannot fit: refused untokenised
    # a UTF-8 character is at most 4 bytes: a question of fewer characters than most_bytes / 4 is never encoded
    huge = [i for i, q in enumerate(questions) if len(q["question"]) > most_bytes // 4
            and len(q["question"].encode("utf-8")) > most_bytes]  # fmt: skip
    if huge:
        i, more = huge[0], len(huge) - 1
        line = _question_lines(Path(path))[i]
        raise DataError(f"{path}:{line}: question {questions[i]['id']!r} has {len(questions[i]['question'].encode())} "
                        f"bytes, more than rollout.max_model_len {cfg.max_model_len} tokens can hold with this "
                        f"tokenizer (at most {most_bytes} bytes)"
                        + (f" ({more} more question{'s' * (more > 1)} in the file too)" if more else ""))  # fmt: skip
    around = len(prompt_ids(tokenizer, "", cfg, proto))  # the prompt's tokens besides the question's
    alone = tokenizer([str(q["question"]).strip() for q in questions], add_special_tokens=False)["input_ids"]
    near = [i for i, ids in enumerate(alone) if around + len(ids) > limit - SLACK]
    exact = {i: len(prompt_ids(tokenizer, str(questions[i]["question"]), cfg, proto)) for i in near}
    over = [(i, n) for i, n in exact.items() if n > limit]
    if over:
        (i, n), more = over[0], len(over) - 1
        line = _question_lines(Path(path))[i]
        raise DataError(f"{path}:{line}: question {questions[i]['id']!r} is {n} tokens as a prompt, over "
                        f"rollout.max_model_len {cfg.max_model_len} less the {FIRST_TURN_ROOM} a first turn needs"
                        + (f" ({more} more question{'s' * (more > 1)} in the file too)" if more else ""))  # fmt: skip


SLACK = 64  # tokens: where the exact prompt is built (check_prompt_lengths)
# How far a tokenizer's normalizer can shrink text before it is split: NFC composing 3 Hangul jamo
# (9 bytes) into one syllable (3 bytes) is the largest shrink of NFC / NFKC we know of; 4 leaves room.
NORMALIZED_SHRINK = 4


def max_token_bytes(tokenizer) -> int:
    """The most input bytes one token can stand for, bounded by its vocabulary: the longest token
    string in UTF-8. A byte-level BPE token (Qwen, GPT-2) writes each byte it covers as one
    character of 1-2 UTF-8 bytes; a SentencePiece piece writes its text ("▁" for a space, 3 bytes
    for 1) or a byte-fallback "<0xE3>" (6 for 1). So a question of more than
    limit x this x NORMALIZED_SHRINK bytes cannot fit in `limit` tokens, and is refused before
    tokenising it: tokenising a 50 MB line took 166-228 s and 13.3 GB (88e794b)."""
    return max(len(token.encode("utf-8")) for token in tokenizer.get_vocab())


def _question_lines(path: Path) -> list[int]:
    """The line (parquet: row) of each question load_questions(path) returns, in its order."""
    if path.suffix == ".parquet":
        return list(range(1, len(read_parquet_questions(path)) + 1))
    return [n for n, _ in _jsonl_lines(path)]


def _jsonl_lines(path: Path):
    """(line number, text) per non-blank line, numbered as editors and `sed -n` count (on "\n"
    alone); a line that is not UTF-8 is a DataError naming it and its column."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if n == 1 and raw.startswith(codecs.BOM_UTF8):  # a file saved "with BOM" (as the corpus reader allows)
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                column = len(raw[: e.start].decode("utf-8")) + 1
                raise DataError(f"{path}:{n}: not UTF-8 text (byte {raw[e.start]:#04x} at column {column}: "
                                f"{e.reason})") from None  # fmt: skip
            if line.strip():
                yield n, line


def _read_jsonl_numbered(path: Path) -> list[tuple[int, dict]]:
    """(line number in the file, object) per non-blank line; a bad line is a DataError naming it
    (world.read_jsonl would raise json's own error, which names neither the file nor, with blank
    lines skipped, the right line)."""
    out = []
    for n, line in _jsonl_lines(path):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{n}: not a JSON object (got {type(row).__name__})")
        out.append((n, row))
    return out


def read_parquet_questions(path: Path) -> list[dict]:
    """Search-R1's parquet (scripts/data_process/qa_search_{train,test}_merge.py) as FlashRAG-style dicts.

    Its rows keep the FlashRAG columns (id, question, golden_answers, metadata) beside verl's own
    (data_source, prompt, ability, reward_model.ground_truth.target, extra_info.{split,index}); the
    plain question is preferred (`prompt` holds it wrapped in Search-R1's instruction). A row with a
    data_source gets an id within it, `<data_source>/<id>` (load_questions says why):
      {"id": "train_0", "question": "who wrote ...", "golden_answers": ["x"], "data_source": "nq", ...}
    -> {"id": "nq/train_0", "question": "who wrote ...", "golden_answers": ["x"], "metadata": {"dataset": "nq"}}
    Null columns (a merged file's metadata fields that one source lacks) read as missing.
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
        question = row.get("question")
        if question is None:
            question = _prompt_text(row.get("prompt"))
        qid = row.get("id")
        if qid is None:
            qid = (row.get("extra_info") or {}).get("index", n)
        source = row.get("data_source")
        meta = row.get("metadata")
        if isinstance(meta, str):  # prepare_data.py writes metadata whose fields clash in type as JSON text
            try:
                meta = json.loads(meta)
            except json.JSONDecodeError:
                raise DataError(f"{path}:{n + 1}: metadata is text but not JSON") from None
        if source:
            meta = (meta if isinstance(meta, dict) else {}) | {"dataset": source}
            qid = f"{source}/{qid}"
        golden = golden if isinstance(golden, str) else list(golden)  # list("Paris"): letters; refused later
        out.append({"id": str(qid), "question": question, "golden_answers": golden, "metadata": meta})
    return out


def _prompt_text(prompt) -> str | None:
    """The text of verl's `prompt` column: chat messages (its last message's content) or plain text."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list | tuple) and prompt and isinstance(prompt[-1], dict):
        return prompt[-1].get("content")
    return None
