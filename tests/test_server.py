"""The retrieval server as a real process on 127.0.0.1, and the client rollouts use.

Search-R1's exact request shape, every kind of bad input (each a 4xx, the server staying up),
batching of concurrent requests, the client's refusal to retry a 4xx, and a rollout that gets
the same observations over HTTP as in process. The client against servers that are down, slow or
wrong: tests/test_retriever_client.py.
"""

import contextlib
import http.server
import json
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import free_port

from search.client import RetrieverError, http_retrieve
from search.index import build_index, load_index, search
from search.server import Limits, create_app, header_timeout_protocol
from search.tools import open_search
from trainer.config import RetrieverConfig

ROOT = Path(__file__).resolve().parents[1]


def start_server(index_dir, *extra):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "retriever.py"), "serve", "--index", str(index_dir), "--port", str(port), *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(proc.stdout.read()) from None
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not come up")


@pytest.fixture(scope="module")
def server(search_world):
    proc, url = start_server(search_world[2], "--max-queries", "64", "--max-query-chars", "500", "--max-topk", "50")
    yield url
    proc.terminate()
    out = proc.communicate(timeout=30)[0]
    assert "serving" in out and "http://127.0.0.1:" in out  # default bind is loopback


def post(url: str, body: bytes | dict, path: str = "/retrieve"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def health(url):
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.numeric
def test_search_r1_request_shape_round_trip(server, search_world):
    world, _, index_dir = search_world
    queries = [q["question"] for q in world.questions["val"][:5]]
    status, body = post(server, {"queries": queries, "topk": 3, "return_scores": True})
    assert status == 200 and list(body) == ["result"] and len(body["result"]) == 5
    local = search(load_index(index_dir), queries, 3)
    for remote_hits, local_hits in zip(body["result"], local):
        assert [h["document"]["id"] for h in remote_hits] == [h["document"]["id"] for h in local_hits]
        assert all(set(h) == {"document", "score"} and {"id", "contents"} <= set(h["document"]) for h in remote_hits)
        # float32 scores of the same index and queries (JSON carries them exactly); approx's default
        # (rel 1e-6 ~ 8 float32 ulps, abs 1e-12) allows another batch of query embeddings
        assert [h["score"] for h in remote_hits] == pytest.approx([h["score"] for h in local_hits])
    status, body = post(server, {"queries": queries[:2], "topk": 2, "return_scores": False})
    assert status == 200 and all(set(d) >= {"id", "contents"} and "score" not in d for d in body["result"][0])


@pytest.mark.parametrize(
    "body,status,message",
    [
        ({"queries": ["x" * 100_000], "topk": 3}, 413, "100000 characters; the limit is 500"),
        (b'{"queries": ["caf\xe9"], "topk": 3}', 400, "not valid UTF-8"),
        ({"queries": ["a"], "topk": 0}, 422, "topk must be an integer from 1 to 50"),
        ({"queries": ["a"], "topk": -1}, 422, "got -1"),
        ({"queries": ["a"], "topk": 10**6}, 422, "got 1000000"),
        ({"queries": ["a"], "topk": "3"}, 422, "topk must be an integer"),
        (b'{"queries": ["a"], "topk": ', 400, "not valid JSON"),
        (b"[1, 2]", 422, "must be a JSON object"),
        ({"queries": ["born"] * 10_000, "topk": 3}, 413, "10000 queries in one request; the limit is 64"),
        ({"queries": "born", "topk": 3}, 422, "'queries' must be a list of strings, got str"),
        ({"queries": ["born"], "query": "born"}, 422, "needs 'queries' (a list of strings) or 'query'"),
        ({"topk": 3}, 422, "needs 'queries' (a list of strings) or 'query' (a string), one of the two"),
        ({"query": ["born"]}, 422, "query must be a string, got list"),
        ({"query": "born", "top_k": 51}, 422, "top_k must be an integer from 1 to 50, got 51"),
        ({"queries": [3], "topk": 3}, 422, "queries[0] must be a string"),
        ({"queries": ["born \ud800"], "topk": 3}, 422, "queries[0] holds a lone surrogate (\\ud800 at character 5)"),
        (b'{"queries": ["a"], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested too deeply"),
        (b"[" * 5000 + b"]" * 5000, 400, "nested too deeply"),
        ({"queries": ["a"], "return_scores": "false"}, 422, "return_scores must be true or false, got 'false'"),
        ({"queries": ["a"], "return_scores": 0}, 422, "return_scores must be true or false, got 0"),
    ],
)
def test_bad_input_gets_a_4xx_and_the_server_stays_up(server, body, status, message):
    got, answer = post(server, body)
    assert got == status and message in answer["error"], answer
    assert health(server)["status"] == "ok"
    assert post(server, {"queries": ["born"], "topk": 1})[0] == 200


NESTED = b"[" * 5000 + b"]" * 5000


@pytest.mark.parametrize(
    "path,body,status,message",
    [
        ("/read", b'{"id": "\\ud800"}', 422, "id holds a lone surrogate (\\ud800 at character 0)"),
        ("/search", b'{"query": "born \\udfff"}', 422, "query holds a lone surrogate (\\udfff at character 5)"),
        ("/read", {"id": "\u00b2"}, 200, "no document with id or url '\u00b2'"),  # "²".isdigit(), int("²") fails
        ("/read", {"id": "\u0663"}, 200, "no document with id or url"),  # Arabic-Indic 3: int() takes it
        ("/read", b'{"id": "p1", "x": ' + NESTED + b"}", 400, "nested too deeply"),
        ("/search", NESTED, 400, "nested too deeply"),
    ],
)
def test_bad_read_and_search_input_is_answered_and_the_server_stays_up(server, path, body, status, message):
    """One line (an error result or a 4xx), never a 500."""
    got, answer = post(server, body, path)
    assert got == status and message in answer["error"], answer
    assert health(server)["status"] == "ok"
    assert post(server, {"id": "p1", "max_tokens": 3}, "/read")[0] == 200


def test_oversized_body_is_refused_before_parsing(server):
    got, answer = post(server, b'{"queries": ["' + b"a" * 5_000_000 + b'"]}')
    assert got == 413 and "the limit is" in answer["error"]
    assert health(server)["status"] == "ok"


def test_concurrent_requests_are_batched_and_answered_correctly(server, search_world):
    world, _, index_dir = search_world
    questions = [q["question"] for q in world.questions["val"]]
    expected = {
        q: [h["document"]["id"] for h in hs] for q, hs in zip(questions, search(load_index(index_dir), questions, 3))
    }
    before = health(server)

    def client(i):
        qs = questions[i::8]
        return qs, http_retrieve(server, qs, 3)

    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            for qs, hits in pool.map(client, range(8)):
                assert [[h["document"]["id"] for h in hs] for hs in hits] == [expected[q] for q in qs]
    after = health(server)
    requests, batches = after["requests"] - before["requests"], after["batches"] - before["batches"]
    assert requests == 24 and batches < requests  # waiting requests were merged into one search call


def test_web_search_and_read_endpoints(server, search_world):
    world = search_world[0]
    person = world.questions["val"][0]["metadata"]["person"]
    status, body = post(server, {"query": f"{person} born site:tinypedia.org", "topk": 3}, "/search")
    assert status == 200 and body["error"] is None and {r["domain"] for r in body["results"]} == {"tinypedia.org"}
    status, doc = post(server, {"id": body["results"][0]["id"], "max_tokens": 3}, "/read")
    assert status == 200 and doc["truncated"] and doc["text"].startswith(person)
    status, body = post(server, {"query": "site:tinypedia.org"}, "/search")
    assert status == 200 and "only operators" in body["error"]
    assert post(server, {"id": "", "max_tokens": 3}, "/read")[0] == 422
    assert post(server, {"id": "p1", "max_tokens": 0}, "/read")[0] == 422


@pytest.fixture(scope="module")
def bm25_dir(search_world, tmp_path_factory):
    """A BM25-only index of the search world (fast to load in process)."""
    return build_index(search_world[1], tmp_path_factory.mktemp("bm25") / "bm25", "bm25")


@contextlib.contextmanager
def app_server(index, **limits):
    """create_app under uvicorn in a thread on 127.0.0.1, as `retriever.py serve` runs it (limits
    the CLI does not set); yields (url, port)."""
    import uvicorn

    lim = Limits()
    for key, value in limits.items():
        setattr(lim, key, value)
    port = free_port()
    config = uvicorn.Config(create_app(index, lim), host="127.0.0.1", port=port, log_level="error",
                            http=header_timeout_protocol(lim.header_timeout))  # fmt: skip
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", port
    finally:
        srv.should_exit = True
        thread.join(10)


def raw_request(port: int, body: bytes, length: int = -1) -> socket.socket:
    """A POST /retrieve on a fresh connection; `length` above len(body) leaves the body unfinished."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    length = length if length >= 0 else len(body)
    s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length + body)
    return s


def reset(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST: an aborted client
    s.close()


def test_a_body_that_does_not_arrive_gets_a_408_and_a_closed_connection(bm25_dir):
    with app_server(load_index(bm25_dir), body_timeout=1.0) as (url, port):
        slow = raw_request(port, b'{"queries": ["bo', length=100)  # 84 bytes promised, never sent
        t, reply = time.monotonic(), b""
        while chunk := slow.recv(65536):  # the server answers, then closes
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"request body not received within 1 s" in reply
        assert time.monotonic() - t < 3  # (before: no answer, ever; here the 5 s socket timeout)
        slow.close()
        assert post(url, {"queries": ["born"], "topk": 1})[0] == 200


def test_a_connection_whose_headers_do_not_arrive_gets_a_408_and_is_closed(bm25_dir):
    """Half a request, or nothing, on a new connection or after a reply: closed after
    header_timeout s (before: held open for good; uvicorn has no header timeout)."""
    with app_server(load_index(bm25_dir), header_timeout=1.0) as (url, port):
        half = socket.create_connection(("127.0.0.1", port), timeout=5)
        half.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Le")  # the headers never end
        idle = socket.create_connection(("127.0.0.1", port), timeout=5)  # sends nothing
        again = http.client.HTTPConnection("127.0.0.1", port, timeout=5)  # one whole request, then half of the next
        again.request("POST", "/retrieve", b'{"queries": ["born"], "topk": 1}')
        t = time.monotonic()
        assert again.getresponse().read().startswith(b'{"result":')
        again.sock.sendall(b"POST /retrieve HTTP/1.1\r\nHo")
        for s in (half, idle, again.sock):
            reply = b""
            while chunk := s.recv(65536):  # the server answers, then closes (before: a TimeoutError here)
                reply += chunk
            s.close()
            assert reply.startswith(b"HTTP/1.1 408") and b"request headers not received within 1 s" in reply
        assert time.monotonic() - t < 3.5
        assert post(url, {"queries": ["born"], "topk": 1})[0] == 200


def test_health_answers_at_once_beside_8_requests_at_the_size_limits(bm25_dir):
    """8 clients each ask for max_queries x max_topk passages (256 x 100 of 2,048-character
    queries: 5.5 MB replies) while /health is polled; it answers within 0.5 s throughout (before:
    1-2 s, as FastAPI encoded each reply on the event loop). The test ends once 3 replies have
    come; the other clients reset their connections and their work is dropped."""
    lim = {"max_queries": 256, "max_topk": 100, "max_query_chars": 2048}
    query = ("born in the city of the river capital " * 60)[: lim["max_query_chars"] - 5]
    body = json.dumps({"queries": [f"{query} {i:04d}" for i in range(lim["max_queries"])], "topk": 100}).encode()
    done, stop = [], threading.Event()

    def client(port: int) -> None:  # reads its whole reply, or resets the connection once told to stop
        s = raw_request(port, body)
        s.settimeout(0.1)
        reply, size = b"", -1
        while not stop.is_set() and len(reply) != size:
            try:
                chunk = s.recv(1 << 20)
            except TimeoutError:
                continue
            if not chunk:
                break
            reply += chunk
            head, _, rest = reply.partition(b"\r\n\r\n")
            if rest and size < 0:
                size = len(head) + 4 + int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        if len(reply) == size:
            done.append(reply)
        reset(s)

    with app_server(load_index(bm25_dir), **lim) as (url, port), ThreadPoolExecutor(8) as pool:
        for _ in range(8):
            pool.submit(client, port)
        waits, deadline = [], time.monotonic() + 60
        while len(done) < 3 and time.monotonic() < deadline:
            t = time.monotonic()
            assert health(url)["status"] == "ok"
            waits.append(time.monotonic() - t)
            time.sleep(0.05)
        stop.set()
    assert len(done) >= 3 and all(r.startswith(b"HTTP/1.1 200") and len(r) > 5_000_000 for r in done)
    assert max(waits) < 0.5, f"/health took {max(waits):.2f} s (median {sorted(waits)[len(waits) // 2]:.3f} s)"


def test_queued_work_of_clients_that_have_gone_is_skipped(bm25_dir):
    """30 clients send 512 queries x topk 100 and reset the connection while queued: none of their
    passages is read (the work that made /retrieve take 20 s), and the next request is answered at
    once. Their searches (ms each on this index) may have run before they left."""
    body = json.dumps({"queries": [f"born in the city {i}" for i in range(512)], "topk": 100}).encode()
    with app_server(load_index(bm25_dir)) as (url, port):
        before = health(url)
        aborted = [raw_request(port, body) for _ in range(30)]
        time.sleep(0.5)  # read and queued behind the first, which the worker is searching
        for s in aborted:
            reset(s)
        t = time.monotonic()
        status, answer = post(url, {"queries": ["born"], "topk": 3})
        assert status == 200 and len(answer["result"][0]) == 3
        assert time.monotonic() - t < 3.0
        deadline, after = time.monotonic() + 10, health(url)
        while after["dropped"] + after["answered"] - before["answered"] < 31 and time.monotonic() < deadline:
            time.sleep(0.1)  # the requests still waiting for a reply slot see their client gone
            after = health(url)
        assert after["answered"] - before["answered"] <= 3  # ours and at most the 2 replies being built
        assert after["dropped"] >= 25 and after["status"] == "ok"


def test_each_request_reads_passages_for_its_own_topk_only(bm25_dir, monkeypatch):
    """A topk-1 request batched with a topk-100 one reads 1 passage per query, not 100."""
    from search import server

    index = load_index(bm25_dir)
    reads, started, release = [0], threading.Event(), threading.Event()
    real_rows, real_get = server.search_rows, server.get_passage

    def rows(index, queries, k, method=""):
        if queries == ["block"]:  # holds the worker so the next two requests queue up together
            started.set()
            release.wait(10)
        return real_rows(index, queries, k, method)

    def get(corpus, row):
        reads[0] += 1
        return real_get(corpus, row)

    monkeypatch.setattr(server, "search_rows", rows)  # the names the server looks up
    monkeypatch.setattr(server, "get_passage", get)
    with app_server(index) as (url, _), ThreadPoolExecutor(3) as pool:
        blocker = pool.submit(post, url, {"queries": ["block"], "topk": 1})
        assert started.wait(10)
        wide = pool.submit(post, url, {"queries": ["born in the city"] * 8, "topk": 100})
        narrow = pool.submit(post, url, {"queries": ["born in the city"], "topk": 1})
        deadline = time.monotonic() + 10
        while health(url)["requests"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)
        release.set()
        answers = [f.result()[1]["result"] for f in (blocker, wide, narrow)]
        assert health(url)["batches"] == 2  # wide and narrow were searched in one batch
    assert [len(hs) for hs in answers[2]] == [1] and all(len(hs) == 100 for hs in answers[1])
    assert reads[0] == sum(len(hs) for a in answers for hs in a)  # (before: 8 x 100 + 100 for narrow)


def test_client_does_not_retry_a_refused_request(server):
    t = time.time()
    with pytest.raises(RetrieverError, match="refused the request: HTTP 422 .*topk must be"):
        http_retrieve(server, ["born"], 0, retries=5, backoff=2.0)
    assert time.time() - t < 2.0
    assert http_retrieve(server, ["", "born"], 2)[0] == []  # empty queries answered locally, no hits


def test_a_blank_query_is_searched_as_search_r1s_servers_search_it(server, search_world):
    """A blank query (Search-R1's `<search> </search>`, sent as "") is answered, not a 422 for the
    whole batch: on this hybrid index with the dense hits of the encoded blank, as Search-R1's E5
    server gives its top-k; rollout.search_r1_text's client sends it there (send_blank)."""
    status, body = post(server, {"queries": ["", "   ", "born"], "topk": 3, "return_scores": True})
    assert status == 200 and [len(hs) for hs in body["result"]] == [3, 3, 3]
    assert [h["document"]["id"] for h in body["result"][0]] == [h["document"]["id"] for h in body["result"][1]]
    sent = http_retrieve(server, ["", "born"], 3, send_blank=True)
    assert [h["document"] for h in sent[0]] == [h["document"] for h in body["result"][0]]
    assert http_retrieve(server, ["", "born"], 3)[0] == []  # other protocols: answered locally, as in process
    status, body = post(server, {"queries": [], "topk": 3})  # a turn where nobody searched
    assert (status, body) == (200, {"result": []})


def test_open_search_over_http_equals_in_process(server, search_world):
    world, corpus, index_dir = search_world
    questions = [q["question"] for q in world.questions["val"][:10]]
    remote = open_search(RetrieverConfig(url=server), corpus)(questions, 3)
    local = open_search(RetrieverConfig(index=str(index_dir)), corpus)(questions, 3)
    assert [[h["document"] for h in hs] for hs in remote] == [[h["document"] for h in hs] for hs in local]


def test_rollouts_see_the_same_observations_over_http(vllm_engine, micro):
    """The rollout loop with retriever.url set: same greedy records as with the in-process index."""
    from rollout import rollout_batch
    from search.tools import make_search_fn
    from trainer.engine import load_tokenizer
    from trainer.questions import load_questions

    _, cfg, policy, world = micro
    tokenizer = load_tokenizer(policy)
    questions = load_questions(world / "val.jsonl")[:8]

    local = rollout_batch(vllm_engine, tokenizer, questions, 1, make_search_fn(cfg, world / "corpus.jsonl", {}),
                          cfg.rollout, greedy=True)  # fmt: skip
    proc, url = start_server(world / "index-bm25")
    try:
        cfg.retriever.url = url
        remote = rollout_batch(vllm_engine, tokenizer, questions, 1, make_search_fn(cfg, world / "corpus.jsonl", {}),
                               cfg.rollout, greedy=True)  # fmt: skip
    finally:
        cfg.retriever.url = ""
        proc.terminate()
        proc.wait(timeout=30)
    assert sum(r["num_searches"] for r in local) > 0
    assert [r["response_ids"] for r in remote] == [r["response_ids"] for r in local]
    assert [r["loss_mask"] for r in remote] == [r["loss_mask"] for r in local]


def test_server_bound_to_loopback_is_not_reachable_on_other_addresses(server, search_world):
    """Default bind is 127.0.0.1 (the module's server): the port is open there and closed on the
    machine's other address; a server bound to 0.0.0.0 is reached there."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # UDP: picks the outgoing interface, sends nothing
            other = s.getsockname()[0]
        except OSError:
            other = "127.0.0.1"
    if other.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address")
    port = int(server.rsplit(":", 1)[1])
    wide, wide_url = start_server(search_world[2], "--host", "0.0.0.0")
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        with pytest.raises(OSError):
            socket.create_connection((other, port), timeout=2).close()
        socket.create_connection((other, int(wide_url.rsplit(":", 1)[1])), timeout=2).close()  # the check can fail
    finally:
        wide.terminate()
        assert "warning: binding 0.0.0.0" in wide.communicate(timeout=30)[0]


@pytest.fixture(scope="module")
def default_server(bm25_dir):
    """The BM25 index served with the client's limits: 512 queries of at most 2,048 characters a
    request (retriever.max_queries_per_request, max_query_chars; the server takes 16,384 by default)."""
    proc, url = start_server(bm25_dir, "--max-queries", "512", "--max-query-chars", "2048")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def world_queries(world, n: int) -> list[str]:
    """n distinct queries about the world's passages (their titles, in four phrasings)."""
    titles = sorted({d["contents"].split("\n")[0].strip('"') for d in world.corpus})
    return [f"{t} {w}" for w in ("born", "city", "country", "lived") for t in titles][:n]


def test_a_batch_over_the_servers_limit_goes_in_requests_and_comes_back_in_order(default_server, bm25_dir,
                                                                               search_world):  # fmt: skip
    """1,300 queries, through the config's own path (open_search): three requests of at most 512,
    every answer at its own query's place (before: one request, a 413 that ended the run)."""
    queries = world_queries(search_world[0], 1300)
    assert len(set(queries)) == 1300
    before = health(default_server)
    hits = open_search(RetrieverConfig(url=default_server))(queries, 3)
    after = health(default_server)
    assert after["requests"] - before["requests"] == 3 and after["queries"] - before["queries"] == 1300
    local = search(load_index(bm25_dir), queries, 3)
    assert [[h["document"]["id"] for h in hs] for hs in hits] == [[h["document"]["id"] for h in hs] for hs in local]
    assert RetrieverConfig().max_queries_per_request == 512 <= Limits().max_queries


def test_a_query_over_the_servers_length_limit_is_cut_and_answered(default_server, bm25_dir, search_world, capsys):
    """A 3,000-character query among others is cut to retriever.max_query_chars (2,048, the
    server's default) and gets the hits of its first 2,048 characters, not a 413; the cut is said
    in one warning line, once."""
    short = world_queries(search_world[0], 2)
    long = (short[0] + " " + "lorem ipsum dolor " * 200)[:3000]
    search_fn = open_search(RetrieverConfig(url=default_server))
    hits = search_fn([short[0], long, short[1]], 3)
    local = search(load_index(bm25_dir), [short[0], long[:2048], short[1]], 3)
    assert hits[1] and [[h["document"]["id"] for h in hs] for hs in hits] == [
        [h["document"]["id"] for h in hs] for hs in local]  # fmt: skip
    search_fn([long, long], 3)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "1 of 3 queries" in warnings[0] and "max_query_chars = 2048" in warnings[0]
    assert RetrieverConfig().max_query_chars == 2048 == Limits().max_query_chars


def test_a_large_request_is_streamed_in_chunks_and_a_failure_midway_cuts_the_reply(bm25_dir, monkeypatch):
    """2,000 queries go to the index in chunks of at most 512 (before: one call, or a 413 past the
    limit) and come back whole and in order; a corpus changed after the first chunk was sent ends
    the transfer unfinished, which the client sees as an error, never as a whole reply."""
    from search import server
    from search.integrity import CorpusChanged

    index = load_index(bm25_dir)
    queries = [f"born in the city {i}" for i in range(2000)]
    body = json.dumps({"queries": queries, "topk": 3}).encode()
    with app_server(index) as (url, port):
        status, answer = post(url, body)
        assert status == 200 and len(answer["result"]) == 2000 and health(url)["batches"] == 4
        assert [[h["document"]["id"] for h in hs] for hs in answer["result"][::97]] == [
            [h["document"]["id"] for h in hs] for hs in search(index, queries[::97], 3)]  # fmt: skip
        reads, real_get = [0], server.get_passage

        def get(corpus, row):
            reads[0] += 1
            if reads[0] > 2000:  # in the second chunk's passages: the first went out with the 200
                raise CorpusChanged("corpus changed since the index was built")
            return real_get(corpus, row)

        monkeypatch.setattr(server, "get_passage", get)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/retrieve", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 200 and reply.getheader("transfer-encoding") == "chunked"
        with pytest.raises(http.client.IncompleteRead):
            reply.read()
        conn.close()
        assert health(url)["cut"] == 1
