"""What a data file or a config declares is read, or refused in one line naming path:line or the
key, before anything slow starts (issue 55's probe of fcae7e2: findings 3, 8, 9, 11, 12, 13).

No model loads here: the tests that run train.py are refused before any does, and where setup
could reach the engine it is a stand-in that fails the test if built (the refusal must come first)."""

import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import eval as eval_script
import prepare_data
import run_setup
import train
from data import data_paths
from search.index import default_encoder_path
from search.meta import check_index, search_params
from trainer.config import MAX_NODES, ConfigError, DataError, load_config
from trainer.questions import load_questions
from trainer.rundir import discard_unstarted, own_run_dir


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def row(qid="train_0", question="who wrote it", golden=("Ana",)) -> dict:
    return {"id": qid, "question": question, "golden_answers": list(golden)}


# ---------------------------------------------------------------------------------------------
# 3. A test file that is there but cannot be read is refused, never passed over for another split.


def flashrag_with(tmp_path: Path, make_test) -> Path:
    flashrag = tmp_path / "flashrag"
    write_jsonl(flashrag / "nq" / "train.jsonl", [row()])
    make_test(flashrag / "nq" / "test.jsonl")
    return flashrag


@pytest.mark.parametrize("kind, says", [
    ("broken symlink", "a symlink to"), ("symlink loop", "a symlink loop"), ("directory", "a directory"),
])  # fmt: skip
def test_prepare_refuses_a_test_file_it_cannot_read_instead_of_using_train(tmp_path, kind, says):
    def make(path: Path) -> None:
        if kind == "broken symlink":
            path.symlink_to(path.parent / "gone.jsonl")
        elif kind == "symlink loop":
            path.symlink_to(path)
        else:
            path.mkdir()

    flashrag = flashrag_with(tmp_path, make)
    with pytest.raises(SystemExit) as e:
        prepare_data.main(["--flashrag", str(flashrag), "--out", str(tmp_path / "out"), "--train", "", "--test", "nq"])
    line = str(e.value.code)
    assert line.startswith(f"error: {flashrag / 'nq' / 'test.jsonl'}: cannot read it (") and says in line, line
    assert "\n" not in line and not (tmp_path / "out").exists()  # nothing written, nothing built from train.jsonl


def test_a_question_or_data_file_that_is_a_directory_says_so(tmp_path):
    (tmp_path / "q.jsonl").mkdir()
    with pytest.raises(DataError, match=r"q.jsonl: cannot read it as a question file: a directory"):
        load_questions(tmp_path / "q.jsonl")
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"id": "0", "contents": "x"}])
    cfg = load_config(None, [f"data.corpus={corpus}", f"data.train={tmp_path / 'q.jsonl'}", f"data.val={corpus}",
                             f"data.test={corpus}"])  # fmt: skip
    with pytest.raises(FileNotFoundError, match=r"train file .*q.jsonl cannot be read: a directory"):
        data_paths(cfg)


# ---------------------------------------------------------------------------------------------
# 8. A lone surrogate is no text: refused at its line, not a tokenizer TypeError after the engine.


@pytest.mark.parametrize("field, value, says", [
    ("question", "who wrote \ud800 it", "question character 11"),
    ("golden_answers", ["A\udfff"], r"golden_answers\[0\] character 2"),
    ("metadata", {"title": "\ud800"}, "metadata.title character 1"),
])  # fmt: skip
def test_a_lone_surrogate_is_refused_with_its_line_and_field(tmp_path, field, value, says):
    bad = row("train_1") | {field: value}
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(row()) + "\n" + json.dumps(bad) + "\n")  # json.dumps writes it as \ud800
    with pytest.raises(DataError, match=rf"^{path}:2: {says}: a lone UTF-16 surrogate is not text"):
        load_questions(path)
    pair = row("train_2", question="who wrote \ud83d\ude00 it")  # a surrogate pair is an emoji: fine
    path.write_text(json.dumps(pair) + "\n")
    assert load_questions(path)[0]["question"] == "who wrote \U0001f600 it"


# ---------------------------------------------------------------------------------------------
# 9. Types, where each value enters: a parquet's fields, ids, and ids across prepare_data's sources.


@pytest.mark.parametrize("fields, says", [
    ({"reward_model": "EM"}, "reward_model must be an object, got str 'EM'"),
    ({"reward_model": {"ground_truth": "x"}}, "reward_model.ground_truth must be an object, got str 'x'"),
    ({"id": None, "extra_info": "split=train"}, "extra_info must be an object, got str 'split=train'"),
    ({"golden_answers": 1990}, "golden_answers must be a list, got 1990"),
    ({"data_source": 7}, "data_source must be text, got int 7"),
    ({"id": 1.5}, "id must be text or an integer, got float 1.5"),
    ({"metadata": "[1]"}, "metadata must be an object, got a list"),
])  # fmt: skip
def test_a_parquet_field_of_the_wrong_type_names_the_row_and_field(tmp_path, fields, says):
    path = tmp_path / "q.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "a", "question": "q?", "golden_answers": ["x"], "data_source": "nq"}
                                         | fields]), path)  # fmt: skip
    with pytest.raises(DataError) as e:
        load_questions(path)
    assert str(e.value).startswith(f"{path}:1: {says}"), str(e.value)


def test_integer_golden_answers_in_a_parquet_are_read_as_text(tmp_path):
    path = tmp_path / "q.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "a", "question": "q?", "reward_model": {"style": "rule",
                   "ground_truth": {"target": [1990, 1991]}}}]), path)  # fmt: skip
    assert load_questions(path)[0]["golden_answers"] == ["1990", "1991"]


@pytest.mark.parametrize("qid", [1.0, True, [1], {"a": 1}])
def test_an_id_that_is_neither_text_nor_an_integer_is_refused(tmp_path, qid):
    path = write_jsonl(tmp_path / "q.jsonl", [row(), row(qid)])
    with pytest.raises(DataError, match=rf"^{path}:2: id must be text or an integer"):
        load_questions(path)


def test_prepare_refuses_int_ids_beside_text_ids_naming_both(tmp_path):
    flashrag = tmp_path / "flashrag"
    write_jsonl(flashrag / "nq" / "train.jsonl", [row("train_0"), row("train_1")])
    write_jsonl(flashrag / "hotpotqa" / "train.jsonl", [row("train_0"), row(7)])
    with pytest.raises(SystemExit) as e:
        prepare_data.main(["--flashrag", str(flashrag), "--out", str(tmp_path / "out"), "--test", ""])
    hotpot, nq = flashrag / "hotpotqa" / "train.jsonl", flashrag / "nq" / "train.jsonl"
    assert str(e.value.code) == (f"error: {hotpot}:2: id 7 is an integer, but the id at {nq}:1 is text: one parquet "
                                 "column holds one type; write every id as text")  # fmt: skip
    write_jsonl(flashrag / "hotpotqa" / "train.jsonl", [row(2**64)])
    with pytest.raises(SystemExit, match=r"train.jsonl:1: id 18446744073709551616 does not fit a parquet int64"):
        prepare_data.main(["--flashrag", str(flashrag), "--out", str(tmp_path / "out"), "--train", "hotpotqa",
                           "--test", ""])  # fmt: skip
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# 12. YAML: aliases are bounded, a key given twice is refused, and an error line stays a line.

LAUGHS = "{a: &a [x,x,x,x,x,x,x,x,x], " + ", ".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi")) + "}"  # 9**9 values


def test_yaml_aliases_in_an_override_are_refused_at_once():
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"train.reward_params={LAUGHS}"])
    assert time.monotonic() - t0 < 2 and "YAML aliases (*name) are not taken in an override" in str(e.value)
    assert len(str(e.value)) < 500, len(str(e.value))


def test_yaml_aliases_in_a_file_are_bounded_and_small_ones_kept(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(f"train:\n  reward_params: {LAUGHS}\n")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=rf"c.yaml: its YAML aliases expand to more than {MAX_NODES} values"):
        load_config(f)
    assert time.monotonic() - t0 < 2
    f.write_text("train:\n  lr: &lr 0.001\nsft:\n  lr: *lr\n")
    cfg = load_config(f)
    assert cfg.train.lr == cfg.sft.lr == 0.001


def test_a_key_given_twice_is_refused_with_its_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 0.1\n  steps: 3\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=rf"^{f}:4: key 'lr' given twice in one mapping \(first at line 2\)"):
        load_config(f)
    with pytest.raises(ConfigError, match=r"key 'lr' given twice"):
        load_config(None, ["train={lr: 0.1, lr: 0.2}"])


@pytest.mark.parametrize("override", [
    "rollout.protocol=" + "x" * 100_000, "train.steps=" + "x" * 100_000, "train.lr=" + "[" * 5000,
    "train." + "y" * 100_000 + "=1", "x" * 100_000,
])  # fmt: skip
def test_an_error_line_echoes_at_most_a_few_hundred_characters(override):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert len(str(e.value)) < 1500 and "\n" not in str(e.value), str(e.value)[:2000]  # train's key list: ~900


# ---------------------------------------------------------------------------------------------
# 13. world.cache_dir that is no directory; a refused train.py leaves no run directory behind.


@pytest.mark.parametrize("cache", ["/dev/zero", "/dev/zero/cache"])
def test_a_cache_dir_that_is_not_a_directory_names_the_key(cache):
    with pytest.raises(ConfigError, match=r"config key 'world.cache_dir' must be a directory .*is not one"):
        load_config(None, [f"world.cache_dir={cache}"])


def test_discard_unstarted_removes_only_a_run_that_holds_nothing(tmp_path):
    fresh, started = tmp_path / "fresh", tmp_path / "started"
    for run in (fresh, started):
        run.mkdir()
        (run / "config.yaml").write_text("train: {}\n")
        own_run_dir(run)
    (started / "metrics.jsonl").write_text('{"step": 0}\n')
    discard_unstarted(fresh)
    discard_unstarted(started)
    assert not fresh.exists() and sorted(p.name for p in started.iterdir()) == ["config.yaml", "metrics.jsonl",
                                                                               "run.lock"]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 11. retriever.index and retriever.search_params are read before the engine (and the world) start.


@pytest.mark.parametrize("params, says", [
    ("nprobe=0", "nprobe must be an integer >= 1; got '0'"), ("nprobe=1.5", "nprobe must be an integer"),
    ("efsearch=16", "takes name=value pairs"), ("nprobe", "takes name=value pairs"),
    ("k_factor_rf=nan", "k_factor_rf must be a number >= 1"),
])  # fmt: skip
def test_search_params_faiss_would_take_silently_or_refuse_late_are_refused(params, says):
    with pytest.raises(ConfigError, match=f"config key 'retriever.search_params'.*{says}"):
        check_index(load_config(None, [f"retriever.search_params={params}", "retriever.method=dense"]).retriever)
    assert search_params("nprobe=8,quantizer_efSearch=16, k_factor_rf=1.5") == {
        "nprobe": 8, "quantizer_efSearch": 16, "k_factor_rf": 1.5}  # fmt: skip


def write_meta(index: Path, method: str, factory: str = "") -> Path:
    """An index directory's meta.json as retriever.py build / import write it (its other files are
    not read before the engine)."""
    index.mkdir(parents=True, exist_ok=True)
    dense = {"model": default_encoder_path(), "family": "minilm", "index_factory": factory}
    meta = {"method": method, "complete": True, "n_docs": 2, "corpus": "corpus.jsonl", "corpus_bytes": 10,
            "id_checks": [[0, "p0"]]} | ({"dense": dense} if factory else {})  # fmt: skip
    (index / "meta.json").write_text(json.dumps(meta))
    return index


@pytest.mark.parametrize("method, factory, params, ok", [
    ("dense", "IVF16,Flat", "nprobe=4", True), ("dense", "IVF16,Flat", "efSearch=64", False),
    ("dense", "HNSW32", "efSearch=64", True), ("dense", "HNSW32", "nprobe=4", False),
    ("dense", "Flat", "nprobe=4", False), ("hybrid", "IVF16_HNSW32,Flat", "nprobe=4,efSearch=8", True),
    ("dense", "IndexIVFFlat (imported)", "nprobe=4", True), ("dense", "IndexFlatIP (imported)", "nprobe=4", False),
    ("dense", "IndexPreTransform (imported)", "nprobe=4", True), ("bm25", "", "nprobe=4", False),
])  # fmt: skip
def test_check_index_matches_search_params_to_the_index_kind(tmp_path, method, factory, params, ok):
    cfg = load_config(None, [f"retriever.index={write_meta(tmp_path / 'index', method, factory)}",
                             f"retriever.search_params={params}"])  # fmt: skip
    if ok:
        check_index(cfg.retriever)
    else:
        with pytest.raises(ConfigError, match=r"retriever.search_params"):
            check_index(cfg.retriever)


def test_an_index_that_is_not_there_or_partial_is_one_line(tmp_path):
    cfg = load_config(None, [f"retriever.index={tmp_path / 'nowhere'}"])
    with pytest.raises(FileNotFoundError, match=r"retriever.index .*nowhere: no index there"):
        check_index(cfg.retriever)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "meta.json").write_text('{"method": "bm25"}')
    with pytest.raises(DataError, match=r"half is a partial build"):
        check_index(load_config(None, [f"retriever.index={tmp_path / 'half'}"]).retriever)


@pytest.mark.parametrize("sets, says", [
    (["retriever.index={tmp}/nowhere"], "retriever.index {tmp}/nowhere: no index there"),
    (["retriever.search_params=nprobe=4"], "but the index is bm25"),
])  # fmt: skip
def test_train_refuses_a_bad_index_before_any_engine_and_leaves_no_run_dir(micro, tmp_path, monkeypatch, sets,
                                                                           says):  # fmt: skip
    """At fcae7e2 both were refused only after the engine started (a missing index 99 s in, with
    7 GiB of KV cache taken; a bad parameter as faiss's traceback), and the refused run's
    directory stayed behind. Here the engine is a stand-in that fails the test if it is built."""
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built before the refusal")

    monkeypatch.setattr(run_setup, "make_engine", no_engine)
    runs = tmp_path / "runs"
    argv = ["--config", str(micro[0]), "--set", f"train.run_dir={runs}", "--set", "train.steps=1"]
    for s in sets:
        argv += ["--set", s.format(tmp=tmp_path)]
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert str(e.value.code).startswith("error: ") and says.format(tmp=tmp_path) in str(e.value.code), e.value.code
    assert not runs.exists() or not os.listdir(runs), os.listdir(runs)  # the refused run left no directory


def test_eval_refuses_a_missing_index_before_any_engine(micro, tmp_path, monkeypatch, capsys):
    """eval.py too: a missing retriever.index or a search parameter the index cannot take is one
    line before its engine starts (at fcae7e2, after; the engine here fails the test if built)."""
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built before the refusal")

    monkeypatch.setattr(eval_script, "make_engine", no_engine)
    for sets, says in [(f"retriever.index={tmp_path}/nowhere", f"retriever.index {tmp_path}/nowhere: no index there"),
                       ("retriever.search_params=nprobe=4", "but the index is bm25")]:  # fmt: skip
        with pytest.raises(SystemExit):
            eval_script.main(["--config", str(micro[0]), "--set", sets, "--model", f"sft={micro[2]}",
                              "--out", str(tmp_path / "out")])  # fmt: skip
        said = capsys.readouterr().err
        assert says in said.strip().splitlines()[-1], said  # argparse's usage, then the one line


def test_a_refused_train_leaves_no_run_dir_and_a_refused_resume_keeps_its_own(tmp_path):
    """A bad data line refuses a fresh run before any model loads: its run directory (config.yaml,
    run.lock) goes with it (at fcae7e2 it stayed, reading as a run that died at once). A refused resume
    keeps its directory whole."""
    model, runs = tmp_path / "model", tmp_path / "runs"
    model.mkdir()
    (model / "config.json").write_text("{}")  # never loaded: the questions fail first
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"id": "0", "contents": "Tavi Morek\nborn in Sarn"}])
    good = write_jsonl(tmp_path / "val.jsonl", [row()])
    bad = tmp_path / "train.jsonl"
    bad.write_text(json.dumps(row()) + "\n{not json\n")
    sets = [f"model.path={model}", f"data.corpus={corpus}", f"data.train={bad}", f"data.val={good}",
            f"train.run_dir={runs}", "rollout.engine=hf"]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        train.main([a for s in sets for a in ("--set", s)])
    assert str(e.value.code).startswith(f"error: {bad}:2: not valid JSON")
    assert runs.is_dir() and not os.listdir(runs), os.listdir(runs)
    old = runs / "tiny-old"
    (old / "checkpoints").mkdir(parents=True)
    (old / "config.yaml").write_text("train: {steps: 3}\n")
    with pytest.raises(SystemExit):
        train.main(["--resume", str(old)])  # no checkpoint to resume: refused
    assert sorted(p.name for p in old.iterdir()) == ["checkpoints", "config.yaml", "run.lock"]


# ---------------------------------------------------------------------------------------------
# The same class, beyond the probe's cases: a key twice in a JSON row, numbers Python cannot read
# back as text, a config file that is no file or no config, --out that is no directory.


def test_a_json_row_with_a_key_twice_or_an_unreadable_number_names_its_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(row()) + '\n{"id": "b", "question": "a?", "question": "b?", "golden_answers": ["x"]}\n')
    with pytest.raises(DataError, match=rf"^{path}:2: key 'question' given twice in one object$"):
        load_questions(path)
    path.write_text('{"id": "a", "question": "q?", "golden_answers": [' + "1" * 5000 + "]}\n")
    with pytest.raises(DataError, match=rf"^{path}:1: a number too long to read"):
        load_questions(path)
    path.write_text('{"id": "a", "question": "q?", "golden_answers": [' + "1" * 400 + "]}\n")  # too big for a float
    assert load_questions(path)[0]["golden_answers"] == ["1" * 400]


def test_a_config_file_that_is_no_file_or_too_big_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=rf"^config file is not a regular file: {tmp_path}$"):
        load_config(tmp_path)
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (2 << 20) + "\n")
    with pytest.raises(ConfigError, match=rf"^config file {big} has \d+ bytes; a config is a few KB"):
        load_config(big)


def test_prepare_out_that_is_not_a_directory_is_one_line_before_any_work(tmp_path):
    flashrag = tmp_path / "flashrag"
    write_jsonl(flashrag / "nq" / "train.jsonl", [row()])
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, says in ((afile, f"--out {afile} is not a directory"),
                      (afile / "out", f"cannot write {afile / 'out' / 'train.parquet'} (--out): Not a directory")):
        with pytest.raises(SystemExit) as e:
            prepare_data.main(["--flashrag", str(flashrag), "--out", str(out), "--train", "nq", "--test", ""])
        assert str(e.value.code).startswith(f"error: {says}"), e.value.code


@pytest.mark.parametrize("name", ["a/b", "x" * 300, "", ".."])
def test_a_train_name_that_is_no_directory_name_names_the_key(name):
    """At fcae7e2 a 100 KB name reached mkdir: a RunDirError echoing the whole path."""
    with pytest.raises(ConfigError, match=r"^config key 'train.name' must be one directory name") as e:
        load_config(None, [f"train.name={name}"])
    assert len(str(e.value)) < 500
