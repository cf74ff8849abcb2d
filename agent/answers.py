"""Reading model output: one parser for every reward, and the answer metrics.

    p = parse_response("<think>a</think><search> P born </search><information>Doc 1 ..."
                       "</information><think>b</think><answer> \\boxed{Velor} </answer>")
    p.answer, p.queries, p.format_ok     # ('Velor', ['P born'], True)
    exact_match("the Velor.", ["Velor"])  # 1.0  (SQuAD normalisation)
    f1_score("city of Velor", ["Velor"])  # 0.5  (word level; WebFilter eq. 7)
    char_f1("Velor", ["Velot"])           # 0.8  (character level; BAPO §2.2)

The parser reads the *response* (policy text plus tool outputs, never the prompt, whose example
"<answer> Paris </answer>" would otherwise score; docs/design.md §7). Tags: think, search, tool_call,
read, information / result / tool_response (what tools write back), confidence, answer. Text
inside a tool's block is never the policy's: an answer planted in a retrieved passage does not
count. Malformed text never raises; it shows up as format flags (structure_ok, tags_balanced,
bad_tool_calls). rewards.py builds every reward on top of this module.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from dataclasses import dataclass, field

from trainer.config import PROTOCOLS

# --------------------------------------------------------------------------------------------
# Parsing: one pass over the response text, shared by every reward.

ACTIONS = ("search", "tool_call", "read")  # what the policy may call
OBSERVATIONS = ("information", "result", "tool_response")  # what the tools write back
TAG_NAMES = ("think", "answer", "confidence", *ACTIONS, *OBSERVATIONS)
_BLOCK = re.compile(r"<(" + "|".join(TAG_NAMES) + r")>(.*?)</\1>", re.S)
_ANY_TAG = re.compile(r"</?(" + "|".join(TAG_NAMES) + r")>")
# BAPO §3.2 asks for \boxed{I DON'T KNOW}; WebFilter's released prompt abstains with
# "Insufficient information to proceed safely." Compared after SQuAD normalisation.
IDK_ANSWERS = {"i dont know", "i do not know", "idk", "insufficient information to proceed safely"}


@dataclass
class Parsed:
    blocks: list[tuple[str, str]]  # (tag or "text", content) in order
    answer: str | None = None  # last <answer> block; the inside of \boxed{} if present
    # the final answer's confidence, an integer 1..10: the <confidence> block right after the last
    # <answer>, else right before it; None when the final answer carries none. Deliberative
    # Searcher eq. 5's c(s_T) is "the certainty of the final answer", so an earlier step's
    # confidence does not stand in for it.
    confidence: int | None = None
    queries: list[str] = field(default_factory=list)  # <search> blocks and tool_call queries
    structure_ok: bool = False  # think -> (action -> observation -> think)* -> [confidence] answer
    tags_balanced: bool = False  # every opening tag has its closing tag, nothing nested
    bad_tool_calls: int = 0  # <tool_call> blocks that are not {"name", "arguments": {...}} JSON

    @property
    def idk(self) -> bool:
        """ "I don't know" and its variants; a typographic apostrophe ("don’t", which SQuAD's
        ASCII punctuation list keeps) counts too."""
        if self.answer is None:
            return False
        return normalize_answer(self.answer.replace("\u2019", "'").replace("\u2018", "'")) in IDK_ANSWERS

    @property
    def format_ok(self) -> bool:
        return self.structure_ok and self.tags_balanced and self.bad_tool_calls == 0 and self.answer is not None


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


def unbox(text: str) -> str:
    r"""The inside of the last \boxed{...} (braces may nest), else the text itself.

    >>> unbox(r"The final answer is \boxed{I DON'T KNOW}")
    "I DON'T KNOW"
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return text.strip()
    depth, i = 1, start + 7
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[start + 7 : i - 1].strip() if depth == 0 else text.strip()


def boxed(text: str) -> str | None:
    r"""Strict reading of a \boxed{} answer (BAPO's format; rollout.py checks answers with it):
    the inside of the last \boxed{...}, or None when there is none, a brace is left open, or a
    \boxed{} sits inside another. (`unbox` is the lenient reading the rewards use.)

    >>> boxed(r"The answer is \boxed{Paris}"), boxed("Paris"), boxed(r"\boxed{a \boxed{b}}")
    ('Paris', None, None)
    """
    found, pos = None, 0
    while (start := text.find("\\boxed{", pos)) >= 0:
        depth, i = 1, start + 7
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        inside = text[start + 7 : i - 1]
        if depth or "\\boxed{" in inside:
            return None
        found, pos = inside.strip(), i
    return found


def confidence_value(text: str | None) -> int | None:
    """A <confidence> block's content as an integer 1..10, else None ("11", "high", "7.5")."""
    text = (text or "").strip()
    return int(text) if re.fullmatch(r"\d{1,2}", text) and 1 <= int(text) <= 10 else None


def load_tool_call(body: str) -> dict | None:
    """One <tool_call> block as {"name", "arguments": {...}}; None when it is not JSON, not an
    object or has no arguments object. The name is not checked (the caller knows its tools)."""
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("arguments"), dict):
        return None
    return call


def tool_call_queries(body: str) -> list[str] | None:
    """Queries of one JSON tool call; `arguments.query` may be a string or a list of strings.
    None when the block is not a well-formed call (not JSON, not an object, no arguments)."""
    call = load_tool_call(body)
    if call is None:
        return None
    q = call["arguments"].get("query", call["arguments"].get("queries"))
    if isinstance(q, str):
        return [q]
    if isinstance(q, list) and all(isinstance(x, str) for x in q):
        return list(q)
    return None


def _structure_ok(blocks: list[tuple[str, str]]) -> bool:
    """think -> (action -> observation -> think)* -> answer, only whitespace between, where every
    think may be followed by a <confidence> (Deliberative Searcher §2.2: a confidence on each step
    and on the answer) and the answer by one.

    Search-R1's `is_valid_sequence` with the action and observation tags widened to the other
    papers' (tool_call / read, result / tool_response) and Deliberative Searcher's confidences.

    >>> _structure_ok([("think", ""), ("confidence", "3"), ("search", ""), ("information", ""),
    ...                ("think", ""), ("confidence", "9"), ("answer", "")])
    True
    """
    if any(k == "confidence" and confidence_value(b) is None for k, b in blocks):
        return False  # a confidence must be an integer 1..10 ("11" or "high" is a format failure)
    kinds = [k for k, _ in blocks]
    kinds = [k for i, k in enumerate(kinds) if not (k == "confidence" and i and kinds[i - 1] == "think")]
    if not kinds or "text" in kinds or kinds[0] != "think":
        return False
    i = 1
    while i < len(kinds) and kinds[i] in ACTIONS:
        if i + 2 >= len(kinds) or kinds[i + 1] not in OBSERVATIONS or kinds[i + 2] != "think":
            return False
        i += 3
    return kinds[i:] in (["answer"], ["answer", "confidence"])


def final_answer_confidence(blocks: list[tuple[str, str]]) -> int | None:
    """The confidence the final answer carries: the block right after the last <answer>
    (rollout.confidence_after_answer), else the one right before it; None otherwise.

    >>> final_answer_confidence([("think", ""), ("confidence", "8"), ("search", ""), ("information", ""),
    ...                          ("think", ""), ("answer", "x")]) is None  # a step's, not the answer's
    True
    >>> final_answer_confidence([("think", ""), ("confidence", "3"), ("answer", "x"), ("confidence", "9")])
    9
    """
    last = max((i for i, (k, _) in enumerate(blocks) if k == "answer"), default=None)
    if last is None:
        return None
    for i in (last + 1, last - 1):
        if 0 <= i < len(blocks) and blocks[i][0] == "confidence":
            return confidence_value(blocks[i][1])
    return None


def parse_response(text: str, query_sep: str = "") -> Parsed:
    """Blocks, final answer, confidence, queries and format flags of one response. `query_sep`
    splits a <search> block into several queries (a protocol's Protocol.query_sep, e.g. " ## ").

    >>> p = parse_response("<think>a</think><search> P born </search><information>Doc 1 ..."
    ...                    "</information><think>b</think><answer> \\\\boxed{Velor} </answer>")
    >>> p.answer, p.queries, p.format_ok
    ('Velor', ['P born'], True)
    """
    if not isinstance(text, str):
        text = ""
    blocks: list[tuple[str, str]] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        if text[pos : m.start()].strip():
            blocks.append(("text", text[pos : m.start()]))
        blocks.append((m.group(1), m.group(2)))
        pos = m.end()
    if text[pos:].strip():
        blocks.append(("text", text[pos:]))
    p = Parsed(blocks)
    # a tag inside a block or between blocks is nested or unclosed; tool output may hold anything
    p.tags_balanced = not any(_ANY_TAG.search(b) for k, b in blocks if k not in OBSERVATIONS)
    answers = [b for k, b in blocks if k == "answer"]
    if answers:
        p.answer = unbox(answers[-1])
    p.confidence = final_answer_confidence(blocks)
    for k, b in blocks:
        if k == "search" and b.strip():
            p.queries += [q.strip() for q in (b.split(query_sep) if query_sep else [b]) if q.strip()]
        elif k == "tool_call":
            qs = tool_call_queries(b)
            if qs is None:
                p.bad_tool_calls += 1
            else:
                p.queries += qs
    p.structure_ok = _structure_ok(blocks)
    return p


def parsed(record: dict) -> Parsed:
    """The record's parse, cached on the record (several components read it), with the query split of
    the record's protocol (agent/protocols.py's table; a search_r1 record names none)."""
    if "_parsed" not in record:
        text = record.get("response", record.get("response_text", ""))
        sep = getattr(PROTOCOLS.get(str(record.get("protocol", ""))), "query_sep", "")
        record["_parsed"] = parse_response(text if isinstance(text, str) else "", sep)
    return record["_parsed"]


# --------------------------------------------------------------------------------------------
# Answer metrics.

_NO_PUNCT = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """SQuAD v1.1's normalisation: lower, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", s.lower().translate(_NO_PUNCT)).split())


def golden_of(record: dict) -> list[str]:
    g = record.get("golden_answers") or []
    return [x for x in (g if isinstance(g, list) else [g]) if isinstance(x, str)]


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


def _f1(pred: list[str], gold: list[str]) -> float:
    common = sum((Counter(pred) & Counter(gold)).values())
    if not common:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str | None, golden: list[str]) -> float:
    """Best word-level F1 against any golden answer (SQuAD; WebFilter eq. 7: 2 IN / (PN + RN)).

    >>> f1_score("city of Velor", ["Velor"])
    0.5
    """
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction).split()
    return max((_f1(pred, normalize_answer(g).split()) for g in golden), default=0.0)


def char_f1(prediction: str | None, golden: list[str]) -> float:
    """Best character-level F1 (BAPO §2.2: "character-level F1 score between two strings"):
    bags of the characters of the normalised strings, spaces dropped.

    >>> round(char_f1("Velor", ["Velot"]), 2)
    0.8
    """
    if prediction is None:
        return 0.0
    pred = list(normalize_answer(prediction).replace(" ", ""))
    return max((_f1(pred, list(normalize_answer(g).replace(" ", ""))) for g in golden), default=0.0)
