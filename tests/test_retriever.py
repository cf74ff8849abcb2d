"""Real indexes built from a generated corpus: BM25 (bm25s), dense (MiniLM + faiss), hybrid.

Build, save, reload with mmap, query; the corpus check; a killed dense build that resumes;
approximate faiss indexes against Flat; ranks launched at once building one index. Importing
Search-R1's bare faiss file, the encoder family and the memory an index takes:
test_retriever_import.py.
"""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import run_script
from numerics import EPS32, FP32_FORMULA, assert_close, sum_rtol

from search import corpus
from search.corpus import scan_corpus
from search.index import bm25_tokenize, build_index, load_index, search, search_rows
from trainer.config import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[1]


def one_hop(world, split="val"):
    return [q for q in world.questions[split] if q["metadata"]["type"] == "1hop"]


def recall_at(index, world, k, method):
    qs = one_hop(world)
    hits = search(index, [q["question"] for q in qs], k, method)
    return sum(q["metadata"]["gold_ids"][0] in [h["document"]["id"] for h in hs] for q, hs in zip(qs, hits)) / len(qs)


def test_indexes_reload_with_mmap_and_find_the_gold_passage(search_world):
    world, corpus, index_dir = search_world
    index = load_index(index_dir)
    assert isinstance(index.bm25.scores["data"], np.memmap)  # bm25s arrays mmap'd, not copied
    assert index.meta["n_docs"] == len(world.corpus) and len(index.corpus) == len(world.corpus)
    for method, floor in (("bm25", 0.95), ("dense", 0.9), ("hybrid", 0.95)):
        assert recall_at(index, world, 3, method) >= floor, method
    again = load_index(index_dir)
    qs = [q["question"] for q in one_hop(world)]
    for method in ("bm25", "dense", "hybrid"):
        assert search_rows(index, qs, 5, method) == search_rows(again, qs, 5, method)
    hit = search(index, ["Where was " + one_hop(world)[0]["metadata"]["person"] + " born?"], 3)[0][0]
    assert set(hit) == {"document", "score"} and {"id", "contents", "url", "domain", "date"} <= set(hit["document"])


@pytest.mark.numeric
def test_bm25_scores_equal_plain_bm25s_on_the_same_tokens(search_world):
    """Our wrapper adds no ranking of its own: same rows and scores as bm25s used directly."""
    import bm25s

    world, corpus, index_dir = search_world
    index = load_index(index_dir)
    plain = bm25s.BM25()
    plain.index(bm25_tokenize([d["contents"] for d in world.corpus]), show_progress=False)
    qs = [q["question"] for q in one_hop(world)]
    rows, scores = plain.retrieve(bm25_tokenize(qs), k=5, show_progress=False)
    numpy_index = load_index(index_dir, bm25_backend="numpy")  # bm25s's own scorer on our index
    # A score is a float32 sum of the stored per-term scores of <= 32 query terms, which another
    # scorer (numba vs numpy) adds in another order: sum_rtol(32) of the score itself (the terms
    # are positive), and the same at the top score's size as the floor
    rtol = sum_rtol(32)
    for backend_index in (index, numpy_index):
        ours = search_rows(backend_index, qs, 5, "bm25")
        for r, s, o in zip(rows, scores, ours):
            assert_close([y for _, y in o], s, rtol=rtol, atol=rtol * float(np.max(s)), what="bm25 scores")
            # rows agree wherever the score is not tied (tied rows may come in any order, and a
            # tie at the k-th place may be broken by a row just outside the top k); a tie: equal
            # up to that summation order
            unique = [j for j in range(len(s)) if np.sum(np.isclose(s, s[j], rtol=rtol)) == 1
                      and not np.isclose(s[j], s[-1], rtol=rtol)]  # fmt: skip
            assert [o[j][0] for j in unique] == [int(r[j]) for j in unique]


def test_stemming_is_applied_to_queries_and_documents(search_world):
    index = load_index(search_world[2])
    person = one_hop(search_world[0])[0]["metadata"]["person"]
    # "cities" and "city" share the stem "citi": the query is stemmed like the documents
    assert (
        search_rows(index, [f"{person} cities"], 1, "bm25")[0] == search_rows(index, [f"{person} city"], 1, "bm25")[0]
    )
    assert search(index, ["", "qqqq zzzz"], 3, "bm25") == [[], []]


def test_corpus_that_does_not_match_the_index_is_refused(search_world, tmp_path):
    _, corpus, index_dir = search_world
    lines = corpus.read_text().splitlines(keepends=True)
    swapped = tmp_path / "corpus.jsonl"
    swapped.write_text("".join([lines[1], lines[0], *lines[2:]]))  # same size, rows swapped
    with pytest.raises(DataError, match="row 0 holds id"):
        load_index(index_dir, swapped)
    swapped.write_text("".join(lines[:-1]))
    with pytest.raises(DataError, match="does not match index"):
        load_index(index_dir, swapped)
    with pytest.raises(FileNotFoundError, match="gone.jsonl"):
        load_index(index_dir, tmp_path / "gone.jsonl")
    with pytest.raises(FileNotFoundError, match="no index at"):
        load_index(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="unknown retrieval method 'tfidf'"):
        build_index(corpus, tmp_path / "x", "tfidf")


@pytest.mark.numeric
def test_killed_dense_build_resumes_and_matches_a_clean_build(search_world, tmp_path):
    _, corpus, index_dir = search_world
    out = tmp_path / "dense"
    cmd = [
        sys.executable,
        str(ROOT / "retriever.py"),
        "build",
        "--corpus",
        str(corpus),
        "--method",
        "dense",
        "--out",
        str(out),
        "--chunk",
        "64",
        "--batch-size",
        "16",
        "--keep-embeddings",  # compared with the clean build's below
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    state = out / "embed_state.json"
    deadline = time.time() + 240
    while time.time() < deadline and not (state.exists() and json.loads(state.read_text())["rows_done"] >= 128):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = json.loads(state.read_text())["rows_done"]
    n = json.loads((out / "meta.json").read_text())["n_docs"]
    assert 128 <= done < n, "the build finished before it could be killed"
    with pytest.raises(DataError, match="partial build"):
        load_index(out)
    resumed = run_script(cmd[1:])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming embeddings at row {done} of {n}" in resumed.stdout
    clean = np.memmap(index_dir / "embeddings.f32", dtype=np.float32, mode="r").reshape(n, -1)
    got = np.memmap(out / "embeddings.f32", dtype=np.float32, mode="r").reshape(n, -1)
    # batches of 16 vs 64, padded to their longest text: another batch shape for the encoder
    # (MiniLM: 6 layers, sums of <= 1536 terms). A reordered sum of n terms moves by ~sqrt(n) eps
    # of the (unit-norm) state, two random walks of n roundings (Higham and Mary 2019); 6 layers add
    assert_close(got, clean, rtol=0, atol=6 * math.sqrt(1536) * EPS32, what="resumed embeddings")
    assert load_index(out).meta["complete"]
    rebuild = run_script(cmd[1:])
    assert rebuild.returncode != 0 and "already holds a finished index" in rebuild.stderr


def approx_index(search_world, tmp_path, factory):
    """A dense index with another faiss factory over the session index's finished embeddings
    (copied in, so the build resumes past them and only builds the faiss index)."""
    _, corpus, index_dir = search_world
    out = tmp_path / factory.replace(",", "_")
    out.mkdir()
    shutil.copy(index_dir / "embeddings.f32", out / "embeddings.f32")
    meta = json.loads((index_dir / "meta.json").read_text())
    (out / "embed_state.json").write_text(json.dumps({"rows_done": meta["n_docs"]}))
    meta = {k: v for k, v in meta.items() if k != "complete"}
    meta |= {"method": "dense", "dense": meta["dense"] | {"index_factory": factory}}
    (out / "meta.json").write_text(json.dumps(meta))
    built = build_index(corpus, out, "dense", model=meta["dense"]["model"], family=meta["dense"]["family"],
                        index_factory=factory)  # fmt: skip
    assert not (out / "embeddings.f32").exists()  # deleted once the index is complete (no --keep-embeddings)
    return built


def overlap_at_10(found, exact):
    return float(np.mean([len({r for r, _ in a} & {r for r, _ in e}) / len(e) for a, e in zip(found, exact)]))


def test_hnsw_recall_at_10_against_flat(search_world, tmp_path):
    world, _, index_dir = search_world
    qs = [q["question"] for q in world.questions["val"]]
    exact = search_rows(load_index(index_dir), qs, 10, "dense")
    hnsw = load_index(approx_index(search_world, tmp_path, "HNSW32"), search_params="efSearch=64")
    assert overlap_at_10(search_rows(hnsw, qs, 10, "dense"), exact) >= 0.95


def test_ivf_search_params_reach_faiss(search_world, tmp_path):
    world, _, index_dir = search_world
    qs = [q["question"] for q in world.questions["val"]]
    exact = search_rows(load_index(index_dir), qs, 10, "dense")
    ivf = approx_index(search_world, tmp_path, "IVF8,Flat")
    every_list = overlap_at_10(search_rows(load_index(ivf, search_params="nprobe=8"), qs, 10, "dense"), exact)
    one_list = overlap_at_10(search_rows(load_index(ivf, search_params="nprobe=1"), qs, 10, "dense"), exact)
    assert every_list == 1.0 and one_list < 0.9  # probing all 8 lists is exhaustive; one list is not


def test_faiss_uses_all_cores(search_world):
    import faiss

    load_index(search_world[2])
    assert faiss.omp_get_max_threads() == os.cpu_count()


@pytest.mark.parametrize(
    "family_dir,prefix,pooling", [("e5-base-v2-tiny", "query: ", "mean"), ("bge-tiny", None, "cls")]
)
@pytest.mark.numeric
def test_encoder_conventions_on_a_local_hub_style_model(tmp_path, family_dir, prefix, pooling):
    """A BERT saved to a local directory named like the hub model loads through the same code as
    intfloat/e5-base-v2 would; the family's prefix, pooling and normalisation (the family given,
    never guessed from the name) are applied."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from search.index import ENCODER_FAMILIES, default_encoder_path, encode, load_encoder

    path = tmp_path / family_dir
    tok = AutoTokenizer.from_pretrained(default_encoder_path())
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64)  # fmt: skip
    BertModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    enc = load_encoder(str(path), family_dir.split("-")[0])
    prefix = ENCODER_FAMILIES[enc.family]["query_prefix"] if prefix is None else prefix
    texts = ["Where was Tavi Morek born?", "Velor"]
    got = encode(enc, texts, "query")
    batch = tok([prefix + t for t in texts], padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = BertModel.from_pretrained(path).eval()(**batch).last_hidden_state
    if pooling == "mean":
        m = batch["attention_mask"].unsqueeze(-1).float()
        want = (hidden * m).sum(1) / m.sum(1)
    else:
        want = hidden[:, 0]
    want = torch.nn.functional.normalize(want, dim=-1).numpy()
    # the same model, batch and pooling formula: at most another attention kernel, whose widest
    # sum (64 terms, the MLP) comes in another order, and the pooling's few roundings; unit vectors
    assert_close(got, want, rtol=0, atol=sum_rtol(64) + FP32_FORMULA, what="query embeddings")
    # unit norm: the norm's sum of 32 squares, and the division
    assert_close(np.linalg.norm(got, axis=1), [1.0, 1.0], rtol=0, atol=sum_rtol(32) + FP32_FORMULA, what="norms")
    if enc.family == "e5":  # passages get their own prefix, so the same text embeds differently
        assert np.abs(encode(enc, texts, "passage") - got).max() > 1e-3  # far more than rounding


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"id": "1", "contents": null}', "'contents' must be a string, got null"),
        ('{"id": "1", "contents": 42}', "'contents' must be a string, got int 42"),
        ('{"id": "1", "contents": ["a", "b"]}', "'contents' must be a string, got a list"),
        ('{"id": null, "contents": "x"}', "'id' must be a string or an integer, got null"),
        ('{"id": true, "contents": "x"}', "'id' must be a string or an integer, got a boolean"),
        ('{"id": "1", "contents": "x", "date": 2015}', "'date' must be a string when present, got int 2015"),
        ('{"id": "1", "contents": "x", "url": {"a": 1}}', "'url' must be a string when present, got an object"),
    ],
)
def test_a_corpus_line_of_the_wrong_types_is_one_error_naming_file_and_line(tmp_path, line, message):
    """Was a traceback from deep inside the BM25 build (or a crash at search time)."""
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"id": "0", "contents": "\\"A\\"\\nok"}\n\n' + line + "\n")
    with pytest.raises(DataError, match=re.escape(f"{path}:3: {message}")):
        build_index(path, tmp_path / "idx")
    assert not (tmp_path / "idx").exists()  # refused before anything was written


def test_duplicate_ids_are_refused_naming_both_lines(tmp_path):
    path = tmp_path / "corpus.jsonl"
    rows = [{"id": i, "contents": "x"} for i in ["a", "7", "b", 7]]  # ids are compared as strings: 7 is "7"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    want = f"{path}: duplicate id '7' on lines 2 and 4; passage ids must be unique"
    with pytest.raises(DataError, match=re.escape(want)):
        build_index(path, tmp_path / "idx")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    assert len(scan_corpus(path)) == 3


def test_an_id_hash_collision_is_not_a_duplicate(tmp_path, monkeypatch):
    """Duplicates are found by sorting 64-bit hashes; equal hashes are confirmed on the ids."""
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "contents": "x"}) + "\n" for i in range(50)))
    monkeypatch.setattr(corpus, "hash", lambda _: 0, raising=False)  # every id collides
    assert len(scan_corpus(path)) == 50


def test_bm25s_is_imported_with_jax_kept_on_the_cpu():
    """bm25s runs a JAX op when imported, and JAX on a GPU machine takes 75% of the GPU's memory
    (seen on the lent H200: 105 GiB after `import bm25s`, 0.5 GiB through import_bm25s). JAX is not
    installed here, so this checks the setting itself, in a fresh process: set when unset, a user's
    own choice kept."""
    code = "import os; from search.index import import_bm25s; import_bm25s(); print(os.environ['JAX_PLATFORMS'])"
    for env, expected in (({}, "cpu"), ({"JAX_PLATFORMS": "cuda"}, "cuda")):
        base = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
        out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=base | env,
                             capture_output=True, text=True, check=True)  # fmt: skip
        assert out.stdout.strip() == expected


RANK = """
import sys, time, pathlib
from search.index import ensure_index, load_index, search
print("ready", flush=True)
while not pathlib.Path(sys.argv[2]).exists():  # both processes start the same moment, as ranks do
    time.sleep(0.002)
out = ensure_index(sys.argv[1], "bm25")
print("hit", search(load_index(out), ["P17 passage"], 1)[0][0]["document"]["id"], flush=True)
"""


def test_ranks_launched_at_once_build_the_default_index_once(tmp_path):
    """Two processes ask for the default index of one corpus at the same moment: one builds it
    under the lock beside it, the other waits and loads it (before: both built, into one dir)."""
    corpus_path = tmp_path / "corpus.jsonl"
    corpus_path.write_text("".join(json.dumps({"id": f"d{i}", "contents": f'"P{i}"\npassage {i} word{i % 97}'}) + "\n"
                                   for i in range(20_000)))  # fmt: skip
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(corpus_path), str(go)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]  # fmt: skip
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        go.touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr[-2000:]
    stdout = "".join(o for o, _ in outs)
    assert stdout.count("building ") == 1, stdout
    assert [line for line in stdout.splitlines() if line.startswith("hit")] == ["hit d17", "hit d17"]
    assert (tmp_path / "index-bm25.lock").exists() and load_index(tmp_path / "index-bm25").meta["complete"]
