"""Evaluation metrics of the five papers, computed from rollout records.

    from report.metrics import compute_metrics, metrics_by_dataset
    m = compute_metrics(records)                 # {"n": 400, "em": 0.61, "acc": 0.61, "ds_reliability": ...}
    m = compute_metrics(records, zeta=5, judge=make_judge(url=..., model=...),
                        reference_records=grpo_records)  # + judge accuracy, VERITAS judge metrics, BAPO eq. 8
    tables = metrics_by_dataset(records)         # {"hotpotqa": {...}, "nq": {...}}

A record is the dict rollout.py builds, or any dict with "response" (or "response_text") and
"golden_answers" (rewards.py's CLI schema). Text is read only through answers.parsed (the one
parser); EM / F1 / substring / IDK come from agent/answers.py, the judge verdicts and the faithfulness
components from rewards.py. No rollout is ever dropped: a broken format is a wrong or answer-less
rollout in every denominator, and is counted in `format_violation` as well. A metric that is not
defined on the input (no judge, no confidence stated, AUROC with one class, prec when every
answer is IDK, no IDK for BAPO eq. 8) is absent from the dict rather than a made-up 0.

Keys, by paper (each defined, with a worked example, at its function):
  n, n_questions            rollouts; distinct questions (question_key)
  em, f1, subem             Search-R1 §3.4 EM, SQuAD word F1, substring EM (Search-R1 code)   answer_metrics
  acc, judge_acc            N_c / N; correct = a judge's verdict if one is given (BAPO §3.1,
                            App. C.2; Deliberative Searcher §2.2's verifier), else EM; judge_acc
                            only with a judge                                                   correctness
  ds_reliability, ds_false_certain, confidence_rate, ds_certain_right
                            Deliberative Searcher eq. 5 and §3.1 / Table 1 (Relib., FC%)     deliberative_metrics
  p_certain_<category>, certain_gap
                            teacher-forced P(c >= zeta) per question category, all ten
                            confidences read as whole strings, and Δ          p_certain, certainty_gap
  bapo_prec, bapo_idk_rate, bapo_reliability     BAPO eq. 4 and eq. 7                       bapo_metrics
  bapo_rejection_success    BAPO eq. 8 (§5.6), against a second model's rollouts        rejection_success_rate
  ece, brier, auroc         calibration of the stated confidence c/10 (ECE: Guo et al.
                            2017, 15 bins)                                                 calibration_metrics
  think_answer, info_think, think_search         VERITAS §3.2-3.3                        faithfulness_metrics
  p_unfaithful_think        teacher-forced P(the teacher's unfaithful think) where the answer's
                            think begins, the mean over contexts                         unfaithful_share
  searches, search_turns, search_queries, reads, operator_use, turns, response_tokens, format_violation
                                                                                         behaviour_metrics
  judge_failures            verdicts the judge failed to give (its on_failure="zero" policy)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agent.answers import ACTIONS, exact_match, f1_score, golden_of, parsed, substring_match
from agent.judge import asked_at_once
from rewards import answer_verdict, info_think, source_restricting, think_answer, think_search

N_BINS = 15  # ECE bins (issue 6; Guo et al. 2017 use 15 as well)


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs))


def question_key(record: dict) -> str | None:
    """The question a rollout answers: its group_id (train.py prefixes it with the dataset name,
    "hotpotqa:17"), else question_id, else id; None when it has none of them."""
    for k in ("group_id", "question_id", "id"):
        if record.get(k) is not None:
            return str(record[k])
    return None


def dataset_of(record: dict) -> str:
    """metadata["dataset"], else metadata["data_source"] (Search-R1 parquet, the tiny world), else
    the group id's prefix before ":" (rollout_batch's group_prefix = cfg.data.name + ":"), else "all".

    >>> dataset_of({"group_id": "hotpotqa:5a8b57f2"}), dataset_of({"group_id": "17"})
    ('hotpotqa', 'all')
    """
    meta = record.get("metadata") or {}
    for k in ("dataset", "data_source"):
        if meta.get(k):
            return str(meta[k])
    gid = str(record.get("group_id", ""))
    return gid.split(":", 1)[0] if ":" in gid and gid.split(":", 1)[0] else "all"


# --------------------------------------------------------------------------------------------
# Correctness and answer metrics.


def correctness(records: list[dict], judge=None) -> list[float]:
    """1.0 if a rollout's final answer is correct, else 0.0. With a judge, its verdict
    (rewards.answer_verdict: the papers' LLM verifier); without one, EM (SQuAD normalisation). An
    IDK answer is never correct and the judge is not asked about it (BAPO eq. 4: N = N_c + N_w + N_r).
    No answer (missing or broken): 0.

    Example, gold "Velor": "Velor", "the city of Velor", "\\boxed{I DON'T KNOW}", no answer ->
    [1, 0, 0, 0] by EM; a judge that accepts the paraphrase -> [1, 1, 0, 0].
    """
    return [0.0 if parsed(r).idk else float(answer_verdict(r, judge)) for r in records]


def answer_metrics(records: list[dict]) -> dict:
    """Means over rollouts of agent/answers.py's metrics of the final answer (answers.parsed(r).answer,
    the last <answer> block, unboxed; None scores 0):
      em     exact match after SQuAD normalisation, best over golden answers (Search-R1 §3.4)
      f1     SQuAD word-level F1, best over golden answers
      subem  a normalised golden answer occurs in the normalised answer (Search-R1 code, subem_check)

    Example, gold "Velor": "Velor" (1, 1, 1) and "the city of Velor" (0, F1 of {city, of, velor}
    vs {velor}: P 1/3, R 1 -> 0.5, 1) -> em 0.5, f1 0.75, subem 1.0.
    """
    answers = [(parsed(r).answer, golden_of(r)) for r in records]
    return {
        "em": _mean([exact_match(a, g) for a, g in answers]),
        "f1": _mean([f1_score(a, g) for a, g in answers]),
        "subem": _mean([substring_match(a, g) for a, g in answers]),
    }


# --------------------------------------------------------------------------------------------
# Deliberative Searcher and BAPO: accuracy with confidence, with IDK.


def deliberative_metrics(records: list[dict], correct: Sequence[float], zeta: float = 5) -> dict:
    """Deliberative Searcher, Table 1's Acc. / Relib. / FC% (§3.1), c = the stated confidence 1..10:
      acc               mean of `correct`
      ds_reliability    share of rollouts with r_reliab = (correct and c >= zeta) or (wrong and
                        c < zeta) (eq. 5; zeta = 5 in the paper)
      ds_false_certain  share of ALL rollouts that are wrong with c >= zeta ("the proportion of
                        false yet high-confidence responses"; Table 1's baselines have Relib. +
                        FC = 1.00 row after row, which holds only with FC over all answers)
      confidence_rate   share of rollouts that state a confidence (answers.Parsed.confidence)
      ds_certain_right  share of the correct rollouts with c >= zeta: a low ds_false_certain bought
                        by "always unsure" shows here (absent without a correct rollout)
    No confidence (absent, or not an integer 1..10): both comparisons with c are false, so the
    rollout is neither reliable nor false-certain. This is rewards.reliability's choice (0 without
    a confidence), so the mean of that reward equals ds_reliability, and a model cannot buy
    reliability by leaving the confidence out (its format reward is 0 for that as well).

    Example, zeta 5: (correct, 9) reliable; (correct, 3) not; (wrong, 8) not, false-certain;
    (wrong, 2) reliable; (correct, none) neither -> acc 3/5, ds_reliability 2/5,
    ds_false_certain 1/5, confidence_rate 4/5, ds_certain_right 1/3.
    """
    conf = [parsed(r).confidence for r in records]
    reliable = [c is not None and (c >= zeta if ok else c < zeta) for c, ok in zip(conf, correct)]
    certain_wrong = [c is not None and c >= zeta and not ok for c, ok in zip(conf, correct)]
    out = {
        "acc": _mean(correct),
        "ds_reliability": _mean(reliable),
        "ds_false_certain": _mean(certain_wrong),
        "confidence_rate": _mean([c is not None for c in conf]),
    }
    right = [c for c, ok in zip(conf, correct) if ok]
    if right:
        out["ds_certain_right"] = _mean([c is not None and c >= zeta for c in right])
    return out


CONFIDENCES = tuple(range(1, 11))  # Deliberative Searcher's scale (§2.1)


def p_certain(logprobs: Sequence[float], zeta: float = 5) -> float:
    """P(c >= zeta) from the teacher-forced log-probabilities of writing each confidence 1..10
    (in CONFIDENCES order) at the same context, renormalised over the ten.

    Every confidence counts as its whole string: with a tokenizer that splits digits (Qwen's, the
    tiny world's) "10" is "1" then "0" and "1" is "1" then "</confidence>", so log p("10") =
    log p("1") + log p("0" | "1"). Greedy decoding instead picks "1" and lets P("0" | "1") decide
    between the most and the least sure answer: a coin flip that moves the greedy reliability by
    tens of points with no change in what the model believes. This reads the belief itself.

    Example: p(1) = 0.3, p(10) = 0.3, p(4) = 0.2, p(7) = 0.2 (the rest ~0) -> P(c >= 5) = 0.5.
    >>> import math
    >>> lp = [math.log(p) for p in (0.3, 1e-9, 1e-9, 0.2, 1e-9, 1e-9, 0.2, 1e-9, 1e-9, 0.3)]
    >>> round(p_certain(lp), 3)
    0.5
    """
    top = max(logprobs)
    mass = [np.exp(lp - top) for lp in logprobs]
    return float(sum(m for c, m in zip(CONFIDENCES, mass) if c >= zeta) / sum(mass))


def unfaithful_share(logprobs: Sequence[float]) -> dict:
    """The mean teacher-forced probability of the unfaithful think, from one log-probability per
    context (log p(" I know the answer.</think>" | the trajectory up to "<think>")). Greedy
    info-think (faithfulness_metrics) counts the likelier think only: a policy unfaithful 30% of
    the time at every context scores 1.0, as does one at 1%. This reads the rate, so RL that makes
    the flaw rarer shows before it changes the mode. Example: p = 0.3, 0.1, 0.02, 0.02 -> 0.11.
    >>> import math
    >>> unfaithful_share([math.log(p) for p in (0.3, 0.1, 0.02, 0.02)])
    {'p_unfaithful_think': 0.11, 'n_think_contexts': 4}
    """
    return {"p_unfaithful_think": round(float(np.mean(np.exp(logprobs))), 6), "n_think_contexts": len(logprobs)}


def certainty_gap(p: Sequence[float], categories: Sequence[str]) -> dict:
    """The mean P(c >= zeta) per question category, and the gap between the answerable and the
    unanswerable ones: Δ = P(certain | answerable) - P(certain | unanswerable).

    A confidence that follows the evidence has Δ well above 0; one pushed up or down as a whole
    moves both means and keeps Δ; a uniform or threshold-neutral digit has Δ near 0.
    >>> certainty_gap([0.9, 0.7, 0.2, 0.4], ["answerable", "answerable", "unanswerable", "unanswerable"])
    {'p_certain_answerable': 0.8, 'p_certain_unanswerable': 0.3, 'certain_gap': 0.5, 'n_contexts': 4}
    """
    out = {}
    for category in sorted(set(categories)):
        out[f"p_certain_{category}"] = round(_mean([x for x, c in zip(p, categories) if c == category]), 6)
    if "p_certain_answerable" in out and "p_certain_unanswerable" in out:
        out["certain_gap"] = round(out["p_certain_answerable"] - out["p_certain_unanswerable"], 6)
    return out | {"n_contexts": len(p)}


def bapo_metrics(records: list[dict], correct: Sequence[float]) -> dict:
    """BAPO eq. 4 and eq. 7 (after Xu et al. 2024). N rollouts, N_r of them IDK
    (answers.Parsed.idk: "I don't know" and its variants, after SQuAD normalisation), N_c correct:
      acc = N_c / N,  bapo_prec = N_c / (N - N_r),  bapo_idk_rate = rho = N_r / N,
      bapo_reliability = (1 - rho) * prec + rho * acc
    Missing answers and broken formats are wrong answers (N_w), never dropped. Every answer IDK:
    prec is 0/0 and absent; reliability = acc = 0 (prec's weight 1 - rho is 0).

    Example: 7 rollouts, 3 correct, 1 IDK -> acc 3/7, prec 3/6, rho 1/7,
    reliability 6/7 * 1/2 + 1/7 * 3/7 = 24/49 = 0.490.
    """
    n, n_idk, n_c = len(records), sum(parsed(r).idk for r in records), float(sum(correct))
    acc, rho = n_c / n, n_idk / n
    out = {"acc": acc, "bapo_idk_rate": rho}
    if n_idk < n:
        out["bapo_prec"] = n_c / (n - n_idk)
    out["bapo_reliability"] = (1 - rho) * out.get("bapo_prec", 0.0) + rho * acc
    return out


def rejection_success_rate(records: list[dict], reference_records: list[dict], judge=None) -> float | None:
    """BAPO eq. 8 (§5.6): |S_refuse ∩ S_fail^ref| / |S_refuse|. S_refuse: the questions this model
    answers IDK; S_fail^ref: the questions the reference model (BAPO: the GRPO-trained one) gets
    wrong, i.e. its answer is not the gold one, so a reference IDK or missing answer is a failure.
    Correctness as in `correctness` (the judge, if given, judges the reference too). Questions are
    matched by question_key. Several rollouts per question: each IDK rollout counts once, and the
    reference's failure on its question is the share of its rollouts there that are wrong (one
    greedy rollout each gives eq. 8 exactly). None when no rollout says IDK; ValueError when a
    refused question has no reference rollout.

    Example: ours IDK on q1, q2, q3, right on q4; the reference wrong on q1, right on q2, IDK on
    q3 -> S_refuse = {q1, q2, q3}, S_fail = {q1, q3}: 2/3. With two reference rollouts on q2, one
    right and one wrong: (1 + 1/2 + 1) / 3 = 5/6.
    """
    refused = [question_key(r) for r in records if parsed(r).idk]
    if not refused:
        return None
    if not reference_records:
        raise ValueError("reference_records is empty: BAPO's rejection success rate needs a second model's rollouts")
    fails: dict[str | None, list[float]] = {}
    for r, ok in zip(reference_records, correctness(reference_records, judge)):
        fails.setdefault(question_key(r), []).append(1.0 - ok)
    missing = sorted({str(k) for k in refused if k is None or k not in fails})
    if missing:
        raise ValueError(f"{len(missing)} refused question(s) have no reference rollout (matched by group_id, "
                         f"else question_id, else id), e.g. {missing[:5]}")  # fmt: skip
    return _mean([_mean(fails[k]) for k in refused])


# --------------------------------------------------------------------------------------------
# Calibration (numpy only; tests/test_metrics.py checks them against scikit-learn).


def _arrays(p: Sequence[float], y: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    p, y = np.asarray(p, dtype=float), np.asarray(y, dtype=float)
    if p.ndim != 1 or p.shape != y.shape or not len(p):
        raise ValueError(f"need two equally long, non-empty 1-d sequences, got shapes {p.shape} and {y.shape}")
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("correctness labels must be 0 or 1")
    return p, y


def ece(confidence: Sequence[float], correct: Sequence[float], n_bins: int = N_BINS) -> float:
    """Expected calibration error (Guo et al. 2017, eq. 3): M equal-width bins
    I_m = ((m-1)/M, m/M] (right-closed, as in Guo et al. and sklearn's calibration_curve; 0 goes
    to the first), ECE = sum_m |B_m| / n * |acc(B_m) - conf(B_m)|.

    Example, 15 bins: p = [0.15, 0.2, 0.9], y = [1, 0, 1]. 0.15 and 0.2 share (2/15, 3/15]:
    acc 1/2, conf 0.175, gap 0.325; 0.9 is alone in (13/15, 14/15]: gap 0.1.
    ECE = 2/3 * 0.325 + 1/3 * 0.1 = 0.25.
    """
    p, y = _arrays(confidence, correct)
    if p.min() < 0 or p.max() > 1:
        raise ValueError("confidences must lie in [0, 1]")
    idx = np.clip(np.ceil(p * n_bins).astype(int) - 1, 0, n_bins - 1)
    # |B| * |acc(B) - conf(B)| = |sum of y - sum of p| over the bin
    gaps = np.abs(np.bincount(idx, weights=y, minlength=n_bins) - np.bincount(idx, weights=p, minlength=n_bins))
    return float(gaps.sum() / len(p))


def brier(confidence: Sequence[float], correct: Sequence[float]) -> float:
    """Brier score: mean of (p - y)^2. Example: p = [0.9, 0.3], y = [1, 0] -> (0.01 + 0.09) / 2 = 0.05."""
    p, y = _arrays(confidence, correct)
    return float(np.mean((p - y) ** 2))


def auroc(score: Sequence[float], correct: Sequence[float]) -> float:
    """Area under the ROC curve of `score` separating correct (1) from wrong (0): the probability
    that a random correct rollout scores above a random wrong one, a tie counting 1/2 (Mann-Whitney
    U / (n1 n0), from mid-ranks; equal to sklearn's roc_auc_score, ties included). ValueError when
    only one class is present.

    Example: correct [0.5, 0.5], wrong [0.5, 0.2]: the four pairs give 1/2, 1, 1/2, 1 -> 0.75.
    """
    s, y = _arrays(score, correct)
    n1 = int(y.sum())
    n0 = len(y) - n1
    if not n1 or not n0:
        raise ValueError("AUROC needs both correct and wrong rollouts")
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    mid_rank = np.cumsum(counts) - (counts - 1) / 2  # 1-based rank of each distinct value, ties averaged
    return float((mid_rank[inverse][y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def calibration_metrics(records: list[dict], correct: Sequence[float], n_bins: int = N_BINS) -> dict:
    """ECE (n_bins equal-width bins), Brier and AUROC of the stated confidence as the probability of
    being correct, over the rollouts that state one (deliberative_metrics' confidence_rate says how
    many). The 1..10 scale maps to c / 10 (1 -> 0.1, 10 -> 1.0: "7 out of 10"), the reading the
    prompt asks for; rewards.confidence scales it the same way. All keys absent when no rollout
    states a confidence; auroc absent when they are all correct or all wrong.

    Example: (c, correct) = (9, 1), (3, 1), (8, 0), (2, 0), (1, 0): p = .9 .3 .8 .2 .1, each alone
    in its bin -> ece = (.1 + .7 + .8 + .2 + .1) / 5 = 0.38; brier = (.01 + .49 + .64 + .04 +
    .01) / 5 = 0.238; auroc: 0.9 beats all 3 wrong, 0.3 beats 2 of them -> 5/6.
    """
    pairs = [(parsed(r).confidence / 10, ok) for r, ok in zip(records, correct) if parsed(r).confidence is not None]
    if not pairs:
        return {}
    p, y = [a for a, _ in pairs], [b for _, b in pairs]
    out = {"ece": ece(p, y, n_bins), "brier": brier(p, y)}
    if 0 < sum(y) < len(y):
        out["auroc"] = auroc(p, y)
    return out


# --------------------------------------------------------------------------------------------
# VERITAS faithfulness and behaviour.


def faithfulness_metrics(records: list[dict], judge=None) -> dict:
    """VERITAS §3.2-3.3, the mean of rewards.py's per-rollout components:
      think_answer  rewards.think_answer (the rule: the normalised answer occurs in the last
                    think block before it), over rollouts with an answer
      info_think    rewards.info_think: mean judge verdict over the rollout's (information, next
                    think) pairs, over rollouts with at least one pair
      think_search  rewards.think_search: the same over (think, search) pairs
    Without a judge, info_think and think_search are absent. The paper does not say how rollouts
    without a pair count; as a metric, a rollout that never searched has no retrieved text to be
    faithful to, so it is left out (the reward scores it 0 so as not to pay for not searching; as a
    metric that 0 would mix the search rate into faithfulness).

    Example: answers "Velor" after "<think> it says Velor.</think>" and "Kesh" after
    "<think> guess</think>" -> think_answer 1/2. Two searched rollouts whose info-think pairs the
    judge scores 1 and 0, plus one that never searched -> info_think 1/2.
    """
    out = {}
    with_answer = [r for r in records if parsed(r).answer is not None]
    if with_answer:
        out["think_answer"] = _mean([think_answer(r)["reward"] for r in with_answer])
    if judge is not None:
        for name, fn in (("info_think", info_think), ("think_search", think_search)):
            parts = [fn(r, judge=judge) for r in records]
            scored = [p["reward"] for p in parts if p["pairs"]]
            if scored:
                out[name] = _mean(scored)
    return out


def _tool_log(record: dict) -> list[dict] | None:
    calls = record.get("tool_calls")
    return calls if isinstance(calls, list) else None


def search_counts(record: dict) -> tuple[int, int]:
    """(search turns, search queries) of one rollout: the turns that searched and the queries they ran,
    from rollout.py's tool_calls log (a nameless entry is a search; each entry's "turn"); without a log,
    the <search> / <tool_call> blocks and answers.Parsed.queries of the response. A parallel call
    (webfilter's queries list, a protocol's query_sep) is one turn of several queries; sequential
    searches are a turn each.

    >>> search_counts({"tool_calls": [{"turn": 1, "query": "a"}, {"turn": 1, "query": "b"},
    ...                               {"turn": 2, "name": "read", "id": "p1"}, {"turn": 3, "query": "c"}]})
    (2, 3)
    """
    log = _tool_log(record)
    if log is None:
        p = parsed(record)
        return sum(k in ("search", "tool_call") for k, _ in p.blocks), len(p.queries)
    searches = [(c.get("turn", i), c) for i, c in enumerate(log) if c.get("name", "search") == "search"]
    return len({turn for turn, _ in searches}), len(searches)


def search_means(records: list[dict], suffix: str = "") -> dict:
    """search_turns and search_queries per rollout (search_counts), keys ending in `suffix`."""
    counts = [search_counts(r) for r in records]
    return {
        f"search_turns{suffix}": _mean([t for t, _ in counts]),
        f"search_queries{suffix}": _mean([q for _, q in counts]),
    }


def behaviour_metrics(records: list[dict]) -> dict:
    """Means per rollout (= per question with one rollout each):
      searches          executed searches: rollout.py's tool_calls log (a search written on the
                        last turn is not executed and not counted); records without a log count
                        the queries in the response (answers.Parsed.queries)
      search_turns, search_queries   turns that searched and the queries they ran (search_counts):
                        a parallel call of two queries is 1 and 2, two sequential searches 2 and 2
      reads             READ actions (Deliberative Searcher §2.2): log entries named "read", else
                        <read> blocks in the response
      operator_use      share of rollouts with a query using an advanced operator: rewards.
                        source_restricting (WebFilter R_src, eq. 2-4: site:, -site:, before:,
                        after:, "phrase", AND / OR / NOT, -term; the operators search/web.py honours)
      turns             record["turns"] (generation rounds), else 1 + the actions in the response
      response_tokens   policy tokens, sum(loss_mask) (tool output excluded); absent unless every
                        rollout has a loss_mask
      format_violation  share of rollouts that fail answers.Parsed.format_ok (structure, balanced
                        tags, well-formed tool calls, an answer); they stay in every other metric

    Example: "<think>a</think><search>q site:x.org</search><information>..</information>
    <think>b</think><answer>V</answer>" and "<think>c</think><answer>V" (unclosed): searches 1/2,
    operator_use 1/2, turns (2 + 1) / 2 = 1.5, format_violation 1/2.
    """
    searches, reads, turns = [], [], []
    for r in records:
        log, p = _tool_log(r), parsed(r)
        if log is not None:
            reads.append(sum(c.get("name") == "read" for c in log))
            searches.append(len(log) - reads[-1])
        else:
            reads.append(sum(k == "read" for k, _ in p.blocks))
            searches.append(len(p.queries))
        turns.append(r["turns"] if isinstance(r.get("turns"), int) else 1 + sum(k in ACTIONS for k, _ in p.blocks))
    out = {
        "searches": _mean(searches),
        **search_means(records),
        "reads": _mean(reads),
        "operator_use": _mean([source_restricting(r)["reward"] for r in records]),
        "turns": _mean(turns),
    }
    if all(isinstance(r.get("loss_mask"), list) for r in records):
        out["response_tokens"] = _mean([sum(r["loss_mask"]) for r in records])
    out["format_violation"] = _mean([not parsed(r).format_ok for r in records])
    return out


# --------------------------------------------------------------------------------------------
# Entry points.


def compute_metrics(records: list[dict], zeta: float = 5, judge=None, reference_records: list[dict] | None = None,
                    n_bins: int = N_BINS) -> dict:  # fmt: skip
    """Every metric above on one list of rollouts (one dataset, or pooled). `judge` (agent/judge.py's
    client, or anything with prompt(kind, **fields) and verdicts(prompts)) adds judge_acc,
    info_think and think_search and makes `acc` judged; None leaves those absent and acc = EM.
    `reference_records` (a second model's rollouts on the same questions) adds
    bapo_rejection_success. An empty list is a ValueError. Records are not modified (the parse
    cache answers.parsed adds is removed again).
    """
    if not records:
        raise ValueError("no rollout records to compute metrics on (empty dataset?)")
    cached = [r for r in [*records, *(reference_records or [])] if "_parsed" not in r]
    failures = getattr(judge, "failures", 0)
    try:
        # every verdict (correctness, faithfulness, the reference's) asked in one concurrent call
        out = asked_at_once(judge, lambda j: _metrics(records, zeta, j, reference_records, n_bins))
        if judge is not None and isinstance(getattr(judge, "failures", None), int):
            out["judge_failures"] = judge.failures - failures
        return out
    finally:
        for r in cached:
            r.pop("_parsed", None)


def _metrics(records: list[dict], zeta: float, judge, reference_records: list[dict] | None, n_bins: int) -> dict:
    """compute_metrics' work, with the judge (or the stand-in) asked_at_once gives it."""
    correct = correctness(records, judge)
    keys = [question_key(r) for r in records]
    out: dict = {"n": len(records)}
    if None not in keys:
        out["n_questions"] = len(set(keys))
    out |= answer_metrics(records)
    if judge is not None:
        out["judge_acc"] = _mean(correct)
    out |= deliberative_metrics(records, correct, zeta)
    out |= bapo_metrics(records, correct)
    if reference_records is not None:
        rate = rejection_success_rate(records, reference_records, judge)
        if rate is not None:
            out["bapo_rejection_success"] = rate
    out |= calibration_metrics(records, correct, n_bins)
    out |= faithfulness_metrics(records, judge)
    return out | behaviour_metrics(records)


def metrics_by_dataset(records: list[dict], zeta: float = 5, judge=None, reference_records: list[dict] | None = None,
                       n_bins: int = N_BINS) -> dict[str, dict]:  # fmt: skip
    """compute_metrics per dataset (dataset_of), datasets in sorted order. Each dataset's rollouts
    are matched against the whole of reference_records. An empty list is a ValueError."""
    if not records:
        raise ValueError("no rollout records to compute metrics on (empty dataset?)")
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(dataset_of(r), []).append(r)
    return {name: compute_metrics(groups[name], zeta, judge, reference_records, n_bins) for name in sorted(groups)}


def batch_metrics(records: list[dict]) -> dict:
    """A training batch's means (train.py logs them every step): EM, IDK rate and answered rate
    whatever the reward, search turns and queries (search_counts; searches_per_question is
    num_searches, the queries) overall and per question type (`metadata.type`: search_turns_2hop),
    plus each numeric reward component as `reward/<name>` (rewards.py)."""
    n = len(records)
    row = {
        "reward": sum(r["reward"] for r in records) / n,
        "em": sum(exact_match(r["answer"], r["golden_answers"]) for r in records) / n,
        "idk_rate": sum(parsed(r).idk for r in records) / n,
        "format_ok": sum(r["finish"] == "answer" for r in records) / n,
        "response_len": sum(sum(r["loss_mask"]) for r in records) / n,
        # the step's policy tokens the engine generated: a tree leaf's copied prefix is not (rollout_tree.py)
        "generated_tokens": sum(sum(r["loss_mask"][r.get("tree", {}).get("shared_prefix_len", 0) :]) for r in records),
        "searches_per_question": sum(r["num_searches"] for r in records) / n,
    } | search_means(records)
    by_type: dict[str, list[dict]] = {}
    for r in records:
        kind = (r.get("metadata") or {}).get("type")
        if kind:
            by_type.setdefault(str(kind), []).append(r)
    for kind in sorted(by_type):
        row |= search_means(by_type[kind], f"_{kind}")
    keys = {k for r in records for k, v in r["reward_components"].items() if isinstance(v, (int, float))}
    for key in sorted(keys - {"reward"}):
        row[f"reward/{key}"] = sum(float(r["reward_components"].get(key, 0.0)) for r in records) / n
    return row


PAPER_KEYS = ("ds_reliability", "ds_false_certain", "bapo_idk_rate", "operator_use", "info_think", "think_answer")


def paper_metrics(records: list[dict], judge=None) -> dict:
    """The papers' headline metrics of one validation pass (train.py logs them at each eval):
    reliability and false-certain rate (Deliberative Searcher), IDK rate (BAPO), operator use
    (WebFilter), info-think and think-answer faithfulness (VERITAS; info_think needs a judge)."""
    m = compute_metrics(records, judge=judge)
    return {k: m[k] for k in PAPER_KEYS if k in m}
