"""Bad input is one line that names the file (and line) or path and the cause, before anything
slow starts, with no traceback and nothing lost: a malformed questions file, a run directory that
cannot be written, a full disk while saving a checkpoint, a checkpoint that would run code on resume.

No model is loaded: the checkpoint tests use stand-ins for the policy and tokenizer (their
save_pretrained writes one small file) and a real optimizer, so they take a second or two."""

import errno
import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_script
from safetensors.torch import save_file

from trainer.checkpoint import (
    check_writable,
    load_trainer_state,
    log,
    new_run_dir,
    save_checkpoint,
    verify_checkpoint,
    write_samples,
)
from trainer.config import DataError, RunDirError, load_config
from trainer.questions import load_questions

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"id": "q1", "question": "Where was Tavi Morek born?", "golden_answers": ["Sarn"]}


def one_error_line(stderr: str) -> str:
    """The CLI's error line; there must be exactly one and no traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    (line,) = [x for x in stderr.splitlines() if "error:" in x]
    return line


# ---------------------------------------------------------------------------------------------
# A malformed questions file: file:line, counted as the file's lines (blank lines included).


@pytest.mark.parametrize(
    "bad, says",
    [
        ('{"id": "q2", "question": "x", ', "not valid JSON"),  # a truncated line
        ('["a", "list"]', "not a JSON object (got list)"),
        ('{"id": "q2", "question": "x", "golden_answers": "Sarn"}', "golden_answers must be a list"),
        ('{"id": "q2", "question": "  ", "golden_answers": ["x"]}', "empty question"),
    ],
)
def test_a_malformed_question_line_names_the_file_and_line(tmp_path, bad, says):
    f = tmp_path / "q.jsonl"
    f.write_text(json.dumps(GOOD) + "\n\n" + bad + "\n" + json.dumps(GOOD) + "\n")  # the bad line is line 3
    with pytest.raises(DataError, match=f"^{f}:3: {says}".replace("(", r"\(").replace(")", r"\)")) as e:
        load_questions(f)
    assert "\n" not in str(e.value)


def test_a_file_that_is_not_utf8_is_one_line(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    with pytest.raises(DataError, match=rf"^{f}:2: not UTF-8 text \(byte 0xff at column 1: invalid start byte\)$"):
        load_questions(f)


def test_eval_cli_names_the_bad_line_before_any_engine(tmp_path):
    model = tmp_path / "model"  # eval.py checks only that a model dir is there before the data
    model.mkdir()
    (model / "config.json").write_text("{}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n{not json\n")
    out = run_script(["eval.py", "--model", str(model), "--datasets", str(bad)], timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert f"{bad}:3: not valid JSON" in one_error_line(out.stderr)


def test_train_cli_names_the_bad_line_before_any_model(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # never loaded: the questions fail first
    corpus, val, bad = tmp_path / "corpus.jsonl", tmp_path / "val.jsonl", tmp_path / "train.jsonl"
    corpus.write_text(json.dumps({"id": "0", "contents": "Tavi Morek\nborn in Sarn"}) + "\n")
    val.write_text(json.dumps(GOOD) + "\n")
    bad.write_text(json.dumps(GOOD) + "\n" + '{"id": "q2", "question": "x", "golden_answers": ["y"]\n')
    sets = [f"model.path={model}", f"data.corpus={corpus}", f"data.train={bad}", f"data.val={val}",
            f"train.run_dir={tmp_path / 'runs'}", "rollout.engine=hf"]  # fmt: skip
    out = run_script(["train.py", *[a for s in sets for a in ("--set", s)]], timeout=300)  # fmt: skip
    assert out.returncode == 1
    assert one_error_line(out.stderr).startswith(f"error: {bad}:2: not valid JSON")


def _byo_run(tmp_path, model: Path, *extra: str) -> subprocess.CompletedProcess:
    corpus, qs = tmp_path / "corpus.jsonl", tmp_path / "q.jsonl"
    corpus.write_text(json.dumps({"id": "0", "contents": "Tavi Morek\nborn in Sarn"}) + "\n")
    qs.write_text(json.dumps(GOOD) + "\n")
    sets = [f"model.path={model}", f"data.corpus={corpus}", f"data.train={qs}", f"data.val={qs}",
            f"train.run_dir={tmp_path / 'runs'}", "rollout.engine=hf", *extra]  # fmt: skip
    return run_script(["train.py", *[a for s in sets for a in ("--set", s)]], timeout=300)  # fmt: skip


def test_a_model_path_that_is_not_a_model_is_one_line(tmp_path):
    (tmp_path / "weights").mkdir()
    out = _byo_run(tmp_path, tmp_path / "weights")
    assert out.returncode == 1
    config = tmp_path / "weights" / "config.json"
    assert one_error_line(out.stderr) == f"error: model.path has no model: {config} not found"


def test_chat_template_on_a_tokenizer_without_one_is_one_line(tmp_path):
    """A real (tiny, random) Llama-architecture model whose tokenizer has no chat template, with
    rollout.chat_template on: refused before any engine starts, naming the key and the directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    model_dir = tmp_path / "base-model"
    vocab = {t: i for i, t in enumerate(["<unk>", "</s>", *"abcdefghijklmnopqrstuvwxyz?"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>", pad_token="</s>")
    tok.save_pretrained(model_dir)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(model_dir)  # fmt: skip
    out = _byo_run(tmp_path, model_dir, "rollout.chat_template=true")
    assert out.returncode == 1
    line = one_error_line(out.stderr)
    assert "rollout.chat_template is on" in line and str(model_dir) in line and "no chat template" in line


# ---------------------------------------------------------------------------------------------
# A run directory that cannot be written. Tests run as root, where chmod 0o555 stops no write;
# a path under a regular file fails for root too (NotADirectoryError).


def test_a_run_dir_under_a_file_is_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    cfg = load_config(None, [f"train.run_dir={afile / 'runs'}"])
    with pytest.raises(RunDirError, match=f"cannot create the run directory {afile / 'runs'}/tiny-.*Not a directory"):
        new_run_dir(cfg)
    with pytest.raises(RunDirError, match=f"cannot append to {afile / 'metrics.jsonl'}: Not a directory"):
        log(afile, {"step": 1})
    with pytest.raises(RunDirError, match=f"cannot write {afile / 'samples' / 'step_1.jsonl'}: Not a directory"):
        write_samples(afile, 1, [{"reward": 1.0}])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o555 directory; the file case above covers it")
def test_a_read_only_run_dir_is_one_line(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    with pytest.raises(RunDirError, match=f"cannot create the run directory {ro}/tiny-.*Permission denied"):
        new_run_dir(load_config(None, [f"train.run_dir={ro}"]))


def test_resume_checks_the_run_dir_is_writable_before_any_model(tmp_path):
    """A resumed run writes metrics.jsonl into its directory: check_writable (train.py --resume,
    before any model loads) fails at once on one it cannot write."""
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    with pytest.raises(RunDirError, match=f"cannot write in the run directory {afile}: Not a directory"):
        check_writable(afile)
    check_writable(tmp_path)
    assert list(tmp_path.iterdir()) == [afile]  # the probe file is gone


def test_train_cli_reports_an_unwritable_run_dir_before_any_work(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    out = run_script(["train.py", "--set", f"train.run_dir={afile / 'runs'}"], timeout=120)  # fmt: skip
    assert out.returncode == 2
    line = one_error_line(out.stderr)
    assert f"{afile / 'runs'}" in line and "Not a directory" in line and "train.run_dir" in line


def test_train_cli_turns_a_run_dir_error_in_training_into_one_line(tmp_path, monkeypatch):
    """A full disk mid-run (save_checkpoint, log) reaches main() as a RunDirError: one line, exit 1."""
    import train

    def full_disk(cfg, run, ckpt):
        raise RunDirError(f"cannot save checkpoint {run}/checkpoints/step_2: No space left on device")

    monkeypatch.setattr(train, "train", full_disk)
    with pytest.raises(SystemExit) as e:
        train.main(["--set", f"train.run_dir={tmp_path}"])
    assert str(e.value.code).startswith("error: cannot save checkpoint") and "No space left" in str(e.value.code)


# ---------------------------------------------------------------------------------------------
# Checkpoints: a full disk while saving; weights_only loading on resume.


class StandIn:
    """The policy / tokenizer as save_checkpoint sees them: save_pretrained writes a file (for the
    weights a real safetensors file, whose length resume checks), and no parameters to check."""

    def __init__(self, name: str):
        self.name = name

    def named_parameters(self):
        return iter(())

    def save_pretrained(self, directory, safe_serialization: bool = True) -> None:
        path = Path(directory) / self.name
        if path.suffix == ".safetensors":
            save_file({"w": torch.zeros(1024)}, str(path))
        else:
            path.write_bytes(b"\0" * 4096)


def optimizer_with_state() -> torch.optim.Optimizer:
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.sum().backward()
    opt.step()
    return opt


def save(run: Path, step: int, opt=None) -> Path:
    state = {"order": [3, 1, 2], "data_rng": random.Random(7).getstate(), "constraints": [{"lam": 0.25}],
             "bapo": {"stage": "plateau", "best": 0.5}}  # fmt: skip
    return save_checkpoint(run, step, StandIn("model.safetensors"), StandIn("tokenizer.json"),
                           opt or optimizer_with_state(), state, keep=2)  # fmt: skip


def test_save_then_resume_round_trips_with_weights_only(tmp_path):
    """RNG states (python, numpy's ndarray, torch), the optimizer and the trainer state come back
    through torch.load(weights_only=True)."""
    opt = optimizer_with_state()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    ckpt = save(tmp_path, 1, opt)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))], lr=0.1)
    verify_checkpoint(ckpt)
    state = load_trainer_state(ckpt, tmp_path, fresh)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    # exact: torch.save / torch.load keep the bits
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert (state["step"], state["order"], state["constraints"], state["bapo"]) == (
        1, [3, 1, 2], [{"lam": 0.25}], {"stage": "plateau", "best": 0.5})  # fmt: skip
    assert state["data_rng"] == random.Random(7).getstate()


class RunsCodeOnLoad:
    """A pickled object whose unpickling runs code: here it only writes a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


@pytest.mark.parametrize("target", ["trainer_state.pt", "optimizer.rank0.pt"])
def test_a_checkpoint_that_would_run_code_is_refused(tmp_path, target):
    ckpt = save(tmp_path, 1)
    marker = tmp_path / "marker"
    torch.save({"step": 1, "payload": RunsCodeOnLoad(marker)}, ckpt / target)
    with pytest.raises(RunDirError, match=f"refusing to load {ckpt / target}: .*could run code") as e:
        verify_checkpoint(ckpt)
    assert "\n" not in str(e.value)
    with pytest.raises(RunDirError, match=f"refusing to load {ckpt / target}"):
        load_trainer_state(ckpt, tmp_path, torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))]))
    assert not marker.exists()


def test_resume_cli_refuses_a_checkpoint_that_would_run_code(tmp_path):
    cfg = load_config(None, [f"train.run_dir={tmp_path}", f"world.cache_dir={tmp_path / 'cache'}"])
    run = new_run_dir(cfg)
    ckpt = save(run, 1)
    marker = tmp_path / "marker"
    torch.save({"step": 1, "world": 1, "payload": RunsCodeOnLoad(marker)}, ckpt / "trainer_state.pt")
    out = run_script(["train.py", "--resume", str(run)], timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert f"refusing to load {ckpt / 'trainer_state.pt'}" in one_error_line(out.stderr)
    assert not marker.exists()


@pytest.mark.parametrize("fault", ["oserror", "torch_runtime_error"])
def test_a_full_disk_while_saving_removes_the_partial_checkpoint(tmp_path, monkeypatch, fault):
    """SIMULATED FAULT: a real full disk cannot be made safely in a test, so torch.save writes part
    of the file and then fails as a full disk makes it fail: OSError(ENOSPC), or (what torch.save
    itself raises on a full disk) a RuntimeError 'unexpected pos' with the disk reported full."""
    first = save(tmp_path, 1)
    real_save = torch.save

    def save_until_full(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"\0" * 1024)  # the partial file a full disk leaves
        if fault == "oserror":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 0))
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", save_until_full)
    step2 = tmp_path / "checkpoints" / "step_2"
    with pytest.raises(RunDirError, match=f"cannot save checkpoint {step2}: No space left on device") as e:
        save(tmp_path, 2)
    assert "\n" not in str(e.value)
    if fault == "oserror":
        assert str(step2.with_name("step_2.tmp") / "optimizer.rank0.pt") in str(e.value)  # the file that failed
    monkeypatch.setattr(torch, "save", real_save)
    assert not step2.with_name("step_2.tmp").exists() and not step2.exists()  # nothing left filling the disk
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]  # nothing lost
    assert load_trainer_state(first, tmp_path, optimizer_with_state())["step"] == 1


def test_a_bug_while_saving_keeps_its_traceback(tmp_path, monkeypatch):
    """Only failed writes become one line; any other error (a bug) propagates as it was, and the
    partial checkpoint is still removed."""

    def broken(obj, path, *args, **kwargs):
        raise RuntimeError("a bug, not a full disk")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(RuntimeError, match="a bug, not a full disk"):
        save(tmp_path, 1)
    assert not (tmp_path / "checkpoints" / "step_1.tmp").exists()


# ---------------------------------------------------------------------------------------------
# convert_gguf.py: a GGUF that is not there, or not a GGUF, is one line.


@pytest.mark.parametrize("content", [None, b"this is not a GGUF file\n"])
def test_convert_gguf_refuses_a_missing_or_broken_file_in_one_line(tmp_path, content):
    gguf = tmp_path / "model.gguf"
    if content is not None:
        gguf.write_bytes(content)
    out = run_script(["convert_gguf.py", str(gguf), "--out", str(tmp_path / "out")], timeout=300)  # fmt: skip
    assert out.returncode == 1
    line = one_error_line(out.stderr)
    expected = f"error: GGUF file not found: {gguf}" if content is None else f"error: cannot read {gguf} as a GGUF"
    assert line.startswith(expected), line
    assert not (tmp_path / "out" / "DONE").exists()
