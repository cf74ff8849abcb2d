"""An index never calls a broken build finished.

Issue "Nothing silent", case 4, on real bm25s / faiss builds:
  * a build on a full disk (a real tmpfs) leaves no index marked complete, at every fill level,
    and the next build really builds; a dense build there is one line, not a SIGBUS;
  * a truncated faiss.index, spans.npy or bm25 file is one line naming it, and the same build
    command repairs it.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import run_script

from search.index import build_index, load_index, search
from trainer.config import ConfigError, DataError

SYLLABLES = ["ka", "de", "zo", "ta", "pe", "ru", "mi", "lo", "bi", "ne", "su", "ga", "vo", "ri", "te", "pu"]
CITIES = ["Velor", "Umbrit", "Castan", "Orrim", "Pelisk"]
N_ROWS, WIDTH = 3000, 700


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


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs: a disk that really fills (ENOSPC from the kernel, at any write)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


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

