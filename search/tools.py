"""The rollout's search tools, built from config: in process or over HTTP, plain or web-style.

    search = open_search(cfg.retriever, corpus_path)     # (queries, k) -> hits per query
    search_fn = make_search_fn(cfg, corpus_path, timings)  # queries -> rendered hits (Search-R1)
    tools = make_search_fn(cfg_deliberative, ...)          # {"search", "read"} (web protocols)

This is the one place that chooses between the index in this process (index.py, with
WebFilter's operators through web.py) and a retrieval server (search/client.py), so both of
those stay below it. Building an index imports bm25s (numba): call these after vLLM has
started in the process (docs/design.md §6).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from search.client import RetrieverError, http_retrieve
from search.corpus import format_hits, format_hits_search_r1
from search.index import Index, ensure_index, load_index
from search.web import operator_search, read, web_search
from trainer.config import PROTOCOLS, Config, ConfigError


def open_index(rcfg, corpus_path: str | Path = "") -> Index:
    """The in-process index of a retriever config: `retriever.index`, else the default index
    next to the corpus, built on first use (once, under a lock, however many ranks ask). An index
    embedded with another encoder than retriever.model / retriever.encoder_family is refused."""
    model, family = rcfg.model, rcfg.encoder_family
    index_dir = rcfg.index or ensure_index(corpus_path, rcfg.method, model, rcfg.index_factory, family)
    return load_index(index_dir, search_params=rcfg.search_params, bm25_backend=rcfg.bm25_backend,
                      encoder=(model, family))  # fmt: skip


def check_retriever(rcfg) -> None:
    """A `retriever.url` that cannot answer one query is a ConfigError in one line, raised before any
    engine starts (a paper config points at the machine's server: not started, a run would load
    the model and the engine, then stop at its first search). It gets `retriever.timeout` to
    answer, as a search does; any server speaking Search-R1's /retrieve passes."""
    if not rcfg.url:
        return
    try:
        retries = 0 if rcfg.retries == 0 else None  # as open_search: until the timeout
        http_retrieve(rcfg.url, ["is the retriever up"], 1, timeout=rcfg.timeout, retries=retries)
    except RetrieverError as e:
        raise ConfigError(f"retriever.url: {e}. Start it first (python retriever.py serve --index DIR --port N), "
                          "or set retriever.index to search in process") from None  # fmt: skip


def open_search(rcfg, corpus_path: str | Path = "", send_blank: bool = False) -> Callable[[list[str], int],
                                                                                       list[list[dict]]]:  # fmt: skip
    """`(queries, k) -> hits per query`, from config: `retriever.url` (an HTTP server speaking
    Search-R1's /retrieve), else `retriever.index` (a built index dir), else the default index
    next to the corpus, built on first use. In process, queries with advanced operators
    (`site:tinypedia.org`, `-term`, ...) are filtered as search/web.py does. Over HTTP, each call
    retries a server that is down or answers 5xx until `retriever.timeout` (`retriever.retries`
    0: never), then raises search.client.RetrieverError; a batch goes in requests of at most
    `retriever.max_queries_per_request` queries, each cut to `retriever.max_query_chars`. Hits scoring
    below `retriever.min_score` are dropped (a hit without a score counts as 0). `send_blank`
    (rollout.search_r1_text): a blank query goes to the server, as Search-R1 sends it."""
    if rcfg.url:
        retries = 0 if rcfg.retries == 0 else None  # None: until the timeout (config.py says why)
        limits = {"max_queries": rcfg.max_queries_per_request, "max_query_chars": rcfg.max_query_chars}
        search = lambda queries, k: http_retrieve(rcfg.url, queries, k, timeout=rcfg.timeout,  # noqa: E731
                                                  retries=retries, send_blank=send_blank, **limits)  # fmt: skip
    else:
        index = open_index(rcfg, corpus_path)  # site:, -term, ... honoured (WebFilter's operators)
        search = lambda queries, k: operator_search(index, queries, k)  # noqa: E731
    if not rcfg.min_score:
        return search
    floor = rcfg.min_score
    return lambda queries, k: [[h for h in hits if h.get("score", 0.0) >= floor] for hits in search(queries, k)]


# --------------------------------------------------------------------------------------------

def web_tools(index, k: int = 5, read_tokens: int = 512, tokenizer=None) -> dict:
    """{"search", "read"} batched over web.py on a built index (deliberative, webfilter)."""
    return {
        "search": lambda queries: [web_search(index, q, k) for q in queries],
        "read": lambda ids: [read(index, i, read_tokens, tokenizer) for i in ids],
    }


def make_search_fn(cfg: Config, corpus_path: Path, timings: dict):
    """The rollout's tools. Search-R1 and BAPO protocols: one batched search, queries -> rendered
    hits, in process or over HTTP (search.tools.open_search). Protocols with `web_tools` (Deliberative, WebFilter):
    {"search", "read"} over search/web.py (sources with url and date, operators, read by id), in
    process only. With rollout.search_r1_text the hits are rendered as Search-R1 renders them
    (corpus.format_hits_search_r1: titles with their quotes, each line ending in a newline). Imports
    bm25s: call after vLLM has started."""
    if cfg.rollout.protocol not in PROTOCOLS and cfg.rollout.protocol != "search_r1":  # never a silent guess
        raise ConfigError(f"config key 'rollout.protocol' {cfg.rollout.protocol!r} is not in agent/protocols.py's "
                          "table (unknown, or that module is not imported yet)")  # fmt: skip
    if getattr(PROTOCOLS.get(cfg.rollout.protocol), "web_tools", False):  # agent/protocols.py's table
        return make_web_tools(cfg, corpus_path, timings)
    search = open_search(cfg.retriever, corpus_path, send_blank=cfg.rollout.search_r1_text)
    render = format_hits_search_r1 if cfg.rollout.search_r1_text else format_hits

    def search_fn(queries: list[str]) -> list[str]:
        t = time.time()
        out = [render(h) for h in search(queries, cfg.retriever.topk)]
        timings["retrieve"] = timings.get("retrieve", 0.0) + time.time() - t
        return out

    return search_fn


def make_web_tools(cfg: Config, corpus_path: Path, timings: dict) -> dict:
    """search.tools.web_tools on the configured index, each call timed into timings["retrieve"]."""
    r = cfg.retriever
    if r.url:
        raise ConfigError(
            f"rollout.protocol {cfg.rollout.protocol!r} needs an in-process index (operators, read by id); "
            "retriever.url is a Search-R1 /retrieve server: set retriever.index instead"
        )
    tools = web_tools(open_index(r, corpus_path), k=r.topk, read_tokens=cfg.rollout.max_obs_tokens)

    def timed(fn):
        def call(items: list[str]) -> list:
            t = time.time()
            out = fn(items)
            timings["retrieve"] = timings.get("retrieve", 0.0) + time.time() - t
            return out

        return call

    return {name: timed(fn) for name, fn in tools.items()}
