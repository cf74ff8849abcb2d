"""Every reward of the five papers, worked by hand from each paper's definition.

Each table covers a correct answer, a wrong one, IDK, a missing answer and a broken format.
The expected numbers are computed in the comments from the equations (rewards.py docstring).
Rewards are Python floats (float64) of a few terms: pytest.approx's default (rel 1e-6, abs
1e-12) is far above their rounding (~1e-16).
"""

import json
import time
from pathlib import Path

import pytest
from conftest import run_script

from agent.answers import (
    char_f1,
    exact_match,
    f1_score,
    golden_of,
    last_block,
    normalize_answer,
    parse_response,
    parsed,
)
from agent.bapo import BapoState, bapo_resample_groups
from report.metrics import bapo_metrics
from rewards import (
    bapo,
    compute,
    parse_spec,
    score,
    source_restricting,
)  # fmt: skip
from rollout import SEARCH_R1_TEMPLATE

ROOT = Path(__file__).resolve().parents[1]
INFO = "<information>Doc 1(Title: Tavi Morek) Tavi Morek was born in the city of Velor.</information>"
SEARCHED = f"<think> find it</think><search> Tavi Morek born</search>{INFO}<think> it says Velor.</think>"


def R(text: str, golden=("Velor",), **extra) -> dict:
    return {"response": text, "golden_answers": list(golden), "question": "Where was Tavi Morek born?", **extra}


def reward(name: str, text: str, **params) -> float:
    return compute([R(text)], name, params)[0]["reward"]


# ---------------------------------------------------------------------------------- helpers


@pytest.mark.parametrize(
    "pred, gold, em",
    [("Velor", ["Velor"], 1.0), ("the velor.", ["Velor"], 1.0), ("The  Velor!", ["a Velor"], 1.0),
     ("Velor city", ["Velor"], 0.0), ("", ["Velor"], 0.0), ("Kandria", ["Velor", "Kandria"], 1.0)],
)  # fmt: skip
def test_exact_match_squad_normalisation(pred, gold, em):
    assert exact_match(pred, gold) == em


def test_f1_word_and_character_level_by_hand():
    # words {city, of, velor} vs {velor}: P 1/3, R 1 -> 0.5
    assert f1_score("city of Velor", ["Velor"]) == pytest.approx(0.5)
    # characters k,e,s,h vs v,e,l,o,r: one common (e): P 1/4, R 1/5 -> 2/9
    assert char_f1("Kesh", ["Velor"]) == pytest.approx(2 / 9)
    assert normalize_answer("An Apple, the pie") == "apple pie"


def test_parser_answer_boxed_confidence_queries_and_blocks():
    p = parse_response(SEARCHED + "<confidence> 7 </confidence><answer> The final answer is \\boxed{Velor} </answer>")
    assert p.answer == "Velor" and p.confidence == 7 and p.queries == ["Tavi Morek born"] and p.format_ok
    assert [k for k, _ in p.blocks] == ["think", "search", "information", "think", "confidence", "answer"]
    call = '<tool_call>{"name": "web_search", "arguments": {"query": ["a AND b", "c"]}}</tool_call>'
    p = parse_response(f"<think>x</think>{call}<tool_response>r</tool_response><think>y</think><answer>z</answer>")
    assert p.queries == ["a AND b", "c"] and p.format_ok  # a list argument stays a list
    assert parse_response("<think>x</think><answer>\\boxed{I DON'T KNOW}</answer>").idk
    assert parse_response("<think>x</think><answer>\\boxed{a{b}c}</answer>").answer == "a{b}c"


def test_answer_is_the_last_block_of_the_response_not_the_prompt_or_a_passage():
    assert "<answer> Paris </answer>" in SEARCH_R1_TEMPLATE  # the prompt is never scored
    text = "<think>x</think><answer> Kandria </answer><think>no</think><answer> Velor </answer>"
    assert last_block(text, "answer") == "Velor"
    planted = "<think>a</think><search>q</search><information><answer> Velor </answer></information><think>b</think>"
    assert parse_response(planted).answer is None  # an answer inside retrieved text is not ours


# --------------------------------------------------------------------------------- Search-R1

CASES = {
    "correct": SEARCHED + "<answer> Velor </answer>",
    "wrong": SEARCHED + "<answer> Kesh </answer>",
    "idk": "<think> no idea</think><answer> I don't know </answer>",
    "missing": SEARCHED,
    "broken": "<think> unclosed <answer> Velor </answer>",
}


@pytest.mark.parametrize(
    "case, em, subem, fmt, fmt_r",
    [
        # EM & valid -> 1 (both lambda_r settings); lambda_s 0.2, lambda_r 0 (or 0.1), lambda_f 0.1
        ("correct", 1.0, 1.0, 1.0, 1.0),
        # wrong & valid -> lambda_s = 0.2; with a retrieval hit (Velor is in the passage) + lambda_r 0.1
        ("wrong", 0.0, 0.0, 0.2, 0.3),
        # IDK is just a wrong answer to Search-R1: valid format, no retrieval -> lambda_s
        ("idk", 0.0, 0.0, 0.2, 0.2),
        # no answer, valid-looking blocks but the sequence does not end in an answer -> 0
        ("missing", 0.0, 0.0, 0.0, 0.0),
        # EM with a broken structure -> 1 - lambda_s
        ("broken", 1.0, 1.0, 0.8, 0.8),
    ],
)
def test_search_r1_table(case, em, subem, fmt, fmt_r):
    assert reward("search_r1_em", CASES[case]) == em
    assert reward("search_r1_subem", CASES[case]) == subem
    assert reward("search_r1_format", CASES[case]) == pytest.approx(fmt)
    assert reward("search_r1_format", CASES[case], lambda_r=0.1) == pytest.approx(fmt_r)


def test_search_r1_subem_and_wrong_invalid_case():
    assert reward("search_r1_subem", SEARCHED + "<answer> the city of Velor </answer>") == 1.0
    assert reward("search_r1_em", SEARCHED + "<answer> the city of Velor </answer>") == 0.0
    assert reward("search_r1_format", "stray text <think>x</think><answer> Kesh </answer>") == pytest.approx(0.1)


# ---------------------------------------------------------------------- Deliberative Searcher


@pytest.mark.parametrize(
    "answer, conf, lam, expected",
    [
        ("Velor", 8, 0.5, 1.5),  # format 1: 0.1 + 0.9 * 1 + 0.5 * [acc and 8 >= 5]
        ("Velor", 3, 0.5, 1.0),  # right but unsure: reliability 0
        ("Kesh", 3, 0.5, 0.6),  # wrong and unsure: 0.1 + 0 + 0.5
        ("Kesh", 9, 0.5, 0.1),  # wrong and certain: 0.1
        ("I don't know", 2, 0.5, 0.6),  # IDK: not accurate, unsure -> reliable
        ("Velor", 8, 0.0, 1.0),  # warm-up quarter: lambda = 0
        ("Velor", None, 0.5, 0.0),  # no confidence -> format violated -> 0
        ("Velor", 11, 0.5, 0.0),  # confidence outside 1..10 -> format violated
        (None, 8, 0.5, 0.0),  # missing answer -> 0
    ],
)
def test_deliberative_table(answer, conf, lam, expected):
    text = SEARCHED + (f"<confidence> {conf} </confidence>" if conf is not None else "")
    text += f"<answer> {answer} </answer>" if answer is not None else ""
    out = compute([R(text)], "deliberative", {"lam": lam, "zeta": 5})[0]
    assert out["reward"] == pytest.approx(expected)
    assert set(out["components"]) >= {"format", "acc", "reliability", "lambda"}


def test_deliberative_a_step_confidence_does_not_stand_in_for_the_answers():
    # eq. 5's c(s_T) is the final answer's certainty: a confidence on an earlier step (here the
    # first think's 9) leaves the answer without one, so reliability is 0 and the format fails
    step = "<think> find it</think><confidence> 9 </confidence><search> Tavi Morek born</search>"
    text = step + INFO + "<think> it says Velor.</think><answer> Kesh </answer>"
    assert parse_response(text).confidence is None
    out = compute([R(text)], "deliberative", {"lam": 0.5, "zeta": 5})[0]
    assert out["components"]["reliability"] == 0.0 and out["reward"] == 0.0
    # the same digit on the answer (before it, or after it) is the answer's
    assert parse_response(text.replace("<answer>", "<confidence> 9 </confidence><answer>")).confidence == 9
    assert parse_response(text + "<confidence> 2 </confidence>").confidence == 2
    bad = parse_response(text.replace("<answer>", "<confidence> 9 </confidence><answer>"))
    assert bad.format_ok


def test_deliberative_broken_format_is_strictly_zero():
    assert reward("deliberative", "<think> x <confidence>9</confidence><answer> Velor </answer>", lam=1.0) == 0.0


# ---------------------------------------------------------------------------------- WebFilter


def web(query: str, answer: str | None) -> str:
    call = json.dumps({"name": "web_search", "arguments": {"query": query}})
    text = f"<think> look</think><tool_call>{call}</tool_call><tool_response>Velor is a city</tool_response>"
    text += "<think> ok</think>"
    return text + (f"<answer> {answer} </answer>" if answer is not None else "")


@pytest.mark.parametrize(
    "text, expected",
    [
        (web("Tavi Morek born", "Velor"), 0.8),  # z = EM = 1, c = 0 (no judge), F1 1: 0.4 + 0 + 0.4
        (web("Tavi Morek born", "city of Velor"), 0.2),  # z 0, F1 0.5: 0.4 * 0.5
        (web("Tavi Morek site:tinypedia.org", "Kesh"), 0.1),  # f = 0, an operator was used -> 0.1
        (web("Tavi Morek born", "Kesh"), 0.0),  # f = 0, no operator -> 0
        (web("Tavi Morek born", "Insufficient information to proceed safely."), 0.0),  # abstaining: 0
        (web("Tavi Morek born", None), -1.0),  # missing answer: format violated
        ("<think> x <answer> Velor </answer>", -1.0),  # broken format
        ("<think>x</think><tool_call>[1, 2]</tool_call><tool_response>r</tool_response><think>y</think>"
         "<answer> Velor </answer>", -1.0),  # a tool call that is JSON but not an object
    ],
)  # fmt: skip
def test_webfilter_table(text, expected):
    out = compute([R(text)], "webfilter")[0]
    assert out["reward"] == pytest.approx(expected)
    assert out["components"]["judged"] == 0.0  # without a judge this is said, not hidden


@pytest.mark.parametrize(
    "query, uses_operator",
    [
        ("Tavi Morek site:tinypedia.org", True),
        ("Tavi Morek -site:rumormill.net", True),
        ("Velor before:2015", True),
        ('"born in the city of"', True),
        ("Velor -rumor", True),
        ("Velor AND Tavi", True),
        ("Velor OR Kesh", True),
        ("Velor NOT Kesh", True),
        ("Velor and Tavi", False),  # lower-case boolean words are words (the text is never lower-cased)
        ("velor or kesh", False),
        ("a well-known city", False),  # a hyphen inside a word is not exclusion
        ("Site:tinypedia.org", False),  # operators are lower-case
        ("ANDROID ORBIT NOTE", False),  # AND / OR / NOT only as whole words
    ],
)
def test_webfilter_operator_pitfalls(query, uses_operator):
    assert source_restricting(R(web(query, "Velor")))["reward"] == float(uses_operator)
    # the same query given as a list argument is read as a list, not as its string form
    call = json.dumps({"name": "web_search", "arguments": {"query": ["plain words", query]}})
    text = f"<think>x</think><tool_call>{call}</tool_call><tool_response>r</tool_response>"
    text += "<think>y</think><answer>z</answer>"
    assert source_restricting(R(text))["reward"] == float(uses_operator)


# --------------------------------------------------------------------------------------- BAPO


def group(answers: list[str | None], gid="q1") -> list[dict]:
    out = []
    for a in answers:
        text = "<think> x </think>" + (f"<answer> \\boxed{{{a}}} </answer>" if a is not None else "")
        out.append(R(text, group_id=gid))
    return out


IDK = "I DON'T KNOW"


def test_idk_variants_including_a_typographic_apostrophe():
    said = lambda text: parse_response(f"<think> x</think><answer> {text}</answer>").idk  # noqa: E731
    assert said("I don't know") and said("I DON\u2019T KNOW") and said("i do not know.") and said("IDK")
    assert not said("I know") and not said("Don Know")


def test_bapo_idk_bonus_only_when_no_rollout_is_correct():
    # a correct rollout in the group: no IDK bonus; R_correct = char-F1 or -1 (no answer)
    got = bapo(group(["Velor", "Kesh", IDK, None]), stage="plateau")
    assert [g["reward"] for g in got] == pytest.approx([1.0, 2 / 9, 0.0, -1.0])
    # nobody correct ("Zug" shares no character with "Velor"), 2 distinct answers < G/2 = 3: +0.5 on IDK
    got = bapo(group([IDK, IDK, IDK, "Zug", "Zug", "Zug"]), stage="plateau")
    assert [g["reward"] for g in got] == [0.5, 0.5, 0.5, 0.0, 0.0, 0.0]
    # issue 23.4: a wrong answer with char-F1 > 0 ("Kesh" vs "Velor": 2/9) is not correct, so the
    # bonus is on; R_correct keeps its char-F1
    got = bapo(group([IDK, IDK, IDK, "Kesh", "Kesh", "Kesh"]), stage="plateau")
    assert [g["reward"] for g in got] == pytest.approx([0.5, 0.5, 0.5, 2 / 9, 2 / 9, 2 / 9])
    # eq. 5 read literally (correct="reward": R_correct > 0 counts as correct): the bonus is off
    got = bapo(group([IDK, IDK, IDK, "Kesh", "Kesh", "Kesh"]), stage="plateau", correct="reward")
    assert [g["idk_bonus"] for g in got] == [0.0] * 6
    # with word-level F1 "Kesh" shares nothing with "Velor": nobody is correct either way
    for correct in ("em", "reward"):
        got = bapo(group([IDK, IDK, IDK, "Kesh", "Kesh", "Kesh"]), stage="plateau", f1_unit="word", correct=correct)
        assert [g["reward"] for g in got] == [0.5, 0.5, 0.5, 0.0, 0.0, 0.0]


def test_bapo_modulator_stage_and_sample_level():
    diverse = group([IDK, IDK, "Zug", "Mip"])  # 3 distinct answers >= G/2 = 2
    assert [g["idk_bonus"] for g in bapo(diverse, stage="plateau")] == [0.0] * 4  # sample level: off
    assert [g["idk_bonus"] for g in bapo(diverse, stage="plateau", sample_level=False)] == [0.5, 0.5, 0, 0]
    # exploration: on only while the batch IDK ratio is below alpha = 5%, whatever the diversity
    assert [g["idk_bonus"] for g in bapo(diverse, stage="exploration", idk_ratio=0.02)] == [0.5, 0.5, 0, 0]
    assert [g["idk_bonus"] for g in bapo(diverse, stage="exploration", idk_ratio=0.08)] == [0.0] * 4
    state = BapoState(patience=5)
    stages = [state.update(v) for v in [0.1, 0.2, 0.2, 0.15, 0.2, 0.19, 0.2, 0.3]]
    # best 0.2 at the 2nd evaluation, then 5 evaluations without improvement -> plateau, for good
    assert stages == ["exploration"] * 6 + ["plateau", "plateau"]


def test_bapo_resampling_and_reliability():
    records = group(["Zug", "Mip"], "a") + group([IDK, "Zug"], "b") + group(["Velor", "Zug"], "c")
    assert bapo_resample_groups(records) == ["a"]  # b said IDK, c has a correct rollout
    # "Kesh" vs "Velor" (char-F1 2/9): not correct, so the group is resampled (issue 23.4); only
    # eq. 5's literal reading counts it as correct (train.resample_marked_groups passes all of
    # reward_params, so the marking judges as the reward does)
    near = group(["Kesh", "Kesh"], "d")
    assert bapo_resample_groups(near) == ["d"] and bapo_resample_groups(near, correct="reward") == []
    assert bapo_resample_groups(near, **{"f1_unit": "word", "alpha": 0.2}) == ["d"]  # reproduction/tiny_bapo.yaml's
    correct = [exact_match(parsed(r).answer, golden_of(r)) for r in records]
    m = bapo_metrics(records, correct)  # N 6, correct 1, IDK 1: acc 1/6, prec 1/5, rho 1/6
    assert m["acc"] == pytest.approx(1 / 6) and m["bapo_prec"] == pytest.approx(1 / 5)
    assert m["bapo_reliability"] == pytest.approx((5 / 6) * (1 / 5) + (1 / 6) * (1 / 6))


@pytest.mark.parametrize(
    "think, answer, expected",
    [
        ("it was in Paris, so", "Paris", 1.0),
        ("a comparison of cities", "Paris", 0.0),  # issue 23.6: a substring inside a word is no match
        ("born in New York City", "New York", 1.0),  # whole words, several of them
        ("born in Newark", "New", 0.0),
    ],
)
def test_veritas_think_answer_matches_whole_words(think, answer, expected):
    text = f"<think> {think}</think><answer> {answer} </answer>"
    assert compute([R(text)], "think_answer")[0]["reward"] == expected


def test_bapo_through_compute_groups_by_group_id():
    records = group([IDK, IDK, IDK, "Zug", "Zug", "Zug"], "g1") + group(["Velor", IDK], "g2")
    rewards = [s["reward"] for s in compute(records, "bapo", {"stage": "plateau"})]
    assert rewards == [0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 1.0, 0.0]


# ------------------------------------------------------------------------------------ VERITAS


@pytest.mark.parametrize(
    "text, expected",
    [
        (SEARCHED + "<answer> Velor </answer>", 0.92),  # EM 1, think-answer 1 ("it says Velor."), no judge
        (SEARCHED.replace("it says Velor.", "found it.") + "<answer> Velor </answer>", 0.9),  # not in think
        (SEARCHED + "<answer> Kesh </answer>", 0.0),  # wrong, and not what the think said
        ("<think> I don't know </think><answer> I don't know </answer>", 0.02),  # IDK: faithful, wrong
        (SEARCHED, 0.0),  # missing answer
        ("<think> Velor </think> junk <answer> Velor </answer>", 0.92),  # broken format: EM has no gate
    ],
)
def test_veritas_table(text, expected):
    out = compute([R(text)], "veritas")[0]
    assert out["reward"] == pytest.approx(expected)
    assert out["components"]["info_think"] == 0.0 and out["components"]["judged"] == 0.0


# ------------------------------------------------------------------------- composition, CLI


def test_weighted_sum_and_unknown_names():
    assert parse_spec("0.9*em + 0.1*think_answer") == [(0.9, "em"), (0.1, "think_answer")]
    out = compute([R(SEARCHED + "<answer> Velor </answer>")], "0.5*em + 0.25*think_answer + 0.25*format")[0]
    # each term's scalar, and each term's own components beside it (em's em / f1 / format_ok)
    assert out["reward"] == pytest.approx(1.0) and out["components"] == {
        "em": 1.0, "think_answer": 1.0, "format": 1.0, "em/em": 1.0, "em/f1": 1.0, "em/format_ok": 1.0}  # fmt: skip
    with pytest.raises(ValueError, match="unknown reward 'bogus'"):
        parse_spec("0.5*em + 0.5*bogus")
    records = score([R(SEARCHED + "<answer> Velor </answer>")], "em")
    assert records[0]["reward"] == 1.0 and records[0]["reward_components"]["f1"] == 1.0
    assert "_parsed" not in records[0]


def test_cli_scores_a_file_with_groups(tmp_path):
    rows = [{"id": f"r{i}", "group_id": "g", "question": "q", "golden_answers": ["Velor"],
             "response": f"<think> x </think><answer> \\boxed{{{a}}} </answer>"}
            for i, a in enumerate([IDK, IDK, IDK, "Zug", "Zug", "Zug"])]  # fmt: skip
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = ["rewards.py", "--reward", "bapo", "--set", "stage=plateau", "--input", str(inp), "--output", str(out)]
    res = run_script(cmd)
    assert res.returncode == 0, res.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["id"] for g in got] == [r["id"] for r in rows] and [g["reward"] for g in got] == [0.5] * 3 + [0.0] * 3
    assert set(got[0]["components"]) >= {"correct", "idk_bonus"}
    res = run_script(cmd[:-4] + ["--input", str(tmp_path / "nope.jsonl"), "--output", str(out)])
    assert res.returncode != 0 and "nope.jsonl" in res.stderr and "Traceback" not in res.stderr
    helptext = run_script(["rewards.py", "--help"]).stdout
    assert '"group_id"' in helptext and '"response"' in helptext and "components" in helptext


def test_rule_based_throughput_10k_rollouts_under_2s():
    texts = [SEARCHED + f"<confidence> {i % 10 + 1} </confidence><answer> {'Velor' if i % 3 else 'Kesh'} </answer>"
             for i in range(10_000)]  # fmt: skip
    for name in ("search_r1_em", "deliberative"):
        records = [R(t, group_id=f"g{i // 8}") for i, t in enumerate(texts)]
        t = time.perf_counter()
        compute(records, name, {"lam": 0.1})
        assert time.perf_counter() - t < 2.0, name
