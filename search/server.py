"""HTTP retrieval server speaking Search-R1's wire format.

    python retriever.py serve --index idx/bm25 --port 8000        # binds 127.0.0.1 by default

    POST /retrieve  {"queries": ["Tavi Morek born"], "topk": 3, "return_scores": true}
                 -> {"result": [[{"document": {"id": "p17", "contents": "\\"Tavi Morek\\"\\n..."},
                                  "score": 7.3}, ...]]}
                    (return_scores false: {"result": [[document, ...]]}, as Search-R1's server)
    POST /search    {"query": "Tavi Morek site:tinypedia.org", "topk": 5}   web_search (operators)
    POST /read      {"id": "p17", "max_tokens": 512}                          read one source
    GET  /health    {"status": "ok", "n_docs": ..., "requests": ..., "batches": ..., "dropped": ..., "answered": ...}
                    (503 {"status": "corpus changed", "reason": "corpus ... changed since ..."})

Existing Search-R1 clients work unchanged against /retrieve. Unlike the reference server
(docs/design.md §7), requests are limited: body size, queries per request, characters per query
and topk are checked, and each violation gets a 4xx naming the limit; the server stays up.
Malformed input (bad UTF-8 or JSON, lone surrogates, JSON nested too deep, a non-bool
return_scores) is a 4xx too, a body not received within `body_timeout` s a 408 and a
closed connection, and so are request headers not received within `header_timeout` s
(header_timeout_protocol: uvicorn itself never times them out). Concurrent /retrieve
requests are batched: one worker task drains the queue and sends every waiting query to the
index in one call, so the dense encoder sees one batch, not many; requests whose client has
gone are dropped before their search and before their passages are read, and each request's
passages are read for its own topk only. The event loop only parses and routes: searching,
reading passages and writing the reply's JSON run in threads, the JSON one hit list at a time,
so /health answers at once beside replies of 512 queries x 100 passages. /search checks at most
`max_scan` candidates against its operators (web.filtered_hits). A corpus file changed under the
server (integrity.py: a stat each request, its hashes when the stat changes) is a 503 with the
reason on every endpoint, /health included, until it is restored; never passages of another text.

The client rollouts use is search/client.py.
"""

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from search.corpus import get_passage
from search.index import load_index, search_rows
from search.integrity import CorpusChanged
from search.web import read, web_search

DRAIN_BYTES = 64 * 2**20
WRITE_PIECE = 1 << 16  # bytes of a /retrieve reply sent at a time (TimedReply)
SMALL = 16  # queries: a request this small joins the next search whatever is queued before it (next_batch)
SMALL_REPLY = 1_000  # passages: a reply this small is built in its own threads, never behind big ones

@dataclass
class Limits:
    max_queries: int = 512
    max_query_chars: int = 2048
    max_topk: int = 100
    body_timeout: float = 10.0  # seconds to receive a request body; a slow client gets a 408
    # seconds for a request's headers to arrive, from the connection's opening or its last reply
    header_timeout: float = 10.0
    max_scan: int = 10_000  # /search: candidates checked against the operators (web.MAX_SCAN)
    # seconds a client may take to read each WRITE_PIECE of its reply; one that stops reading loses
    # its connection and the reply's memory (30 unread 512 x top-100 replies held 450 MB)
    write_timeout: float = 30.0

    @property
    def max_body_bytes(self) -> int:  # generous for JSON escaping; a hard cap before parsing
        return 16_384 + self.max_queries * (6 * self.max_query_chars + 16)


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def parse_json_body(body: bytes) -> dict:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(400, f"request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(400, f"request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:  # the parser recurses per level: [[[[... 5,000 deep
        raise BadRequest(400, "request body is JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise BadRequest(422, "request body must be a JSON object")
    return data


def check_topk(topk, limits: Limits) -> int:
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= limits.max_topk:
        raise BadRequest(422, f"topk must be an integer from 1 to {limits.max_topk}, got {topk!r}")
    return topk


def check_query(q, limits: Limits, where: str = "query") -> str:
    if not isinstance(q, str):
        raise BadRequest(422, f"{where} must be a string, got {type(q).__name__}")
    if not q.strip():
        raise BadRequest(422, f"{where} is empty")
    if not q.isascii():
        try:
            q.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON "\ud800": parses, but cannot be searched or echoed
            bad = f"\\u{ord(q[e.start]):04x}"
            raise BadRequest(422, f"{where} holds a lone surrogate ({bad} at character {e.start})") from None
    if len(q) > limits.max_query_chars:
        raise BadRequest(413, f"{where} has {len(q)} characters; the limit is {limits.max_query_chars}")
    return q


def parse_retrieve(data: dict, limits: Limits) -> tuple[list[str], int, bool]:
    """Validate a Search-R1 /retrieve request -> (queries, topk, return_scores)."""
    queries = data.get("queries")
    if not isinstance(queries, list) or not queries:
        raise BadRequest(422, "'queries' must be a non-empty list of strings")
    if len(queries) > limits.max_queries:
        raise BadRequest(413, f"{len(queries)} queries in one request; the limit is {limits.max_queries}")
    for i, q in enumerate(queries):
        check_query(q, limits, f"queries[{i}]")
    with_scores = data.get("return_scores", True)
    if not isinstance(with_scores, bool):  # bool("false") is True
        raise BadRequest(422, f"return_scores must be true or false, got {with_scores!r}")
    return queries, check_topk(data.get("topk", 3), limits), with_scores


def next_batch(pending: list[tuple], max_queries: int) -> list[tuple]:
    """The requests of the next index call, taken out of `pending` (queued (queries, ...) entries,
    oldest first): every small one (<= SMALL queries), then the others in order while the batch
    holds fewer than max_queries queries. A 1-query request so waits for the search in flight at
    most, not behind 30 queued requests of 512 queries each (88e794b: > 10 s).

    >>> pending = [(["q"] * 512,), (["q"] * 512,), (["q"],)]
    >>> [len(e[0]) for e in next_batch(pending, 512)], [len(e[0]) for e in pending]
    ([1, 512], [512])
    """
    batch = [e for e in pending if len(e[0]) <= SMALL]
    size = sum(len(e[0]) for e in batch)
    for entry in pending:
        if len(entry[0]) > SMALL and (size < max_queries or not batch):
            batch.append(entry)
            size += len(entry[0])
    taken = {id(e) for e in batch}
    pending[:] = [e for e in pending if id(e) not in taken]
    return batch


def create_app(index, limits: Limits):
    """The FastAPI app over a loaded `retriever.Index`: the error replies, /retrieve (batched,
    add_retrieve), /search, /read and /health (add_lookups), sharing one dict of counters."""
    from fastapi import FastAPI

    app = FastAPI(title="search-agent retriever")
    stats = {"requests": 0, "batches": 0, "queries": 0, "dropped": 0, "answered": 0, "write_timeouts": 0}
    add_error_replies(app)
    add_retrieve(app, index, limits, stats)
    add_lookups(app, index, limits, stats)
    return app


def add_error_replies(app) -> None:
    """A BadRequest is its 4xx, a corpus changed under the server a 503, anything else a 500."""
    from fastapi.responses import JSONResponse

    @app.exception_handler(BadRequest)
    async def bad_request(_, e: BadRequest):
        # after a 408 the rest of the body may still come: close rather than parse it as a request
        headers = {"Connection": "close"} if e.status == 408 else None
        return JSONResponse({"error": e.message}, status_code=e.status, headers=headers)

    @app.exception_handler(CorpusChanged)
    async def corpus_changed(_, e: CorpusChanged):
        return JSONResponse({"error": str(e)}, status_code=503)

    @app.exception_handler(Exception)
    async def server_error(_, e: Exception):
        return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=500)


def timed_reply_type() -> type:
    """TimedReply, a FastAPI Response (imported here, when a server is built)."""
    from fastapi.responses import Response

    class TimedReply(Response):
        """The reply in WRITE_PIECE pieces, each sent within `timeout` s (the client reading the one
        before); past it the rest is dropped and uvicorn closes the connection, counted in
        /health's write_timeouts. uvicorn waits for a client to read before it takes the next piece
        (its flow control), so a slow reader holds one piece in its buffers, not the reply."""

        def __init__(self, body: bytes, timeout: float, stats: dict):
            super().__init__(body, media_type="application/json")
            self.timeout, self.stats = timeout, stats

        async def __call__(self, scope, receive, send) -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            body, self.body = self.body, b""
            for start in range(0, len(body), WRITE_PIECE):
                piece = {"type": "http.response.body", "body": body[start : start + WRITE_PIECE],
                         "more_body": start + WRITE_PIECE < len(body)}  # fmt: skip
                try:
                    await asyncio.wait_for(send(piece), self.timeout)
                except TimeoutError:
                    self.stats["write_timeouts"] += 1
                    return

    return TimedReply


def reply_body(index, rows: list[list[tuple[int, float]]], topk: int, with_scores: bool) -> bytes:
    """One request's /retrieve reply, JSON bytes: its passages read for its own topk, each
    hit list dumped on its own. Run in a thread: returning the dict made FastAPI encode it
    on the event loop (jsonable_encoder, 1.9 s for 512 queries x 100 passages, then 0.4 s of
    json.dumps), and /health waited behind it; and one json.dumps of the whole reply would
    hold the GIL as long, where one per hit list lets the loop in between."""
    lists = []
    for hits in rows:
        docs = [get_passage(index.corpus, row) for row, _ in hits[:topk]]
        items = [{"document": d, "score": score} for d, (_, score) in zip(docs, hits)] if with_scores else docs
        lists.append(json.dumps(items, ensure_ascii=False, allow_nan=False, separators=(",", ":")))
    return ('{"result":[' + ",".join(lists) + "]}").encode()


async def gone(entry: tuple, stats: dict) -> bool:
    """Has this request's client disconnected? Then its future gets None and no more work."""
    if not await entry[3].is_disconnected():
        return False
    stats["dropped"] += 1
    if not entry[2].done():
        entry[2].set_result(None)
    return True


async def drain(index, limits: Limits, queue: asyncio.Queue, stats: dict) -> None:
    """The one worker task of /retrieve: searches the queued requests' queries batch by batch."""
    # Work of clients that have gone is skipped: 30 aborted requests of 512 queries x topk
    # 100 once held /retrieve for 20 s of searches nobody would read. A batch is one index
    # call (at its largest topk, next_batch: small requests first); each request then reads
    # its own passages for its own topk, in its handler, so the next search need not wait.
    pending: list[tuple] = []
    while True:
        if not pending:
            pending.append(await queue.get())
        while not queue.empty():
            pending.append(queue.get_nowait())
        pending = [entry for entry in pending if not await gone(entry, stats)]
        if not pending:
            continue
        batch = next_batch(pending, limits.max_queries)
        queries = [q for b in batch for q in b[0]]
        try:
            rows = await asyncio.to_thread(search_rows, index, queries, max(b[1] for b in batch))
            stats["batches"] += 1
            stats["queries"] += len(queries)
            at = 0
            for entry in batch:
                mine, at = rows[at : at + len(entry[0])], at + len(entry[0])
                if not entry[2].done():
                    entry[2].set_result(mine)
        except Exception as e:  # noqa: BLE001 - answered as a 500 to every request still waiting
            for b in batch:
                if not b[2].done():
                    b[2].set_exception(await said(index, e))


async def said(index, e: Exception) -> Exception:
    """A corpus rewritten under the server fails its passage reads: say that (a 503), not the error."""
    why = index.guard and await asyncio.to_thread(index.guard.reason)
    return CorpusChanged(why) if why else e


async def read_body(request, limits: Limits) -> dict:
    """The request's JSON body, within the limits (BadRequest otherwise)."""
    # An oversized body is read to the end and dropped (up to DRAIN_BYTES) so the client gets
    # the 413 instead of a connection reset; it is never held in memory. A body that has not
    # arrived within body_timeout s is a 408: a slow client cannot hold a connection forever.
    body, size = bytearray(), 0
    try:
        async with asyncio.timeout(limits.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size <= limits.max_body_bytes:
                    body += chunk
                elif size > DRAIN_BYTES:
                    break
    except TimeoutError:
        raise BadRequest(408, f"request body not received within {limits.body_timeout:g} s") from None
    if size > limits.max_body_bytes:
        raise BadRequest(
            413, f"request body over {limits.max_body_bytes} bytes; the limit is {limits.max_body_bytes}"
        )
    return parse_json_body(bytes(body))


def add_retrieve(app, index, limits: Limits, stats: dict) -> None:
    """POST /retrieve: each request's queries join the queue one worker task (drain) searches in
    batches; its passages are then read and its reply written in a thread (reply_body)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    TimedReply = timed_reply_type()
    queue: asyncio.Queue = asyncio.Queue()  # (queries, topk, future, request, return_scores)
    worker: list[asyncio.Task] = []
    # Replies are built in threads (GIL-bound JSON): big ones two at a time, so the event loop and the
    # small ones, in threads of their own, are never queued behind them. A request waits for its
    # slot here, not in a pool's queue, so a client gone meanwhile is seen before its passages are read.
    pools = {size: (asyncio.Semaphore(2), ThreadPoolExecutor(2, thread_name_prefix=f"{size}-replies"))
             for size in ("big", "small")}  # fmt: skip

    @app.post("/retrieve")
    async def retrieve(request: Request):
        queries, topk, with_scores = parse_retrieve(await read_body(request, limits), limits)
        stats["requests"] += 1
        if not worker:
            worker.append(asyncio.create_task(drain(index, limits, queue, stats)))
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        await queue.put((queries, topk, fut, request, with_scores))
        rows = await fut
        slots, pool = pools["small" if len(queries) * topk <= SMALL_REPLY else "big"]
        async with slots:
            if rows is None or await request.is_disconnected():  # gone before its passages are read
                stats["dropped"] += rows is not None
                return JSONResponse({"error": "client disconnected"}, status_code=499)
            try:
                body = await loop.run_in_executor(pool, reply_body, index, rows, topk, with_scores)
            except Exception as e:  # noqa: BLE001 - the exception handlers answer it
                raise await said(index, e) from None
        stats["answered"] += 1
        return TimedReply(body, limits.write_timeout, stats)


def add_lookups(app, index, limits: Limits, stats: dict) -> None:
    """POST /search (web_search, operators), POST /read (one source) and GET /health."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    @app.post("/search")
    async def web(request: Request):
        data = await read_body(request, limits)
        query, topk = check_query(data.get("query"), limits), check_topk(data.get("topk", 5), limits)
        if await request.is_disconnected():
            return JSONResponse({"error": "client disconnected"}, status_code=499)
        return await asyncio.to_thread(web_search, index, query, topk, limits.max_scan)

    @app.post("/read")
    async def read_doc(request: Request):
        data = await read_body(request, limits)
        key = check_query(data.get("id"), limits, "id")
        budget = data.get("max_tokens", 512)
        if not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget <= 100_000:
            raise BadRequest(422, f"max_tokens must be an integer from 1 to 100000, got {budget!r}")
        return await asyncio.to_thread(read, index, key, budget)

    @app.get("/health")
    async def health():
        why = await asyncio.to_thread(index.guard.reason) if index.guard else None  # hashes: off the loop
        status = {"status": "corpus changed", "reason": why} if why else {"status": "ok"}
        return JSONResponse(status | {"n_docs": len(index.corpus), "method": index.meta["method"], **stats},
                            status_code=503 if why else 200)  # fmt: skip


def header_timeout_protocol(header_timeout: float) -> type:
    """uvicorn's HTTP protocol (httptools or h11, whichever uvicorn would pick) that answers a
    408 and closes a connection whose request headers have not all arrived `header_timeout` s
    after it opened or after its last reply. uvicorn has no such bound: its keep-alive timer
    starts after a reply and the next byte cancels it, so half a request line held a connection
    open for good (>= 25 s in a probe; an app never sees a request before its headers end)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    message = json.dumps({"error": f"request headers not received within {header_timeout:g} s"}).encode()
    reply = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % len(message)
    reply += b"connection: close\r\n\r\n" + message

    class HeaderTimeoutProtocol(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.header_clock = None
            self.start_header_clock()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.start_header_clock()

        def connection_lost(self, exc) -> None:
            self.header_clock.cancel()
            super().connection_lost(exc)

        def start_header_clock(self) -> None:
            if self.header_clock is not None:
                self.header_clock.cancel()
            self.header_clock = self.loop.call_later(header_timeout, self.headers_late, self.cycle)

        def headers_late(self, cycle) -> None:
            # uvicorn starts a new cycle (one request) once a request's headers are in: the same
            # cycle as when the clock started, with no request of it still running, means none came
            if self.transport.is_closing() or self.cycle is not cycle:
                return
            if cycle is None or cycle.response_complete:
                self.transport.write(reply)
                self.transport.close()

    return HeaderTimeoutProtocol


def serve(args) -> None:
    """`retriever.py serve`: load the index, then run uvicorn until killed."""
    import uvicorn

    index = load_index(args.index, args.corpus, args.search_params, bm25_backend=args.bm25_backend,
                       faiss_on_gpus=True)  # one server per machine: the dense index over its GPUs
    limits = Limits(args.max_queries, args.max_query_chars, args.max_topk, write_timeout=args.write_timeout)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: binding {args.host}: the server is reachable beyond this machine", flush=True)
    print(
        f"serving {len(index.corpus)} passages ({index.meta['method']}) on http://{args.host}:{args.port}", flush=True
    )
    app, http = create_app(index, limits), header_timeout_protocol(limits.header_timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", http=http)
