"""What each search step of a rollout found: the pieces of the per-turn rewards (rewards.py).

A record's action turns are its policy chunks, in order; turn k's tool calls are those logged
with `turn` k + 1 (rollout.py counts turns from 1). Each returns one value per action turn, None
for a turn it does not score (no search in it, nothing to compare):

    >>> rec = {"chunks": [{"role": "policy"}, {"role": "tool"}, {"role": "policy"}],
    ...        "tool_calls": [{"turn": 1, "result": "Doc 1(Title: Tavi) Tavi was born in Velor."}],
    ...        "golden_answers": ["Velor"]}
    >>> retrieval_hits(rec)                  # the search turn found the answer; the answer turn has no search
    [1.0, None]
    >>> [round(x, 3) for x in stepsearch_steps(rec, ["Tavi was born in Velor."])[:1]]   # gain, nothing repeated
    [0.776]

  retrieval_hits   1 if the turn's results hold a golden answer (SQuAD-normalised, as EM), else 0
  stepsearch_steps StepSearch (Wang et al. 2025, arXiv 2505.15107; docs/design.md §4; its code's
                   step_information_gain): IG_t - P_t, with IG_t = mean over gold documents g of
                   max(0, m_t(g) - M_{t-1}(g)), m_t(g) the best TF-IDF cosine of a document the
                   step retrieved with g, M the running best of earlier steps, and P_t the share of
                   the step's documents seen before (exact text)
  ig_search_steps  IG-Search (arXiv 2604.15148; its code's ig_reward.py): the policy's mean
                   log-probability of the gold answer after the turn's real results, minus its mean
                   over the same context with those results swapped for another rollout's

The gold documents of StepSearch are the question's `metadata.support_docs` (its data's field),
else the passages `metadata.gold_ids` names (the tiny world's), looked up with `passage`.
"""

from __future__ import annotations

import math
import re
from collections import Counter

from agent.answers import golden_of, normalize_answer

DOC_START = re.compile(r"(?m)^Doc \d+\(")  # format_hits / Search-R1's `Doc i(Title: ...) text` lines


def action_turns(record: dict) -> int:
    """How many action turns the record has: its policy chunks (trainer/turns.turn_spans gives
    their token spans; kept apart so that reading a reward loads no torch)."""
    return sum(c.get("role") == "policy" for c in record.get("chunks") or [])


def turn_results(record: dict) -> list[list[str]]:
    """Per action turn, the result texts of its searches (reads and other tools left out)."""
    out: list[list[str]] = [[] for _ in range(action_turns(record))]
    for call in record.get("tool_calls") or []:
        k = int(call.get("turn") or 0) - 1
        if 0 <= k < len(out) and call.get("name", "search") == "search":
            out[k].append(str(call.get("result") or ""))
    return out


def documents(result: str) -> list[str]:
    """The documents of one rendered search result: its `Doc i(...)` lines, else the whole text."""
    starts = [m.start() for m in DOC_START.finditer(result)]
    if not starts:
        return [result.strip()] if result.strip() and result.strip() != "No results." else []
    return [result[a:b].strip() for a, b in zip(starts, starts[1:] + [len(result)])]


def retrieval_hits(record: dict) -> list[float | None]:
    """Per action turn: 1.0 if a result of its searches holds a golden answer, 0.0 if it searched
    and none does, None if it did not search."""
    golden = [normalize_answer(g) for g in golden_of(record)]
    golden = [g for g in golden if g]
    out: list[float | None] = []
    for results in turn_results(record):
        if not results:
            out.append(None)
            continue
        text = normalize_answer(" ".join(results))
        out.append(float(any(f" {g} " in f" {text} " for g in golden)))
    return out


def _tfidf_cosine(docs: list[str], golds: list[str]) -> list[list[float]]:
    """cos(TF-IDF(d), TF-IDF(g)) for every document d and gold document g, the IDF fit on these
    texts alone (as StepSearch's step_information_gain fits its vectoriser per call)."""
    texts = [normalize_answer(t).split() for t in docs + golds]
    df = Counter(w for words in texts for w in set(words))
    n = len(texts)

    def vector(words: list[str]) -> dict[str, float]:
        tf = Counter(words)
        return {w: c * (math.log((1 + n) / (1 + df[w])) + 1) for w, c in tf.items()}  # sklearn's smooth idf

    vectors = [vector(words) for words in texts]
    norms = [math.sqrt(sum(v * v for v in vec.values())) or 1.0 for vec in vectors]
    doc_vecs, gold_vecs = vectors[: len(docs)], vectors[len(docs) :]
    return [[sum(v * g.get(w, 0.0) for w, v in d.items()) / (norms[i] * norms[len(docs) + j])
             for j, g in enumerate(gold_vecs)] for i, d in enumerate(doc_vecs)]  # fmt: skip


def stepsearch_steps(record: dict, gold_docs: list[str]) -> list[float | None]:
    """StepSearch's step reward IG_t - P_t per action turn (module docstring); None for a turn
    without a search; IG_t is 0 without gold documents (the redundancy penalty still counts)."""
    best = [0.0] * len(gold_docs)  # M_{t-1}: the best match of each gold document so far
    seen: set[str] = set()
    out: list[float | None] = []
    for results in turn_results(record):
        if not results:
            out.append(None)
            continue
        docs = [d for r in results for d in documents(r)]
        repeated = 0
        for d in docs:
            repeated += d in seen
            seen.add(d)
        penalty = repeated / len(docs) if docs else 0.0
        gain = 0.0
        if docs and gold_docs:
            cos = _tfidf_cosine(docs, gold_docs)
            match = [max(0.0, max(row[j] for row in cos)) for j in range(len(gold_docs))]
            gain = sum(max(0.0, m - b) for m, b in zip(match, best)) / len(gold_docs)
            best = [max(m, b) for m, b in zip(match, best)]
        out.append(gain - penalty)
    return out


def gold_documents(record: dict, passage) -> list[str]:
    """StepSearch's gold documents: metadata.support_docs, else the passages of metadata.gold_ids
    (looked up with `passage(id) -> text or None`), else none."""
    meta = record.get("metadata") or {}
    docs = meta.get("support_docs")
    if isinstance(docs, list) and docs:
        return [str(d) for d in docs]
    ids = meta.get("gold_ids")
    if passage is None or not isinstance(ids, list):
        return []
    return [text for text in (passage(str(i)) for i in ids) if text]


def information_spans(record: dict) -> list[tuple[int, int] | None]:
    """Per action turn, [start, end) in response_ids of the observation that follows it (its
    retrieved documents), None if none follows."""
    chunks = record.get("chunks") or []
    out: list[tuple[int, int] | None] = []
    for i, c in enumerate(chunks):
        if c.get("role") != "policy":
            continue
        after = chunks[i + 1] if i + 1 < len(chunks) else None
        out.append((after["start"], after["end"]) if after is not None and after.get("role") == "tool" else None)
    return out


def ig_search_steps(group: list[dict], answer_logprob, swaps: int = 3) -> list[list[float | None]]:
    """IG-Search's information gain per search turn of each rollout of a group (module
    docstring): log P(gold | prompt, response up to the turn's observation) minus its mean over
    up to `swaps` counterfactuals, the same context with that observation's tokens replaced by
    another rollout's observation (the group's others, in order; IG-Search samples other
    rollouts of the batch). Later turns are dropped; the context ends in the answer tag (the
    scorer adds it). `answer_logprob(prefixes, answers) -> mean log-probabilities`, one call for
    the whole group. A turn with no observation, or no other observation to swap in, is None."""
    observations = [(i, span) for i, r in enumerate(group) for span in information_spans(r) if span]
    prefixes, answers, where = [], [], []  # where: (rollout, turn, real or counterfactual)
    for i, r in enumerate(group):
        gold = next((g for g in golden_of(r) if g.strip()), None)
        for k, span in enumerate(information_spans(r)):
            others = [(j, s) for j, s in observations if j != i][:swaps]
            if span is None or gold is None or not others:
                continue
            head, real = r["prompt_ids"] + r["response_ids"][: span[0]], r["response_ids"][span[0] : span[1]]
            prefixes.append(head + real)
            answers.append(gold)
            where.append((i, k, "real"))
            for j, (a, b) in others:
                prefixes.append(head + group[j]["response_ids"][a:b])
                answers.append(gold)
                where.append((i, k, "swap"))
    out: list[list[float | None]] = [[None] * len(information_spans(r)) for r in group]
    if not prefixes:
        return out
    scores = answer_logprob(prefixes, answers)
    real: dict[tuple[int, int], float] = {}
    swapped: dict[tuple[int, int], list[float]] = {}
    for (i, k, kind), s in zip(where, scores):
        if kind == "real":
            real[(i, k)] = s
        else:
            swapped.setdefault((i, k), []).append(s)
    for (i, k), s in real.items():
        out[i][k] = s - sum(swapped[(i, k)]) / len(swapped[(i, k)])
    return out
