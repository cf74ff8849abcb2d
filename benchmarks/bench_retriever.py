"""Retriever numbers for the README: recall, speed against peers, server throughput.

    python benchmarks/bench_retriever.py                    # 100k-passage world, ~15 min on 2 cores
    python benchmarks/bench_retriever.py --n-people 5000    # a quick look

What it measures (docs/design.md §8: ratios side by side in one run, alternated, median of reps):
  1. recall@3 of the gold passage for the tiny world's single-hop questions (configs/tiny.yaml's
     world), with BM25 and with dense retrieval (all-MiniLM-L6-v2);
  2. on a scaled world (>= 100k passages, same generator):
     - BM25 queries/s: ours (bm25s, mmap) against rank_bm25's BM25Okapi on the same tokens;
     - our search() against calling bm25s / encoder + faiss directly (the wrapper's overhead);
     - recall@10 of HNSW32 and IVF,SQ8 relative to Flat on the same embeddings;
     - the HTTP server: 8 concurrent loopback clients, queries/s with p50 / p99 latency, against
       the in-process search of the same queries (the ceiling the server can reach).
Indexes are cached under --out and reused by later runs.
"""

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from search.corpus import get_passage  # noqa: E402
from search.index import bm25_tokenize, build_index, encode, load_index, search, search_rows  # noqa: E402
from tiny.world import generate_world, write_jsonl  # noqa: E402
from trainer.config import WorldConfig, load_config  # noqa: E402


def timed(fn, reps: int) -> float:
    """Median wall seconds of fn() over reps."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def side_by_side(fns: dict, reps: int) -> dict:
    """Alternate the contenders rep by rep; median seconds each."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def index_once(corpus: Path, out: Path, method: str, **kw) -> Path:
    meta = out / "meta.json"
    if meta.exists() and json.loads(meta.read_text()).get("complete"):
        return out
    t = time.time()
    build_index(corpus, out, method, **kw)
    print(f"built {out.name} in {time.time() - t:.0f} s", flush=True)
    return out


def recall(index, questions, k, method) -> float:
    hits = search_rows(index, [q["question"] for q in questions], k, method)
    gold = [q["metadata"]["gold_ids"][0] for q in questions]
    return float(np.mean([g in {str(get_passage(index.corpus, r)["id"]) for r, _ in h} for g, h in zip(gold, hits)]))


def overlap(found, exact) -> float:
    return float(np.mean([len({r for r, _ in a} & {r for r, _ in e}) / max(1, len(e)) for a, e in zip(found, exact)]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_load(index_dir: Path, queries: list[str], clients: int, per_request: int) -> dict:
    port = free_port()
    cmd = [sys.executable, str(ROOT / "retriever.py"), "serve", "--index", str(index_dir), "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.2)
    from search.client import http_retrieve

    requests = [queries[i : i + per_request] for i in range(0, len(queries), per_request)]
    latencies: list[float] = []

    def one(batch):
        t = time.perf_counter()
        http_retrieve(url, batch, 3)
        latencies.append(time.perf_counter() - t)

    try:
        one(requests[0])  # warm-up
        latencies.clear()
        t = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(one, requests))
        wall = time.perf_counter() - t
    finally:
        proc.terminate()
        proc.wait()
    lat = np.array(latencies) * 1000
    return {
        "qps": len(queries) / wall,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml", help="config whose world gives the recall@3 numbers")
    p.add_argument("--n-people", type=int, default=100_000, help="people in the scaled world (passages ~1.05x)")
    p.add_argument("--queries", type=int, default=256, help="queries per speed measurement")
    p.add_argument("--reps", type=int, default=5, help="repetitions (median)")
    p.add_argument("--out", default="bench_cache/retriever", help="where indexes are built and cached")
    p.add_argument("--parts", default="recall,bm25,dense,server", help="comma-separated subset to run")
    args = p.parse_args()
    out = ROOT / args.out
    parts = set(args.parts.split(","))
    results_path = out / "results.json"
    results: dict = json.loads(results_path.read_text()) if results_path.exists() else {}

    # 1. recall@3 on the tiny world
    cfg = load_config(ROOT / args.config)
    tiny = generate_world(cfg.world)
    write_jsonl(out / "tiny" / "corpus.jsonl", tiny.corpus)
    if "recall" in parts:
        tiny_idx = load_index(index_once(out / "tiny" / "corpus.jsonl", out / "tiny" / "hybrid", "hybrid"))
        one_hop = [q for s in ("val", "test") for q in tiny.questions[s] if q["metadata"]["type"] == "1hop"]
        results["tiny"] = {"passages": len(tiny.corpus), "questions": len(one_hop)}
        results["tiny"] |= {f"recall@3_{m}": recall(tiny_idx, one_hop, 3, m) for m in ("bm25", "dense", "hybrid")}
        print(json.dumps(results["tiny"]), flush=True)

    # 2. the scaled world
    big = generate_world(
        WorldConfig(seed=1, n_people=args.n_people, n_cities=2000, n_countries=100, n_val=200, n_test=0)
    )
    corpus = out / f"big{args.n_people}" / "corpus.jsonl"
    if not corpus.exists():
        write_jsonl(corpus, big.corpus)
    queries = [q["question"] for q in big.questions["train"][: args.queries]]
    bm25_dir = index_once(corpus, corpus.parent / "bm25", "bm25")
    index = load_index(bm25_dir)
    results.setdefault("big", {}).update({"passages": len(index.corpus), "queries": len(queries)})
    if "bm25" in parts:
        bm25_part(results["big"], index, bm25_dir, queries, args.reps)
    if "dense" in parts:
        dense_part(results["big"], corpus, big, queries, args.reps)
    if "server" in parts:  # 8 concurrent clients, one query per request (a rollout's pattern), BM25
        many = [q["question"] for q in big.questions["train"][: 8 * args.queries]]
        in_process = len(many) / timed(lambda: [search(index, [q], 3) for q in many], 1)
        load = server_load(bm25_dir, many, clients=8, per_request=1)
        results["server"] = {"clients": 8, "queries": len(many), **load, "in_process_qps_one_by_one": in_process,
                             "server_over_in_process": load["qps"] / in_process}  # fmt: skip
        print(json.dumps(results["server"]), flush=True)
    results_path.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


def bm25_part(res: dict, index, bm25_dir: Path, queries: list[str], reps: int) -> None:
    """BM25 against rank_bm25 (same tokens; rank_bm25 on 32 queries, it is slow), with both bm25s
    backends, and our wrapper against calling bm25s directly."""
    from rank_bm25 import BM25Okapi

    t = time.time()
    docs = [get_passage(index.corpus, r)["contents"] for r in range(len(index.corpus))]
    okapi = BM25Okapi(bm25_tokenize(docs))
    print(f"rank_bm25 index built in {time.time() - t:.0f} s", flush=True)
    few = queries[:32]
    few_tokens = bm25_tokenize(few)
    numba = load_index(bm25_dir, bm25_backend="numba")
    t = time.time()
    search(numba, few, 3)
    res["bm25_numba_compile_s"] = time.time() - t
    okapi_top = lambda: [np.argsort(-okapi.get_scores(q))[:3] for q in few_tokens]  # noqa: E731
    sec = side_by_side(
        {"ours": lambda: search(index, few, 3), "ours_numba": lambda: search(numba, few, 3), "rank_bm25": okapi_top},
        3,
    )
    for name in ("ours", "ours_numba", "rank_bm25"):
        res[f"bm25_qps_{name}"] = len(few) / sec[name]
    res["bm25_speedup_vs_rank_bm25"] = sec["rank_bm25"] / sec["ours"]
    res["bm25_numba_speedup_vs_rank_bm25"] = sec["rank_bm25"] / sec["ours_numba"]
    # context only: the two use different idf formulas (bm25s "lucene", rank_bm25 Okapi with an
    # epsilon floor), and these queries tie on shared first names and "born"
    same = np.mean([int(a[0]) == b[0][0] for a, b in zip(okapi_top(), search_rows(index, few, 3, "bm25"))])
    res["top1_agreement_with_rank_bm25"] = float(same)
    print(json.dumps(res), flush=True)

    # 2b. our wrapper against bm25s directly (same loaded model, bm25s's own tokenizer + stemmer)
    import bm25s
    import Stemmer

    stem = Stemmer.Stemmer("english")

    def bm25s_direct():
        toks = bm25s.tokenize(queries, stopwords="en", stemmer=stem, return_ids=False, show_progress=False)
        rows, _ = index.bm25.retrieve(toks, k=3, show_progress=False, n_threads=index.threads)
        return [[get_passage(index.corpus, int(r)) for r in row] for row in rows]

    sec = side_by_side({"ours": lambda: search(index, queries, 3), "direct": bm25s_direct}, reps)
    res["bm25_overhead_vs_bm25s"] = sec["ours"] / sec["direct"] - 1
    res[f"bm25_qps_batch{len(queries)}"] = len(queries) / sec["ours"]
    print(json.dumps(res), flush=True)


def dense_part(res: dict, corpus: Path, big, queries: list[str], reps: int) -> None:
    """Flat vs HNSW / IVF recall@10 and speed, and our wrapper against encoder + faiss directly."""
    flat_dir = index_once(corpus, corpus.parent / "dense-flat", "dense", index_factory="Flat",
                          keep_embeddings=True)  # the approximate indexes below are built from them
    flat = load_index(flat_dir)
    val = [q["question"] for q in big.questions["val"]]
    exact = search_rows(flat, val, 10, "dense")
    q_emb = encode(flat.encoder, queries, "query")
    for factory, params in (("HNSW32", "efSearch=128"), ("IVF1024,SQ8", "nprobe=32")):
        d = corpus.parent / ("dense-" + factory.replace(",", "_"))
        if not (d / "meta.json").exists():  # reuse the Flat build's embeddings: only faiss is rebuilt
            d.mkdir(parents=True)
            meta = json.loads((flat_dir / "meta.json").read_text())
            meta = {k: v for k, v in meta.items() if k != "complete"}
            meta["dense"] = meta["dense"] | {"index_factory": factory}
            (d / "meta.json").write_text(json.dumps(meta))
            (d / "embed_state.json").write_text(json.dumps({"rows_done": meta["n_docs"]}))
            (d / "embeddings.f32").hardlink_to(flat_dir / "embeddings.f32")
        approx = load_index(index_once(corpus, d, "dense", index_factory=factory), search_params=params)
        res[f"recall@10_{factory}_{params}_vs_flat"] = overlap(search_rows(approx, val, 10, "dense"), exact)
        contenders = {"flat": flat.faiss, "approx": approx.faiss}
        sec = side_by_side({k: (lambda ix=ix: ix.search(q_emb, 10)) for k, ix in contenders.items()}, reps)
        res[f"faiss_speedup_{factory}_vs_flat"] = sec["flat"] / sec["approx"]

    def dense_direct():
        _, rows = flat.faiss.search(encode(flat.encoder, queries, "query"), 3)
        return [[get_passage(flat.corpus, int(r)) for r in row] for row in rows]

    sec = side_by_side({"ours": lambda: search(flat, queries, 3), "direct": dense_direct}, reps)
    res["dense_overhead_vs_encoder_plus_faiss"] = sec["ours"] / sec["direct"] - 1
    res["dense_qps"] = len(queries) / sec["ours"]
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
