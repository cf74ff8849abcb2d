"""Question files that would train on wrong numbers without a word (88e794b) are said, in one line,
or read as the user meant: numeric golden answers, unscorable ones, a BOM, a parquet whose
`prompt` is plain text, and a 50 MB question refused before it is tokenised."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agent.answers import exact_match, golden_of
from trainer.config import DataError
from trainer.questions import load_questions

ROOT = Path(__file__).resolve().parents[1]


def write(path: Path, rows: list[dict], head: bytes = b"") -> Path:
    path.write_bytes(head + "".join(json.dumps(r) + "\n" for r in rows).encode())
    return path


def test_numeric_golden_answers_are_read_as_text_and_said_once(tmp_path, capsys):
    path = write(tmp_path / "q.jsonl", [{"id": "a", "question": "When?", "golden_answers": [1990, "MCMXC"]},
                                        {"id": "b", "question": "How much?", "golden_answers": [2.5]}])  # fmt: skip
    qs = load_questions(path)
    assert [q["golden_answers"] for q in qs] == [["1990", "MCMXC"], ["2.5"]]
    assert exact_match("1990", golden_of(qs[0])) == 1.0  # 88e794b: golden_of dropped 1990, EM 0
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and "2 golden answer(s) written as numbers" in said and str(path) in said


@pytest.mark.parametrize("bad, says", [(None, "null"), ("", "str ''"), ("  ", "str '  '"), (["x"], "a list"),
                                       ({"a": 1}, "an object"), (True, "a boolean")])  # fmt: skip
def test_unscorable_golden_answers_name_their_line(tmp_path, bad, says):
    path = write(tmp_path / "q.jsonl", [{"id": "a", "question": "Q?", "golden_answers": ["ok"]},
                                        {"id": "b", "question": "Q?", "golden_answers": ["ok", bad]}])  # fmt: skip
    with pytest.raises(DataError, match=rf"q.jsonl:2: golden answer 2 must be a non-empty string or a number, "
                                        rf"got {says}"):  # fmt: skip
        load_questions(path)


def test_a_question_file_with_a_bom_loads_as_the_corpus_does(tmp_path):
    path = write(tmp_path / "q.jsonl", [{"id": "a", "question": "Q?", "golden_answers": ["x"]}], b"\xef\xbb\xbf")
    assert load_questions(path)[0]["id"] == "a"  # 88e794b: "q.jsonl:1: not valid JSON (Unexpected UTF-8 BOM)"


def test_a_parquet_whose_prompt_is_plain_text_loads(tmp_path):
    rows = [{"data_source": "nq", "prompt": "who wrote x?", "reward_model": {"ground_truth": {"target": ["A"]}},
             "extra_info": {"index": 3}}]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "q.parquet")
    assert load_questions(tmp_path / "q.parquet") == [
        {"id": "nq/3", "question": "who wrote x?", "golden_answers": ["A"], "metadata": {"dataset": "nq"}}]


def test_a_50_mb_question_is_refused_in_seconds_and_little_memory(micro, tmp_path):
    """Refused by its bytes before it is tokenised (88e794b: 166-228 s and 13.3 GB): measured in a
    child process, its peak memory above what the tokenizer and imports take."""
    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        f.write(json.dumps({"id": "a", "question": "Where was Tavi Morek born?", "golden_answers": ["x"]}) + "\n")
        f.write(json.dumps({"id": "b", "question": "Tavi " * 10_000_000, "golden_answers": ["x"]}) + "\n")
    assert big.stat().st_size > 50_000_000
    script = textwrap.dedent(f"""
        import resource, sys, time
        from trainer.config import DataError, load_config
        from data import check_prompt_lengths
        from trainer.questions import load_questions
        from trainer.engine import load_tokenizer
        cfg = load_config({str(micro[0])!r})
        tokenizer = load_tokenizer({str(micro[2])!r})
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.time()
        try:
            check_prompt_lengths(load_questions({str(big)!r}), tokenizer, cfg.rollout, {str(big)!r})
        except DataError as e:
            print(time.time() - t0, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20, e)
            sys.exit(0)
        sys.exit("not refused")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seconds, peak_gib, message = done.stdout.split(" ", 2)
    assert "big.jsonl:2: question 'b' has 50000000 bytes, more than rollout.max_model_len" in message
    print(f"refused in {float(seconds):.2f} s, peak +{float(peak_gib):.3f} GiB")
    assert float(seconds) < 10 and float(peak_gib) < 1.0, (seconds, peak_gib)
