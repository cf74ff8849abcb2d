"""An index directory's meta.json: what it says, checked where it is read (load_index).

    {"method": "hybrid", "corpus": "/data/wiki-18.jsonl", "n_docs": 21015324, "corpus_bytes": ...,
     "corpus_digest": {...}, "id_checks": [[0, "1"], ...], "bm25": {...},
     "dense": {"model": ..., "family": "e5", "index_factory": "Flat", "metric": "inner product"},
     "files": {"spans.npy": {...}, "faiss.index": {...}, ...}, "complete": true}

"files" holds the digest (integrity.py) of each file a loaded index reads from (served_files), as
the build or import wrote it; a meta.json whose fields are not of the type and range the loaders
read is one line naming the key (check_meta), not a KeyError inside a loader.
"""

from __future__ import annotations

from pathlib import Path

from search.dense import ENCODER_FAMILIES
from search.files import corrupt

METHODS = ("bm25", "dense", "hybrid")
BM25_FILES = ("params.index.json", "vocab.index.json", "data.csc.index.npy", "indices.csc.index.npy",
              "indptr.csc.index.npy")  # fmt: skip  # what bm25s.BM25.save writes (lucene BM25)


def served_files(meta: dict) -> list[str]:
    """The files of an index directory a loaded index reads from (meta.json's "files" digests)."""
    names = ["spans.npy"]
    if meta["method"] in ("bm25", "hybrid"):
        names += [f"bm25/{name}" for name in BM25_FILES]
    if meta["method"] in ("dense", "hybrid"):
        names.append("faiss.index")
    return names


DIGEST_KEYS = ("bytes", "mtime_ns", "ctime_ns", "inode", "device", "block_bytes", "blocks")


def check_meta(meta: dict, path: Path) -> None:
    """meta.json's fields, each of the type and range load_index reads it as: a hand-edited or
    foreign meta.json is one line naming the key (files.corrupt), not a KeyError in a loader."""

    def need(ok: bool, key: str, want: str, value) -> None:
        if not ok:
            raise corrupt(path, f"{key!r} must be {want}, got {value!r}"[:200])

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    def digest(key: str, d) -> None:
        need(isinstance(d, dict) and all(count(d.get(k)) for k in DIGEST_KEYS)
             and isinstance(d.get("sampled_blake2b"), str) and isinstance(d.get("blake2b", ""), str),
             key, f"a digest ({', '.join(DIGEST_KEYS)}, sampled_blake2b)", d)  # fmt: skip

    need(meta.get("method") in METHODS, "method", f"one of {METHODS}", meta.get("method"))
    n = meta.get("n_docs")
    need(count(n) and n > 0, "n_docs", "a positive integer", n)
    need(isinstance(meta.get("corpus"), str) and meta["corpus"] != "", "corpus", "a path", meta.get("corpus"))
    need(count(meta.get("corpus_bytes")), "corpus_bytes", "a byte count", meta.get("corpus_bytes"))
    checks = meta.get("id_checks")
    need(isinstance(checks, list) and all(isinstance(c, list) and len(c) == 2 and count(c[0]) and c[0] < n
                                          and isinstance(c[1], str) for c in checks),
         "id_checks", "a list of [row below n_docs, id]", checks)  # fmt: skip
    if "corpus_digest" in meta:
        digest("corpus_digest", meta["corpus_digest"])
    files = meta.get("files", {})
    need(isinstance(files, dict), "files", "an object of digests", files)
    for name, d in files.items():
        digest(f"files.{name}", d)
    if meta["method"] != "bm25":
        dense = meta.get("dense")
        need(isinstance(dense, dict) and isinstance(dense.get("model"), str), "dense.model", "a path",
             dense.get("model") if isinstance(dense, dict) else dense)  # fmt: skip
        need(dense.get("family") in ENCODER_FAMILIES, "dense.family", f"one of {list(ENCODER_FAMILIES)}",
             dense.get("family"))  # fmt: skip
