"""An index directory's meta.json: what it says, checked where it is read (load_index).

    {"method": "hybrid", "corpus": "/data/wiki-18.jsonl", "n_docs": 21015324, "corpus_bytes": ...,
     "corpus_digest": {...}, "id_checks": [[0, "1"], ...], "bm25": {...},
     "dense": {"model": ..., "family": "e5", "index_factory": "Flat", "metric": "inner product"},
     "files": {"spans.npy": {...}, "faiss.index": {...}, ...}, "complete": true}

"files" holds the digest (integrity.py) of each file a loaded index reads from (served_files), as
the build or import wrote it; a meta.json whose fields are not of the type and range the loaders
read is one line naming the key (check_meta), not a KeyError inside a loader. check_index reads
the meta.json and the search parameters a run's config names, before anything slow starts.
"""

from __future__ import annotations

import math
from pathlib import Path

from search.dense import ENCODER_FAMILIES, check_encoder
from search.files import corrupt, read_json
from trainer.config import ConfigError, DataError, RetrieverConfig, shown

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


# faiss's search parameters (faiss.ParameterSpace, AutoTune.cpp; 1.15.1): name -> (the index kinds
# that take it, as a factory string or imported class name spells them, and its least value).
# faiss itself accepts nprobe=0, -1 or 1.5 without a word, and refuses a name the index lacks only
# when the index loads, after the engine started: so they are read here.
SEARCH_PARAMS = {
    "nprobe": (("IVF",), 1),  # inverted lists visited per query
    "max_codes": (("IVF",), 0),  # codes scanned per query; 0: no cap
    "efSearch": (("HNSW",), 1),  # HNSW's search queue (also an IVF's HNSW quantizer)
    "ht": (("PQ",), 0),  # polysemous Hamming threshold
    "k_factor_rf": (("RFlat", "Refine"), 1),  # refinement: k x this candidates re-ranked
    "k_factor": (("PQR",), 1),
}


def search_params(text: str, key: str = "retriever.search_params") -> dict[str, float]:
    """`nprobe=32,efSearch=64` -> {"nprobe": 32, "efSearch": 64}: each a name faiss knows (a
    `quantizer_` prefix: an IVF's quantizer) with a value at or above its least (an integer; the
    k_factors a finite number); anything else is a ConfigError naming `key`."""
    out = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, eq, raw = item.partition("=")
        base = name.strip().removeprefix("quantizer_")
        if not eq or base not in SEARCH_PARAMS:
            raise ConfigError(f"config key '{key}' takes name=value pairs with the names "
                              f"{', '.join(SEARCH_PARAMS)} (faiss's search parameters); got {shown(item)}")  # fmt: skip
        least, number = SEARCH_PARAMS[base][1], float if base.startswith("k_factor") else int
        try:
            value = number(raw.strip())
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < least:
            what = "an integer" if number is int else "a number"
            raise ConfigError(f"config key '{key}': {name.strip()} must be {what} >= {least}; got {shown(raw)}")
        out[name.strip()] = value
    return out


def check_index(rcfg: RetrieverConfig) -> None:
    """The in-process index a run will open, read before anything slow: `retriever.index` holds a
    complete index (its meta.json), and each of `retriever.search_params` is one its faiss index
    takes (SEARCH_PARAMS; the index's factory string or imported class, else the default
    index's retriever.method and retriever.index_factory). Unchecked, both failed after vLLM had
    started and taken its KV cache (a missing index 99 s in; a bad parameter as faiss's traceback).
    A server (`retriever.url`) searches with its own index and parameters: nothing to read here.
    Its encoder (check_encoder) too; what is left for load_index is reading the files themselves."""
    if rcfg.url:
        return
    method, factory = rcfg.method, rcfg.index_factory
    if rcfg.index:
        meta_path = Path(rcfg.index) / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"retriever.index {rcfg.index}: no index there (no {meta_path}); build it with "
                                    "`retriever.py build` or `retriever.py import`")  # fmt: skip
        meta = read_json(meta_path)  # as load_index reads it: a bad file is one line naming it
        if not meta.get("complete"):
            raise DataError(f"retriever.index {rcfg.index} is a partial build; run the same build command again")
        check_meta(meta, meta_path)
        method, factory = meta["method"], str((meta.get("dense") or {}).get("index_factory", ""))
        check_encoder(meta, rcfg.model, rcfg.encoder_family, Path(rcfg.index))  # embedded by another encoder
    params = search_params(rcfg.search_params)
    if params and method == "bm25":
        raise ConfigError(f"retriever.search_params {shown(rcfg.search_params)} sets faiss parameters, but the index "
                          "is bm25 (no faiss index to take them): leave it empty, or use a dense or hybrid one")
    wrapped = factory.endswith("(imported)") and any(w in factory for w in ("PreTransform", "IDMap", "Shards",
                                                                             "Replicas", "Refine"))  # fmt: skip
    for name in params if not wrapped else ():  # a wrapper's inner index is not named: faiss judges it
        needs = SEARCH_PARAMS[name.removeprefix("quantizer_")][0]
        if name.startswith("quantizer_"):
            needs = ("IVF",)
        if not any(kind in factory for kind in needs):
            raise ConfigError(f"retriever.search_params: {name} is for a faiss index of kind "
                              f"{' or '.join(needs)}; the index is {factory!r}"
                              f"{' (' + rcfg.index + ')' if rcfg.index else ' (retriever.index_factory)'}")  # fmt: skip
