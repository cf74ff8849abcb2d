"""Web-style operators (WebFilter) and READ (Deliberative Searcher), each checked for its meaning
on a hand-made corpus where the right answer is known, then on the tiny world's unreliable domains."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from search import web as websearch
from search.index import build_index, load_index
from search.web import MAX_SCAN, parse_query, read, web_search
from tiny.world import write_jsonl

ROOT = Path(__file__).resolve().parents[1]

DOCS = [  # id, title, text, domain, date
    ("a1", "Apple Orchard", "Red apple trees grow in the north valley.", "farm.org", "2010-05-01"),
    ("a2", "Apple Market", "The north market sells apple cider and red pears.", "news.com", "2016-07-09"),
    ("a3", "Pear Farm", "Pear trees grow in the red valley of the south.", "farm.org", "2019-01-20"),
    ("a4", "Valley Rumors", "Some say apple trees grow red pears in the valley.", "rumors.net", "2021-11-30"),
    ("a5", "Apple Press", "Cider from apples, pressed in the north.", "blog.farm.org", "2014-03-03"),
    ("a6", "Filetype Note", "A pdf about filetype conventions for apple growers.", "docs.com", "2012-02-02"),
    ("a7", "Long Apple Essay", " ".join(["apple orchard history"] * 40), "farm.org", ""),
]


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    base = tmp_path_factory.mktemp("web")
    write_jsonl(base / "corpus.jsonl", [
        {"id": i, "contents": f'"{t}"\n{x}', "url": f"https://{d}/{i}", "domain": d, "date": dt}
        for i, t, x, d, dt in DOCS
    ])  # fmt: skip
    return load_index(build_index(base / "corpus.jsonl", base / "bm25"))


def ids(res):
    assert res["error"] is None, res["error"]
    return {r["id"] for r in res["results"]}


def test_site_and_minus_site(index):
    assert ids(web_search(index, "apple site:farm.org", 10)) == {"a1", "a5", "a7"}  # subdomains count
    assert ids(web_search(index, "apple site:news.com", 10)) == {"a2"}
    assert ids(web_search(index, "apple site:news.com site:rumors.net", 10)) == {"a2", "a4"}
    assert ids(web_search(index, "apple -site:farm.org", 10)) == {"a2", "a4", "a6"}


def test_before_and_after_compare_dates_strictly(index):
    assert ids(web_search(index, "apple before:2014-03-03", 10)) == {"a1", "a6"}
    assert ids(web_search(index, "apple after:2014-03-03", 10)) == {"a2", "a4"}
    assert ids(web_search(index, "apple before:2016", 10)) == {"a1", "a5", "a6"}  # before 2016-01-01
    assert ids(web_search(index, "apple after:2016", 10)) == {"a4"}  # after 2016-12-31
    assert "a7" not in ids(web_search(index, "apple after:2000", 10))  # undated fails a date filter


def test_quoted_phrase_matches_only_the_exact_phrase(index):
    assert ids(web_search(index, '"red apple"', 10)) == {"a1"}  # a2 has "apple ... red", a4 "red pears"
    assert ids(web_search(index, '"RED Apple trees"', 10)) == {"a1"}  # case-insensitive, whole words
    assert ids(web_search(index, '"red app"', 10)) == set()
    assert ids(web_search(index, 'apple -"red pears"', 10)) == {"a1", "a5", "a6", "a7"}


def test_minus_term_not_and_or(index):
    assert ids(web_search(index, "apple -north", 10)) == {"a4", "a6", "a7"}
    assert ids(web_search(index, "apple NOT north", 10)) == {"a4", "a6", "a7"}
    assert ids(web_search(index, "apple -pears", 10)) == {"a1", "a5", "a6", "a7"}  # stemmed: pear = pears
    assert ids(web_search(index, "cider AND north", 10)) == {"a2", "a5"}
    assert ids(web_search(index, "cider north", 10)) == {"a2", "a5"}  # juxtaposition is AND
    assert ids(web_search(index, "cider OR south", 10)) == {"a2", "a3", "a5"}
    assert ids(web_search(index, "cider OR south site:farm.org", 10)) == {"a3", "a5"}
    # operators are upper-case only: lower-case "or" is an ordinary (stop)word, so this is AND
    assert ids(web_search(index, "cider or south", 10)) == set()
    assert parse_query("a OR b").expr[0] == "or" and parse_query("a or b").expr[0] == "and"


def test_unknown_operators_are_text_and_only_operators_is_an_error(index):
    assert ids(web_search(index, "filetype:pdf", 10)) == {"a6"}  # both words are in a6's text
    assert ids(web_search(index, "intitle:cider", 10)) == set()  # "intitle" is a word no passage has
    for q in ["site:farm.org", "-apple", "before:2015 after:2010", "NOT apple", "AND OR"]:
        res = web_search(index, q, 5)
        assert res["results"] == [] and "only operators" in res["error"], q


def test_results_carry_title_url_date_snippet(index):
    r = web_search(index, "cider", 1)["results"][0]
    assert {"id", "title", "url", "date", "domain", "snippet", "score"} <= set(r)
    assert r["url"] == f"https://{r['domain']}/{r['id']}" and "cider" in r["snippet"].lower()
    long = web_search(index, "history", 1)["results"][0]
    assert long["id"] == "a7" and len(long["snippet"]) <= 210 and long["snippet"].endswith("...")


def test_read_by_id_or_url_with_marked_truncation(index, tmp_path):
    doc = read(index, "a1", 100)
    assert doc["text"] == "Red apple trees grow in the north valley." and not doc["truncated"]
    assert read(index, "https://farm.org/a1", 100)["id"] == "a1"
    cut = read(index, "a7", 10)
    assert cut["truncated"] and cut["n_tokens"] == 120
    assert cut["text"].endswith("[truncated: 10 of 120 tokens shown]")
    assert cut["text"].startswith("apple orchard history apple orchard history apple orchard history apple ...")
    missing = read(index, "nope", 10)
    assert "no document with id or url 'nope'" in missing["error"]


def test_read_of_non_ascii_digits_and_lone_surrogates_is_an_error_result(index):
    assert "no document with id or url '\u00b2'" in read(index, "\u00b2", 10)["error"]  # "²".isdigit(); int() fails
    bad = read(index, "a1\ud800", 10)  # JSON "\ud800", or argv bytes that are not UTF-8
    assert bad["id"] == "a1\\ud800" and "not valid Unicode" in bad["error"]
    bad["error"].encode("utf-8")  # printable


@pytest.mark.parametrize("key", [b"\xc2\xb2", b"a1\xff"])  # "²", and bytes that are not UTF-8
def test_cli_read_of_a_bad_key_is_one_clear_answer(index, key):
    env = os.environ | {"PYTHONIOENCODING": "utf-8:strict"}  # a UTF-8 terminal (the C locale would escape)
    out = subprocess.run([sys.executable, str(ROOT / "retriever.py"), "read", "--index", str(index.dir), key],
                         cwd=ROOT, env=env, capture_output=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and b"Traceback" not in out.stderr, out.stderr.decode(errors="replace")
    assert b'"error": "no document with id or url' in out.stdout


def test_a_filter_nothing_passes_checks_at_most_max_scan_candidates(tmp_path, monkeypatch):
    """It used to widen until the whole corpus had been checked (~12 us a passage: minutes per
    query at wiki-18 scale); now at most MAX_SCAN candidates are."""
    n = MAX_SCAN + 2_000
    write_jsonl(tmp_path / "corpus.jsonl", [
        {"id": f"d{i}", "contents": f'"D{i}"\nword{i % 97} common text', "domain": "farm.org"} for i in range(n)
    ])  # fmt: skip
    big = load_index(build_index(tmp_path / "corpus.jsonl", tmp_path / "bm25"))
    checked = []
    real = websearch.matches
    monkeypatch.setattr(websearch, "matches", lambda q, doc: checked.append(1) or real(q, doc))
    t = time.monotonic()
    res = web_search(big, "common site:nowhere.example", 5)
    assert res["error"] is None and res["results"] == []
    assert len(checked) == MAX_SCAN < n
    assert time.monotonic() - t < 5
    checked.clear()
    assert len(web_search(big, "common word3 site:farm.org", 5)["results"]) == 5 and len(checked) <= 50
    checked.clear()
    assert web_search(big, "common site:nowhere.example", 5, max_scan=300)["results"] == []
    assert len(checked) == 300  # pools of 50, then 400 cut to 300 (the 50 already seen are skipped)


def test_read_budget_in_model_tokens(index, micro):
    tok = AutoTokenizer.from_pretrained(micro[2])
    cut = read(index, "a7", 7, tokenizer=tok)
    assert cut["truncated"] and cut["n_tokens"] == len(tok.encode(" ".join(["apple orchard history"] * 40)))
    assert "[truncated: 7 of" in cut["text"]


def test_site_filters_out_the_tiny_worlds_unreliable_domains(search_world):
    world, _, index_dir = search_world
    index = load_index(index_dir)
    bad = [d for d in world.corpus if d["domain"] != "tinypedia.org"]
    person = next(d["contents"].split('"')[1] for d in bad if d["contents"].split('"')[1] in world.people)
    plain = web_search(index, f"{person} born", 3)["results"]
    assert {r["domain"] for r in plain} - {"tinypedia.org"}  # the contradicting passage shows up
    only = web_search(index, f"{person} born site:tinypedia.org", 3)["results"]
    assert only and {r["domain"] for r in only} == {"tinypedia.org"}
    assert only[0]["title"] == person and world.people[person] in only[0]["snippet"]
