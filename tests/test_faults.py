"""A bounded fault probe of the retrieval server, on 127.0.0.1 only: slow-body clients, clients
that abort while their work is queued, and JSON nested 5,000 deep, all at once; /retrieve must
still answer within 1 s (through the rollouts' own client, whose timeout bounds the whole call)
and the server stays up. A few seconds in all, a fixed number of connections."""

import contextlib
import json
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import free_port

from search.client import http_retrieve
from search.index import build_index, load_index
from search.server import Limits, create_app
from tiny.world import generate_world, write_jsonl
from trainer.config import WorldConfig

N_SLOW, N_ABORTED, N_NESTED = 20, 30, 5


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")
    world = generate_world(WorldConfig(seed=5, n_people=150, n_cities=20, n_countries=5, n_val=5, n_test=5))
    write_jsonl(base / "corpus.jsonl", world.corpus)
    return load_index(build_index(base / "corpus.jsonl", base / "bm25"))


@contextlib.contextmanager
def app_server(index, limits: Limits):
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(index, limits), host="127.0.0.1", port=port, log_level="error"))
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


def send(port: int, body: bytes, length: int = -1) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    length = length if length >= 0 else len(body)
    s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length + body)
    return s


def answer(s: socket.socket) -> bytes:
    reply = b""
    while chunk := s.recv(65536):
        reply += chunk
    s.close()
    return reply


def test_faults_leave_retrieve_answering_within_a_second(index):
    limits = Limits()
    limits.body_timeout = 0.5
    with app_server(index, limits) as (url, port):
        assert http_retrieve(url, ["born"], 3, timeout=5)[0]  # warm
        slow = [send(port, b'{"queries": ["bo', length=200) for _ in range(N_SLOW)]  # the rest never comes
        work = json.dumps({"queries": [f"born in the city {i}" for i in range(128)], "topk": 100}).encode()
        aborted = [send(port, work) for _ in range(N_ABORTED)]
        nested = b'{"queries": ["a"], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        for _ in range(N_NESTED):
            req = urllib.request.Request(url + "/retrieve", nested, {"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=5)
            assert e.value.code == 400 and b"nested too deeply" in e.value.read()
        time.sleep(0.2)  # the aborted requests are read and queued
        answered_before = health(url)["answered"] - 1  # the warm-up's; a fast machine answers a batch in 0.2 s
        for s in aborted:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset
            s.close()
        t = time.monotonic()
        hits = http_retrieve(url, ["Where was someone born?"], 3, timeout=1.0, retries=0)
        assert len(hits[0]) == 3 and time.monotonic() - t < 1.0
        replies = [answer(s) for s in slow]  # each a 408 after 0.5 s, then a closed connection
        assert all(r.startswith(b"HTTP/1.1 408") for r in replies), replies[0][:200]
        deadline, after = time.monotonic() + 10, health(url)
        while after["dropped"] + after["answered"] < N_ABORTED + 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # requests still waiting for a reply slot see their client gone
            after = health(url)
        # every aborted request not answered before its client left is dropped, but for those in
        # hand as they left: a batch being searched (CHUNK_QUERIES // 128 = 4) or 2 replies being built
        assert after["status"] == "ok" and after["dropped"] >= N_ABORTED - answered_before - 4, (after, answered_before)


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return json.loads(r.read())


N_READERS = 30  # the case: 30 clients asking 512 queries x top-100 that never read their replies


def test_slow_readers_neither_starve_a_small_request_nor_keep_their_replies(index):
    """88e794b built the slow readers' replies one after another in the batching worker (a
    1-query request waited > 15 s behind them) and kept each until its client read it (450 MB
    for 30). Now a small request rides along in the next search, its reply is built apart, and
    a reply not read within `write_timeout` is dropped with its connection."""
    limits = Limits()
    limits.write_timeout = 1.0
    with app_server(index, limits) as (url, port):
        assert http_retrieve(url, ["born"], 3, timeout=5)[0]  # warm
        work = json.dumps({"queries": [f"born in the city {i}" for i in range(512)], "topk": 100}).encode()
        readers = []
        for _ in range(N_READERS):  # a small receive window: the kernel holds little of a reply for them
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(work) + work)
            readers.append(s)
        time.sleep(0.5)  # their searches and replies under way
        t = time.monotonic()
        hits = http_retrieve(url, ["Where was someone born?"], 3, timeout=30, retries=0)
        small = time.monotonic() - t
        print(f"1-query request beside {N_READERS} slow readers: {small:.2f} s")
        assert len(hits[0]) == 3 and small < 2.0, small
        deadline = time.monotonic() + 60
        while health(url)["write_timeouts"] < N_READERS and time.monotonic() < deadline:
            time.sleep(0.2)
        assert health(url)["write_timeouts"] == N_READERS  # every unread reply dropped
        head = readers[0].recv(4096)
        length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
        got = len(head) - head.index(b"\r\n\r\n") - 4 + len(answer(readers[0]))
        assert got < length  # the connection was closed mid-reply: the server kept nothing for it
        for s in readers[1:]:
            s.close()
