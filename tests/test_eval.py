"""eval.summarize: per-type EM / F1 / format / searches, worked by hand."""

import pytest

from eval import summarize
from rewards import score


def rec(kind, answer, golden, searches, finish="answer"):
    text = f"<think> x</think><answer> {answer} </answer>" if answer else "<think> x</think><search> q</search>"
    return {"answer": answer, "golden_answers": [golden], "finish": finish, "num_searches": searches,
            "metadata": {"type": kind}, "response_text": text}  # fmt: skip


def test_summarize_by_hand():
    records = score([
        rec("1hop", "Velor", "Velor", 1),
        rec("1hop", "Pife", "Velor", 0),
        rec("2hop", "Kandria", "Kandria", 2),
        rec("2hop", None, "Budo", 3, finish="max_turns"),
    ])  # fmt: skip
    m = summarize(records)
    assert m["n"] == 4
    assert m["em"] == 0.5 and m["em_1hop"] == 0.5 and m["em_2hop"] == 0.5
    assert m["format_ok"] == 0.75 and m["format_ok_2hop"] == 0.5  # the unanswered one counts, as a failure
    assert m["searches_1hop"] == 0.5 and m["searches_2hop"] == 2.5


def test_empty_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="empty dataset"):
        summarize([])


# ---------------------------------------------------------------------------------------------
# Baseline modes on the real micro world with the session's vLLM engine, and the CLI's errors.

import json  # noqa: E402

from conftest import run_script  # noqa: E402


@pytest.fixture(scope="module")
def micro_eval(micro):
    from data import data_paths
    from search.tools import make_search_fn
    from trainer.engine import load_tokenizer
    from trainer.questions import load_questions

    _, cfg, policy, _ = micro
    return (
        cfg,
        load_tokenizer(policy),
        load_questions(data_paths(cfg)["val"])[:6],
        make_search_fn(cfg, data_paths(cfg)["corpus"], {}),
    )


def test_modes_force_their_prefix_and_keep_it_untrained(vllm_engine, micro_eval):
    from eval import SEARCH_OFF, rollout_mode
    from report.metrics import compute_metrics

    cfg, tok, questions, search_fn = micro_eval
    by_mode = {m: rollout_mode(m, vllm_engine, tok, questions, search_fn, cfg) for m in ("direct", "rag", "agentic")}
    for mode, records in by_mode.items():
        assert len(records) == len(questions) and all(r["mode"] == mode for r in records)
        for r in records:
            assert len(r["response_ids"]) == len(r["loss_mask"]) == len(r["logprobs"])
            forced = [c for c in r["chunks"] if c["role"] != "policy"]
            assert all(set(r["loss_mask"][c["start"] : c["end"]]) == {0} for c in forced)
    for r in by_mode["direct"]:
        assert r["chunks"][0]["role"] == "prefix" and r["response_text"].startswith("<answer>")
        assert all(c["text"].find(SEARCH_OFF) >= 0 for c in r["chunks"] if c["role"] == "tool")  # no retrieval
    hits = search_fn([q["question"] for q in questions])
    for r, q, h in zip(by_mode["rag"], questions, hits):
        assert r["tool_calls"][0] == {"turn": 0, "query": q["question"], "result": h}  # the question's own hits
        assert r["chunks"][1]["role"] == "tool" and r["chunks"][1]["text"].startswith("\n<information>")
    m = compute_metrics(by_mode["rag"])
    assert m["n"] == len(questions) and m["searches"] >= 1.0  # the forced retrieval counts as one


def test_broken_formats_are_counted_not_dropped(vllm_engine, micro_eval):
    from dataclasses import replace

    from eval import rollout_mode, summarize
    from report.metrics import compute_metrics

    cfg, tok, questions, search_fn = micro_eval
    short = replace(cfg, rollout=replace(cfg.rollout, max_tokens_per_turn=3, max_turns=0))  # no room to answer
    records = rollout_mode("agentic", vllm_engine, tok, questions, search_fn, short)
    assert summarize(records)["n"] == len(questions) == compute_metrics(records)["n"]
    assert compute_metrics(records)["format_violation"] == 1.0 and summarize(records)["format_ok"] == 0.0


def run_cli(*args):
    return run_script(["eval.py", *args])


def test_cli_bad_inputs_fail_clearly_before_any_engine(micro, tmp_path):
    path = str(micro[0])
    missing = run_cli("--config", path, "--model", str(tmp_path / "nope"))
    assert (
        missing.returncode == 2
        and "model directory not found" in missing.stderr
        and str(tmp_path / "nope") in missing.stderr
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = run_cli("--config", path, "--datasets", str(empty))
    assert out.returncode == 2 and "no questions" in out.stderr and str(empty) in out.stderr
    no_gold = tmp_path / "nogold.jsonl"
    no_gold.write_text(json.dumps({"id": "q1", "question": "Where was X born?"}) + "\n")
    out = run_cli("--config", path, "--datasets", str(no_gold))
    assert out.returncode == 2 and "no golden_answers" in out.stderr and "nogold.jsonl:1" in out.stderr
    out = run_cli("--config", path, "--datasets", str(tmp_path / "absent.parquet"))
    assert out.returncode == 2 and "absent.parquet" in out.stderr
    for bad in (missing, out):
        assert "Traceback" not in bad.stderr


def test_search_r1_parquet_is_read_like_flashrag(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainer.questions import load_questions

    rows = [  # the columns of Search-R1's scripts/data_process/nq_search.py output
        {"id": "test_0", "question": "who wrote x?", "golden_answers": ["A B"], "data_source": "nq",
         "prompt": [{"role": "user", "content": "Answer the given question. ... Question: who wrote x?"}],
         "reward_model": {"style": "rule", "ground_truth": {"target": ["A B"]}},
         "extra_info": {"split": "test", "index": 0}},
        {"data_source": "hotpotqa", "prompt": [{"role": "user", "content": "where is y?"}],
         "reward_model": {"style": "rule", "ground_truth": {"target": ["Z"]}},
         "extra_info": {"split": "test", "index": 7}},
    ]  # fmt: skip
    for r in rows[1:]:
        r.update({"id": None, "question": None, "golden_answers": None})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    qs = load_questions(tmp_path / "test.parquet")
    assert qs == [
        {"id": "nq/test_0", "question": "who wrote x?", "golden_answers": ["A B"], "metadata": {"dataset": "nq"}},
        {"id": "hotpotqa/7", "question": "where is y?", "golden_answers": ["Z"], "metadata": {"dataset": "hotpotqa"}},
    ]
