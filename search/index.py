"""A local search engine over a wiki-18 style corpus: BM25, dense (E5 / MiniLM + faiss), hybrid.

The corpus (docs/design.md §3's wiki-18 jsonl) is read through corpus.py: byte spans, never a list.
An index is a directory built once and reloaded with mmap (`python retriever.py build ...`,
the command line over this module).

In Python:

    index = load_index("idx/bm25")
    hits = search(index, ["Tavi Morek born", "Velor country"], k=3)   # one batched call
    format_hits(hits[0])   # corpus.py: what the policy reads
    # 'Doc 1(Title: Tavi Morek) Tavi Morek was born in the city of Velor.\\nDoc 2(Title: ...'

Design choices, each against a pitfall in docs/design.md §7:
  * The corpus is never loaded as a list (corpus.py); `load_index` refuses a corpus whose ids,
    size or digest (integrity.py) differ from the one the index was built on, and every search
    first checks (a stat) that the file has not changed since; the index's own files likewise
    (meta.json's "files" digests: a file rewritten in place or cut short is refused, not served).
  * Every file of an index is written whole (files.py: a temporary name, fsync, rename) and read
    back before meta.json says "complete"; a resumed build checks what an earlier one left (a
    0-byte or corrupt file is built again, never taken for done); a corrupt file at load is one
    line naming it.
  * BM25 (bm25s) uses one tokenizer for documents and queries: lower-case words, English
    stopwords, the Snowball English stemmer (PyStemmer).
  * Dense (dense.py): the encoder's family is said, never guessed; embeddings stream to a
    resumable memmap; a bare faiss index built elsewhere (Search-R1's e5_Flat.index) is
    imported, not re-embedded (`import_index`).
  * Hybrid is reciprocal-rank fusion (Cormack et al. 2009, k=60) of BM25 and dense.
  * faiss indexes are opened mmap'd (IO_FLAG_MMAP_IFC): the page cache holds one copy per host.
  * The default index next to a corpus is built under a file lock: ranks launched together
    build it once (ensure_index).

Import order matters on vLLM CPU: bm25s imports numba, and a vLLM engine constructed after
that fails to start (docs/design.md §6). bm25s, faiss and the encoder are imported only inside the
functions that need them, and `engine.make_engine` refuses to start once numba is loaded.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from search.corpus import Corpus, check_corpus, get_passage, id_checks, iter_passages
from search.dense import ENCODER_FAMILIES as ENCODER_FAMILIES  # re-exported: retriever.py, the tests
from search.dense import (
    Encoder,
    build_dense,
    check_encoder,
    check_factory,
    encode,
    encoder_width,
    load_encoder,
    load_faiss,
    resolve_encoder,
    set_search_params,
    to_gpus,
    use_all_cores,
)
from search.dense import default_encoder_path as default_encoder_path
from search.dense import import_index as import_index
from search.files import corrupt, load_npy, read_json, save_npy, write_json
from search.integrity import CorpusGuard, IndexFileGuard, IndexGuard, index_file_digests, scan_with_digest
from search.meta import BM25_FILES, METHODS, check_meta, served_files
from trainer.config import ConfigError, DataError
from trainer.fsync import fsync_path, fsync_tree

BM25_BACKENDS = ("scipy", "numpy", "numba")
RRF_K = 60  # reciprocal-rank fusion constant (Cormack, Clarke & Buettcher 2009)


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


def import_bm25s():
    """bm25s, imported with JAX kept on the CPU. bm25s runs a JAX op when it is imported if JAX is
    installed, and JAX on a GPU machine then takes 75% of the GPU's memory for itself (its
    default preallocation), beside vLLM and the trainer: seen on an H200 (110 of 140 GiB in use
    by a run whose tensors peaked at 4 GiB). A JAX the user set up (JAX_PLATFORMS) is left alone."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bm25s

    return bm25s


def build_bm25(corpus: Corpus, out: Path, chunk: int = 10_000) -> None:
    """Index the corpus with bm25s into out/bm25; token ids are kept as compact int32 arrays while
    building. bm25s writes its files one after another, so they are saved into a temporary
    directory, flushed, read back (load_bm25) and only then renamed to out/bm25: a full disk once
    left params.index.json at 0 bytes, which a resumed build took for done."""
    bm25s = import_bm25s()

    vocab: dict[str, int] = {}
    ids: list[np.ndarray] = []
    for start in tqdm(range(0, len(corpus), chunk), desc="bm25 tokenize", mininterval=2, disable=len(corpus) < 50_000):
        docs = [d["contents"] for d in iter_passages(corpus, start, min(start + chunk, len(corpus)))]
        for toks in bm25_tokenize(docs):
            ids.append(np.array([vocab.setdefault(t, len(vocab)) for t in toks], dtype=np.int32))
    model = bm25s.BM25()
    model.index((ids, vocab), show_progress=len(corpus) > 100_000)
    tmp, final = out / ".building-bm25", out / "bm25"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a build that died while saving
    try:
        model.save(str(tmp), show_progress=False)
        fsync_tree(tmp)
        load_bm25(tmp, len(corpus))
    except OSError as e:  # numpy's and json's write errors name no file
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its space back
        raise OSError(e.errno, f"{e.strerror or e}: writing the BM25 index into {tmp}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)  # an earlier one that did not read back (bm25_done)
    os.rename(tmp, final)
    fsync_path(out)


def load_bm25(directory: Path, n_docs: int, backend: str = "numpy"):
    """bm25s's index in `directory`, mmap'd, checked to score n_docs documents. bm25s's own errors
    name no file ("mmap length is greater than file size"): on any, each file is read on its own
    and the first that fails is named (files.corrupt)."""
    bm25s = import_bm25s()
    try:
        model = bm25s.BM25.load(str(directory), mmap=True, show_progress=False, verbosity=0, backend=backend)
    except Exception as e:  # noqa: BLE001 - whatever bm25s raised, a file is corrupt: found below
        for name in BM25_FILES:
            path = directory / name
            if path.suffix == ".json":
                read_json(path)
            else:
                load_npy(path, shape=(None,))
        raise corrupt(directory, e) from None
    sc = model.scores
    if sc["num_docs"] != n_docs:
        raise corrupt(directory / "params.index.json", f"num_docs {sc['num_docs']}, expected {n_docs}")
    if not len(sc["data"]) == len(sc["indices"]) == int(sc["indptr"][-1]):
        raise corrupt(directory, f"{len(sc['data'])} scores, {len(sc['indices'])} indices and indptr[-1] = "
                      f"{int(sc['indptr'][-1])} should be equal")  # fmt: skip
    return model


def bm25_done(directory: Path, n_docs: int, digests: dict | None = None) -> bool:
    """Did an earlier run of this build leave a BM25 index that reads back, and (`digests`: a finished
    index's meta.json "files") is each of its files the one that build wrote? (Not merely a file.)"""
    if not directory.exists():
        return False
    try:
        load_bm25(directory, n_docs)
    except DataError as e:
        print(f"building {directory} again: {e}", flush=True)
        return False
    for name in BM25_FILES:
        want = (digests or {}).get(f"{directory.name}/{name}")
        why = want and IndexFileGuard(directory / name, want, directory.parent).reason()
        if why:
            print(f"building {directory} again: {why}", flush=True)
            return False
    return True


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
# Dense retrieval (dense.py: the encoder and faiss files).


def dense_search(index: Index, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
    q = encode(index.encoder, queries, "query")
    scores, rows = index.faiss.search(q, min(k, len(index.corpus)))
    return [[(int(r), float(s)) for r, s in zip(rr, ss) if r >= 0] for rr, ss in zip(rows, scores)]


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
    guard: IndexGuard | None = None  # are the corpus and the index's files still the indexed ones (integrity.py)


def build_index(
    corpus_path: str | Path,
    out: str | Path,
    method: str = "bm25",
    model: str = "",
    family: str = "",
    index_factory: str = "Flat",
    batch_size: int = 64,
    chunk: int = 1024,
    keep_embeddings: bool = False,
) -> Path:
    """Build (or resume building) an index directory; returns it. See the module docstring.
    A dense build embeds on every visible GPU and, once the index is complete, deletes its float32
    embeddings (as large as a Flat index: ~65 GB for wiki-18) unless `keep_embeddings`.

    Each file is written whole (files.py) and meta.json says "complete" only once every file
    reads back as load_index reads it (index_fault). A resumed build redoes whatever an earlier
    one left unfinished or unreadable; a finished index that does not read back is built again."""
    if method not in METHODS:
        raise ConfigError(f"unknown retrieval method {method!r}; choose one of {METHODS}")
    out = Path(out)
    for name, value in (("batch_size", batch_size), ("chunk", chunk)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if method != "bm25":  # before the corpus scan: a missing family or a bad factory fails at once
        model, family = resolve_encoder(model, family)
        check_factory(index_factory, model)
    corpus, digest = scan_with_digest(corpus_path)
    meta = {
        "method": method,
        "corpus": str(Path(corpus_path).resolve()),
        "n_docs": len(corpus),
        "corpus_bytes": digest["bytes"],
        "corpus_digest": digest,
        "id_checks": id_checks(corpus),
        "bm25": {"tokenizer": "words>=2 chars, lower, stopwords en, snowball english"},
    }
    if method != "bm25":
        meta["dense"] = {"model": model, "family": family, "index_factory": index_factory}
    earlier = check_earlier_build(out, meta)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "meta.json", meta)
    save_npy(out / "spans.npy", corpus.spans)
    if method in ("bm25", "hybrid") and not bm25_done(out / "bm25", len(corpus), earlier):
        build_bm25(corpus, out)
    if method in ("dense", "hybrid"):
        enc = load_encoder(meta["dense"]["model"], meta["dense"]["family"], all_gpus=True)
        build_dense(corpus, out, enc, index_factory, chunk=chunk, batch_size=batch_size)
    fault = index_fault(out, meta)
    if fault:
        raise DataError(f"index {out} does not read back after its build: {fault}")
    write_json(out / "meta.json", meta | {"files": index_file_digests(out, served_files(meta)), "complete": True})
    if not keep_embeddings:  # only once the index is complete: until then a killed build resumes from them
        for name in ("embeddings.f32", "embed_state.json"):
            (out / name).unlink(missing_ok=True)
    return out


OWN_NAMES = ("faiss.index", "spans.npy", "bm25", "embeddings.f32", "embed_state.json")  # what a build writes


def check_earlier_build(out: Path, meta: dict) -> dict:
    """Refuse to build over a finished index that reads back, over a build of another index, or
    into a directory without meta.json that holds a file of a name a build writes (a build writes
    meta.json first, so that file is not a build's: perhaps the user's own faiss.index); say so when
    a finished one does not read back (it is built again, like a partial one). Returns the file
    digests a finished one recorded (a file that reads back but is not one of them is built again)."""
    if not (out / "meta.json").exists():
        theirs = [name for name in OWN_NAMES if (out / name).exists() or (out / name).is_symlink()]
        if theirs:
            raise ConfigError(f"{out} holds {', '.join(theirs)} but no meta.json: not a build this one can resume, "
                              "and a build would replace them; move them away or build into another directory")
        return {}
    try:
        done = read_json(out / "meta.json")
    except DataError as e:  # not written by this code (its writes are whole): whose build is it?
        raise ConfigError(f"{e}; {out} holds no build this one can resume: remove it first") from None
    finished = bool(done.get("complete"))
    fault = index_fault(out, done) if finished else None
    if finished and fault is None:
        raise ConfigError(f"{out} already holds a finished index; remove it to rebuild")
    # a build from before digests (no corpus_digest) resumes when the rest agrees, as it did then
    same_corpus = "corpus_digest" not in done or all(
        done["corpus_digest"].get(k) == meta["corpus_digest"][k] for k in ("bytes", "sampled_blake2b", "blake2b")
    )
    if not same_corpus or any(done.get(k) != v for k, v in meta.items() if k != "corpus_digest"):
        raise ConfigError(f"{out} holds a partial build of a different index; remove it first")
    if finished:
        print(f"{out} is marked finished but does not read back ({fault}); building it again", flush=True)
    files = done.get("files") if finished else None
    return files if isinstance(files, dict) else {}


def index_fault(out: Path, meta: dict) -> str | None:
    """Why the files of an index directory do not read back as `meta`'s index (load_index's
    loaders, each checked against n_docs), or None."""
    try:
        check_meta(meta, out / "meta.json")
        n = meta["n_docs"]
        load_npy(out / "spans.npy", shape=(n, 2), dtype=np.int64)
        if meta["method"] in ("bm25", "hybrid"):
            load_bm25(out / "bm25", n)
        if meta["method"] in ("dense", "hybrid"):
            load_faiss(out / "faiss.index", n, meta["dense"].get("metric", "inner product"))
    except DataError as e:
        return str(e)
    for name, want in meta.get("files", {}).items():  # readable, but not the files the build wrote
        why = IndexFileGuard(out / name, want, out).reason()
        if why:
            return why
    return None


def _complete(out: Path) -> bool:
    meta = out / "meta.json"  # written whole by os.replace: never seen half-written
    return meta.is_file() and bool(read_json(meta).get("complete"))


def load_index(
    index_dir: str | Path,
    corpus_path: str | Path = "",
    search_params: str = "",
    device: str = "",
    threads: int = -1,
    bm25_backend: str = "scipy",
    faiss_on_gpus: bool = False,
    encoder: tuple[str, str] | None = None,
) -> Index:
    """Open a built index (BM25 arrays and faiss index mmap'd; each file checked, a corrupt one is
    one line naming it), after checking its corpus (check_corpus, and its digest: integrity.py) and,
    given `encoder` (model dir, family: what the config asks for), that its dense part was embedded
    with that encoder (check_encoder).

    The dense query encoder runs on `device` (the GPU if there is one). The faiss index itself
    stays on the host (mmap'd: the page cache holds one copy per machine, whatever the number of
    processes that open it) unless `faiss_on_gpus`, which shards it over every GPU the process
    sees: what the retrieval server does (`retriever.py serve`, one process per machine). The
    trainer never asks for it: each of 8 training processes would shard its own copy over all 8
    GPUs beside vLLM (issue 33, item 3; no GPU here to show it, search/tools.open_index passes False).

    BM25 scoring (same scores, different speed): "scipy" (default) multiplies a sparse query
    matrix with bm25s's score arrays, no copy, 1.75x bm25s's own "numpy" scorer end to end; "numba"
    is ~4x faster again (benchmarks/bench_retriever.py, README "Retriever numbers") but compiles
    for 10-30 s in every new process (bm25s does not cache it): worth it for a long-lived server
    on a large corpus.

    faiss opens the index with IO_FLAG_MMAP_IFC: Flat and HNSW codes (and HNSW's graph) stay in the
    file's pages. IO_FLAG_MMAP, used before, only maps IVF lists: faiss 1.15.1 read a Flat or HNSW
    index into private memory with it (tests/test_retriever_import.py measures both).
    """
    if bm25_backend not in BM25_BACKENDS:
        raise ConfigError(f"bm25_backend must be one of {BM25_BACKENDS}, got {bm25_backend!r}")
    index_dir = Path(index_dir)
    meta_path = index_dir / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"no index at {index_dir} (missing {meta_path}); build it with `retriever.py build`")
    meta = read_json(meta_path)
    if not meta.get("complete"):
        raise DataError(f"index {index_dir} is a partial build; run the same build command again to resume")
    check_meta(meta, meta_path)
    if encoder is not None:
        check_encoder(meta, *encoder, index_dir)
    path = Path(corpus_path or meta["corpus"])
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path} (index {index_dir}; pass --corpus if it moved)")
    corpus = Corpus(path, load_npy(index_dir / "spans.npy", shape=(meta["n_docs"], 2), dtype=np.int64))
    check_corpus(corpus, meta, index_dir)
    corpus_guard = CorpusGuard(path, meta.get("corpus_digest"), index_dir)
    corpus_guard.check()  # the sampled blocks, and the whole file up to integrity.FULL_HASH_BYTES
    index = Index(index_dir, meta, corpus, threads=threads if threads >= 0 else (os.cpu_count() or 1),
                  guard=IndexGuard(corpus_guard, []))  # fmt: skip
    if meta["method"] in ("bm25", "hybrid"):
        backend = "numba" if bm25_backend == "numba" else "numpy"
        index.bm25 = load_bm25(index_dir / "bm25", meta["n_docs"], backend)
        if bm25_backend == "scipy" and index.bm25.nonoccurrence_array is None:  # lucene BM25: none
            import scipy.sparse as sp

            sc = index.bm25.scores
            vocab = len(sc["indptr"]) - 1
            index.bm25_matrix = sp.csr_matrix((sc["data"], sc["indices"], sc["indptr"]), shape=(vocab, sc["num_docs"]))
    if meta["method"] in ("dense", "hybrid"):
        import torch

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        use_all_cores()
        metric = meta["dense"].get("metric", "inner product")
        index.faiss = load_faiss(index_dir / "faiss.index", meta["n_docs"], metric)
        set_search_params(index.faiss, search_params)
        if faiss_on_gpus and device.startswith("cuda"):
            index.faiss = to_gpus(index.faiss)
        index.encoder = load_encoder(meta["dense"]["model"], meta["dense"]["family"], device)
        if index.faiss.d != encoder_width(index.encoder):
            raise corrupt(index_dir / "faiss.index", f"{index.faiss.d}-dimensional vectors; encoder "
                          f"{meta['dense']['model']} embeds {encoder_width(index.encoder)}")  # fmt: skip
    # the index's own files against their digests, after the loaders (a cut file is "corrupt", named by them)
    since = "imported" if meta.get("dense", {}).get("imported_from") else "built"
    files = meta.get("files", {})  # an index from before file digests: its files watched from this load
    index.guard.files = [IndexFileGuard(index_dir / name, files.get(name), index_dir, since)
                         for name in served_files(meta)]  # fmt: skip
    index.guard.check()
    return index


def ensure_index(
    corpus_path: str | Path, method: str = "bm25", model: str = "", index_factory: str = "Flat", family: str = ""
) -> Path:
    """The default index next to a corpus (`<corpus dir>/index-<method>`), built on first use.

    The ranks of one launch all ask at once: the build runs under an exclusive lock on
    `<corpus dir>/index-<method>.lock`, so the first builds and the others wait, then find it
    built (without the lock each built it, or died on the other's partial build). A built index
    embedded with another encoder than `model` / `family` is refused (check_encoder)."""
    out = Path(corpus_path).parent / f"index-{method}"
    if not _complete(out):  # no lock file needed (or writable) once the index exists
        with open(out.with_name(out.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released on close, or when the process dies
            if not _complete(out):
                print(f"building {out} (first use; other processes wait for it)", flush=True)
                build_index(corpus_path, out, method, model=model, family=family, index_factory=index_factory)
    check_encoder(read_json(out / "meta.json"), model, family, out)
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
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"k (passages per query) must be a positive integer, got {k!r}")
    if index.guard is not None:  # a stat; the corpus's hashes only once the stat changes
        index.guard.check()
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
