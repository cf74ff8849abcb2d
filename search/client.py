"""The client of a Search-R1 /retrieve server (search/server.py's, or Search-R1's own): what
rollouts call over HTTP (search/tools.open_search), and the POST the judge client shares.

    hits = http_retrieve("http://127.0.0.1:8000", ["Tavi Morek born"], k=3, timeout=30)

The client (`http_retrieve`) has a timeout that bounds the whole call (retries and a server
that trickles bytes included). It retries 5xx and connection errors until that timeout, with
exponential backoff capped at `max_backoff` s, so a server restarting for 10 s of a 30 s timeout
is ridden out; it never retries a 4xx (the request itself is wrong). Every failure is one
RetrieverError with a one-line message (attempts, seconds spent, the timeout, the last cause).
It sends a batch in requests of at most the server's default --max-queries and cuts each query to
its --max-query-chars (retriever.max_queries_per_request, retriever.max_query_chars), so a rollout
batch of 1,300 queries or a 3,000-character query is answered, not refused with a 413.
"""

import http.client
import json
import math
import socket
import sys
import threading
import time
import urllib.parse

LAST_TRY = 0.1  # s: the client's pauses end this long before its deadline, for one last attempt


class RetrieverError(RuntimeError):
    """The retrieval server could not answer (after retries) or refused the request."""


def post_by(endpoint: str, data: bytes, deadline: float) -> tuple[int, bytes]:
    """POST JSON `data` -> (HTTP status, reply body) by `deadline`: post_reply without the headers."""
    status, reply, _ = post_reply(endpoint, data, deadline)
    return status, reply


def post_reply(endpoint: str, data: bytes, deadline: float) -> tuple[int, bytes, http.client.HTTPMessage]:
    """POST JSON `data` -> (HTTP status, reply body, reply headers: .get is case-insensitive), all
    of it (connect, send, status line, headers, body) over by `deadline` (a time.monotonic()
    value). A socket timeout alone bounds each read, not the call: a server trickling a byte a
    second held a 2 s call for 25 s. At the deadline a watchdog shuts the socket down and the call
    raises TimeoutError. Transport failures raise OSError or http.client.HTTPException
    (IncompleteRead, BadStatusLine, ...); a URL that is not http(s) raises ValueError."""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {endpoint!r}")
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, parts.port, timeout=left)
    expired = threading.Event()

    def expire():
        expired.set()  # before reading conn.sock: a connect that finishes later sees the flag
        if conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked read
            except OSError:
                pass

    watchdog = threading.Timer(left, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.connect()
        if expired.is_set():
            raise TimeoutError("timed out")
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        reply = resp.read()
    except (OSError, http.client.HTTPException):
        if expired.is_set():
            raise TimeoutError("timed out") from None
        raise
    finally:
        watchdog.cancel()
        conn.close()
    if expired.is_set():  # a reply cut short by the watchdog can still parse: never trust it
        raise TimeoutError("timed out")
    return resp.status, reply, resp.headers


def search_r1_result(reply: bytes, n: int) -> list[list[dict]]:
    """A /retrieve reply body -> its `result` (n lists of hits); ValueError naming what is wrong."""
    try:
        data = json.loads(reply)
    except (ValueError, RecursionError) as e:  # HTML, truncated JSON, bad UTF-8, absurd nesting
        raise ValueError(f"not JSON ({type(e).__name__})") from None
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, list) or len(result) != n:
        raise ValueError(f"no 'result' list of {n} hit lists")
    for hits in result:  # the rollout renders each document's contents (corpus.format_hits)
        if not isinstance(hits, list) or not all(isinstance(h, dict) and isinstance(h.get("document"), dict)
                                                 and isinstance(h["document"].get("contents"), str)
                                                 for h in hits):  # fmt: skip
            raise ValueError("a hit list is not a list of {'document': {'contents': '...', ...}, 'score': ...}")
    for q, hits in enumerate(result):
        for h, hit in enumerate(hits):
            check_score(hit, f"result[{q}][{h}].score")
    return result


def check_score(hit: dict, where: str) -> None:
    """A hit's score is a finite number, or absent: `retriever.min_score` compares it (search/tools.py)
    mid-rollout, where "high" was a TypeError. A null score is taken for a missing one (dropped)."""
    if "score" not in hit:
        return
    score = hit["score"]
    if score is None:
        del hit["score"]
    elif not isinstance(score, (int, float)) or isinstance(score, bool) or not math.isfinite(score):
        raise ValueError(f"{where} must be a finite number, got {score!r}"[:120])


def one_line(text: str) -> str:
    """`text` with each run of whitespace, newlines included, as one space: errors are one line."""
    return " ".join(text.split())


def http_retrieve(
    url: str,
    queries: list[str],
    k: int,
    timeout: float = 30.0,
    retries: int | None = None,
    backoff: float = 0.5,
    max_backoff: float = 4.0,
    max_queries: int = 512,
    max_query_chars: int = 2048,
    send_blank: bool = False,
) -> list[list[dict]]:
    """POST /retrieve (Search-R1 format) -> hits per query, in order. Blank queries are answered
    locally with no hits, as the in-process index answers them; with `send_blank`
    (rollout.search_r1_text) they go to the server as Search-R1's batch_search sends them (its
    postprocess_predictions turns `<search> </search>` into "", never dropped), and get what the
    server gives: Search-R1's E5 server its top-k, ours the same (search/server.py, search_chunk).

    The batch goes in requests of at most `max_queries` queries, each query cut to
    `max_query_chars` characters (retriever.max_queries_per_request and retriever.max_query_chars;
    the defaults are the server's own limits), so neither a large rollout batch nor a runaway query
    is a 413 that ends a run. The first cut is said once per server (a warning line on stderr).

    `timeout` bounds the whole call, every request of it: each attempt gets the time left. A
    connection error or a 5xx is retried until then (retries=None) or at most `retries` times per
    request (0: one attempt), after pauses of backoff, 2 backoff, 4 backoff, ... s capped at
    `max_backoff`, the last one cut short to leave LAST_TRY s for a last attempt. The defaults try
    at 0, 0.5, 1.5, 3.5, 7.5, 11.5, ... s: a server restarting for 10 s answers the attempt at
    11.5 s. (A count of 3 retries alone gave up after 3.5 s, whatever the timeout.) A 4xx is never
    retried (the request itself is wrong), nor a 200 that is not Search-R1's format (the same
    server would answer the same). Every failure raises RetrieverError, its message one line."""
    live = [i for i, q in enumerate(queries) if send_blank or q.strip()]
    out: list[list[dict]] = [[] for _ in queries]
    if not live:
        return out
    endpoint = url.rstrip("/") + ("" if url.rstrip("/").endswith("/retrieve") else "/retrieve")
    sent = [cut_query(queries[i], max_query_chars) for i in live]
    warn_cut(endpoint, sum(len(queries[i]) > max_query_chars for i in live), len(live), max_query_chars)
    start = time.monotonic()
    for at in range(0, len(live), max_queries):
        body = json.dumps({"queries": sent[at : at + max_queries], "topk": k, "return_scores": True}).encode()
        hits = post_retrieve(endpoint, body, len(sent[at : at + max_queries]), start, timeout, retries, backoff,
                             max_backoff)  # fmt: skip
        for i, h in zip(live[at : at + max_queries], hits):
            out[i] = h
    return out


def cut_query(query: str, max_chars: int) -> str:
    """The query as sent: whole, or (longer than the server takes) its first `max_chars`
    characters once leading whitespace is gone (so the cut never leaves only blanks)."""
    return query if len(query) <= max_chars else query.strip()[:max_chars]


_CUT_SAID: set[str] = set()  # servers already told about cut queries in this process


def warn_cut(endpoint: str, n_cut: int, n: int, max_chars: int) -> None:
    """One warning line per server and process that queries were cut, not one per query."""
    if n_cut and endpoint not in _CUT_SAID:
        _CUT_SAID.add(endpoint)
        print(f"warning: {n_cut} of {n} queries to {endpoint} are over retriever.max_query_chars = {max_chars} "
              "characters and were cut to it (said once)", file=sys.stderr, flush=True)  # fmt: skip


def post_retrieve(endpoint: str, body: bytes, n: int, start: float, timeout: float, retries: int | None,
                  backoff: float, max_backoff: float) -> list[list[dict]]:  # fmt: skip
    """One /retrieve request of `n` queries with http_retrieve's retries, by start + timeout."""
    deadline, pause = start + timeout, backoff
    last, attempts = "", 0
    while True:
        attempts += 1
        try:
            status, reply = post_by(endpoint, body, deadline)
        except ValueError as e:
            raise RetrieverError(one_line(f"retrieval server {endpoint}: {e}")) from None
        except (OSError, http.client.HTTPException) as e:  # TimeoutError and refused connections are OSErrors
            last = f"{type(e).__name__}: {e}"
        else:
            detail = one_line(reply[:300].decode(errors="replace"))
            if status < 500 and status != 200:  # the request itself is wrong: a retry would be too
                raise RetrieverError(f"retrieval server {endpoint} refused the request: HTTP {status} {detail}")
            if status == 200:
                try:
                    return search_r1_result(reply, n)
                except ValueError as e:
                    raise RetrieverError(
                        f"retrieval server {endpoint} answered HTTP 200 but not in Search-R1's format ({e}): "
                        f"{detail[:100]!r}"
                    ) from None
            last = f"HTTP {status} {detail}"
        left = deadline - time.monotonic()
        if (retries is not None and attempts > retries) or left < LAST_TRY:
            break
        time.sleep(min(pause, left - LAST_TRY))
        pause = min(2 * pause, max_backoff)
    capped = f", retries {retries}" if retries is not None and attempts > retries else ""
    raise RetrieverError(one_line(
        f"retrieval server {endpoint} failed {attempts} attempt(s) in {time.monotonic() - start:.1f} s "
        f"(timeout {timeout:g} s{capped}); last error: {last}"
    ))  # fmt: skip
