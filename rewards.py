"""Rewards: rollout record -> reward components -> one scalar per rollout.

Search-R1 (paper §3.3, the outcome reward): r = EM(answer, golden) in {0, 1}, with SQuAD's
answer normalisation (lower-case, drop punctuation and the articles a/an/the, squeeze spaces).
The answer is the LAST `<answer>` block of the policy's own text: never the prompt (whose
example "<answer> Paris </answer>" would otherwise score), never a retrieved passage.

    >>> exact_match("the Velor.", ["Velor"])
    1.0
    >>> f1_score("city of Velor", ["Velor"])
    0.5
    >>> search_r1_em({"answer": "Velor", "golden_answers": ["velor"], "finish": "answer"})
    {'em': 1.0, 'f1': 1.0, 'format_ok': 1.0, 'reward': 1.0}

Malformed model output (unclosed or nested tags, no answer, a huge query) never raises: it is
a format failure with reward 0. A new reward is one function `record -> dict of components
with a "reward" key` and one line in REWARDS.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_BLOCK = re.compile(r"<(think|search|information|answer)>(.*?)</\1>", re.S)


def split_segments(text: str, policy: bool) -> list[dict]:
    """Tagged blocks of a chunk of text, in order, plus any untagged text between them.

    >>> [s["type"] for s in split_segments("<think>a</think>x<search>b</search>", True)]
    ['think', 'text', 'search']
    """
    out, pos = [], 0
    for m in _BLOCK.finditer(text):
        if text[pos : m.start()].strip():
            out.append({"type": "text", "text": text[pos : m.start()], "policy": policy})
        out.append({"type": m.group(1), "text": m.group(2), "policy": policy})
        pos = m.end()
    if text[pos:].strip():
        out.append({"type": "text", "text": text[pos:], "policy": policy})
    return out


def last_block(text: str, tag: str) -> str | None:
    """Content of the last complete <tag>...</tag> block in text, or None.

    >>> last_block("<answer>a</answer> <answer> b </answer>", "answer")
    'b'
    """
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.S)
    return found[-1].strip() if found else None


def normalize_answer(s: str) -> str:
    """SQuAD v1.1's normalisation: lower, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction: str | None, golden: list[str]) -> float:
    if prediction is None:
        return 0.0
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in golden))


def substring_match(prediction: str | None, golden: list[str]) -> float:
    """1 if a normalised golden answer occurs inside the normalised prediction."""
    if prediction is None:
        return 0.0
    p = normalize_answer(prediction)
    return float(any(normalize_answer(g) in p for g in golden if normalize_answer(g)))


def f1_score(prediction: str | None, golden: list[str]) -> float:
    """Best word-level F1 against any golden answer (SQuAD)."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction).split()
    best = 0.0
    for g in golden:
        gold = normalize_answer(g).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if common:
            precision, recall = common / len(pred), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def search_r1_em(record: dict) -> dict:
    """Search-R1 outcome reward: EM of the final answer; 0 when the rollout never answered."""
    answer = record.get("answer")
    golden = record.get("golden_answers") or []
    ok = float(record.get("finish") == "answer" and answer is not None)
    em = exact_match(answer, golden) if ok else 0.0
    return {"em": em, "f1": f1_score(answer, golden) if ok else 0.0, "format_ok": ok, "reward": em}


REWARDS = {
    "em": search_r1_em,
}


def score(records: list[dict], name: str = "em") -> list[dict]:
    """Attach `reward` and `reward_components` to each record (in place) and return them."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; known: {', '.join(REWARDS)}")
    fn = REWARDS[name]
    for r in records:
        parts = fn(r)
        r["reward"] = float(parts["reward"])
        r["reward_components"] = parts
    return records
