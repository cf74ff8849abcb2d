"""The field's retrieval clients against a real `retriever.py serve`, default flags, on 127.0.0.1.

Each peer's request and reply handling is replayed here, written from its public code (never
copied; docs/peers.md names each file): Search-R1 a14dc3a `execute_predictions` / `batch_search`
(requests, no status check: a refusal is a KeyError on 'result'), verl b178a3c
`perform_single_search_batch` (a refusal becomes an `api_error` observation), SkyRL a956457 skyrl-gym
`SearchToolGroup.search`, rLLM 7982c508 `LocalRetrievalTool.forward` (httpx) and ASearcher 813e804
`AsyncSearchBrowserClient` (aiohttp, /retrieve then /access). The corpus is wiki-18's form (`id`,
`contents`; no `url`). Every turn shape Search-R1's loop produces (nobody searches, a blank
`<search> </search>`, its GRPO batch of 512 x 5 = 2,560 queries in one POST, topk 150, a non-ASCII
query) is answered as in process. train.py against a second, independent server that speaks only
the minimal Search-R1 wire format (tests/search_r1_wire_server.py) closes the loop the other way.
"""

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import httpx
import pytest
import requests
from conftest import free_port, run_script
from test_server import start_server

import retriever
from search.index import build_index, load_index, search

ROOT = Path(__file__).resolve().parents[1]
INVALID = "\nMy previous action is invalid. "  # the start of Search-R1's invalid-action observation


# --- the peers' clients, replayed -------------------------------------------------------------


def search_r1_passages(hits: list[dict]) -> str:
    """Search-R1's _passages2string: `Doc i(Title: first line) rest` lines, each ending in \\n."""
    out = ""
    for i, hit in enumerate(hits, 1):
        lines = hit["document"]["contents"].split("\n")
        out += f"Doc {i}(Title: {lines[0]}) {chr(10).join(lines[1:])}\n"
    return out


def search_r1_turn(url: str, predictions: list[str], topk: int) -> list[str]:
    """Search-R1's execute_predictions for one turn, every rollout active: each prediction's first
    <search> or <answer> (stripped), one POST of every search's query (an empty list when none
    searches), `['result']` read without a status check, an observation per rollout."""
    actions, contents = [], []
    for text in predictions:
        m = re.search(r"<(search|answer)>(.*?)</\1>", text, re.DOTALL)
        actions.append(m.group(1) if m else None)
        contents.append(m.group(2).strip() if m else "")
    queries = [c for a, c in zip(actions, contents) if a == "search"]
    reply = requests.post(url, json={"queries": queries, "topk": topk, "return_scores": True}).json()
    results = [search_r1_passages(hits) for hits in reply["result"]]
    assert len(results) == len(queries)
    obs = []
    for action in actions:
        if action == "search":
            obs.append(f"\n\n<information>{results.pop(0).strip()}</information>\n\n")
        else:
            obs.append("" if action == "answer" else INVALID)
    return obs


def verl_passages(hits: list[dict]) -> str:
    out = ""
    for i, hit in enumerate(hits, 1):
        lines = hit["document"]["contents"].split("\n")
        out += f"Doc {i} (Title: {lines[0]})\n{chr(10).join(lines[1:])}\n\n"
    return out.strip()


def verl_batch(url: str, queries: list[str], topk: int) -> tuple[str, str]:
    """verl's perform_single_search_batch -> (result text, status): return_scores true, a 5xx
    retried (here: once is enough to see it), any other error or refusal an `api_error` text."""
    try:
        r = requests.post(url, headers={"Content-Type": "application/json", "Accept": "application/json"},
                          json={"queries": queries, "topk": topk, "return_scores": True}, timeout=30)  # fmt: skip
        r.raise_for_status()
        reply = r.json()
    except (requests.RequestException, ValueError) as e:
        return json.dumps({"result": f"Search error: {e}"}), "api_error"
    raw = reply.get("result", [])
    if not raw:
        return json.dumps({"result": "No search results found."}), "no_results"
    return json.dumps({"result": "\n---\n".join(verl_passages(hits) for hits in raw)}), "success"


def skyrl_search(url: str, query: str, topk: int = 3) -> str:
    """skyrl-gym's SearchToolGroup.search: one stripped query as {"query"}; "result" read as hit lists."""
    r = requests.post(url, json={"query": query.strip(), "topk": topk, "return_scores": True}, timeout=30)
    r.raise_for_status()
    raw = r.json().get("result", [])
    if not raw:
        return json.dumps({"result": "No search results found."})
    texts = ["".join(f"Doc {i}: {h['document']['contents'].strip()}\n" for i, h in enumerate(hits, 1)) for hits in raw]
    return json.dumps({"result": "\n---\n".join(texts)})


def rllm_forward(base: str, query: str, top_k: int = 10) -> tuple[str | None, list[dict]]:
    """rLLM's LocalRetrievalTool: GET /health when built, then {"query", "top_k" (at most 50)} to
    /retrieve, "results" read as one hit list -> (error or None, results)."""
    with httpx.Client(timeout=30) as client:
        assert client.get(f"{base}/health").status_code == 200
        r = client.post(f"{base}/retrieve", json={"query": query, "top_k": min(top_k, 50)})
        if not r.is_success:
            return f"Retrieval server error: {r.status_code}", []
        results = r.json().get("results", [])
    for i, hit in enumerate(results, 1):  # its formatting reads these
        assert isinstance(hit["document"].get("id", f"doc_{i}"), str) and f"{hit.get('score', 0.0):.3f}"
        assert isinstance(hit["document"].get("contents", ""), str)
    return None, results


async def asearcher_search_and_access(base: str, query: str, topk: int) -> tuple[list[str], list[str], list[str]]:
    """ASearcher's AsyncSearchBrowserClient: query_async with {"queries": [q], "topk", "return_scores":
    false} reads each document's "contents" and "url"; access_async posts those urls to /access and
    reads each result's "contents" (None: "") -> (documents, urls, pages)."""
    timeout = aiohttp.ClientTimeout(total=120, sock_connect=120)
    async with aiohttp.ClientSession() as session:
        meta = {"queries": [query], "topk": topk, "return_scores": False}
        async with session.post(f"{base}/retrieve", json=meta, timeout=timeout) as r:
            r.raise_for_status()
            res = await r.json()
        found = [dict(documents=[d["contents"] for d in docs], urls=[d["url"] for d in docs]) for docs in res["result"]]
        async with session.post(f"{base}/access", json={"urls": found[0]["urls"]}, timeout=timeout) as r:
            r.raise_for_status()
            pages = [p["contents"] if p is not None else "" for p in (await r.json())["result"]]
    return found[0]["documents"], found[0]["urls"], pages


# --- the server they call ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def wiki(search_world, tmp_path_factory):
    """(corpus rows, BM25 index dir) of the search world in wiki-18's form: id and contents only."""
    rows = [{"id": d["id"], "contents": d["contents"]} for d in search_world[0].corpus]
    base = tmp_path_factory.mktemp("wiki18")
    (base / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows, build_index(base / "corpus.jsonl", base / "bm25", "bm25")


@pytest.fixture(scope="module")
def peer_server(wiki):
    """`retriever.py serve` with its default flags; yields its base URL."""
    proc, url = start_server(wiki[1])
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def local(wiki):
    index = load_index(wiki[1])
    return lambda queries, k: search(index, queries, k)


def turn_queries(rows: list[dict], n: int) -> list[str]:
    """n distinct queries about the corpus's people: their names in four phrasings, then numbered."""
    names = sorted({r["contents"].split("\n")[0].strip('"') for r in rows})
    phrased = [f"{name} {w}" for w in ("born", "city", "country", "lived") for name in names]
    return [phrased[i % len(phrased)] + (f" {i}" if i >= len(phrased) else "") for i in range(n)]


CASES = {  # a turn's queries and topk
    "blank": lambda rows: (["", "   ", turn_queries(rows, 1)[0]], 3),
    "grpo_2560": lambda rows: (turn_queries(rows, 2560), 3),  # Search-R1's train_grpo.sh: 512 x n_agent 5
    "topk_150": lambda rows: (["born in the city of", turn_queries(rows, 1)[0]], 150),
    "non_ascii": lambda rows: ([turn_queries(rows, 1)[0] + " — née à Zürich? 東京 ünïcödé"], 3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_search_r1_execute_predictions_gets_each_turn_shape_answered(peer_server, wiki, local, case):
    """Search-R1's turn over 4 shapes (before: 422/413, a KeyError that ends its run)."""
    queries, topk = CASES[case](wiki[0])
    assert len(set(queries)) == len(queries) == {"grpo_2560": 2560}.get(case, len(queries))
    predictions = [f"<think>x</think><search>{q}</search>" for q in queries] + ["<answer>Sarn</answer>", "oops"]
    obs = search_r1_turn(peer_server + "/retrieve", predictions, topk)
    want = [f"\n\n<information>{search_r1_passages(h).strip()}</information>\n\n" for h in local(queries, topk)]
    assert obs == want + ["", INVALID]
    if case == "topk_150":
        assert "Doc 150(" in obs[0]
    if case == "blank":  # BM25: a blank has no word to match, as pyserini's (Search-R1's BM25 server)
        assert obs[:2] == ["\n\n<information></information>\n\n"] * 2 and "Doc 3(" in obs[2]


def test_search_r1_turn_where_nobody_searches_posts_an_empty_list(peer_server):
    """No active rollout searches: Search-R1 still posts `queries: []` and reads ['result']
    (before: 422, KeyError: 'result')."""
    assert search_r1_turn(peer_server + "/retrieve", ["<answer>Sarn</answer>", "no tags"], 3) == ["", INVALID]
    reply = requests.post(peer_server + "/retrieve", json={"queries": []})
    assert (reply.status_code, reply.json()) == (200, {"result": []})


def test_the_default_limit_of_16384_queries_is_answered_in_one_call(peer_server, wiki):
    """A user's larger GRPO batch (16,384 queries, the default --max-queries) in one POST: answered
    in order, searched in 32 chunks of 512 (before: a 413 over 512)."""
    queries = turn_queries(wiki[0], 16_384)
    before = requests.get(peer_server + "/health").json()
    r = requests.post(peer_server + "/retrieve", json={"queries": queries, "topk": 3, "return_scores": True})
    assert r.status_code == 200 and len(r.json()["result"]) == 16_384
    after = requests.get(peer_server + "/health").json()
    assert after["queries"] - before["queries"] == 16_384 and after["batches"] - before["batches"] >= 32
    over = requests.post(peer_server + "/retrieve", json={"queries": queries + ["x"]})
    assert over.status_code == 413 and "16385 queries in one request; the limit is 16384" in over.json()["error"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_verl_search_batch_gets_each_turn_shape_answered(peer_server, wiki, local, case):
    """verl's perform_single_search_batch: a success with the in-process hits (before: api_error
    texts the policy trained on)."""
    queries, topk = CASES[case](wiki[0])
    text, status = verl_batch(peer_server + "/retrieve", queries, topk)
    assert status == "success", text
    assert json.loads(text)["result"] == "\n---\n".join(verl_passages(h) for h in local(queries, topk))
    text, status = verl_batch(peer_server + "/retrieve", [], 3)  # nobody searched
    assert (status, json.loads(text)["result"]) == ("no_results", "No search results found.")


def test_skyrl_rllm_and_asearcher_get_well_formed_answers(peer_server, wiki, local):
    """SkyRL's {"query"}, rLLM's {"query", "top_k"} -> "results", ASearcher's documents with urls
    and /access of those urls: each answered in its own shape (before: 422s and 404s)."""
    query = turn_queries(wiki[0], 1)[0]
    hits = local([query], 10)[0]
    text = json.loads(skyrl_search(peer_server + "/retrieve", "  " + query + " ", 3))["result"]
    top3 = local([query], 3)[0]  # (ties at the 3rd place may rank apart from the top-10's)
    assert text == "".join(f"Doc {i}: {h['document']['contents'].strip()}\n" for i, h in enumerate(top3, 1))
    assert json.loads(skyrl_search(peer_server + "/retrieve", "   "))["result"] == ""  # blank: no hits, no error
    error, results = rllm_forward(peer_server, query, top_k=10)
    assert error is None and [r["document"]["id"] for r in results] == [h["document"]["id"] for h in hits]
    assert [r["score"] for r in results] == pytest.approx([h["score"] for h in hits])
    docs, urls, pages = asyncio.run(asearcher_search_and_access(peer_server, query, 5))
    top5 = local([query], 5)[0]
    assert docs == [h["document"]["contents"] for h in top5] == pages
    assert urls == [h["document"]["id"] for h in top5]  # no url in the corpus: the passage's id


# --- train.py against an independent Search-R1 server -----------------------------------------


@pytest.mark.slow
def test_train_runs_against_a_minimal_search_r1_server(micro, tmp_path):
    """train.py, one GRPO step with the transformers engine, searching through a second server
    process that speaks only Search-R1's wire format: it starts, every rollout search reaches that
    server, and the step completes."""
    path, cfg, _, world = micro
    port, log = free_port(), tmp_path / "requests.log"
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "search_r1_wire_server.py"),
                               str(world / "corpus.jsonl"), str(port), str(log)], stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert server.stdout.readline() == b"serving\n"
        sets = [f"retriever.url=http://127.0.0.1:{port}", "rollout.engine=hf", "train.steps=1",
                "train.questions_per_step=2", "train.group_size=2",
                f"train.run_dir={tmp_path / 'runs'}"]  # fmt: skip
        out = run_script(["train.py", "--config", str(path), *[a for s in sets for a in ("--set", s)]], timeout=300)
    finally:
        server.kill()
        server.wait()
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    counts = [int(n) for n in log.read_text().split()]
    assert counts[0] == 1 and len(counts) > 1  # the start-up probe, then the rollouts' searches
    rows = [json.loads(x) for x in next((tmp_path / "runs").iterdir()).joinpath("metrics.jsonl").read_text().split("\n")
            if x]  # fmt: skip
    assert [r["step"] for r in rows if "time" in r] == [1]


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--write-timeout", "-1", "argument --write-timeout: must be a number of seconds above 0, got '-1'"),
        ("--write-timeout", "nan", "must be a number of seconds above 0, got 'nan'"),
        ("--max-topk", "0", "argument --max-topk: must be an integer >= 1, got '0'"),
        ("--max-queries", "-5", "argument --max-queries: must be an integer >= 1, got '-5'"),
        ("--max-query-chars", "2.5", "argument --max-query-chars: must be an integer >= 1, got '2.5'"),
        ("--port", "70000", "argument --port: must be an integer from 1 to 65535, got '70000'"),
    ],
)
def test_serve_refuses_a_bad_limit_flag_in_one_line(flag, value, message, capsys):
    """Before: `--write-timeout -1` served empty 200s and `--max-topk 0` refused every request."""
    with pytest.raises(SystemExit) as e:
        retriever.main(["serve", "--index", "idx", flag, value])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(message)
