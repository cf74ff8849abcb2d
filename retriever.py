"""Search over a wiki-18 style corpus: BM25 in process, hits rendered for the policy.

Corpus format (DESIGN.md §3): jsonl, one passage per line,
`{"id": str, "contents": "\\"Title\\"\\ntext", "url"?, "domain"?, "date"?}`.

    index = build_bm25(load_corpus("cache/tiny-xxxx/corpus.jsonl"))
    hits = search(index, ["Tavi Morek born", "Velor country"], k=3)   # one batched call
    format_hits(hits[0])
    # 'Doc 1(Title: Tavi Morek) Tavi Morek was born in the city of Velor.\\nDoc 2(Title: ...'

Documents and queries go through the same tokenizer (`bm25_tokenize`), so a query term always
matches the indexed form of that term (DESIGN §7: a stemmer on one side only breaks recall).

Import order matters on vLLM CPU: bm25s imports numba/llvmlite, and a vLLM engine constructed
after that fails to start (DESIGN §6). This module therefore imports bm25s only inside the
functions that need it, and `engine.make_engine` refuses to start once numba is loaded.

Run: `python retriever.py search --corpus cache/tiny-xxxx/corpus.jsonl "Tavi Morek born"`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from config import DataError


@dataclass
class BM25Index:
    corpus: list[dict]
    model: object  # bm25s.BM25


def load_corpus(path: str | Path) -> list[dict]:
    """Read a corpus jsonl; a missing file or a line without id/contents is a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    corpus = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not JSON ({e})") from None
            if not isinstance(doc, dict) or "id" not in doc or "contents" not in doc:
                raise DataError(f"{path}:{lineno}: a passage needs 'id' and 'contents'")
            corpus.append(doc)
    if not corpus:
        raise DataError(f"corpus file is empty: {path}")
    return corpus


def title_and_text(doc: dict) -> tuple[str, str]:
    """wiki-18 contents: first line is the title in double quotes, the rest is the text."""
    head, _, body = doc["contents"].partition("\n")
    return head.strip().strip('"'), body.strip()


def bm25_tokenize(texts: list[str]):
    """The one tokenizer for documents and queries: lower-case words, English stopwords."""
    import bm25s

    return bm25s.tokenize(texts, stopwords="en", show_progress=False)


def build_bm25(corpus: list[dict]) -> BM25Index:
    import bm25s

    model = bm25s.BM25()
    model.index(bm25_tokenize([d["contents"] for d in corpus]), show_progress=False)
    return BM25Index(corpus, model)


def search(index: BM25Index, queries: list[str], k: int = 3) -> list[list[dict]]:
    """Top-k passages for each query, in one batched call. Empty queries get no hits."""
    if not queries:
        return []
    k = min(k, len(index.corpus))
    results: list[list[dict]] = [[] for _ in queries]
    live = [i for i, q in enumerate(queries) if q.strip()]
    if not live:
        return results
    tokens = bm25_tokenize([queries[i] for i in live])
    # bm25s returns, for a query whose words are all unknown, arbitrary ids with score 0
    docs, scores = index.model.retrieve(tokens, k=k, show_progress=False, n_threads=0)
    for row, i in enumerate(live):
        results[i] = [
            {"document": index.corpus[int(d)], "score": float(s)}
            for d, s in zip(docs[row], scores[row])
            if s > 0
        ]
    return results


def format_hits(hits: list[dict]) -> str:
    """Search-R1's rendering: one `Doc i(Title: t) text` line per hit."""
    lines = []
    for i, hit in enumerate(hits, 1):
        title, text = title_and_text(hit["document"])
        lines.append(f"Doc {i}(Title: {title}) {text}")
    return "\n".join(lines) if lines else "No results."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("search", help="search a corpus with BM25 and print the rendered hits")
    s.add_argument("--corpus", required=True, help="corpus jsonl (wiki-18 format)")
    s.add_argument("query", nargs="+", help="one or more queries")
    s.add_argument("-k", type=int, default=3, help="passages per query (default 3)")
    args = parser.parse_args()
    index = build_bm25(load_corpus(args.corpus))
    for q, hits in zip(args.query, search(index, args.query, args.k)):
        print(f"## {q}\n{format_hits(hits)}\n")


if __name__ == "__main__":
    main()
