"""The retrieval client (search.client.http_retrieve, what rollouts call over HTTP) against
servers that misbehave, all on 127.0.0.1: nothing listening, a server that never answers or
trickles bytes, a 200 that is not Search-R1's format, a server down for 10 s then back, one that
never comes back. Its timeout bounds the whole call, it retries until that timeout, and every
failure is one line with the real figures.
"""

import contextlib
import http.server
import json
import re
import socket
import threading
import time

import pytest
from conftest import RawReply, free_port

from search.client import RetrieverError, http_retrieve
from search.tools import open_search
from trainer.config import RetrieverConfig


def test_client_retries_then_fails_clearly_when_nothing_listens():
    url = f"http://127.0.0.1:{free_port()}"
    t = time.time()
    with pytest.raises(RetrieverError, match=r"failed 3 attempt\(s\) in 0\.\d s \(timeout 1 s, retries 2\); .*Conn"):
        http_retrieve(url, ["born"], 3, timeout=1, retries=2, backoff=0.2)
    assert time.time() - t >= 0.2 + 0.4  # backoff 0.2 s, then 0.4 s


def test_client_times_out_on_a_server_that_never_answers():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)  # accepts connections, never replies
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    t = time.time()
    # the timeout bounds the whole call: the first attempt uses it all, no retry is left
    with pytest.raises(RetrieverError, match=r"failed 1 attempt\(s\) in \d\.\d s \(timeout 0.5 s\); .*TimeoutError"):
        http_retrieve(url, ["born"], 3, timeout=0.5, retries=1, backoff=0.1)
    assert 0.5 <= time.time() - t < 1.5
    sock.close()


@contextlib.contextmanager
def raw_server(respond, port: int = 0):
    """A stand-in server on 127.0.0.1 answering every POST with respond(handler); yields its URL."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), RawReply)
    srv.daemon_threads, srv.respond, srv.stopping = True, respond, threading.Event()
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.stopping.set()
        srv.shutdown()
        srv.server_close()


def canned(body: bytes, status: int = 200):
    head = b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
    return lambda h: h.wfile.write(head % (status, len(body)) + body)


@pytest.mark.parametrize("where", ["headers", "body"])
def test_client_timeout_bounds_the_whole_call_against_a_trickling_server(where):
    """A byte every 0.25 s: each socket read is quick, the call must still end at the timeout."""

    def respond(h):
        h.wfile.write(b"HTTP/1.1 200 OK\r\n" + (b"Content-Length: 1000\r\n\r\n" if where == "body" else b"X-Slow: "))
        for _ in range(40):  # at most 10 s
            if h.server.stopping.is_set():
                return
            h.wfile.write(b" ")
            h.wfile.flush()
            time.sleep(0.25)

    with raw_server(respond) as url:
        t = time.monotonic()
        with pytest.raises(RetrieverError, match=r"in 1\.\d s \(timeout 1 s\); last error: TimeoutError"):
            http_retrieve(url, ["born"], 3, timeout=1.0, retries=3, backoff=0.05)
        assert time.monotonic() - t < 2.0  # 1 s + slack, retries included (was ~10 s: the timeout was per read)


@pytest.mark.parametrize(
    "reply,why",
    [
        (b"<html><body>Welcome to nginx</body></html>", "not JSON"),
        (b'{"result": [[{"document": {"id": "1"', "not JSON"),
        (b'{"result": "\xff"}', "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
        (b'{"results": []}', "no 'result' list of 1 hit lists"),
        (b'{"result": []}', "no 'result' list of 1 hit lists"),
        (b'{"result": [[{"score": 1.0}]]}', "a hit list is not a list of"),
        (b'{"result": [[{"document": {"id": "1"}, "score": 1.0}]]}', "a hit list is not a list of"),
        (b'{"result": [[{"document": {"id": "1", "contents": ["x"]}}]]}', "a hit list is not a list of"),
    ],
)
def test_client_refuses_a_200_that_is_not_search_r1s_format(reply, why):
    """One RetrieverError naming the server and what is wrong, not a raw JSONDecodeError / KeyError;
    and no retry (the same server would answer the same)."""
    with raw_server(canned(reply)) as url:
        t = time.monotonic()
        with pytest.raises(RetrieverError, match=f"answered HTTP 200 but not in Search-R1's format \\({why}"):
            http_retrieve(url, ["born"], 3, timeout=5, retries=3, backoff=2.0)
        assert time.monotonic() - t < 1.5
        assert http_retrieve(url, [" "], 3) == [[]]  # nothing to ask: never sent


def test_client_rides_out_a_server_restarting_for_10_s():
    """Through the config's own path (open_search, retriever.timeout 30 s and retries 3, the
    defaults): nothing listens on the port for 6 s, then a server there answers 503 until 10 s,
    then hits. The client keeps trying (backoff 0.5, 1, 2, 4, 4 s) and gets them at ~11.5 s
    (before: it gave up after 0.5 + 1 + 2 s of backoff, 'in the 30 s timeout')."""
    hit = {"document": {"id": "p1", "contents": '"Tavi Morek"\nborn'}, "score": 1.0}
    port, start = free_port(), time.monotonic()

    def respond(h):
        if time.monotonic() - start < 10:
            canned(b'{"error": "index loading"}', 503)(h)
        else:
            canned(json.dumps({"result": [[hit]]}).encode())(h)

    later = contextlib.ExitStack()
    opener = threading.Timer(6.0, lambda: later.enter_context(raw_server(respond, port)))
    opener.start()
    try:
        hits = open_search(RetrieverConfig(url=f"http://127.0.0.1:{port}"))(["born"], 3)
    finally:
        opener.cancel()
        opener.join()
        later.close()
    assert hits == [[hit]]
    assert 10 <= time.monotonic() - start < 16


def test_client_gives_up_at_its_timeout_in_one_line_with_the_real_figures():
    """A server that never comes back: the error comes at the timeout (3 s) and names the
    attempts, the seconds spent, the timeout and the last cause, on one line. retries=0 is one
    attempt, and a 5xx's body with newlines still makes one line."""
    url = f"http://127.0.0.1:{free_port()}"
    t = time.monotonic()
    with pytest.raises(RetrieverError) as e:
        open_search(RetrieverConfig(url=url, timeout=3.0))(["born"], 3)
    spent = time.monotonic() - t
    found = re.fullmatch(r"retrieval server http://127.0.0.1:\d+/retrieve failed (\d+) attempt\(s\) in (\d+\.\d) s "
                         r"\(timeout 3 s\); last error: ConnectionRefusedError: .*", str(e.value))  # fmt: skip
    assert found, str(e.value)
    assert 2.5 <= spent < 4.5 and int(found[1]) >= 4 and abs(float(found[2]) - spent) < 0.3  # 0, .5, 1.5, 2.9 s
    t = time.monotonic()
    with raw_server(canned(b"<html>\n<h1>502 Bad Gateway</h1>\n</html>\n", 502)) as down:
        with pytest.raises(RetrieverError) as e:
            open_search(RetrieverConfig(url=down, timeout=3.0, retries=0))(["born"], 3)
    spent = time.monotonic() - t
    assert spent < 1.0  # one attempt, no back-off: a busy CI machine takes ~0.2 s, not the 3 s timeout
    assert "\n" not in str(e.value)
    found = re.search(r"failed 1 attempt\(s\) in (\d+\.\d) s \(timeout 3 s, retries 0\); "
                      r"last error: HTTP 502 <html> <h1>502 Bad Gateway</h1> </html>$", str(e.value))  # fmt: skip
    assert found and float(found[1]) <= spent + 0.05, str(e.value)
