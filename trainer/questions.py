"""Question files: FlashRAG jsonl and Search-R1's parquets, read and checked line by line.

    questions = load_questions(Path("nq/test.jsonl"))   # [{"id", "question", "golden_answers", "metadata"}]
    by_name = benchmarks([Path("nq/test.jsonl"), Path("hotpotqa/dev.jsonl")])   # {"nq": [...], "hotpotqa": [...]}
    benchmark_name(Path("data/nq/test.jsonl"))          # 'nq': FlashRAG's <dataset>/<split>.jsonl
    first_of_each_benchmark(questions, 100)             # validation's first 100 of each benchmark

A bad line is a DataError naming path:line (a parquet's row) before any model loads. Search-R1's
merged parquets repeat FlashRAG's per-split ids across sources, so a row with a `data_source` is
identified within it (`nq/train_0`). Used by data.py (a run's inputs), eval.py, prepare_data.py
and tiny/papers.py; imports nothing of the project but trainer/config.py.
"""

from __future__ import annotations

import codecs
import errno
import json
import math
import os
import stat
from pathlib import Path

from trainer.config import DataError, json_type


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
    if not os.path.lexists(path):
        raise FileNotFoundError(f"question file not found: {path}")
    if why := unreadable(path):
        raise DataError(f"{path}: cannot read it as a question file: {why}")
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
        if not isinstance(q["id"], str | int) or isinstance(q["id"], bool):  # 1.0, true, [1]: not an id
            raise DataError(f"{path}:{n}: id must be text or an integer, got {json_type(q['id'])}")
        qid = str(q["id"])  # as rollout.py's group ids see it: 7 and "7" are one id
        if qid in first_line:
            raise DataError(f"{path}:{n}: duplicate id {qid!r} (first at line {first_line[qid]})")
        first_line[qid] = n
    if not numbered:
        raise DataError(f"{path}: no questions")
    if numbers:
        print(f"{path}: {numbers} golden answer(s) written as numbers, read as text (1990 -> \"1990\")", flush=True)
    return [q for _, q in numbered]


def unreadable(path: Path) -> str | None:
    """Why `path`, which exists as something (os.path.lexists), cannot be read as a data file: a
    directory, a broken symlink, a symlink loop, a device or fifo, no permission; None when it can.
    A caller that skipped such a path as missing would read another file without a word
    (prepare_data.py took nq/train.jsonl for a broken nq/test.jsonl link: issue 55's probe of fcae7e2)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop"
        if os.path.islink(path):
            return f"a symlink to {os.readlink(path)}, which is not there"
        return e.strerror or str(e)
    if stat.S_ISDIR(mode):
        return "a directory, not a file"
    if not stat.S_ISREG(mode):
        return "not a regular file (a device, fifo or socket)"
    try:
        open(path, "rb").close()
    except OSError as e:
        return e.strerror or str(e)
    return None


def _golden_as_text(q: dict, where: str) -> int:
    """Each golden answer as a non-empty string, in place; returns how many were numbers. The scorers
    compare text: a number would never match ("1990" vs 1990 scored EM 0 in 88e794b) and an empty
    answer never can, so anything else (null, "", a list, an object, a boolean) names its line."""
    converted = 0
    for i, g in enumerate(q["golden_answers"]):
        # an int is never non-finite, and math.isfinite(10**400) raises: only a float is asked
        if (isinstance(g, int) and not isinstance(g, bool)) or (isinstance(g, float) and math.isfinite(g)):
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



def question_lines(path: Path) -> list[int]:
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
            row = json.loads(line, object_pairs_hook=_no_repeated_keys)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
        except ValueError as e:  # an integer of over 4,300 digits (Python's int_max_str_digits), a key twice
            why = f"a number too long to read ({str(e).split(':')[0]})" if "digits" in str(e) else str(e)
            raise DataError(f"{path}:{n}: {why}") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{n}: not a JSON object (got {type(row).__name__})")
        if ("\\ud" in line or "\\uD" in line) and (where := _lone_surrogate(row)):  # only an escape makes one
            raise DataError(f"{path}:{n}: {where}: a lone UTF-16 surrogate is not text (no tokenizer, "
                            "parquet or UTF-8 writer takes it)")  # fmt: skip
        out.append((n, row))
    return out


def _no_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    """json.loads's object hook: a key given twice in one object is a ValueError (json keeps the last
    without a word, so `{"question": "a", ..., "question": "b"}` trained on "b" unseen)."""
    row = dict(pairs)
    if len(row) < len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {twice!r} given twice in one object"[:300])
    return row


def _lone_surrogate(value, field: str = "") -> str | None:
    """Where in a parsed JSON value a lone surrogate sits ("\\ud800" escaped alone: json.loads keeps
    it, and the tokenizer raises a TypeError after the file passed): `question character 3`,
    `metadata.title character 1`; None when there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"{field or 'a value'} character {e.start + 1}"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, sub in items:
        name = f"{field}[{key}]" if isinstance(key, int) else f"{field}.{key}" if field else str(key)
        if isinstance(key, str) and (where := _lone_surrogate(key, f"the key of {name}")):
            return where
        if where := _lone_surrogate(sub, name):
            return where
    return None


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
    for n, row in enumerate(rows, 1):
        where = f"{path}:{n}"
        reward_model = _field(row, "reward_model", dict, where)
        truth = _field(reward_model or {}, "ground_truth", dict, where, "reward_model.ground_truth") or {}
        golden = row.get("golden_answers")
        if golden is None or (isinstance(golden, list) and not golden):  # verl's target is the same list
            golden = truth.get("target")
        question = row.get("question")
        if question is None:
            question = _prompt_text(row.get("prompt"))
        qid = row.get("id")
        if qid is None:
            qid = (_field(row, "extra_info", dict, where) or {}).get("index", n - 1)
        if not isinstance(qid, str | int) or isinstance(qid, bool):
            raise DataError(f"{where}: id must be text or an integer, got {json_type(qid)}")
        source = _field(row, "data_source", str, where)
        meta = row.get("metadata")
        if isinstance(meta, str):  # prepare_data.py writes metadata whose fields clash in type as JSON text
            try:
                meta = json.loads(meta)
            except json.JSONDecodeError:
                raise DataError(f"{where}: metadata is text but not JSON") from None
        if meta is not None and not isinstance(meta, dict):
            raise DataError(f"{where}: metadata must be an object, got {json_type(meta)}")
        if source:
            meta = (meta or {}) | {"dataset": source}
            qid = f"{source}/{qid}"
        golden = list(golden) if isinstance(golden, tuple) else golden  # a str or a number: refused by load_questions
        out.append({"id": str(qid), "question": question, "golden_answers": golden, "metadata": meta})
    return out


def _field(row: dict, key: str, kind: type, where: str, name: str = ""):
    """row[key] if it is a `kind` (or missing / null: None); else a DataError naming the row and the
    field. A string where verl writes a struct (`reward_model`, `extra_info`) was an AttributeError."""
    value = row.get(key)
    if value is not None and not isinstance(value, kind):
        want = {dict: "an object", str: "text", list: "a list"}[kind]
        raise DataError(f"{where}: {name or key} must be {want}, got {json_type(value)}")
    return value


def _prompt_text(prompt) -> str | None:
    """The text of verl's `prompt` column: chat messages (its last message's content) or plain text."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list | tuple) and prompt and isinstance(prompt[-1], dict):
        return prompt[-1].get("content")
    return None


def load_confidence_contexts(path: Path) -> list[dict]:
    """eval.py --confidence-contexts: one context per line, {"category": "answerable", "segments":
    [[text, role], ...]} with roles prompt / policy / obs and the last segment ending where the
    confidence is written ("...</think><confidence>"); tiny/sft.confidence_contexts writes them.
    A line that breaks this is a DataError naming the file and the line."""
    return _load_contexts(Path(path), "<confidence>", "where the digit is written")


def load_think_contexts(path: Path) -> list[dict]:
    """eval.py --think-contexts: as load_confidence_contexts, the last segment ending in "<think>"
    (where the answer's think begins) and "unfaithful": the think whose probability is read there
    (" I know the answer.</think>"); tiny/sft.think_contexts writes them."""
    def unfaithful_text(row: dict) -> str:
        ok = isinstance(row.get("unfaithful"), str) and row["unfaithful"].strip()
        return "" if ok else 'a think context needs "unfaithful" (the think text to read)'

    return _load_contexts(Path(path), "<think>", "where the think begins", unfaithful_text)


def _load_contexts(path: Path, ends: str, where: str, problem=lambda row: "") -> list[dict]:
    out = []
    for n, row in _read_jsonl_numbered(path):
        segments = row.get("segments")
        ok = isinstance(row.get("category"), str) and isinstance(segments, list) and segments and all(
            isinstance(s, list) and len(s) == 2 and isinstance(s[0], str) and s[1] in ("prompt", "policy", "obs")
            for s in segments)  # fmt: skip
        if not ok:
            raise DataError(f'{path}:{n}: a context needs "category" (text) and "segments" ([text, role] pairs, '
                            "role prompt, policy or obs)")  # fmt: skip
        if not segments[-1][0].endswith(ends):
            raise DataError(f"{path}:{n}: the last segment must end in {ends} ({where})")
        if why := problem(row):
            raise DataError(f"{path}:{n}: {why}")
        out.append(row)
    if not out:
        raise DataError(f"{path}: no contexts")
    return out
