"""The request forms of the retrieval server (search/server.py), one per peer dialect, and its limits.

    parse_retrieve({"queries": ["born", ""], "topk": 3, "return_scores": True}, Limits())  # Search-R1, verl
    parse_retrieve({"query": "born", "top_k": 5}, Limits())                               # SkyRL, rLLM
    parse_access({"urls": ["p17"]}, Limits())                                             # ASearcher

Each check raises BadRequest(status, one line naming the key or limit); the server answers it.
Which peer's client each form follows, at which commit and in which file: docs/peers.md.
"""

import json
from dataclasses import dataclass

# A request is searched and answered in chunks: at most CHUNK_QUERIES queries (one index call; also
# the most queries the worker sends the index at once) and CHUNK_HITS passages (512 x 100, the
# largest reply the server built whole before it streamed): 16,384 x topk 3 is 32 chunks of 512,
# topk 1,000 chunks of 51 queries.
CHUNK_QUERIES = 512
CHUNK_HITS = 51_200
DEFAULT_TOPK = 3  # topk of a request that names none (Search-R1's retrieval_server.py --topk)


@dataclass
class Limits:
    # 16,384 queries a request: Search-R1's GRPO sends batch 512 x n_agent 5 = 2,560 in one POST
    max_queries: int = 16_384
    max_query_chars: int = 2048
    max_topk: int = 1_000
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


@dataclass
class Retrieve:
    """One /retrieve request, in whichever dialect it came: `single` is a {"query": ...} request
    (SkyRL's, rLLM's), answered in their reply shape (single_reply)."""

    queries: list[str]
    topk: int
    with_scores: bool
    single: bool = False


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


def check_topk(topk, limits: Limits, name: str = "topk") -> int:
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= limits.max_topk:
        raise BadRequest(422, f"{name} must be an integer from 1 to {limits.max_topk}, got {topk!r}")
    return topk


def check_query(q, limits: Limits, where: str = "query", blank_ok: bool = False) -> str:
    """`q` as a query (or id, url): a string within max_query_chars, valid Unicode; blank only
    where `blank_ok` (a /retrieve query: Search-R1 posts `<search> </search>` as "")."""
    if not isinstance(q, str):
        raise BadRequest(422, f"{where} must be a string, got {type(q).__name__}")
    if not blank_ok and not q.strip():
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


def check_list(data: dict, key: str, limits: Limits) -> list:
    """data[key], a list of at most max_queries items (none is fine: Search-R1 posts [] on a turn
    where no rollout searches, and its server answers {"result": []})."""
    items = data.get(key)
    if not isinstance(items, list):
        raise BadRequest(422, f"'{key}' must be a list of strings, got {type(items).__name__}")
    if len(items) > limits.max_queries:
        raise BadRequest(413, f"{len(items)} {key} in one request; the limit is {limits.max_queries}")
    return items


def parse_retrieve(data: dict, limits: Limits) -> Retrieve:
    """Validate a /retrieve request, in Search-R1's, verl's and ASearcher's form ({"queries": [..],
    "topk", "return_scores"}) or SkyRL's and rLLM's ({"query": str, "topk" or "top_k" or "k"}).

    >>> parse_retrieve({"query": "born", "top_k": 5}, Limits())
    Retrieve(queries=['born'], topk=5, with_scores=True, single=True)
    """
    if ("queries" in data) == ("query" in data):
        raise BadRequest(422, "a /retrieve request needs 'queries' (a list of strings) or 'query' (a string), one "
                         f"of the two; got keys {sorted(data)[:10]}")  # fmt: skip
    single = "query" in data
    if single:
        queries = [check_query(data["query"], limits, "query", blank_ok=True)]
    else:
        queries = check_list(data, "queries", limits)
        for i, q in enumerate(queries):
            check_query(q, limits, f"queries[{i}]", blank_ok=True)
    # Default true, as before and as rLLM's server. Search-R1's and ASearcher's servers declare false,
    # but no peer client leaves it out (docs/peers.md), and Search-R1's fails on it (a 500: its
    # batch_search then returns one list where two values are unpacked; two queries unpack, wrongly)
    with_scores = data.get("return_scores", True)
    if not isinstance(with_scores, bool):  # bool("false") is True
        raise BadRequest(422, f"return_scores must be true or false, got {with_scores!r}")
    name = next((k for k in ("topk", "top_k", "k") if data.get(k) is not None), "topk")  # rLLM's server's order
    return Retrieve(queries, check_topk(data.get(name, DEFAULT_TOPK), limits, name), with_scores, single)


def parse_access(data: dict, limits: Limits) -> list[str]:
    """Validate ASearcher's POST /access {"urls": [..]}."""
    urls = check_list(data, "urls", limits)
    return [check_query(u, limits, f"urls[{i}]", blank_ok=True) for i, u in enumerate(urls)]


def chunk_size(topk: int) -> int:
    """Queries a chunk of a request holds at this topk (CHUNK_QUERIES, CHUNK_HITS).

    >>> chunk_size(3), chunk_size(100), chunk_size(1000)
    (512, 512, 51)
    """
    return max(1, min(CHUNK_QUERIES, CHUNK_HITS // topk))
