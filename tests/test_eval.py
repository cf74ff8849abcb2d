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
