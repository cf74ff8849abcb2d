"""Web-style search with advanced operators (WebFilter) and SEARCH -> READ (Deliberative Searcher).

WebFilter (Dai et al. 2025, §3) trains agents to restrict sources with operators; Deliberative
Searcher (§3.1) separates listing sources (SEARCH) from fetching one (READ). Both run over the
corpus metadata (`url`, `domain`, `date`) of an index built by retriever.py.

Operators (all honoured; anything else is plain text, e.g. `filetype:pdf` -> words):

    site:tinypedia.org      only that domain (several site: are alternatives)
    -site:rumormill.net     never that domain
    before:2015-06-01       dated strictly before (before:2015 = before 2015-01-01)
    after:2015              dated strictly after   (after:2015  = after 2015-12-31)
    "born in the city"      the exact phrase (case-insensitive, whole words)
    -rumor  NOT rumor       the word must not occur (stemmed: also "rumors")
    a AND b, a OR b         upper-case only; juxtaposition means AND; NOT > AND > OR

    web_search(index, 'Tavi Morek "born in" site:tinypedia.org', k=3)
    # {"query": ..., "error": None, "results": [{"id": "p17", "title": "Tavi Morek",
    #   "url": "https://tinypedia.org/wiki/Tavi_Morek", "date": "2011-03-09", "snippet": ...}]}
    web_search(index, "site:tinypedia.org")       # only operators: an error result, no crash
    # {"query": ..., "error": "the query has no search words, only operators ...", "results": []}
    read(index, "p17", max_tokens=50)   # {"id", "url", "title", "text", "truncated": False, ...}

Candidates come from the index's own ranking (BM25 or dense) over the query's positive words;
the operators then filter them, widening the candidate pool until k results pass, the whole
corpus has been considered, or MAX_SCAN candidates have been checked (a filter that nothing
passes would otherwise scan all of wiki-18, minutes per query). Operator words are recognised
in their upper-case form on the raw query; the text is never lower-cased before that
(docs/design.md §7).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from search.corpus import get_passage, iter_passages, title_and_text
from search.index import Index, bm25_tokenize, search, search_rows

# WebFilter's advanced operators (§3), matched on the raw query, case-sensitive: AND / OR / NOT only
# in upper case (a lower-cased "and" is a word), `-term` only at a word start. Its R_src reward
# (eq. 2-4, rewards.source_restricting) and the rule judge (agent/judge.py) read them from here.
SOURCE_OPERATORS = re.compile(r'(?:^|\s)-?(?:site|before|after):\S|"[^"]+"|\b(?:AND|OR|NOT)\b|(?:^|\s)-\w')
SNIPPET_CHARS = 200
MAX_SCAN = 10_000  # candidates checked against the operators per query (filtered_hits)


@dataclass
class Atom:
    """A word or phrase that must (or, under NOT, must not) occur."""

    text: str
    phrase: bool = False
    pattern: re.Pattern | None = None  # phrases: compiled once per query, not once per passage
    stems: list[str] = field(default_factory=list)  # words: stemmed once per query

    def __post_init__(self):
        if self.phrase:
            self.pattern = re.compile(r"(?<!\w)" + re.escape(" ".join(self.text.split())) + r"(?!\w)", re.I)
        else:
            self.stems = bm25_tokenize([self.text])[0]


@dataclass
class ParsedQuery:
    expr: object  # nested ("and"|"or", [..]) / ("not", x) / Atom; None when there is no text
    positive: list[str] = field(default_factory=list)  # text that ranks candidates
    sites: list[str] = field(default_factory=list)
    not_sites: list[str] = field(default_factory=list)
    before: str = ""
    after: str = ""


_TOKEN = re.compile(r'-?"[^"]*"?|\S+')
_DATE = re.compile(r"^(\d{4})(?:-(\d{2}))?(?:-(\d{2}))?$")


def _date_bound(value: str, end: bool) -> str:
    """'2015' -> '2015-01-01' (or '2015-12-31' if end); '' if the value is not a date."""
    m = _DATE.match(value)
    if not m:
        return ""
    y, mo, d = m.group(1), m.group(2), m.group(3)
    return f"{y}-{mo or ('12' if end else '01')}-{d or ('31' if end else '01')}"


def parse_query(query: str) -> ParsedQuery:
    """Split operators from text and build the boolean expression over words and phrases."""
    q = ParsedQuery(expr=None)
    items: list[object] = []  # Atom, ("neg", Atom) or the strings "AND" / "OR" / "NOT"
    for tok in _TOKEN.findall(query):
        neg = tok.startswith("-") and len(tok) > 1
        body = tok[1:] if neg else tok
        key, _, value = body.partition(":")
        if tok in ("AND", "OR", "NOT"):
            items.append(tok)
        elif key == "site" and value:
            (q.not_sites if neg else q.sites).append(value.lower())
        elif key in ("before", "after") and not neg and _date_bound(value, key == "after"):
            setattr(q, key, _date_bound(value, key == "after"))
        elif body.startswith('"'):
            phrase = body.strip('"').strip()
            if phrase:
                items.append(("neg", Atom(phrase, True)) if neg else Atom(phrase, True))
        else:  # a word, or an unknown operator treated as text
            for word in re.findall(r"\w+", body):
                items.append(("neg", Atom(word)) if neg else Atom(word))
    q.expr = _parse_or(items)
    q.positive = [a.text for a in _atoms(q.expr, negated=False)]
    return q


def _parse_or(items: list) -> object:
    """OR of AND-groups; a dangling operator is ignored rather than an error."""
    groups, cur = [], []
    for it in items:
        if it == "OR":
            groups.append(cur)
            cur = []
        else:
            cur.append(it)
    groups.append(cur)
    ands = [g for g in (_parse_and(g) for g in groups) if g is not None]
    return None if not ands else ands[0] if len(ands) == 1 else ("or", ands)


def _parse_and(items: list) -> object:
    terms, negate = [], False
    for it in items:
        if it == "NOT":
            negate = not negate
        elif it == "AND":
            continue
        else:
            atom_neg = isinstance(it, tuple)
            atom = it[1] if atom_neg else it
            terms.append(("not", atom) if atom_neg != negate else atom)
            negate = False
    return None if not terms else terms[0] if len(terms) == 1 else ("and", terms)


def _atoms(expr, negated: bool) -> list[Atom]:
    if expr is None:
        return []
    if isinstance(expr, Atom):
        return [] if negated else [expr]
    if expr[0] == "not":
        return _atoms(expr[1], not negated)
    return [a for sub in expr[1] for a in _atoms(sub, negated)]


def _holds(expr, words: set[str], text: str) -> bool:
    if isinstance(expr, Atom):
        if expr.phrase:
            return expr.pattern.search(text) is not None
        return all(s in words for s in expr.stems)  # a stopword alone constrains nothing
    if expr[0] == "not":
        return not _holds(expr[1], words, text)
    results = (_holds(sub, words, text) for sub in expr[1])
    return all(results) if expr[0] == "and" else any(results)


def _domain_of(doc: dict) -> str:
    if doc.get("domain"):
        return doc["domain"].lower()
    m = re.match(r"^[a-z]+://([^/:]+)", doc.get("url") or "", re.I)  # url may be null
    return m.group(1).lower() if m else ""


def _on_site(domain: str, site: str) -> bool:
    return domain == site or domain.endswith("." + site)


def matches(q: ParsedQuery, doc: dict) -> bool:
    """Does the passage pass every operator of the query?"""
    domain, date = _domain_of(doc), doc.get("date", "")
    if q.sites and not any(_on_site(domain, s) for s in q.sites):
        return False
    if any(_on_site(domain, s) for s in q.not_sites):
        return False
    if (q.before and not (date and date < q.before)) or (q.after and not (date and date > q.after)):
        return False
    if q.expr is None:
        return True
    text = " ".join(doc["contents"].split())
    return _holds(q.expr, set(bm25_tokenize([text])[0]), text)


def _snippet(text: str, words: list[str]) -> str:
    low = text.lower()
    at = min([p for p in (low.find(w.lower()) for w in words) if p >= 0], default=0)
    start = max(0, at - SNIPPET_CHARS // 4)
    cut = text[start : start + SNIPPET_CHARS]
    return ("..." if start else "") + cut + ("..." if start + SNIPPET_CHARS < len(text) else "")


def web_search(index: Index, query: str, k: int = 5, max_scan: int = MAX_SCAN) -> dict:
    """Operator-aware search: {"query", "error", "results": [{id,title,url,date,domain,snippet,score}]}.
    At most `max_scan` candidates are checked against the operators (filtered_hits)."""
    q = parse_query(query)
    if not q.positive:
        return {
            "query": query,
            "results": [],
            "error": "the query has no search words, only operators or exclusions; add words to search for",
        }
    out = []
    for score, doc in filtered_hits(index, q, k, max_scan):
        title, body = title_and_text(doc)
        out.append({
            "id": str(doc["id"]), "title": title, "url": doc.get("url", ""), "date": doc.get("date", ""),
            "domain": _domain_of(doc), "snippet": _snippet(body, q.positive), "score": score,
        })  # fmt: skip
    return {"query": query, "results": out, "error": None}


def filtered_hits(index: Index, q: ParsedQuery, k: int, max_scan: int = MAX_SCAN) -> list[tuple[float, dict]]:
    """The top k (score, passage) of the index's ranking on q's positive words that pass every
    operator, widening the candidate pool (x8) until k pass or the pool holds the whole corpus.

    Bound: at most max(max_scan, 10 k) top-ranked candidates are ever checked, so a filter that
    nothing passes costs max_scan passages, not the whole corpus. Measured on 200k generated
    60-word passages (AMD EPYC, 2 cores), k=5: a site: filter nothing passes took 1.27 s per
    query unbounded, 0.07 s at the default 10,000; a phrase nothing matches 7.45 s -> 0.39 s
    (~40 us a candidate: ~15 min per query over wiki-18's 21M passages without the bound). A
    filter that passes fewer than k of those candidates returns fewer than k results."""
    n = min(len(index.corpus), max(max_scan, 10 * k))
    text = " ".join(q.positive)
    pool, results, seen = max(50, 10 * k), [], set()
    while True:
        for row, score in search_rows(index, [text], min(pool, n))[0]:
            if row in seen:
                continue
            seen.add(row)
            doc = get_passage(index.corpus, row)
            if matches(q, doc):
                results.append((score, doc))
        if len(results) >= k or pool >= n:
            break
        pool *= 8
    return sorted(results, key=lambda r: -r[0])[:k]


def operator_search(index: Index, queries: list[str], k: int, max_scan: int = MAX_SCAN) -> list[list[dict]]:
    """index.search's hits, with the operators of each query honoured (site:, -term, ...).

    The search tool of the tiny world's Search-R1 tags: `<search> Tavi Morek born
    site:tinypedia.org</search>` returns only tinypedia passages. A query without operators is
    passed to index.search unchanged (same hits as before operators existed).
    """
    plain = [i for i, query in enumerate(queries) if not SOURCE_OPERATORS.search(query)]
    out: list[list[dict]] = [[] for _ in queries]
    for i, hits in zip(plain, search(index, [queries[i] for i in plain], k)):
        out[i] = hits
    for i, query in enumerate(queries):
        q = parse_query(query)
        if i not in plain and q.positive:  # only operators: no hits ("No results.")
            out[i] = [{"document": doc, "score": score} for score, doc in filtered_hits(index, q, k, max_scan)]
    return out


def format_web_results(res: dict) -> str:
    """The text the policy sees: one numbered source per result (or the error)."""
    if res["error"]:
        return f"Search error: {res['error']}"
    if not res["results"]:
        return "No results."
    return "\n".join(
        f"[{i}] {r['title']} | {r['url'] or r['id']} | {r['date']}\n{r['snippet']}"
        for i, r in enumerate(res["results"], 1)
    )


def read(index: Index, key: str, max_tokens: int = 512, tokenizer=None) -> dict:
    """READ one source by id or url: its text cut to `max_tokens` (words, or `tokenizer` tokens),
    the cut marked in the text. An unknown key is an error result."""
    if not str(key).isascii():
        try:
            str(key).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (JSON "\ud800", undecodable argv) cannot be printed
            shown = str(key).encode("utf-8", "backslashreplace").decode()
            return {"id": shown, "error": f"no document with id or url {shown!r}: not valid Unicode"}
    if index.guard is not None:  # as search_rows: never a passage of a corpus edited since the build
        index.guard.check()
    row = find_row(index, str(key).strip())
    if row is None:
        return {"id": key, "error": f"no document with id or url {key!r}"}
    doc = get_passage(index.corpus, row)
    title, body = title_and_text(doc)
    if tokenizer is None:
        pieces = body.split()
        total, shown = len(pieces), " ".join(pieces[:max_tokens])
    else:
        ids = tokenizer.encode(body, add_special_tokens=False)
        total, shown = len(ids), tokenizer.decode(ids[:max_tokens])
    truncated = total > max_tokens
    if truncated:
        shown += f" ... [truncated: {max_tokens} of {total} tokens shown]"
    return {
        "id": str(doc["id"]), "url": doc.get("url", ""), "title": title, "date": doc.get("date", ""),
        "text": shown, "truncated": truncated, "n_tokens": total, "error": None,
    }  # fmt: skip


def find_row(index: Index, key: str) -> int | None:
    """The row of the passage whose id or url is `key` (read; the server's /access), or None."""
    # wiki-18 ids are row numbers: try that before building the id/url table
    # (ASCII digits only: "²".isdigit() is true and int("²") fails)
    if key.isascii() and key.isdigit() and int(key) < len(index.corpus):
        if str(get_passage(index.corpus, int(key))["id"]) == key:
            return int(key)
    if index.rows_by_key is None:
        table: dict[str, int] = {}
        for row, doc in enumerate(iter_passages(index.corpus)):
            table.setdefault(str(doc["id"]), row)
            if doc.get("url"):
                table.setdefault(doc["url"], row)
        index.rows_by_key = table
    return index.rows_by_key.get(key)
