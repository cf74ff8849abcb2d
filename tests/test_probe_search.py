"""Issue 55's findings in the index and retriever code, each on real files: a real faiss index
imported and served by a real `retriever.py serve` subprocess, real bm25s / faiss builds, the
client against a real HTTP server on 127.0.0.1.

  1. an import whose --out holds the faiss file itself keeps the file (it deleted it);
  2. a served faiss file rewritten in place or cut short is a 503 naming it, not other
     passages or a SIGBUS; a load after the rewrite is refused;
  8. a corpus line with a lone surrogate is refused at the build, naming path:line;
 10. a server's non-numeric score is one RetrieverError naming the field, a null one is missing;
 11. `search -k 0`, 13. `read --max-tokens -5`: one line each;
  and what an index or corpus file declares is read or refused in one line: an id map that is
  not the corpus rows, a metric that is not inner product, a meta.json of the wrong types, a
  factory faiss cannot build, search parameters the index has not, a build over the user's files.
"""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_index_integrity import get
from test_retriever_client import canned, raw_server
from test_server import post, start_server

import retriever
from search.client import RetrieverError, http_retrieve
from search.index import build_index, default_encoder_path, import_index, load_index, search
from search.integrity import CorpusChanged
from search.tools import open_search
from trainer.config import ConfigError, DataError, RetrieverConfig

N = 40


def write_corpus(path: Path, n: int = N) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"p{i}", "contents": f'"Person {i}"\nPerson {i} was born in city {i}.'})
                            + "\n" for i in range(n)))  # fmt: skip
    return path


def faiss_file(path: Path, n: int = N, seed: int = 0, factory: str = "Flat", ids=None, metric=None) -> Path:
    """A bare faiss file of n unit vectors at MiniLM's width (384), written as Search-R1 writes one."""
    import faiss

    x = np.random.default_rng(seed).standard_normal((n, 384)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    index = faiss.index_factory(384, factory, faiss.METRIC_INNER_PRODUCT if metric is None else metric)
    if ids is None:
        index.add(x)
    else:
        index.add_with_ids(x, np.asarray(ids, dtype=np.int64))
    faiss.write_index(index, str(path))
    return path


@pytest.fixture(scope="module")
def bm25_index(tmp_path_factory):
    base = tmp_path_factory.mktemp("bm25")
    return build_index(write_corpus(base / "corpus.jsonl"), base / "bm25", "bm25")


def test_importing_a_faiss_file_into_its_own_directory_keeps_the_file(tmp_path):
    """Finding 1: `--faiss-index DIR/faiss.index --out DIR` deleted the file and left a symlink to
    itself. Now the file is used where it lies ("in place"), byte for byte; a file of that name
    that is not the imported one is refused and left alone."""
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    own = faiss_file(tmp_path / "dir" / "faiss.index") if (tmp_path / "dir").mkdir() is None else None
    before = own.read_bytes()
    out = import_index(own, corpus, tmp_path / "dir", default_encoder_path(), "minilm")
    assert own.is_file() and not own.is_symlink() and own.read_bytes() == before
    assert json.loads((out / "meta.json").read_text())["dense"]["link"] == "in place"
    assert len(search(load_index(out), ["Person 3 born"], 2)[0]) == 2
    other = tmp_path / "other"
    other.mkdir()
    theirs = faiss_file(other / "faiss.index", seed=1)
    kept = theirs.read_bytes()
    with pytest.raises(ConfigError, match=f"{theirs} already exists and is not {own}; move it away"):
        import_index(own, corpus, other, default_encoder_path(), "minilm")
    assert theirs.read_bytes() == kept


def test_a_build_never_replaces_the_users_files_in_a_directory_without_meta_json(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    (tmp_path / "dir").mkdir()
    theirs = faiss_file(tmp_path / "dir" / "faiss.index")
    kept = theirs.read_bytes()
    with pytest.raises(ConfigError, match=r"holds faiss.index but no meta.json: .*move them away"):
        build_index(corpus, tmp_path / "dir", "dense")
    assert theirs.read_bytes() == kept


def test_a_served_faiss_file_rewritten_or_cut_short_is_a_503_naming_it_never_a_sigbus(tmp_path):
    """Finding 2: the import hard-links the user's file; rewriting it in place changed the hits while
    /health said ok, and cutting it short killed the server with SIGBUS. Now /health and /retrieve
    are 503s naming the file, the server stays up, and the restored file is served again."""
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    users = faiss_file(tmp_path / "e5_Flat.index")
    original = users.read_bytes()
    index_dir = import_index(users, corpus, tmp_path / "idx", default_encoder_path(), "minilm")
    proc, url = start_server(index_dir)
    try:
        ask = {"queries": ["Person 3 born"], "topk": 3}
        status, first = post(url, ask)
        assert status == 200 and get(url + "/health")[0] == 200
        faiss_file(tmp_path / "other.index", seed=7)
        with open(users, "r+b") as f:  # rewritten in place: same inode, same size, other vectors
            f.write((tmp_path / "other.index").read_bytes())
        assert users.stat().st_size == len(original)
        status, health = get(url + "/health")
        assert status == 503 and health["status"] == "index changed", health
        assert f"index file {index_dir / 'faiss.index'} changed since index" in health["reason"]
        assert health["reason"].endswith("was imported (sampled blocks differ): restore it, or import it again")
        status, body = post(url, ask)
        assert status == 503 and "faiss.index changed since index" in body["error"], body
        with open(users, "r+b") as f:
            f.truncate(len(original) // 2)  # cut short: the next read of a page past the end was a SIGBUS
        status, body = post(url, ask)
        assert status == 503 and f"{len(original) // 2} bytes, built on {len(original)}" in body["error"], body
        assert proc.poll() is None
        with open(users, "r+b") as f:  # restored in place
            f.write(original)
        assert post(url, ask) == (200, first) and get(url + "/health")[0] == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    with open(users, "r+b") as f:
        f.write((tmp_path / "other.index").read_bytes())
    with pytest.raises(DataError, match=r"index file .*faiss.index changed since index .* was imported"):
        load_index(index_dir)


def test_an_imported_index_must_return_corpus_rows_and_score_by_inner_product(tmp_path):
    """An index that stores ids (add_with_ids) returns them as corpus rows: ids that are not the
    rows 0 .. n-1 each once would be other passages, or none; an L2 index's scores are distances,
    which retriever.min_score would read backwards. Each refused in one line naming the file."""
    import faiss

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    model = default_encoder_path()
    cases = {
        "offset": ("IDMap,Flat", np.arange(N) + 100, None, f"holds id 100, outside the corpus's rows 0 .. {N - 1}"),
        "twice": ("IDMap2,Flat", [0, *range(N - 1)], None, "holds id 0 twice"),
        "l2": ("Flat", None, faiss.METRIC_L2, "scores by L2, not inner product"),
    }
    for name, (factory, ids, metric, says) in cases.items():
        path = faiss_file(tmp_path / f"{name}.index", factory=factory, ids=ids, metric=metric)
        with pytest.raises(DataError, match=f"^{path} .*{says}"):
            import_index(path, corpus, tmp_path / name, model, "minilm")
        assert not (tmp_path / name).exists()
    shuffled = np.random.default_rng(0).permutation(N)  # a permutation of the rows is a valid id map
    path = faiss_file(tmp_path / "perm.index", factory="IDMap,Flat", ids=shuffled)
    hit = search(load_index(import_index(path, corpus, tmp_path / "perm", model, "minilm")), ["Person 1"], N)
    assert sorted(h["document"]["id"] for h in hit[0]) == sorted(f"p{i}" for i in range(N))


def test_a_lone_surrogate_in_a_corpus_line_is_refused_at_the_build_naming_path_and_line(tmp_path):
    """Finding 8 (corpus half): it was accepted, and every request that hit it was a 500."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", 5)
    with open(corpus, "a") as f:
        f.write('{"id": "p5", "contents": "\\"Bad\\"\\nhalf an emoji \\ud83d here"}\n')
    with pytest.raises(DataError, match=rf"^{corpus}:6: 'contents' holds a lone surrogate \(\\ud83d at character"):
        build_index(corpus, tmp_path / "bm25", "bm25")
    assert not (tmp_path / "bm25").exists()


@pytest.mark.parametrize("score", [b'"high"', b"true", b"[1]", b"NaN"])
def test_a_server_score_that_is_not_a_number_is_one_line_naming_the_field(score):
    """Finding 10: "high" was accepted, then a TypeError mid-rollout (retriever.min_score)."""
    reply = b'{"result": [[{"document": {"id": "1", "contents": "x"}, "score": 1.0}, ' + \
        b'{"document": {"id": "2", "contents": "y"}, "score": ' + score + b"}]]}"  # fmt: skip
    with raw_server(canned(reply)) as url:
        with pytest.raises(RetrieverError, match=r"not in Search-R1's format \(result\[0\]\[1\]\.score must be a fin"):
            http_retrieve(url, ["born"], 3, timeout=5)


def test_a_null_score_is_a_missing_one():
    reply = b'{"result": [[{"document": {"id": "1", "contents": "x"}, "score": null}]]}'
    with raw_server(canned(reply)) as url:
        assert http_retrieve(url, ["born"], 3, timeout=5) == [[{"document": {"id": "1", "contents": "x"}}]]
        kept = open_search(RetrieverConfig(url=url, min_score=-1.0))(["born"], 3)  # a missing score counts as 0
        assert [h["document"]["id"] for h in kept[0]] == ["1"]


@pytest.mark.parametrize("argv,says", [
    (["search", "-k", "0", "born"], "error: -k must be a positive integer, got 0"),
    (["read", "p3", "--max-tokens", "-5"], "error: --max-tokens must be a positive integer, got -5"),
])  # fmt: skip
def test_cli_counts_below_one_are_one_line(bm25_index, argv, says):
    """Findings 11 (`search -k 0`: an AssertionError) and 13 (`read --max-tokens -5`: "-5 of 9 tokens")."""
    with pytest.raises(SystemExit) as e:
        retriever.main([argv[0], "--index", str(bm25_index), *argv[1:]])
    assert str(e.value) == says
    with pytest.raises(ConfigError, match="k \\(passages per query\\) must be a positive integer, got 0"):
        search(load_index(bm25_index), ["born"], 0)


def test_a_meta_json_of_the_wrong_types_is_one_line_naming_the_key(bm25_index, tmp_path):
    meta = json.loads((bm25_index / "meta.json").read_text())
    for key, value, says in [("n_docs", "many", "'n_docs' must be a positive integer, got 'many'"),
                             ("id_checks", [[10_000, "p1"]], "'id_checks' must be a list of [row below n_docs, id]"),
                             ("method", "tfidf", "'method' must be one of")]:  # fmt: skip
        broken = tmp_path / key
        shutil.copytree(bm25_index, broken)
        (broken / "meta.json").write_text(json.dumps(meta | {key: value}))
        with pytest.raises(DataError, match=f"index file {broken / 'meta.json'} is corrupt .*{re.escape(says)}"):
            load_index(broken)


def test_a_bad_factory_or_search_parameter_is_one_line_before_anything_slow(tmp_path, bm25_index):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    with pytest.raises(ConfigError, match=r"index factory 'IVF0,Nonsense' \(--index-factory\): faiss cannot build"):
        build_index(corpus, tmp_path / "dense", "dense", index_factory="IVF0,Nonsense")
    assert not (tmp_path / "dense").exists()  # refused before the corpus was embedded
    for flag in ("chunk", "batch_size"):
        with pytest.raises(ConfigError, match=f"{flag} must be a positive integer, got 0"):
            build_index(corpus, tmp_path / "dense", "dense", **{flag: 0})
    index_dir = import_index(faiss_file(tmp_path / "flat.index"), corpus, tmp_path / "flat", default_encoder_path(),
                             "minilm")  # fmt: skip
    with pytest.raises(ConfigError, match=r"search parameters 'nprobe=8' .* do not apply to this IndexFlat"):
        load_index(index_dir, search_params="nprobe=8")


def test_a_bm25_array_rewritten_under_a_loaded_index_is_refused_and_the_build_repairs_it(bm25_index, tmp_path):
    """The class of finding 2 beyond faiss.index: bm25s's arrays are mmap'd too. Scores rewritten in
    place (same size) changed the ranking silently; now the next search names the file, a load
    refuses it, and the same build command builds the index again."""
    copy = tmp_path / "bm25"
    shutil.copytree(bm25_index, copy)
    index = load_index(copy)
    want = search(index, ["Person 3 born"], 3)
    data = copy / "bm25" / "data.csc.index.npy"
    array = np.load(data)
    np.save(data, (array[::-1] * 3).astype(array.dtype))  # the same shape and size, other scores
    with pytest.raises(CorpusChanged, match=f"index file {data} changed since index {copy} was built"):
        search(index, ["Person 3 born"], 3)
    with pytest.raises(DataError, match="restore it, or rebuild the index"):
        load_index(copy)
    meta = json.loads((copy / "meta.json").read_text())
    build_index(meta["corpus"], copy, "bm25")
    assert search(load_index(copy), ["Person 3 born"], 3) == want


def test_an_index_from_before_file_digests_is_watched_from_its_load(bm25_index, tmp_path):
    """meta.json without "files" (built before them): loaded as before, its files watched from the load."""
    copy = tmp_path / "old"
    shutil.copytree(bm25_index, copy)
    meta = json.loads((copy / "meta.json").read_text())
    meta.pop("files", None)
    (copy / "meta.json").write_text(json.dumps(meta))
    index = load_index(copy)
    spans = copy / "spans.npy"
    array = np.load(spans)
    np.save(spans, array[::-1].copy())  # rows pointing at other passages: the same size
    with pytest.raises(CorpusChanged, match=f"index file {spans} changed since index {copy} was loaded"):
        search(index, ["Person 3 born"], 3)


def test_a_large_imported_faiss_file_is_refused_once_written_and_kept_when_copied_with_its_mtime(tmp_path,
                                                                                                monkeypatch):
    """What wiki-18's 65 GB e5_Flat.index gets (the import reads none of it, so no whole hash), here
    with integrity.FULL_HASH_BYTES at 0: a write that the sampled blocks miss still moves its mtime
    and is refused; the index directory copied with its mtimes (cp -a) still loads and searches."""
    import os

    from search import integrity

    monkeypatch.setattr(integrity, "FULL_HASH_BYTES", 0)
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    users = faiss_file(tmp_path / "e5_Flat.index")
    index_dir = import_index(users, corpus, tmp_path / "idx", default_encoder_path(), "minilm")
    assert "blake2b" not in json.loads((index_dir / "meta.json").read_text())["files"]["faiss.index"]
    copied = tmp_path / "copied"
    shutil.copytree(index_dir, copied)  # copy2: the mtimes kept, new inodes
    assert len(search(load_index(copied), ["Person 3 born"], 3)[0]) == 3
    index = load_index(index_dir)
    st = users.stat()
    os.utime(users, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as a write that missed every sampled block
    with pytest.raises(CorpusChanged, match="faiss.index changed since index .* was imported \\(written since"):
        search(index, ["Person 3 born"], 3)
