"""The corpus an index is built on: a wiki-18 style jsonl, read as byte spans, never loaded whole.

Corpus format (docs/design.md §3): one passage per line,
`{"id": str, "contents": "\\"Title\\"\\ntext", "url"?, "domain"?, "date"?}`.

    corpus = scan_corpus("cache/tiny-xxxx/corpus.jsonl")   # one pass: byte spans, ids checked
    get_passage(corpus, 17)        # {"id": "p17", "contents": "\\"Tavi Morek\\"\\nTavi Morek was ..."}
    title_and_text(get_passage(corpus, 17))              # ("Tavi Morek", "Tavi Morek was ...")

A build scans the file once into (start, end) byte offsets, 16 bytes a passage, and a passage is
read back with `os.pread` when a hit is returned. Row order is the index id; `check_corpus`
re-reads ~1000 sampled rows on load and refuses a corpus whose ids or size differ from the one
the index was built on; a same-size edit elsewhere is integrity.py's to catch (a digest of the
file). A malformed line is a DataError naming the file and line.
"""

from __future__ import annotations

import json
import os
import re
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from trainer.config import DataError

N_ID_CHECKS = 1000  # rows re-read on load: the ids are still on their rows (integrity.py: the bytes)
# a JSON escape of a UTF-16 surrogate (a pair is fine, a lone one is not), or its bytes in the raw line
MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


@dataclass
class Corpus:
    path: Path
    spans: np.ndarray  # (n, 2) int64 byte [start, end) of each passage's line
    fd: int = -1

    def __len__(self) -> int:
        return len(self.spans)


def parse_passage(line: bytes | str, where: str) -> dict:
    """One jsonl line -> passage dict; anything malformed is a DataError naming file:line."""
    try:
        doc = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{where}: not JSON ({e})") from None
    if not isinstance(doc, dict) or "id" not in doc or "contents" not in doc:
        raise DataError(f"{where}: a passage needs 'id' and 'contents'")
    # checked here, once, so a bad line is one error at build time, not a traceback mid-search
    if not isinstance(doc["contents"], str):
        raise DataError(f"{where}: 'contents' must be a string, got {_json_type(doc['contents'])}")
    if not isinstance(doc["id"], (str, int)) or isinstance(doc["id"], bool):
        raise DataError(f"{where}: 'id' must be a string or an integer, got {_json_type(doc['id'])}")
    for key in ("url", "domain", "date"):
        if doc.get(key) is not None and not isinstance(doc[key], str):
            raise DataError(f"{where}: {key!r} must be a string when present, got {_json_type(doc[key])}")
    if MAYBE_SURROGATE.search(line if isinstance(line, bytes) else line.encode("utf-8", "surrogatepass")):
        _refuse_lone_surrogates(doc, where)
    return doc


def _refuse_lone_surrogates(value, where: str, key: str = "") -> None:
    """A lone UTF-16 surrogate ("\\ud800") parses, but no reply holding it can be written as UTF-8:
    every search that hit the passage would be a 500 (the server) or a UnicodeEncodeError (the CLI).
    Refused at the build, naming the line and the key; the regex above keeps this walk off clean lines."""
    if isinstance(value, dict):
        for k, v in value.items():
            _refuse_lone_surrogates(k, where, key)
            _refuse_lone_surrogates(v, where, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _refuse_lone_surrogates(v, where, f"{key}[{i}]")
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise DataError(f"{where}: {key or 'a key'!r} holds a lone surrogate (\\u{ord(value[e.start]):04x} at "
                            f"character {e.start}), which no UTF-8 reply can carry") from None


def _json_type(value) -> str:
    """What a JSON value is, for an error message: null, a boolean, a list, an object, float 1.5."""
    names = {type(None): "null", bool: "a boolean", dict: "an object", list: "a list"}
    return names.get(type(value), f"{type(value).__name__} {value!r}")


def scan_corpus(path: str | Path, on_bytes: Callable[[bytes], None] | None = None) -> Corpus:
    """One streaming pass: validate every line and record its byte span (blank lines skipped).
    Duplicate ids are refused (DataError naming both lines). `on_bytes` sees every byte of the
    file in order (integrity.py hashes the whole corpus in this pass, not in a second read)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    # 8-byte arrays, not lists of Python ints: wiki-18 has 21M passages
    spans, id_hashes, linenos = array("q"), array("q"), array("q")
    pos = 0
    with open(path, "rb") as f:
        bar = tqdm(
            total=path.stat().st_size,
            unit="B",
            unit_scale=True,
            desc="scan corpus",
            mininterval=2,
            disable=path.stat().st_size < 50_000_000,
        )
        for lineno, line in enumerate(f, 1):
            if on_bytes is not None:
                on_bytes(line)
            if line.strip():
                doc = parse_passage(line, f"{path}:{lineno}")
                spans.extend((pos, pos + len(line)))
                id_hashes.append(hash(str(doc["id"])))
                linenos.append(lineno)
            pos += len(line)
            bar.update(len(line))
        bar.close()
    if not spans:
        raise DataError(f"corpus file is empty: {path}")
    corpus = Corpus(path, np.frombuffer(spans, dtype=np.int64).reshape(-1, 2))
    _refuse_duplicate_ids(corpus, np.frombuffer(id_hashes, dtype=np.int64), linenos)
    return corpus


def _refuse_duplicate_ids(corpus: Corpus, id_hashes: np.ndarray, linenos) -> None:
    """Ids name hits, READ's sources and the gold passages of the metrics: two passages with one
    id would make all of them pick one silently. Sorting 64-bit hashes (not a set of 21M
    strings) finds candidates; equal hashes are confirmed by reading both ids back."""
    order = np.argsort(id_hashes, kind="stable")
    for i in np.flatnonzero(id_hashes[order][1:] == id_hashes[order][:-1]):
        a, b = int(order[i]), int(order[i + 1])
        first, second = str(get_passage(corpus, a)["id"]), str(get_passage(corpus, b)["id"])
        if first == second:
            raise DataError(
                f"{corpus.path}: duplicate id {first!r} on lines {linenos[a]} and {linenos[b]}; "
                "passage ids must be unique"
            )


def _fd(corpus: Corpus) -> int:
    if corpus.fd < 0:
        corpus.fd = os.open(corpus.path, os.O_RDONLY)
    return corpus.fd


def get_passage(corpus: Corpus, row: int) -> dict:
    """Passage at index row `row` (thread-safe: pread has no file position)."""
    start, end = corpus.spans[row]
    return json.loads(os.pread(_fd(corpus), int(end - start), int(start)))


def iter_passages(corpus: Corpus, start: int = 0, end: int | None = None) -> Iterator[dict]:
    for row in range(start, len(corpus) if end is None else end):
        yield get_passage(corpus, row)


def title_and_text(doc: dict) -> tuple[str, str]:
    """wiki-18 contents: first line is the title in double quotes, the rest is the text."""
    head, _, body = doc["contents"].partition("\n")
    return head.strip().strip('"'), body.strip()


def id_checks(corpus: Corpus) -> list[list]:
    rows = np.unique(np.linspace(0, len(corpus) - 1, min(len(corpus), N_ID_CHECKS)).astype(int))
    return [[int(r), str(get_passage(corpus, int(r))["id"])] for r in rows]


def check_corpus(corpus: Corpus, meta: dict, index_dir: Path) -> None:
    """Refuse a corpus that is not the one the index was built on (ids are tied to rows)."""
    size = corpus.path.stat().st_size
    if size != meta["corpus_bytes"] or len(corpus) != meta["n_docs"]:
        raise DataError(
            f"corpus {corpus.path} ({len(corpus)} passages, {size} bytes) does not match index {index_dir} "
            f"(built on {meta['n_docs']} passages, {meta['corpus_bytes']} bytes); rebuild the index"
        )
    for row, want in meta["id_checks"]:
        try:
            got = str(get_passage(corpus, row)["id"])
        except (ValueError, KeyError, TypeError):  # the stored byte span no longer holds one passage
            got = "<not a passage at the indexed byte span>"
        if got != want:
            raise DataError(
                f"corpus {corpus.path} does not match index {index_dir}: row {row} holds id {got!r}, "
                f"the index was built with {want!r}; rebuild the index"
            )


def format_hits(hits: list[dict]) -> str:
    """Our rendering of search hits for the policy: one `Doc i(Title: t) text` line per hit.

    >>> format_hits([{"document": {"id": "p17", "contents": '"Tavi Morek"\\nTavi Morek was born in Velor.'}}])
    'Doc 1(Title: Tavi Morek) Tavi Morek was born in Velor.'
    """
    lines = []
    for i, hit in enumerate(hits, 1):
        title, text = title_and_text(hit["document"])
        lines.append(f"Doc {i}(Title: {title}) {text}")
    return "\n".join(lines) if lines else "No results."


def format_hits_search_r1(hits: list[dict]) -> str:
    """Search-R1's own rendering (rollout.search_r1_text), as its _passages2string
    (search_r1/llm_agent/generation.py, a14dc3a) gives it: the title is the first line of
    `contents` as it is (wiki-18's keeps its quotes: `Doc 1(Title: "Paris") ...`), the text the rest,
    each hit a line ending in "\\n"; no hits: "". The information block strips the whole
    (agent/protocols.py, show_search_r1_text); tests/test_search_r1_text.py compares the two."""
    lines = []
    for i, hit in enumerate(hits, 1):
        title, _, text = hit["document"]["contents"].partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(lines)
