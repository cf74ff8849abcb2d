"""Search-R1 EM reward: normalisation, answer extraction, malformed output never raises."""

import pytest

from rewards import exact_match, f1_score, last_block, normalize_answer, score, search_r1_em, split_segments
from rollout import SEARCH_R1_TEMPLATE


def rec(answer, finish="answer", golden=("Velor",)):
    return {"answer": answer, "finish": finish, "golden_answers": list(golden)}


@pytest.mark.parametrize(
    "pred, gold, em",
    [
        ("Velor", ["Velor"], 1.0),
        ("the velor.", ["Velor"], 1.0),
        ("The  Velor!", ["a Velor"], 1.0),
        ("Velor city", ["Velor"], 0.0),
        ("", ["Velor"], 0.0),
        ("Kandria", ["Velor", "Kandria"], 1.0),
    ],
)
def test_exact_match_squad_normalisation(pred, gold, em):
    assert exact_match(pred, gold) == em


def test_f1_by_hand():
    # pred tokens {city, of, velor} vs gold {velor}: precision 1/3, recall 1 -> F1 = 0.5
    assert f1_score("city of Velor", ["Velor"]) == pytest.approx(0.5)
    assert f1_score("Kandria", ["Velor"]) == 0.0
    assert normalize_answer("An Apple, the pie") == "apple pie"


def test_answer_is_the_last_block_of_the_response_not_the_prompt():
    # The prompt's own example answer ("Paris") is never part of the response.
    assert "<answer> Paris </answer>" in SEARCH_R1_TEMPLATE
    text = "<think>x</think><answer> Kandria </answer><think>no</think><answer> Velor </answer>"
    assert last_block(text, "answer") == "Velor"


@pytest.mark.parametrize(
    "text",
    [
        "<think> unclosed <answer> Velor",  # unclosed tags
        "<answer><answer> Velor </answer></answer>",  # nested tags
        "<search>" + "q" * 10_000 + "</search>",  # a huge query, no answer
        "",
        "</answer><answer>",
    ],
)
def test_malformed_output_is_a_format_failure_with_reward_zero(text):
    answer = last_block(text, "answer") if text.endswith("</answer>") else None
    finish = "answer" if answer is not None else "eos"
    parts = search_r1_em(rec(answer, finish))
    assert parts["reward"] == 0.0
    split_segments(text, True)  # never raises


def test_unanswered_rollout_scores_zero_even_if_text_matches():
    assert search_r1_em(rec("Velor", finish="max_turns"))["reward"] == 0.0
    assert search_r1_em(rec("Velor"))["reward"] == 1.0


def test_score_attaches_components_and_rejects_unknown_reward():
    records = score([rec("Velor"), rec("Nope")])
    assert [r["reward"] for r in records] == [1.0, 0.0]
    assert records[0]["reward_components"]["f1"] == 1.0
    with pytest.raises(ValueError, match="unknown reward 'bogus'"):
        score([rec("Velor")], "bogus")
