"""A second, independent retrieval server: the minimal Search-R1 wire format and nothing else.

    python tests/search_r1_wire_server.py CORPUS_JSONL PORT LOG

Standard library only, none of search/: POST /retrieve {"queries": [..], "topk": k,
"return_scores": bool} -> {"result": [[{"document": line, "score": s}, ..], ..]} (documents alone
when return_scores is false), as Search-R1's retrieval_server.py (a14dc3a) answers; anything else
is a 404. Its ranking is its own: passages by how many of the query's lower-cased words they hold.
Each request's query count is appended to LOG, one line each, so a test sees what the trainer sent.
tests/test_peer_clients.py runs train.py against it.
"""

import json
import re
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WORD = re.compile(r"\w+")


def ranked(corpus: list[dict], words: list[set[str]], query: str, k: int) -> list[tuple[int, int]]:
    """(row, score) of the k passages sharing most words with `query`, ties by row; none share: none."""
    want = set(WORD.findall(query.lower()))
    scores = [(len(want & w), row) for row, w in enumerate(words)]
    return [(row, s) for s, row in sorted(scores, key=lambda x: (-x[0], x[1]))[:k] if s > 0]


def main(corpus_path: str, port: int, log_path: str) -> None:
    corpus = [json.loads(line) for line in open(corpus_path, encoding="utf-8")]
    words = [set(WORD.findall(d["contents"].lower())) for d in corpus]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path != "/retrieve":
                self.send_error(404)
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            k, scores = body.get("topk") or 3, body.get("return_scores", False)
            result = []
            for query in body["queries"]:
                hits = ranked(corpus, words, query, k)
                result.append([{"document": corpus[r], "score": s} if scores else corpus[r] for r, s in hits])
            with open(log_path, "a") as log:
                log.write(f"{len(body['queries'])}\n")
            reply = json.dumps({"result": result}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print("serving", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
