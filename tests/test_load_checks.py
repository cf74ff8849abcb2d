"""Question files checked at load, each fault one line naming path:line (issue 34): a question
too long for rollout.max_model_len, two questions under one id, a byte that is not UTF-8; and a
tiny-world build (the SFT start, a child process) that fails is one line naming its log."""

import json
import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import run_script

from data import ensure_policy, run_module
from tiny.world import world_dir
from trainer.config import DataError, config_to_dict, load_config
from trainer.questions import load_questions

ROOT = Path(__file__).resolve().parents[1]


def question(qid, text="Where was Tavi Morek born?") -> str:
    return json.dumps({"id": qid, "question": text, "golden_answers": ["Sarn"]}) + "\n"


def test_a_question_too_long_for_the_model_is_refused_with_its_line(micro, tmp_path):
    """A 1 MB question: refused in seconds, naming its line, the id and both lengths, before any
    engine (the fault probe's run forwarded its million tokens through the reference model)."""
    from data import check_prompt_lengths
    from trainer.engine import load_tokenizer

    _, cfg, policy, world = micro
    tokenizer = load_tokenizer(policy)
    for split in ("train", "val", "test"):  # the world's own questions all fit
        check_prompt_lengths(load_questions(world / f"{split}.jsonl"), tokenizer, cfg.rollout, world / f"{split}.jsonl")
    f = tmp_path / "q.jsonl"
    # 27 KB: under the bytes that could fit (check_prompt_lengths refuses more untokenised), 6,000+ tokens
    f.write_text(question("q1") + "\n" + question("huge", "Where was Tavi Morek born? " * 1_000) + question("q3"))
    qs = load_questions(f)
    t0 = time.time()
    with pytest.raises(DataError) as e:
        check_prompt_lengths(qs, tokenizer, cfg.rollout, f)
    assert time.time() - t0 < 60  # 2.5 s on 2 idle cores, 6 s on 2 cores shared by 6 processes
    m = cfg.rollout.max_model_len
    assert str(e.value).startswith(f"{f}:3: question 'huge' is ") and f"over rollout.max_model_len {m}" in str(e.value)
    assert int(str(e.value).split(" is ")[1].split()[0]) > 1_000 * 5  # the whole question, counted


def test_the_length_bound_is_the_rollouts_own(micro, tmp_path):
    """A prompt that leaves the rollout room to generate (rollout.py's next_turn: 8 tokens) passes;
    one token more is refused: exactly at the bound, through the same prompt_ids as the rollout."""
    from agent import protocols
    from data import check_prompt_lengths
    from rollout import prompt_ids
    from trainer.engine import load_tokenizer

    _, cfg, policy, _ = micro
    tokenizer = load_tokenizer(policy)
    proto = protocols.get(cfg.rollout.protocol)
    text = "Where was Tavi Morek born? " * 30
    n = len(prompt_ids(tokenizer, text, cfg.rollout, proto))
    f = tmp_path / "q.jsonl"
    f.write_text(question("long", text))
    check_prompt_lengths(load_questions(f), tokenizer, replace(cfg.rollout, max_model_len=n + 8), f)
    with pytest.raises(DataError, match=rf"^{f}:1: question 'long' is {n} tokens as a prompt"):
        check_prompt_lengths(load_questions(f), tokenizer, replace(cfg.rollout, max_model_len=n + 7), f)


def test_a_duplicate_id_is_refused_naming_both_lines(tmp_path):
    """Rollouts are grouped by question id: two questions under one id were one GRPO group."""
    f = tmp_path / "q.jsonl"
    f.write_text(question("q1") + question(7) + "\n" + question("q3") + question("7", "Where was Sarn founded?"))
    with pytest.raises(DataError, match=rf"^{f}:5: duplicate id '7' \(first at line 2\)$"):
        load_questions(f)
    f.write_text(question("q1") + json.dumps({"question": "x?", "golden_answers": ["y"]}) + "\n")
    with pytest.raises(DataError, match=rf"^{f}:2: no id"):
        load_questions(f)


def test_the_shipped_worlds_have_unique_ids(micro):
    _, _, _, world = micro
    for split in ("train", "val", "test"):
        load_questions(world / f"{split}.jsonl")


def test_a_byte_that_is_not_utf8_names_its_line_and_column(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_bytes(question("q1").encode() + b"\n" + b'{"id": "q2", "question": "caf\xc3\xa9 \xff"}\n')
    with pytest.raises(DataError, match=rf"^{f}:3: not UTF-8 text \(byte 0xff at column 32: invalid start byte\)$"):
        load_questions(f)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_failed_tiny_world_build_is_one_line_naming_its_log(tmp_path, capfd):
    """The SFT start is built in a child process; here its teacher cannot reach the retriever (a
    closed port, no retries), so the child fails in seconds. The user gets one line with the child's
    own last error line and the log that keeps its traceback, not a CalledProcessError."""
    sets = [f"world.cache_dir={tmp_path / 'cache'}", "world.n_people=40", "world.n_cities=8", "world.n_countries=3",
            "world.n_val=4", "world.n_test=4", f"retriever.url=http://127.0.0.1:{closed_port()}",
            "retriever.timeout=1", "retriever.retries=0"]  # fmt: skip
    cfg = load_config(None, sets)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))  # as new_run_dir does
    t0 = time.time()
    with pytest.raises(DataError) as e:
        ensure_policy(cfg, run)
    assert time.time() - t0 < 120
    log = world_dir(cfg) / "build.log"
    message = str(e.value)
    assert message.startswith("building the tiny world's SFT start failed (exit status 1): ") and "\n" not in message
    assert message.endswith(f"; full log: {log}")
    assert "Traceback" in log.read_text()  # kept, for whoever debugs it
    err = capfd.readouterr().err
    assert "Traceback" not in err and "CalledProcessError" not in err


def test_a_child_shows_its_progress_and_logs_its_traceback(tmp_path, monkeypatch, capfd):
    """run_module on a stand-in child: its stderr is shown as it comes up to the traceback, which
    is logged, even when the traceback's first line arrives in two pieces."""
    (tmp_path / "failing_child.py").write_text(
        "import sys, time\n"
        "sys.stderr.write('\\rbuild: 50%'); sys.stderr.flush(); time.sleep(0.3)\n"
        "sys.stderr.write('\\rbuild: 60%Trace'); sys.stderr.flush(); time.sleep(0.3)\n"
        "sys.stderr.write('back (most recent call last):\\n  File x\\nValueError: no passage\\n'); sys.exit(1)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    log = tmp_path / "logs" / "build.log"
    with pytest.raises(DataError) as e:
        run_module("failing_child", what="building X", log=log)
    assert str(e.value) == f"building X failed (exit status 1): ValueError: no passage; full log: {log}"
    err = capfd.readouterr().err
    assert err == "\rbuild: 50%\rbuild: 60%\n"  # the bar, its line ended; nothing of the traceback
    assert "Traceback (most recent call last):" in log.read_text() and "build: 60%" in log.read_text()


def test_train_cli_refuses_a_too_long_question_before_any_engine(micro, tmp_path):
    """train.py: the over-long question is one error line naming its line, before any engine
    starts (no vLLM, no model weights loaded), well within a minute."""
    path, _, _, _ = micro
    f = tmp_path / "train.jsonl"
    f.write_text(question("q1") + question("huge", "Where was Tavi Morek born? " * 1_000))
    sets = [f"data.train={f}", f"train.run_dir={tmp_path / 'runs'}", "rollout.engine=hf", "train.steps=1"]
    # at 9eafa61 the run took this question into its reference forward: still in step 1 at 150 s
    out = run_script(["train.py", "--config", str(path), *[a for s in sets for a in ("--set", s)]], timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    (line,) = [x for x in out.stderr.splitlines() if "error:" in x]
    assert line.startswith(f"error: {f}:2: question 'huge' is ")
