"""Importing a bare faiss index (Search-R1's e5_Flat.index): `retriever.py import` against a
fresh dense build, a file that does not fit refused, a link across filesystems; the encoder family
never guessed from a cache path; imported Flat and HNSW indexes mmapped, not copied into private
memory. Builds and searches of our own indexes: test_retriever.py.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import run_script

from search.index import build_index, load_index, search, search_rows
from trainer.config import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[1]

SMALL_WORLD = {"seed": 5, "n_people": 60, "n_cities": 10, "n_countries": 4, "n_val": 8, "n_test": 2}


@pytest.fixture(scope="module")
def small_world(tmp_path_factory):
    """(world, corpus path) of a world small enough to embed in a few seconds."""
    from tiny.world import generate_world, write_jsonl
    from trainer.config import WorldConfig

    world = generate_world(WorldConfig(**SMALL_WORLD))
    path = tmp_path_factory.mktemp("small_world") / "corpus.jsonl"
    write_jsonl(path, world.corpus)
    return world, path


def search_r1_index(corpus_path: Path, out: Path, factory: str = "Flat") -> Path:
    """A bare faiss file as Search-R1's index_builder.py writes one: every corpus line embedded as a
    passage, in line order, into index_factory(dim, factory, inner product), then write_index."""
    import faiss

    from search.index import default_encoder_path, encode, load_encoder

    enc = load_encoder(default_encoder_path(), "minilm")
    docs = [json.loads(line)["contents"] for line in corpus_path.read_text().splitlines() if line.strip()]
    emb = encode(enc, docs, "passage")
    index = faiss.index_factory(emb.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
    index.add(emb)
    faiss.write_index(index, str(out))
    return out


def test_an_imported_search_r1_index_searches_like_a_fresh_dense_build(small_world, tmp_path):
    """`retriever.py import` links the bare file in (a hard link: same filesystem), writes meta.json
    and spans.npy, embeds nothing; retriever.py search, load_index and the training path
    (open_search on retriever.index) then give the top hits a fresh `build --method dense` gives."""
    from search.index import default_encoder_path
    from search.tools import open_search
    from trainer.config import RetrieverConfig

    world, corpus_path = small_world
    bare = search_r1_index(corpus_path, tmp_path / "e5_Flat.index")
    model = default_encoder_path()
    enc_args = ["--model", model, "--family", "minilm"]
    out = run_script(["retriever.py", "import", "--faiss-index", str(bare), "--corpus", str(corpus_path), *enc_args,
                      "--out", str(tmp_path / "imported")])  # fmt: skip
    assert out.returncode == 0 and "(hard link, not copied)" in out.stdout, out.stderr[-2000:]
    imported = tmp_path / "imported"
    meta = json.loads((imported / "meta.json").read_text())
    assert meta["complete"] and meta["method"] == "dense" and meta["n_docs"] == len(world.corpus)
    assert meta["dense"] == {"model": model, "family": "minilm", "index_factory": "IndexFlatIP (imported)",
                             "metric": "inner product", "imported_from": str(bare.resolve()),
                             "link": "hard link"}  # fmt: skip
    assert (imported / "faiss.index").stat().st_ino == bare.stat().st_ino  # the same file, not a copy
    assert not (imported / "embeddings.f32").exists()
    built = run_script(["retriever.py", "build", "--corpus", str(corpus_path), "--method", "dense", *enc_args,
                        "--out", str(tmp_path / "built")])  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    qs = [q["question"] for q in world.questions["val"]]
    fresh = search_rows(load_index(tmp_path / "built"), qs, 3)
    assert [h[0][0] for h in search_rows(load_index(imported), qs, 3)] == [h[0][0] for h in fresh]
    cfg = RetrieverConfig(method="dense", index=str(imported), model=model, encoder_family="minilm")
    rows = [[int(r) for r, _ in h] for h in fresh]
    hits = open_search(cfg)(qs, 3)
    assert [h[0]["document"]["id"] for h in hits] == [world.corpus[r[0]]["id"] for r in rows]
    cli = run_script(["retriever.py", "search", "--index", str(imported), qs[0], "-k", "1"])
    title = world.corpus[rows[0][0]]["contents"].split("\n")[0].strip('"')
    assert cli.returncode == 0 and f"Doc 1(Title: {title})" in cli.stdout, cli.stderr[-2000:]


def test_import_refuses_a_file_that_does_not_fit_in_one_line_naming_it(small_world, tmp_path):
    """One vector per passage, the encoder's width, a faiss file at all: each checked before
    anything is written, each a one-line error naming the file."""
    import faiss

    from search.index import default_encoder_path, import_index

    world, corpus_path = small_world
    n, model = len(world.corpus), default_encoder_path()
    cases = {"short": (n - 1, 384, "holds {n1} vectors but corpus"), "narrow": (n, 16, "holds 16-dimensional")}
    for name, (rows, dim, says) in cases.items():
        index = faiss.IndexFlatIP(dim)
        index.add(np.ones((rows, dim), np.float32))
        faiss.write_index(index, str(tmp_path / f"{name}.index"))
        with pytest.raises(DataError, match=re.escape(f"{tmp_path / name}.index " + says.format(n1=n - 1))):
            import_index(tmp_path / f"{name}.index", corpus_path, tmp_path / name, model, "minilm")
        assert not (tmp_path / name).exists()
    (tmp_path / "junk.index").write_bytes(b"not a faiss index at all")
    junk = ["--faiss-index", str(tmp_path / "junk.index"), "--corpus", str(corpus_path), "--out", str(tmp_path / "j")]
    out = run_script(["retriever.py", "import", *junk, "--model", model, "--family", "minilm"])
    assert out.returncode != 0 and "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"error: {tmp_path / 'junk.index'}: faiss cannot read it as an index")


@pytest.mark.skipif(not Path("/dev/shm").is_dir() or Path("/dev/shm").stat().st_dev == Path("/tmp").stat().st_dev,
                    reason="needs /dev/shm on another filesystem than /tmp")  # fmt: skip
def test_import_from_another_filesystem_links_with_a_symlink(small_world, tmp_path):
    """A hard link cannot cross filesystems: the index is then a symlink to the file's real path."""
    import tempfile

    from search.index import default_encoder_path, import_index

    world, corpus_path = small_world
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        bare = search_r1_index(corpus_path, Path(shm) / "e5_Flat.index")
        out = import_index(bare, corpus_path, tmp_path / "imported", default_encoder_path(), "minilm")
        assert json.loads((out / "meta.json").read_text())["dense"]["link"] == "symlink"
        assert os.readlink(out / "faiss.index") == str(bare.resolve())
        q = world.questions["val"][0]
        assert search(load_index(out), [q["question"]], 3)[0][0]["document"]["id"] in q["metadata"]["gold_ids"]


def test_the_encoder_family_is_never_guessed_from_a_hugging_face_cache_path(small_world, tmp_path):
    """MiniLM under a directory named like the Hub's cache of e5-base-v2 is not taken for E5 (no
    "query: " prefix): the family is said (--family, retriever.encoder_family), recorded in
    meta.json, and an index opened with another family or model than it was embedded with is
    refused in one line naming both."""
    from search.index import default_encoder_path, ensure_index, load_encoder
    from search.tools import open_index
    from trainer.config import RetrieverConfig, load_config

    _, corpus_path = small_world
    hub = tmp_path / "hub" / "models--intfloat--e5-base-v2" / "snapshots" / "0123456789abcdef"
    hub.parent.mkdir(parents=True)
    hub.symlink_to(default_encoder_path())
    never = "never guessed from the path"
    with pytest.raises(ConfigError, match=f"needs its family .*one of e5, bge, minilm; it is {never}; got ''"):
        load_encoder(str(hub))
    with pytest.raises(ConfigError, match=never):
        build_index(corpus_path, tmp_path / "x", "dense", model=str(hub))
    assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match=f"'retriever.encoder_family' must be one of e5, bge, minilm .*{never}"):
        load_config(None, [f"retriever.model={hub}"])
    with pytest.raises(ConfigError, match="'retriever.encoder_family' 'e5' needs retriever.model"):
        load_config(None, ["retriever.encoder_family=e5"])
    cli = run_script(["retriever.py", "build", "--corpus", str(corpus_path), "--method", "dense", "--model", str(hub),
                      "--out", str(tmp_path / "y")])  # fmt: skip
    assert cli.returncode != 0 and never in cli.stderr and "Traceback" not in cli.stderr
    enc = load_encoder(str(hub), "minilm")
    assert (enc.family, enc.style["query_prefix"], enc.style["passage_prefix"]) == ("minilm", "", "")
    out = ensure_index(corpus_path, "dense", str(hub), family="minilm")
    assert json.loads((out / "meta.json").read_text())["dense"] | {"index_factory": None} == {
        "model": str(hub), "family": "minilm", "index_factory": None}  # fmt: skip
    assert open_index(RetrieverConfig(method="dense", index=str(out), encoder_family="minilm")).meta["complete"]
    e5 = f"was embedded with encoder {hub} \\(family minilm\\); the config asks for {hub} \\(family e5\\)"
    with pytest.raises(ConfigError, match=e5):
        ensure_index(corpus_path, "dense", str(hub), family="e5")
    with pytest.raises(ConfigError, match=e5):
        open_index(RetrieverConfig(method="dense", index=str(out), model=str(hub), encoder_family="e5"))
    other = tmp_path / "models" / "e5-base-v2"
    with pytest.raises(ConfigError, match=f"the config asks for {other} \\(family e5\\)"):
        open_index(RetrieverConfig(method="dense", index=str(out), model=str(other), encoder_family="e5"))


MEMORY_PROBE = """
import json, os, sys
from search.index import default_encoder_path, encode, load_encoder, load_index, search, use_all_cores
import faiss, numpy as np

def anonymous() -> int:  # resident memory backed by no file: where a copy of the index would be
    return sum(int(line.split()[1]) * 1024 for line in open("/proc/self/smaps_rollup") if line.startswith("Anonymous:"))

encode(load_encoder(default_encoder_path(), "minilm"), ["warm up"], "query")  # torch and the weights first
use_all_cores()
faiss.IndexFlatIP(4).search(np.ones((1, 4), np.float32), 1)  # faiss's threads started
report, opened = {}, []  # each index kept open, so freeing one cannot hide the next one's copy
for path in sys.argv[1:]:
    before = anonymous()
    opened.append(load_index(path))
    hits = search(opened[-1], ["P17 passage"], 3)
    mapped = any(os.path.realpath(os.path.join(path, "faiss.index")) in line for line in open("/proc/self/maps"))
    report[path] = {"added": anonymous() - before, "hits": len(hits[0]), "mapped": mapped}
print(json.dumps(report))
"""


def test_flat_and_hnsw_indexes_are_mmapped_not_copied_into_private_memory(tmp_path):
    """load_index + one search, in a fresh process, adds < 10% of the index file to the memory
    that no file backs (smaps' Anonymous): the codes stay in the file's page-cache pages, one
    copy per host however many ranks open it. (Private_Clean would count those pages too while
    one process alone maps them.) Measured on 2 cores: IO_FLAG_MMAP_IFC +0.3 MB for the 30.7 MB
    Flat, +0.2 MB for the 6.7 MB HNSW16; IO_FLAG_MMAP, the flag used before, +31.1 and +6.8 MB:
    a full private copy, and the file not mapped at all."""
    import faiss

    from search.index import default_encoder_path, import_index

    rng = np.random.default_rng(0)
    dirs = []
    for factory, n in (("Flat", 20_000), ("HNSW16", 4_000)):  # 30.7 MB of float32 codes; a graph on top
        corpus_path = tmp_path / factory / "corpus.jsonl"
        corpus_path.parent.mkdir()
        corpus_path.write_text("".join(json.dumps({"id": str(i), "contents": f'"P{i}"\npassage {i}'}) + "\n"
                                       for i in range(n)))  # fmt: skip
        x = rng.standard_normal((n, 384)).astype(np.float32)
        index = faiss.index_factory(384, factory, faiss.METRIC_INNER_PRODUCT)
        index.add(x / np.linalg.norm(x, axis=1, keepdims=True))
        faiss.write_index(index, str(tmp_path / f"{factory}.index"))
        dirs.append(import_index(tmp_path / f"{factory}.index", corpus_path, tmp_path / factory / "idx",
                                 default_encoder_path(), "minilm"))  # fmt: skip
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, *map(str, dirs)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert (dirs[0] / "faiss.index").stat().st_size > 30e6
    for d in dirs:
        got, size = report[str(d)], (d / "faiss.index").stat().st_size
        assert got["hits"] == 3 and got["mapped"], got
        assert got["added"] < 0.1 * size, f"{d}: +{got['added'] / 1e6:.1f} MB private for a {size / 1e6:.1f} MB index"
