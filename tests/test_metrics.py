"""report/metrics.py: every paper's evaluation metric, worked by hand on small fixed rollout sets.

The rollouts are real response texts read through the same parser as training (agent/answers.py);
one set is produced by rollout.py itself with a scripted engine. Expected values are computed
in the comments from each metric's definition (report/metrics.py docstrings). ECE / Brier / AUROC are
checked against scikit-learn on random data, EM / F1 against the official SQuAD v1.1 script.

Every metric is a float64 mean or ratio of a few counts, computed in Python or numpy: equal to the
hand-worked value up to rounding (~1e-16), so pytest.approx's default (rel 1e-6, abs 1e-12) holds
it with room to spare. The scikit-learn comparisons state their own bound.
"""

import json
import re
import string
from collections import Counter, namedtuple

import numpy as np
import pytest

from agent.answers import exact_match, f1_score, normalize_answer
from report.metrics import (
    auroc,
    behaviour_metrics,
    brier,
    compute_metrics,
    correctness,
    dataset_of,
    ece,
    metrics_by_dataset,
    rejection_success_rate,
)
from rewards import compute, score
from rollout import rollout_batch
from trainer.config import RolloutConfig

INFO = "<information>Doc 1(Title: Tavi Morek) Tavi Morek was born in the city of Velor.</information>"


def searched(query: str = "Tavi Morek born", then: str = "it says Velor.") -> str:
    return f"<think> find it</think><search> {query}</search>{INFO}<think> {then}</think>"


def R(text: str, golden=("Velor",), **extra) -> dict:
    return {"response": text, "golden_answers": list(golden), "question": "Where was Tavi Morek born?", **extra}


def _answer(text: str) -> str:
    return f"<think> x</think><answer> {text} </answer>"


def conf(c: int) -> str:
    return f"<confidence> {c} </confidence>"


# The fixed set (gold "Velor"):           EM  conf  IDK  format  searches  think-answer
SEVEN = [
    searched() + conf(9) + "<answer> Velor </answer>",  # 1    9                 1        1
    searched("Tavi Morek born site:tinypedia.org") + conf(3) + "<answer> Velor </answer>",  # 1  3  1 (operator)  1
    searched(then="I recall Kesh.") + conf(8) + "<answer> Kesh </answer>",  # 0    8                 1        1
    "<think> guess</think>" + conf(2) + "<answer> Kesh </answer>",  # 0    2                 0        0
    "<think> nothing found</think>" + conf(1) + "<answer> \\boxed{I DON'T KNOW} </answer>",  # 0  1  yes  0  0
    searched("weather today") + "<answer> Velor </answer>",  # 1    -                 1        1
    "<think> unclosed <answer> the city of Velor </answer>",  # 0    -        broken   0        0
]


def seven() -> list[dict]:
    return [R(t, group_id=f"demo:q{i}") for i, t in enumerate(SEVEN, 1)]


class RuleJudge:
    """agent/judge.py's interface (prompt, verdicts, failures) with rules in place of a model: it accepts
    any answer that mentions Velor (a paraphrase EM rejects), an info-think pair whose think mentions
    Velor, and a query starting with "Tavi Morek". Answers mentioning Kesh count as failed verdicts
    (scored 0 and counted, like on_failure="zero")."""

    def __init__(self):
        self.failures = 0
        self.asked: list[dict] = []

    def prompt(self, kind: str, **fields) -> str:
        return json.dumps({"kind": kind, **fields})

    def verdicts(self, prompts: list[str]) -> list[float]:
        out = []
        for p in map(json.loads, prompts):
            self.asked.append(p)
            if p["kind"] == "answer":
                self.failures += "kesh" in p["answer"].lower()
                out.append(float("velor" in p["answer"].lower()))
            elif p["kind"] == "info_think":
                out.append(float("Velor" in p["think"]))
            else:
                out.append(float(p["search"].strip().startswith("Tavi Morek")))
        return out


# ------------------------------------------------------------------------- the fixed set, by hand


def test_fixed_set_without_judge_by_hand():
    records = score(seven(), "deliberative")  # records as training leaves them (reward_components attached)
    m = compute_metrics(records)
    assert m["n"] == 7 and m["n_questions"] == 7
    # EM: rows 1, 2, 6 -> 3/7. F1: 1 + 1 + 1 + row 7 ("city of velor" vs "velor": P 1/3, R 1 -> 0.5) -> 3.5/7
    assert m["em"] == pytest.approx(3 / 7) and m["f1"] == pytest.approx(0.5)
    assert m["subem"] == pytest.approx(4 / 7)  # row 7 contains "velor"
    assert "judge_acc" not in m and "info_think" not in m and "think_search" not in m and "judge_failures" not in m
    # Deliberative Searcher, zeta 5: reliable = rows 1 (right, 9), 4 (wrong, 2), 5 (IDK = wrong, 1);
    # row 2 (right, 3) is not; rows 6, 7 state no confidence -> neither -> 3/7. FC: row 3 (wrong, 8) -> 1/7
    assert m["acc"] == pytest.approx(3 / 7)
    assert m["ds_reliability"] == pytest.approx(3 / 7) and m["ds_false_certain"] == pytest.approx(1 / 7)
    assert m["confidence_rate"] == pytest.approx(5 / 7)
    # BAPO: N 7, N_c 3, N_r 1: prec 3/6, rho 1/7, reliability 6/7 * 1/2 + 1/7 * 3/7 = 24/49
    assert m["bapo_prec"] == pytest.approx(0.5) and m["bapo_idk_rate"] == pytest.approx(1 / 7)
    assert m["bapo_reliability"] == pytest.approx(24 / 49)
    # calibration over rows 1-5: p = .9 .3 .8 .2 .1, y = 1 1 0 0 0, each p alone in its 15-bin
    # ECE = (.1 + .7 + .8 + .2 + .1) / 5 = .38; Brier = (.01 + .49 + .64 + .04 + .01) / 5 = .238
    # AUROC: .9 beats .8 .2 .1 (3), .3 beats .2 .1 (2), of 2 x 3 pairs -> 5/6
    assert m["ece"] == pytest.approx(0.38) and m["brier"] == pytest.approx(0.238) and m["auroc"] == pytest.approx(5 / 6)
    # VERITAS think-answer over the 7 answered rows: rows 1, 2, 3 ("I recall Kesh." holds "kesh"), 6 -> 4/7
    assert m["think_answer"] == pytest.approx(4 / 7)
    # behaviour: queries in rows 1, 2, 3, 6 -> 4/7; operator only in row 2 (site:) -> 1/7
    # turns = 1 + actions: 2, 2, 2, 1, 1, 2, 1 -> 11/7; broken format: row 7 -> 1/7 (and still in every mean)
    assert m["searches"] == pytest.approx(4 / 7) and m["operator_use"] == pytest.approx(1 / 7)
    assert m["turns"] == pytest.approx(11 / 7) and m["reads"] == 0.0
    assert m["format_violation"] == pytest.approx(1 / 7)
    assert "response_tokens" not in m  # these records carry no loss_mask
    assert "bapo_rejection_success" not in m  # no reference model given


def test_fixed_set_with_a_judge_by_hand():
    judge = RuleJudge()
    m = compute_metrics(seven(), judge=judge)
    # the judge also accepts row 7's "the city of Velor": N_c 4 -> judge_acc = acc = 4/7
    assert m["judge_acc"] == pytest.approx(4 / 7) and m["acc"] == pytest.approx(4 / 7)
    assert m["em"] == pytest.approx(3 / 7)  # EM itself is never judged
    # the IDK row is never sent to the judge; the 6 others ask 3 distinct prompts, each once (asked_at_once)
    assert sorted(p["answer"] for p in judge.asked if p["kind"] == "answer") == ["Kesh", "Velor", "the city of Velor"]
    # BAPO: prec 4/6, reliability 6/7 * 4/6 + 1/7 * 4/7 = 4/7 + 4/49 = 32/49
    assert m["bapo_prec"] == pytest.approx(4 / 6) and m["bapo_reliability"] == pytest.approx(32 / 49)
    # row 7 is now right but states no confidence: still neither reliable nor false-certain
    assert m["ds_reliability"] == pytest.approx(3 / 7) and m["ds_false_certain"] == pytest.approx(1 / 7)
    # VERITAS, over rows with pairs (1, 2, 3, 6): info-think 1, 1, 0 ("I recall Kesh."), 1 -> 3/4;
    # think-search 1, 1, 1, 0 ("weather today") -> 3/4. Rows 4, 5, 7 never searched: left out
    assert m["info_think"] == pytest.approx(0.75) and m["think_search"] == pytest.approx(0.75)
    assert m["judge_failures"] == 1  # the "Kesh" answer of rows 3 and 4: one prompt, asked once


def test_consistent_with_the_reward_components():
    records = seven()
    m = compute_metrics(records)
    # the Deliberative Searcher reliability reward (eq. 5) averages to ds_reliability
    rel = [c["reward"] for c in compute(seven(), "reliability", {"zeta": 5})]
    assert m["ds_reliability"] == pytest.approx(sum(rel) / len(rel))
    ta = [c["reward"] for c in compute(seven(), "think_answer")]
    assert m["think_answer"] == pytest.approx(sum(ta) / len(ta))  # every row has an answer here


def test_records_are_left_as_they_were():
    records = seven()
    before = json.dumps(records)
    compute_metrics(records, judge=RuleJudge())
    assert json.dumps(records) == before  # the parse cache answers.parsed adds is removed again


def test_zeta_moves_the_confidence_threshold():
    # zeta 9: only row 1 (right, 9) is confident. Reliable: row 1, and the wrong rows with c < 9:
    # 3 (8), 4 (2), 5 (1) -> 4/7; row 2 (right, 3) is not. FC: none
    m = compute_metrics(seven(), zeta=9)
    assert m["ds_reliability"] == pytest.approx(4 / 7) and m["ds_false_certain"] == 0.0


def test_correctness_em_judge_and_idk():
    rs = [R("<think>x</think><answer> Velor </answer>"), R("<think>x</think><answer> the city of Velor </answer>"),
          R("<think>x</think><answer> \\boxed{I DON'T KNOW} </answer>"), R("<think>x</think>")]  # fmt: skip
    assert correctness(rs) == [1.0, 0.0, 0.0, 0.0]
    assert correctness(rs, RuleJudge()) == [1.0, 1.0, 0.0, 0.0]
    # an IDK answer whose gold happens to be "I don't know" still counts as IDK, not as correct
    assert correctness([R("<think>x</think><answer> I don't know </answer>", golden=["I do not know"])]) == [0.0]


# ------------------------------------------------------------------------------------ edge cases


def test_all_idk():
    texts = ["I don't know", "\\boxed{I DON'T KNOW}", "Insufficient information to proceed safely."]
    m = compute_metrics([R(f"<think> no</think><answer> {t} </answer>", group_id=f"q{i}") for i, t in enumerate(texts)])
    # rho 1, N_c 0: prec = 0/0 is absent, reliability = 0 * prec + 1 * acc = 0
    assert m["bapo_idk_rate"] == 1.0 and m["acc"] == 0.0 and "bapo_prec" not in m
    assert m["bapo_reliability"] == 0.0
    assert m["format_violation"] == 0.0


def test_no_idk():
    texts = ["Velor", "Kesh", "Velor", "Pife"]
    m = compute_metrics([R(f"<think> x</think><answer> {t} </answer>") for t in texts])
    # rho 0: prec = acc = 2/4, reliability = prec
    assert m["bapo_idk_rate"] == 0.0 and m["acc"] == 0.5 and m["bapo_prec"] == 0.5 and m["bapo_reliability"] == 0.5
    assert "n_questions" not in m  # no ids to count questions by
    # no IDK: the rejection success rate is 0/0, absent even with a reference model
    m = compute_metrics([R(_answer("Velor"), id="q1")], reference_records=[R(_answer("Kesh"), id="q1")])
    assert "bapo_rejection_success" not in m


def test_no_confidence_given():
    # two right, one wrong, none states a confidence (one states "11", which is not on the 1..10 scale)
    texts = ["<answer> Velor </answer>", "<answer> Kesh </answer>", conf(11) + "<answer> Velor </answer>"]
    m = compute_metrics([R("<think> x</think>" + t) for t in texts])
    assert m["confidence_rate"] == 0.0
    assert m["ds_reliability"] == 0.0 and m["ds_false_certain"] == 0.0  # neither reliable nor false-certain
    assert not {"ece", "brier", "auroc"} & set(m)  # calibration is undefined without confidences
    assert m["acc"] == pytest.approx(2 / 3)


def test_one_class_has_no_auroc_but_has_ece():
    # all right with confidence 8: ECE = |1 - 0.8| = 0.2, Brier = 0.04, AUROC undefined
    m = compute_metrics([R("<think> x</think>" + conf(8) + "<answer> Velor </answer>")] * 3)
    assert m["ece"] == pytest.approx(0.2) and m["brier"] == pytest.approx(0.04) and "auroc" not in m


def test_empty_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="empty dataset"):
        compute_metrics([])
    with pytest.raises(ValueError, match="empty dataset"):
        metrics_by_dataset([])
    with pytest.raises(ValueError, match="non-empty"):
        ece([], [])


# ------------------------------------------------------------------------ BAPO eq. 8


def test_rejection_success_rate_by_hand():
    ours = [R(_answer("I don't know"), group_id="q1"), R(_answer("I don't know"), group_id="q2"),
            R(_answer("I don't know"), group_id="q3"), R(_answer("Velor"), group_id="q4")]  # fmt: skip
    ref = [R(_answer("Kesh"), group_id="q1"), R(_answer("Velor"), group_id="q2"),
           R(_answer("I don't know"), group_id="q3"), R(_answer("Velor"), group_id="q4")]  # fmt: skip
    # S_refuse = {q1, q2, q3}; the reference fails q1 (wrong) and q3 (IDK is not the gold) -> 2/3
    assert rejection_success_rate(ours, ref) == pytest.approx(2 / 3)
    assert compute_metrics(ours, reference_records=ref)["bapo_rejection_success"] == pytest.approx(2 / 3)
    # a second reference rollout on q2, wrong: the reference fails q2 half the time -> (1 + 1/2 + 1) / 3
    assert rejection_success_rate(ours, [*ref, R(_answer("Pife"), group_id="q2")]) == pytest.approx(5 / 6)
    # a judge that accepts "the city of Velor" judges the reference as well: q1 is then solved -> 1/3
    ref_para = [R(_answer("the city of Velor"), group_id="q1"), *ref[1:]]
    assert rejection_success_rate(ours, ref_para) == pytest.approx(2 / 3)  # EM: still a failure
    assert rejection_success_rate(ours, ref_para, RuleJudge()) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="no reference rollout"):
        rejection_success_rate(ours, ref[1:])  # q1 refused, not in the reference
    with pytest.raises(ValueError, match="empty"):
        compute_metrics(ours, reference_records=[])


# ---------------------------------------------------------------------- behaviour, via rollout.py

Completion = namedtuple("Completion", "token_ids logprobs finish_reason")


class CharTokenizer:
    """One token per character, so token counts are string lengths."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


SCRIPTS = {  # question -> what the policy writes at each turn
    "q1": ["<think> find it</think><search> Tavi Morek born</search>",
           "<think> it says Velor.</think><answer> Velor </answer>"],
    "q2": ["<think> guess</think><answer> Kesh </answer>"],
    "q3": ["<think> a</think><search> x site:a.org</search>", "<think> b</think><search> y</search>",
           "<think> b</think><search> y</search>"],
}  # fmt: skip


class ScriptedEngine:
    def generate(self, prompts, max_tokens, temperature, top_p, stop, seeds=None):
        out = []
        for ids in prompts:
            text = CharTokenizer().decode(ids)
            script = SCRIPTS[re.search(r"Q: (q\d)", text).group(1)]
            ids = CharTokenizer().encode(script[text.count("<information>")])
            out.append(Completion(ids, [-0.1] * len(ids), "stop"))
        return out


def test_behaviour_of_real_rollout_records():
    cfg = RolloutConfig(max_turns=2, max_tokens_per_turn=200, prompt_template="Q: {question}\n")
    questions = [{"id": q, "question": q, "golden_answers": ["Velor"]} for q in SCRIPTS]
    records = rollout_batch(ScriptedEngine(), CharTokenizer(), questions, 1, lambda qs: [INFO[13:-14]] * len(qs), cfg,
                            group_prefix="tiny:")  # fmt: skip
    assert [r["finish"] for r in records] == ["answer", "answer", "max_turns"]
    m = compute_metrics(records)
    # searches from the tool log: q1 1, q2 0, q3 2 (its third search, on the last turn, is not run) -> 1
    assert m["searches"] == 1.0 and m["reads"] == 0.0
    assert m["turns"] == 2.0  # 2, 1, 3
    assert m["operator_use"] == pytest.approx(1 / 3)  # q3's site:
    # policy tokens = characters written by the policy (tool text is masked out):
    # q1 56 + 54 = 110; q2 44; q3 47 + 36 + 36 = 119 -> 273 / 3 = 91
    assert m["response_tokens"] == 91.0
    assert m["format_violation"] == pytest.approx(1 / 3) and m["n"] == 3  # q3 never answered: counted, kept
    assert m["em"] == pytest.approx(1 / 3)
    assert dataset_of(records[0]) == "tiny" and list(metrics_by_dataset(records)) == ["tiny"]


def test_read_actions_from_the_log_or_the_text():
    text = (f"<think>a</think><search> q</search>{INFO}<think>b</think><read> p17 </read>"
            "<information>full text</information><think>c</think><answer> Velor </answer>")  # fmt: skip
    m = behaviour_metrics([R(text)])  # no tool log: read the blocks
    assert (m["searches"], m["reads"], m["turns"], m["format_violation"]) == (1.0, 1.0, 3.0, 0.0)
    log = [{"name": "search", "query": "q"}, {"name": "read", "id": "p17"}, {"name": "read", "id": "p18"}]
    m = behaviour_metrics([R(text, tool_calls=log, turns=4, loss_mask=[1, 1, 0, 1])])
    assert (m["searches"], m["reads"], m["turns"], m["response_tokens"]) == (1.0, 2.0, 4.0, 3.0)


def test_metrics_by_dataset():
    right, wrong = _answer("Velor"), _answer("Kesh")
    records = [
        R(right, group_id="nq:1"), R(wrong, group_id="nq:2"), R(right, group_id="hotpotqa:1"),
        R(right, group_id="x:1", metadata={"dataset": "musique"}),  # metadata wins over the prefix
        R(wrong, group_id="7", metadata={"data_source": "tiny"}), R(right, group_id="8"),  # no prefix: "all"
    ]  # fmt: skip
    tables = metrics_by_dataset(records)
    assert list(tables) == ["all", "hotpotqa", "musique", "nq", "tiny"]
    em = {k: t["em"] for k, t in tables.items()}
    assert em == {"all": 1.0, "hotpotqa": 1.0, "musique": 1.0, "nq": 0.5, "tiny": 0.0}
    assert tables["nq"]["n"] == 2 and tables["nq"] == compute_metrics(records[:2])


# -------------------------------------------------------------------- calibration vs scikit-learn


def test_calibration_by_hand():
    # 0.15 and 0.2 share the bin (2/15, 3/15] (right-closed): acc 1/2, conf .175, gap .325;
    # .9 alone, gap .1 -> ECE = 2/3 * .325 + 1/3 * .1 = .25 (left-closed bins would give .4)
    assert ece([0.15, 0.2, 0.9], [1, 0, 1]) == pytest.approx(0.25)
    assert ece([0.61, 0.65], [1, 0]) == pytest.approx(0.13)  # one bin: |1/2 - .63|, not mean |y - p| = .52
    assert ece([0.8] * 4, [1, 1, 1, 0]) == pytest.approx(0.05)
    assert brier([0.9, 0.3], [1, 0]) == pytest.approx(0.05)
    # ties: correct [.5, .5], wrong [.5, .2]: pairs 1/2, 1, 1/2, 1 -> 3/4
    assert auroc([0.5, 0.5, 0.5, 0.2], [1, 1, 0, 0]) == pytest.approx(0.75)
    assert auroc([0.1, 0.9], [1, 0]) == 0.0 and auroc([0.3, 0.3], [1, 0]) == 0.5
    with pytest.raises(ValueError, match="both"):
        auroc([0.3, 0.4], [1, 1])


def _random_sets(seed: int):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 800))
    for p in (rng.uniform(0, 1, n), rng.integers(1, 11, n) / 10, rng.beta(5, 2, n)):
        # miscalibrated on purpose (accuracy p^1.5), so the gaps are not all near 0
        yield p, (rng.uniform(0, 1, n) < p**1.5).astype(float)


@pytest.mark.numeric
@pytest.mark.parametrize("seed", range(6))
def test_ece_matches_sklearn(seed):
    from sklearn.calibration import calibration_curve  # here, not at collection: vLLM starts first (docs/design.md §6)
    from sklearn.metrics import brier_score_loss

    for p, y in _random_sets(seed):
        prob_true, prob_pred = calibration_curve(y, p, n_bins=15, strategy="uniform")  # non-empty bins only
        # bin counts, independently: np.histogram's bins are [a, b); on -p they become (a, b] for p,
        # the right-closed bins of calibration_curve (which matters for c/10 = 0.2, 0.4, ...)
        edges = np.linspace(0, 1, 16)
        counts = np.histogram(-p, bins=-edges[::-1])[0][::-1]
        counts = counts[counts > 0]
        assert counts.sum() == len(p) and len(counts) == len(prob_true)
        expected = float(np.sum(counts / len(p) * np.abs(prob_true - prob_pred)))
        # float64 on both sides: bin means, then weighted gaps, <= 800 terms of size <= 1 summed in
        # other orders (sum_rtol(800, EPS64) = 1.8e-13 each): within 4 x 1.8e-13 < 1e-12
        assert ece(p, y) == pytest.approx(expected, abs=1e-12)
        assert brier(p, y) == pytest.approx(brier_score_loss(y, p), abs=1e-12)


@pytest.mark.numeric
@pytest.mark.parametrize("seed", range(6))
def test_auroc_matches_sklearn_with_ties(seed):
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(100 + seed)
    # float64: ranks vs sklearn's trapezoids, sums of <= 800 terms of size <= 1 in other orders
    # (sum_rtol(800, EPS64) = 1.8e-13 each side)
    for p, y in _random_sets(seed):
        assert auroc(p, y) == pytest.approx(roc_auc_score(y, p), abs=1e-12)  # c/10: many ties
    s, y = rng.integers(0, 3, 200).astype(float), rng.integers(0, 2, 200).astype(float)  # three values only
    assert auroc(s, y) == pytest.approx(roc_auc_score(y, s), abs=1e-12)


# ------------------------------------------------------------------ EM / F1 vs official SQuAD v1.1


def squad_normalize_answer(s):
    """evaluate-v1.1.py, as published: lower, drop punctuation, drop articles, fix whitespace."""

    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def squad_f1(prediction, ground_truth):
    prediction_tokens = squad_normalize_answer(prediction).split()
    ground_truth_tokens = squad_normalize_answer(ground_truth).split()
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def squad_em(prediction, ground_truth):
    return squad_normalize_answer(prediction) == squad_normalize_answer(ground_truth)


TRICKY = [
    ("The Velor", "velor"), ("a Velor!", "Velor."), ("an apple", "Apple"), ("Theory", "ory"), ("the the the", ""),
    ("A", "a"), ("AN", "an"), ("The Lord of the Rings", "Lord of Rings"), ("U.S.A.", "USA"), ("1,000", "1000"),
    ("3.14", "314"), ("$5", "5"), ("50%", "50"), ("1999", "in 1999"), ("Yes", "yes"), ("yes.", "No"), ("no", "No!"),
    ("Café", "Cafe"), ("café", "CAFÉ"), ("naïve", "naive"), ("São Paulo", "Sao Paulo"), ("Mötley Crüe", "Motley Crue"),
    ("“Velor”", "Velor"), ("‘Velor’", "Velor"), ("don’t", "dont"), ("don't", "dont"), ("Velor—city", "Velor city"),
    ("Ｖｅｌｏｒ", "Velor"), ("İstanbul", "istanbul"), ("Straße", "strasse"), ("new\u00a0york", "New York"),
    ("The  Velor\tcity\n", "velor city"), ("", ""), ("", "Velor"), ("Velor", ""), ("   ", "the"), ("-", ""),
    ("Kesh and Velor", "Velor and Kesh"), ("velor velor", "velor"), ("city of Velor", "Velor"),
]  # fmt: skip


@pytest.mark.parametrize("pred, gold", TRICKY)
def test_em_f1_match_official_squad(pred, gold):
    # No deliberate difference from evaluate-v1.1 was found: unicode is left as it is on both sides
    # (no accent folding, curly quotes and em dashes are not string.punctuation, fullwidth letters
    # stay fullwidth), so e.g. "Café" vs "Cafe" and "“Velor”" vs "Velor" are misses in both.
    assert normalize_answer(pred) == squad_normalize_answer(pred)
    assert exact_match(pred, [gold]) == float(squad_em(pred, gold))
    assert f1_score(pred, [gold]) == pytest.approx(squad_f1(pred, gold))


def test_em_f1_tricky_values_by_hand():
    assert exact_match("a Velor!", ["Velor."]) == 1.0 and exact_match("Theory", ["ory"]) == 0.0
    assert exact_match("U.S.A.", ["USA"]) == 1.0 and exact_match("3.14", ["314"]) == 1.0  # punctuation goes
    assert exact_match("Café", ["Cafe"]) == 0.0 and exact_match("“Velor”", ["Velor"]) == 0.0  # unicode stays
    assert exact_match("", [""]) == 1.0 and f1_score("", [""]) == 0.0  # SQuAD: "" == "", but no common token
    assert f1_score("velor velor", ["velor"]) == pytest.approx(2 / 3)  # P 1/2, R 1
    assert f1_score("Kesh and Velor", ["Velor and Kesh"]) == 1.0  # a bag of words
    assert exact_match("Kesh and Velor", ["Velor and Kesh"]) == 0.0
    # several golden answers: the best one (SQuAD's metric_max_over_ground_truths)
    golds = ["Kesh", "city of Velor", "Velor"]
    assert exact_match("the Velor", golds) == 1.0
    assert f1_score("Velor city", golds) == pytest.approx(max(squad_f1("Velor city", g) for g in golds))
    assert exact_match(None, ["Velor"]) == 0.0 and f1_score(None, ["Velor"]) == 0.0  # no answer
