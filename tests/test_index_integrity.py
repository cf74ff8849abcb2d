"""An index never serves a corpus other than its own, and never calls a broken build finished.

Issue "Nothing silent", cases 3 and 4, on real bm25s / faiss builds:
  * two equal-length rows swapped after indexing, away from the rows check_corpus re-reads, are
    refused at load (the whole file is hashed: a corpus under integrity.FULL_HASH_BYTES); on a
    corpus over it, an edit the sampled blocks miss is caught by the background whole-file hash;
  * a corpus rewritten under a running server is a 503 with the reason, /health says why;
  * a build on a full disk (a real tmpfs) leaves no index marked complete, at every fill level,
    and the next build really builds; a dense build there is one line, not a SIGBUS;
  * a truncated faiss.index, spans.npy or bm25 file is one line naming it, and the same build
    command repairs it.
"""

import json
import os
import re
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import run_script
from test_server import post, start_server

from search import integrity
from search.index import build_index, load_index, search
from search.integrity import CorpusChanged
from trainer.config import ConfigError, DataError

SYLLABLES = ["ka", "de", "zo", "ta", "pe", "ru", "mi", "lo", "bi", "ne", "su", "ga", "vo", "ri", "te", "pu"]
CITIES = ["Velor", "Umbrit", "Castan", "Orrim", "Pelisk"]
N_ROWS, WIDTH = 3000, 700  # 2.1 MB: over the 1.06 MB of sampled blocks, so most rows lie outside them


def person(i: int) -> str:
    """A unique invented name of fixed length for row i: 'Kade Zotape'."""
    syllables = [SYLLABLES[(i >> (4 * k)) & 15] for k in range(5)]
    return "".join(syllables[:2]).capitalize() + " " + "".join(syllables[2:]).capitalize()


def corpus_bytes(n: int = N_ROWS, width: int = WIDTH) -> bytes:
    """n passages, every line exactly `width` bytes: any two rows swap without a change of size."""
    lines = []
    for i in range(n):
        name = person(i)
        doc = {"id": f"d{i:05d}", "contents": f'"{name}"\n{name} was born in {CITIES[i % len(CITIES)]}.'}
        doc["contents"] += (" a quiet river town" * (width // 19 + 1))[: width - len(json.dumps(doc)) - 1]
        lines.append(json.dumps(doc) + "\n")
        assert len(lines[-1]) == width
    return "".join(lines).encode()


def swapped(data: bytes, i: int, j: int, width: int = WIDTH) -> bytes:
    rows = [data[k : k + width] for k in range(0, len(data), width)]
    rows[i], rows[j] = rows[j], rows[i]
    return b"".join(rows)


@pytest.fixture(scope="module")
def people(tmp_path_factory):
    """(corpus path, BM25 index dir, rows check_corpus does not re-read)."""
    base = tmp_path_factory.mktemp("people")
    (base / "corpus.jsonl").write_bytes(corpus_bytes())
    index_dir = build_index(base / "corpus.jsonl", base / "bm25", "bm25")
    checked = {row for row, _ in json.loads((index_dir / "meta.json").read_text())["id_checks"]}
    return base / "corpus.jsonl", index_dir, [r for r in range(N_ROWS) if r not in checked]


def unsampled(rows: list[int], size: int, inside: bool) -> list[int]:
    """The rows whose bytes meet (inside) or miss (not inside) every sampled block."""
    blocks = [(at, at + integrity.BLOCK_BYTES) for at in integrity.block_offsets(size)]
    meets = lambda r: any(a < (r + 1) * WIDTH and r * WIDTH < b for a, b in blocks)
    return [r for r in rows if meets(r) == inside]


def test_a_same_size_swap_of_two_rows_is_refused_at_load(people, tmp_path):
    corpus, index_dir, free = people
    missed = unsampled(free, corpus.stat().st_size, inside=False)  # caught by the whole-file hash alone
    i = next(r for r in missed if r > N_ROWS // 3)
    j = next(r for r in missed if r > 2 * N_ROWS // 3)
    hit = search(load_index(index_dir), [f"{person(i)} born"], 1)[0][0]["document"]
    assert hit["id"] == f"d{i:05d}"  # the index works: the name finds its own passage
    edited = tmp_path / "corpus.jsonl"
    edited.write_bytes(swapped(corpus.read_bytes(), i, j))
    with pytest.raises(DataError, match=r"changed since index .* was built \(its blake2b differs.*\): rebuild"):
        load_index(index_dir, edited)
    cli = run_script(["retriever.py", "search", "--index", str(index_dir), "--corpus", str(edited), person(i)])
    assert cli.returncode == 1 and cli.stdout == "", cli.stdout[-500:]
    assert cli.stderr.strip().count("\n") == 0 and f"corpus {edited} changed since index" in cli.stderr, cli.stderr


def test_over_the_whole_hash_limit_sampled_blocks_at_load_then_the_whole_file_in_the_background(
    people, tmp_path, monkeypatch
):
    """What a corpus larger than FULL_HASH_BYTES (wiki-18) gets, here on 2.1 MB: the limit set to 0."""
    corpus, index_dir, free = people
    monkeypatch.setattr(integrity, "FULL_HASH_BYTES", 0)
    size = corpus.stat().st_size
    assert load_index(index_dir).guard.hashing is None  # the build's own file, its stat unchanged: no hash
    copy = tmp_path / "copy.jsonl"
    shutil.copy(corpus, copy)  # same bytes, another inode and mtime: accepted
    index = load_index(index_dir, copy)
    index.guard.wait(60)
    assert search(index, [f"{person(free[0])} born"], 1)[0][0]["document"]["id"] == f"d{free[0]:05d}"
    hit = unsampled(free, size, inside=True)
    edited = tmp_path / "hit.jsonl"
    edited.write_bytes(swapped(corpus.read_bytes(), hit[0], hit[-1]))
    with pytest.raises(DataError, match=r"changed since index .* \(sampled blocks differ\): rebuild the index"):
        load_index(index_dir, edited)
    missed = unsampled(free, size, inside=False)
    i, j = missed[len(missed) // 4], missed[3 * len(missed) // 4]
    edited.write_bytes(swapped(corpus.read_bytes(), i, j))
    blake2b_differs = r"\(its blake2b differs; the sampled blocks are equal\)"
    try:  # the sampled blocks cannot see it; the whole-file hash, started at load, may finish before load returns
        index = load_index(index_dir, edited)
    except CorpusChanged as e:  # it did (a loaded machine: the hash ran while the index's files loaded)
        assert re.search(blake2b_differs, str(e)), e
        return
    index.guard.wait(60)
    with pytest.raises(CorpusChanged, match=blake2b_differs):
        search(index, [f"{person(i)} born"], 1)


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_corpus_rewritten_under_the_server_is_a_503_and_health_says_why(people, tmp_path):
    corpus, _, free = people
    own = tmp_path / "corpus.jsonl"
    original = corpus.read_bytes()
    own.write_bytes(original)
    proc, url = start_server(build_index(own, tmp_path / "bm25", "bm25"))
    try:
        i, j = free[10], free[-10]
        ask = {"queries": [f"{person(i)} born"], "topk": 1}
        status, body = post(url, ask)
        assert status == 200 and body["result"][0][0]["document"]["id"] == f"d{i:05d}"
        with open(own, "r+b") as f:  # rewritten in place: same inode, same size, two rows swapped
            f.write(swapped(original, i, j))
        status, body = post(url, ask)
        assert status == 503 and f"corpus {own} changed since index" in body["error"], body
        assert post(url, {"id": f"d{i:05d}"}, "/read")[0] == 503
        status, health = get(url + "/health")
        assert status == 503 and health["status"] == "corpus changed" and "rebuild the index" in health["reason"]
        own.write_bytes(original[: len(original) // 2])  # cut short: the old code's 500s
        status, body = post(url, ask)
        assert status == 503 and f"{len(original) // 2} bytes, built on {len(original)}" in body["error"], body
        own.write_bytes(original)  # restored: served again
        assert post(url, ask)[0] == 200 and get(url + "/health")[1]["status"] == "ok"
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def leave_free(disk: Path, pages: int) -> None:
    """Fill the disk until `pages` 4 KiB pages are free."""
    filler = disk / "filler"
    filler.unlink(missing_ok=True)
    filler.write_bytes(b"\0" * (os.statvfs(disk).f_bavail - pages) * 4096)
    assert os.statvfs(disk).f_bavail == pages


def test_a_build_on_a_full_disk_is_never_marked_complete_and_the_next_build_rebuilds(small_disk, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(corpus_bytes(40, 300))
    queries = [f"{person(r)} born" for r in range(40)]
    want = search(load_index(build_index(corpus, tmp_path / "reference", "bm25")), queries, 3)
    out = small_disk / "bm25"
    build_index(corpus, out, "bm25")
    used = os.statvfs(small_disk).f_blocks - os.statvfs(small_disk).f_bavail  # pages of a finished index
    failed = 0
    for free in range(used + 4):  # every fill level, a page at a time, + room for the temporary files
        shutil.rmtree(out)
        leave_free(small_disk, free)
        try:
            build_index(corpus, out, "bm25")
        except OSError as e:
            failed += 1
            assert "No space left on device" in str(e)
        meta = out / "meta.json"
        if meta.exists() and json.loads(meta.read_text()).get("complete"):
            assert search(load_index(out), queries, 3) == want, f"{free} pages free: marked complete, not whole"
        (small_disk / "filler").unlink()
        try:
            build_index(corpus, out, "bm25")  # the same command again, with room
        except ConfigError as e:
            assert "already holds a finished index" in str(e)
        assert search(load_index(out), queries, 3) == want, f"{free} pages free, then rebuilt"
    assert failed >= used  # where the index could not fit, the build failed, loudly


def test_a_dense_build_on_a_full_disk_is_one_line_and_resumes(small_disk, tmp_path):
    """The embeddings memmap is allocated before it is written: ENOSPC, not a SIGBUS at a write."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(corpus_bytes(400, 300))  # 400 x 384 float32: 600 KiB of embeddings
    out = small_disk / "dense"
    leave_free(small_disk, 100)
    cmd = ["retriever.py", "build", "--corpus", str(corpus), "--method", "dense", "--out", str(out)]
    full = run_script(cmd)
    assert full.returncode == 1, (full.returncode, full.stderr[-500:])
    assert full.stderr.strip().splitlines()[-1].startswith("error: [Errno 28] No space left on device: cannot allocate")
    (small_disk / "filler").unlink()
    again = run_script(cmd)
    assert again.returncode == 0, again.stderr[-500:]
    index = load_index(out)
    assert search(index, [f"{person(7)} born"], 1)[0][0]["document"]["id"] == "d00007"


@pytest.mark.parametrize("name", ["faiss.index", "spans.npy", "bm25/params.index.json", "bm25/data.csc.index.npy",
                                  "meta.json"])  # fmt: skip
def test_a_truncated_index_file_is_one_line_naming_it_and_the_build_repairs_it(search_world, tmp_path, name):
    world, corpus, index_dir = search_world
    copy = tmp_path / "hybrid"
    shutil.copytree(index_dir, copy)
    broken = copy / name
    # a JSON file as a full disk left params.index.json: 0 bytes; the others cut in half
    broken.write_bytes(broken.read_bytes()[: 0 if name.endswith(".json") else broken.stat().st_size // 2])
    with pytest.raises(DataError) as e:
        load_index(copy)
    assert str(e.value) == " ".join(str(e.value).split()) and f"index file {broken} is corrupt" in str(e.value)
    assert str(e.value).endswith("rebuild the index")
    if name == "meta.json":
        with pytest.raises(ConfigError, match="holds no build this one can resume: remove it first"):
            build_index(corpus, copy, "hybrid")
        return
    meta = json.loads((copy / "meta.json").read_text())
    build_index(corpus, copy, "hybrid", model=meta["dense"]["model"], family=meta["dense"]["family"])
    queries = [q["question"] for q in world.questions["val"][:20]]
    assert search(load_index(copy), queries, 3) == search(load_index(index_dir), queries, 3)

