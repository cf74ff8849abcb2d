"""HTTP retrieval server speaking the retrieval dialects of the field's search-agent trainers.

    python retriever.py serve --index idx/bm25 --port 8000        # binds 127.0.0.1 by default

    POST /retrieve  {"queries": ["Tavi Morek born"], "topk": 3, "return_scores": true}
                 -> {"result": [[{"document": {"id": "p17", "contents": "\\"Tavi Morek\\"\\n...", "url": "p17"},
                                  "score": 7.3}, ...]]}
                    return_scores false (ASearcher's): {"result": [[document, ...]]}; left out: true
                    (Search-R1's server declares false, then answers it with a 500: docs/peers.md)
    POST /retrieve  {"query": "Tavi Morek born", "topk": 3}  (or "top_k", or "k": SkyRL's and rLLM's one query)
                 -> {"result": [hits], "results": hits, "query": ..., "num_results": n}
    POST /access    {"urls": ["p17", ...]}  -> {"result": [document or null, ...]}   ASearcher's page access
    POST /search    {"query": "Tavi Morek site:tinypedia.org", "topk": 5}   web_search (operators)
    POST /read      {"id": "p17", "max_tokens": 512}                          read one source
    GET  /health    {"status": "ok", "n_docs": ..., "requests": ..., "batches": ..., "dropped": ..., "answered": ...}
                    (503 {"status": "corpus changed" | "index changed", "reason": "... changed since ..."})

Which peer's client each form follows (Search-R1 a14dc3a, verl b178a3c, SkyRL a956457, rLLM
7982c508, ASearcher 813e804), file by file, and what differs from their own servers:
docs/peers.md; tests/test_peer_clients.py replays each client against this server with its
default flags. A document on the wire is the corpus line with `url` added where the line has
none (then it holds the passage's id, which /access and /read take back). An empty `queries` list
is {"result": []}; a blank query is searched like any other (BM25: no words, no hits; dense: the
passages nearest the encoded blank, as Search-R1's dense server gives).

Requests are limited (flags of `retriever.py serve`): queries per request (16,384), characters
per query (2,048), topk (1,000) and the body size they imply; each violation gets a 4xx naming the
limit and the server stays up. A large request is searched and answered in chunks of at most
CHUNK_QUERIES queries and CHUNK_HITS passages, its reply streamed chunk by chunk (chunked
transfer encoding), so memory is bounded by a chunk, not by the request; a failure after the first
chunk (a corpus changed mid-reply) ends the reply unfinished, never with passages of another text.
Malformed input (bad UTF-8 or JSON, lone surrogates, JSON nested too deep, a non-bool
return_scores) is a 4xx too, a body not received within `body_timeout` s a 408 and a
closed connection, and so are request headers not received within `header_timeout` s
(header_timeout_protocol: uvicorn itself never times them out). Concurrent /retrieve
requests are batched: one worker task drains the queue and sends every waiting chunk to the
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

from search.corpus import get_passage
from search.index import dense_search, load_index, rrf, search_rows
from search.integrity import CorpusChanged
from search.web import find_row, read, web_search
from search.wire import (
    CHUNK_QUERIES,
    BadRequest,
    Limits,
    Retrieve,
    check_query,
    check_topk,
    chunk_size,
    parse_access,
    parse_json_body,
    parse_retrieve,
)

DRAIN_BYTES = 64 * 2**20
WRITE_PIECE = 1 << 16  # bytes of a /retrieve reply sent at a time (TimedReply)
SMALL = 16  # queries: a request this small joins the next search whatever is queued before it (next_batch)
SMALL_REPLY = 1_000  # passages: a reply this small is built in its own threads, never behind big ones


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
    add_retrieve), /search, /read, /access and /health (add_lookups), sharing one dict of counters
    (/health's; `cut`: streamed replies ended unfinished by a failure after their first chunk)."""
    from fastapi import FastAPI

    app = FastAPI(title="search-agent retriever")
    stats = {"requests": 0, "batches": 0, "queries": 0, "dropped": 0, "answered": 0, "write_timeouts": 0, "cut": 0}
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
        (its flow control), so a slow reader holds one piece in its buffers, not the reply.
        `body` is the whole reply (sent with its length) or an async iterator of its parts (sent
        chunked as they come: a part that fails ends the reply unfinished, which a client sees as
        a cut transfer, never as a whole reply)."""

        def __init__(self, body, timeout: float, stats: dict):
            whole = isinstance(body, bytes)
            super().__init__(body if whole else b"", media_type="application/json")
            if not whole:  # no length: uvicorn sends the parts with chunked transfer encoding
                self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
            self.parts, self.timeout, self.stats = body, timeout, stats

        async def __call__(self, scope, receive, send) -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            parts, self.body = self.parts, b""
            if isinstance(parts, bytes):
                await self.send_pieces(send, parts, last=True)
                return
            try:
                async for part in parts:
                    if not await self.send_pieces(send, part, last=False):
                        return
                await self.send_pieces(send, b"", last=True)
            except ConnectionError:  # the client has gone (rest): nobody to tell
                pass
            except Exception as e:  # noqa: BLE001 - the status is sent: only a cut reply can say it
                self.stats["cut"] += 1
                print(f"warning: /retrieve reply cut: {type(e).__name__}: {e}", flush=True)
            finally:
                await parts.aclose()

        async def send_pieces(self, send, body: bytes, last: bool) -> bool:
            """Send `body` in WRITE_PIECE pieces (more to come unless `last`); False once timed out."""
            for start in range(0, max(len(body), 1), WRITE_PIECE):
                piece = {"type": "http.response.body", "body": body[start : start + WRITE_PIECE],
                         "more_body": not last or start + WRITE_PIECE < len(body)}  # fmt: skip
                try:
                    await asyncio.wait_for(send(piece), self.timeout)
                except TimeoutError:
                    self.stats["write_timeouts"] += 1
                    return False
            return True

    return TimedReply


def as_sent(doc: dict) -> dict:
    """A corpus line as /retrieve sends it: with `url` set to its id where the line has none
    (ASearcher's client reads each document's url; /access and /read take the id back)."""
    if not doc.get("url"):
        doc["url"] = str(doc["id"])
    return doc


def hit_lists(index, rows: list[list[tuple[int, float]]], topk: int, with_scores: bool) -> list[str]:
    """Each query's hit list as JSON: its passages read for its own topk, each list dumped on its
    own. Run in a thread: returning the dict made FastAPI encode it on the event loop
    (jsonable_encoder, 1.9 s for 512 queries x 100 passages, then 0.4 s of json.dumps), and
    /health waited behind it; and one json.dumps of the whole reply would hold the GIL as long,
    where one per hit list lets the loop in between."""
    lists = []
    for hits in rows:
        docs = [as_sent(get_passage(index.corpus, row)) for row, _ in hits[:topk]]
        items = [{"document": d, "score": score} for d, (_, score) in zip(docs, hits)] if with_scores else docs
        lists.append(json.dumps(items, ensure_ascii=False, allow_nan=False, separators=(",", ":")))
    return lists


def reply_part(index, rows: list[list[tuple[int, float]]], req: Retrieve) -> bytes:
    """A chunk's hit lists, comma-separated: a piece of a {"queries"} reply's "result" list, or a
    {"query"} request's whole reply (single_reply)."""
    lists = hit_lists(index, rows, req.topk, req.with_scores)
    if not req.single:
        return ",".join(lists).encode()
    return single_reply(req.queries[0], lists[0], len(rows[0][: req.topk])).encode()


def single_reply(query: str, hits: str, n: int) -> str:
    """A {"query": ...} request's reply: SkyRL's client reads "result" (a list of one hit list, as
    SkyRL's server sends), rLLM's "results" (the hit list, as rLLM's server sends, with "query" and
    "num_results"); both keys, so one request form serves both.

    >>> single_reply("born", "[]", 0)
    '{"result":[[]],"results":[],"query":"born","num_results":0}'
    """
    return f'{{"result":[{hits}],"results":{hits},"query":{json.dumps(query, ensure_ascii=False)},"num_results":{n}}}'


def access_pages(index, urls: list[str]) -> dict:
    """ASearcher's /access: {"result": [the passage whose url (or id: a /retrieve document's url
    where the corpus has none) is each of `urls`, as /retrieve sends it, or None]}. A page is one
    passage here: ASearcher's own server reads whole web pages from a separate pages file."""
    if index.guard is not None:  # as search_rows: never a passage of a corpus edited since the build
        index.guard.check()
    rows = [find_row(index, url.strip()) if url.strip() else None for url in urls]
    return {"result": [None if row is None else as_sent(get_passage(index.corpus, row)) for row in rows]}


def search_chunk(index, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
    """search_rows, with a blank query searched as Search-R1's servers search it: its dense server
    embeds "" like any other query (top-k: the passages nearest the encoded blank); BM25 has no
    word to match (pyserini's Lucene and ours: no hits). Hybrid: those dense hits, RRF-scored."""
    rows = search_rows(index, queries, k)
    method = index.meta["method"]
    blank = [i for i, q in enumerate(queries) if not q.strip()]
    if blank and method != "bm25":
        dense = dense_search(index, [queries[i] for i in blank], k if method == "dense" else 4 * k)
        for i, hits in zip(blank, dense):
            rows[i] = hits if method == "dense" else rrf([[], hits], k)
    return rows


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
        batch = next_batch(pending, CHUNK_QUERIES)
        queries = [q for b in batch for q in b[0]]
        try:
            rows = await asyncio.to_thread(search_chunk, index, queries, max(b[1] for b in batch))
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
    """POST /retrieve: a request's queries, chunk by chunk (wire.chunk_size), join the queue one
    worker task (drain) searches in batches; each chunk's passages are then read and its part of
    the reply written in a thread (reply_part). A reply of one chunk is sent whole, a longer one
    streamed: the next chunk is searched while this one is written, so a request holds at most two
    chunks, whatever its size."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    TimedReply = timed_reply_type()
    queue: asyncio.Queue = asyncio.Queue()  # (queries, topk, future, request)
    worker: list[asyncio.Task] = []
    # Replies are built in threads (GIL-bound JSON): big ones two at a time, so the event loop and the
    # small ones, in threads of their own, are never queued behind them. A request waits for its
    # slot here, not in a pool's queue, so a client gone meanwhile is seen before its passages are read.
    pools = {size: (asyncio.Semaphore(2), ThreadPoolExecutor(2, thread_name_prefix=f"{size}-replies"))
             for size in ("big", "small")}  # fmt: skip

    async def searched(queries: list[str], topk: int, request) -> list | None:
        """The chunk's (row, score) lists; None if its client has gone."""
        if not worker:
            worker.append(asyncio.create_task(drain(index, limits, queue, stats)))
        fut = asyncio.get_running_loop().create_future()
        await queue.put((queries, topk, fut, request))
        return await fut

    async def part(search: asyncio.Task, req: Retrieve, request) -> bytes | None:
        """The chunk's part of the reply (reply_part) once `search` is done; None if its client has gone."""
        rows = await search
        slots, pool = pools["small" if len(rows or ()) * req.topk <= SMALL_REPLY else "big"]
        async with slots:
            if rows is None or await request.is_disconnected():  # gone before its passages are read
                stats["dropped"] += rows is not None
                return None
            try:
                return await asyncio.get_running_loop().run_in_executor(pool, reply_part, index, rows, req)
            except Exception as e:  # noqa: BLE001 - the exception handlers answer it
                raise await said(index, e) from None

    async def rest(first: bytes, chunks: list[list[str]], search: asyncio.Task, req: Retrieve, request):
        """A streamed reply's parts: the first chunk's, then each next one's, searched one ahead."""
        try:
            yield b'{"result":[' + first
            for i in range(1, len(chunks)):
                this, search = search, None
                if i + 1 < len(chunks):
                    search = asyncio.create_task(searched(chunks[i + 1], req.topk, request))
                got = await part(this, req, request)
                if got is None:
                    raise ConnectionError("client disconnected")
                yield b"," + got
            yield b"]}"
            stats["answered"] += 1
        finally:
            if search is not None:
                search.cancel()

    @app.post("/retrieve")
    async def retrieve(request: Request):
        req = parse_retrieve(await read_body(request, limits), limits)
        stats["requests"] += 1
        if not req.queries:  # a turn where no rollout searched: Search-R1's server answers this
            stats["answered"] += 1
            return TimedReply(b'{"result":[]}', limits.write_timeout, stats)
        n = chunk_size(req.topk)
        chunks = [req.queries[at : at + n] for at in range(0, len(req.queries), n)]
        search = asyncio.create_task(searched(chunks[0], req.topk, request))
        ahead = asyncio.create_task(searched(chunks[1], req.topk, request)) if len(chunks) > 1 else None
        try:
            first = await part(search, req, request)
        except BaseException:
            if ahead is not None:
                ahead.cancel()
            raise
        if first is None:
            if ahead is not None:
                ahead.cancel()
            return JSONResponse({"error": "client disconnected"}, status_code=499)
        if ahead is None:
            stats["answered"] += 1
            return TimedReply(first if req.single else b'{"result":[' + first + b"]}", limits.write_timeout, stats)
        return TimedReply(rest(first, chunks, ahead, req, request), limits.write_timeout, stats)


def add_lookups(app, index, limits: Limits, stats: dict) -> None:
    """POST /search (web_search, operators), POST /read (one source), POST /access (ASearcher's
    pages: access_pages) and GET /health."""
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

    @app.post("/access")
    async def access(request: Request):
        urls = parse_access(await read_body(request, limits), limits)
        return await asyncio.to_thread(access_pages, index, urls)

    @app.get("/health")
    async def health():
        why = await asyncio.to_thread(index.guard.reason) if index.guard else None  # hashes: off the loop
        changed = "corpus changed" if why and str(index.guard.corpus.path) in why else "index changed"
        status = {"status": changed, "reason": why} if why else {"status": "ok"}
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
