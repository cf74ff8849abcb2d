"""LLM judge for the rewards that need one: one interface, two backends.

    judge = make_judge(url="http://127.0.0.1:8001/v1", model="qwen3-30b-a3b")   # `vllm serve` on the box
    judge = make_judge(model="/models/Qwen2.5-7B-Instruct", hf=True)             # in process, transformers
    judge.verdicts([judge.prompt("info_think", info="Doc 1 ...", think="So it is Velor.")])   # [1.0]
    judge = make_judge(url="rule")    # the tiny world's rule judge (RuleJudge): no model, no server

Used by WebFilter's retrieval-precision judge (z: answer correct, c: the operators helped; eq. 5),
VERITAS's info-think and think-search faithfulness (§3.2-3.3), and Deliberative Searcher's
verifier for r_acc (§2.2). The prompts are ours, written after the papers' intent; each asks for a
bare 1 or 0, and the first 1/0 (or yes/no) in the reply is the verdict.

The HTTP backend speaks the OpenAI-compatible API (`/completions`, or `/chat/completions` with
api="chat") with a timeout per prompt that bounds the whole call (retries and a server that
trickles bytes included), retries with exponential backoff (capped at 30 s) on connection
errors, timeouts and 5xx, and on 429 (a gateway's rate limit) after the Retry-After it asks for,
bounded concurrency, and an on-disk cache keyed by model and prompt (sqlite). Other 4xx are
permanent refusals. When a prompt still fails, or the reply is malformed, `on_failure` decides:
"error" raises JudgeError, "zero" scores 0 and counts it in `judge.failures` (of `judge.asked`,
with the cause in `judge.last_failure`; train.py logs the rate each step and stops above
train.judge_max_failure_rate). Failures are never silent: they are counted, and the first
message of each kind is printed. Within one `verdicts` call, a prompt that used its whole timeout
while no prompt got a reply shows the judge down: the call's prompts not yet sent fail at once
("skipped"), so a dead judge costs one timeout, not one per prompt.

Rewards ask record by record; `asked_at_once(judge, work)` runs such code twice, first with a
stand-in that only collects the prompts, so that all of them go to the judge in one concurrent
call (rewards.compute and report.metrics.compute_metrics do).
"""

from __future__ import annotations

import email.utils
import hashlib
import http.client
import json
import math
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from agent.answers import exact_match
from search.client import post_reply
from search.web import SOURCE_OPERATORS

PROMPTS = {
    "answer": (
        "You check answers to questions.\nQuestion: {question}\nReference answers: {golden}\n"
        "Candidate answer: {answer}\nDoes the candidate answer mean the same thing as one of the "
        "reference answers? Reply with 1 for yes or 0 for no, and nothing else.\nVerdict:"
    ),
    "syntax": (
        "An agent answered a question by searching the web.\nQuestion: {question}\nIts queries: "
        "{queries}\nWhat came back: {evidence}\nDid the search operators in its queries (site:, "
        "quoted phrases, AND / OR / NOT, before: / after:, exclusions) help it find evidence the "
        "question needs? Reply with 1 for yes or 0 for no, and nothing else.\nVerdict:"
    ),
    "info_think": (
        "Retrieved text: {info}\nThe agent's reasoning right after reading it: {think}\nDoes the "
        "reasoning take the retrieved text into account (use it, or say why it does not help)? "
        "Reply with 1 for yes or 0 for no, and nothing else.\nVerdict:"
    ),
    "think_search": (
        "The agent's reasoning: {think}\nThe search query it wrote next: {search}\nDoes the query "
        "follow from the reasoning? Reply with 1 for yes or 0 for no, and nothing else.\nVerdict:"
    ),
}
_VERDICT = re.compile(r"\b(1|0|yes|no)\b", re.I)
MAX_FIELD_CHARS = 4000  # each filled-in field is cut to this, so a runaway rollout cannot blow the context


class JudgeError(RuntimeError):
    """The judge could not give a verdict and on_failure is "error"."""


def reply_text(raw: bytes, chat: bool) -> str:
    """The completion text of an OpenAI-compatible reply body; ValueError naming what is wrong."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # HTML, truncated JSON, bad UTF-8, absurd nesting
        raise ValueError(f"not JSON ({type(e).__name__})") from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("no choices[0] object")
    if chat:
        message = choices[0].get("message")
        text, where = message.get("content") if isinstance(message, dict) else None, "choices[0].message.content"
    else:
        text, where = choices[0].get("text"), "choices[0].text"
    if not isinstance(text, str):
        raise ValueError(f"{where} is {type(text).__name__}, not a string")
    return text


def retry_after(value: str | None) -> float | None:
    """The seconds a 429's Retry-After header asks for: "5" -> 5.0, an HTTP date -> the seconds
    until it (0 if past); absent or unreadable -> None (the caller backs off on its own)."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError):
            return None
    return max(0.0, seconds) if seconds == seconds else None  # NaN: unreadable


def parse_verdict(text: str) -> float | None:
    """'1' / 'Yes.' -> 1.0, '0' / 'no' -> 0.0, anything else -> None."""
    m = _VERDICT.search(text or "")
    return None if m is None else float(m.group(1).lower() in ("1", "yes"))


@dataclass
class Judge:
    model: str
    url: str = ""  # OpenAI-compatible base URL, e.g. http://127.0.0.1:8001/v1; empty: transformers
    api: str = "completions"  # or "chat"
    timeout: float = 60.0
    retries: int = 4
    backoff: float = 1.0
    concurrency: int = 8
    on_failure: str = "error"  # "error" | "zero"
    max_tokens: int = 8
    # constrain the reply to "0" / "1": vLLM's structured outputs over HTTP, the next-token logits
    # of "1" against "0" in process. Any model then gives a verdict, never a parse failure.
    constrain: bool = True
    cache_path: str = ""  # sqlite file; empty: no cache
    failures: int = 0  # verdicts that failed (on_failure "zero": scored 0)
    asked: int = 0  # verdicts asked for (cached ones included): the failure rate's denominator
    last_failure: str = ""  # why the latest failed verdict failed (a skipped one names no new cause)
    retried: int = 0
    calls: int = 0
    cache_hits: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _db: object = field(default=None, repr=False)
    _hf: object = field(default=None, repr=False)
    _said: set = field(default_factory=set, repr=False)
    _last_reply: float = field(default=-math.inf, repr=False)  # time.monotonic() of the judge's latest answer
    _down: str = field(default="", repr=False)  # set once this verdicts call found the judge down: why

    def prompt(self, kind: str, **fields) -> str:
        def fill(v):
            v = "; ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)
            return v[:MAX_FIELD_CHARS]

        return PROMPTS[kind].format(**{k: fill(v) for k, v in fields.items()})

    def verdicts(self, prompts: list[str]) -> list[float]:
        """One 0/1 verdict per prompt (cached ones first, the rest concurrently)."""
        with self._lock:
            self.asked += len(prompts)
            self._down = ""  # each call finds out afresh whether the judge is up
        out: list[float | None] = [self._cached(p) for p in prompts]
        todo = [i for i, v in enumerate(out) if v is None]
        if todo and self.url:
            with ThreadPoolExecutor(max(1, self.concurrency)) as pool:
                for i, v in zip(todo, pool.map(lambda i: self._http_verdict(prompts[i]), todo)):
                    out[i] = v
        elif todo:
            for i, v in zip(todo, self._hf_verdicts([prompts[i] for i in todo])):
                out[i] = v
        return [float(v) for v in out]

    # -- failures -------------------------------------------------------------------------
    def _fail(self, why: str) -> float:
        with self._lock:
            self.failures += 1
            if not why.startswith("skipped"):
                self.last_failure = why
            kind = why.split(":")[0]
            if kind not in self._said:
                self._said.add(kind)
                print(f"judge failure ({self.on_failure}): {why}", flush=True)
        if self.on_failure == "error":
            raise JudgeError(f"judge {self.url or self.model}: {why}")
        return 0.0

    # -- cache ----------------------------------------------------------------------------
    def _key(self, prompt: str) -> str:
        return hashlib.sha256(f"{self.model}\x00{self.api}\x00{prompt}".encode()).hexdigest()

    def _cached(self, prompt: str) -> float | None:
        if not self.cache_path:
            return None
        with self._lock:
            if self._db is None:
                Path(self.cache_path).parent.mkdir(parents=True, exist_ok=True)
                self._db = sqlite3.connect(self.cache_path, check_same_thread=False)
                self._db.execute("CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, reply TEXT)")
            row = self._db.execute("SELECT reply FROM verdicts WHERE key = ?", (self._key(prompt),)).fetchone()
        if row is None:
            return None
        self.cache_hits += 1
        return parse_verdict(row[0])

    def _store(self, prompt: str, reply: str) -> None:
        if self.cache_path and self._db is not None:
            with self._lock:
                self._db.execute("INSERT OR REPLACE INTO verdicts VALUES (?, ?)", (self._key(prompt), reply))
                self._db.commit()

    # -- backends -------------------------------------------------------------------------
    def _http_verdict(self, prompt: str) -> float:
        chat = self.api == "chat"
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.0}
        body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        if self.constrain:
            body["structured_outputs"] = {"choice": ["0", "1"]}  # vLLM >= 0.11's guided choice
        endpoint = self.url.rstrip("/") + ("/chat/completions" if chat else "/completions")
        data = json.dumps(body).encode()
        started = time.monotonic()
        deadline = started + self.timeout  # the whole call: retries and backoff included
        last, attempts, errors, limited, pause = "", 0, 0, 0, 0.0
        while True:
            if self._down:  # another prompt of this call found the judge down: waiting would be for nothing
                return self._fail(f"skipped: {self._down}")
            if attempts:
                if time.monotonic() + pause >= deadline:
                    break
                with self._lock:
                    self.retried += 1
                time.sleep(pause)
            with self._lock:
                self.calls += 1
            attempts += 1
            try:
                status, raw, headers = post_reply(endpoint, data, deadline)
            except ValueError as e:  # not an http(s) URL: no retry helps
                return self._fail(f"unreachable: {e}")
            except (OSError, http.client.HTTPException) as e:  # timeouts, resets, IncompleteRead, ...
                status, last = 0, f"{type(e).__name__}: {e}"
            if status == 200:
                return self._verdict_of(prompt, raw, chat)
            if status:
                last = f"HTTP {status}: {raw[:200].decode(errors='replace')}"
            if status == 429:  # a rate limit, not a refusal: ask again after the wait the server asks for
                limited += 1  # bounded by the deadline alone: the server said when to come back
                asked_for = retry_after(headers.get("Retry-After"))
                # at least 0.1 s: "Retry-After: 0" must not make a busy loop of the rest of the timeout
                pause = max(0.1, asked_for) if asked_for is not None else min(30.0, self.backoff * 2 ** (limited - 1))
                continue
            if 0 < status < 500:
                self._last_reply = time.monotonic()  # a refusal of this prompt: the judge itself answers
                return self._fail(f"refused: {last}")
            errors += 1
            if errors > self.retries:
                break
            pause = min(30.0, self.backoff * 2 ** (errors - 1))
        return self._unreachable(f"{attempts} attempt(s) in the {self.timeout:g} s timeout, last error {last}", started)

    def _verdict_of(self, prompt: str, raw: bytes, chat: bool) -> float:
        """A 200 reply's verdict, stored in the cache; a malformed one goes through the failure policy."""
        self._last_reply = time.monotonic()
        try:
            reply = reply_text(raw, chat)
        except ValueError as e:
            return self._fail(f"malformed reply: {e}: {raw[:80]!r}")
        verdict = parse_verdict(reply)
        if verdict is None:
            return self._fail(f"no verdict: reply {reply[:80]!r}")
        self._store(prompt, reply)
        return verdict

    def _unreachable(self, why: str, started: float) -> float:
        """A prompt that used its whole timeout, asked since `started`: counted, and when no prompt got
        a reply in that time either, the judge is down for the rest of this verdicts call. A hanging
        judge then costs one timeout per call (the prompts in flight), not one per prompt, and one
        slow prompt of a judge that answers the others stops nothing."""
        with self._lock:
            if self._last_reply < started and not self._down:
                self._down = f"the judge is down (no reply to any prompt in the {self.timeout:g} s timeout)"
        return self._fail(f"unreachable: {why}")

    def _hf_verdicts(self, prompts: list[str]) -> list[float]:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self._hf is None:
            if not Path(self.model).is_dir():
                raise FileNotFoundError(f"judge model directory not found: {self.model}")
            tok = AutoTokenizer.from_pretrained(self.model)
            tok.padding_side = "left"
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token
            self._hf = (tok, AutoModelForCausalLM.from_pretrained(self.model).eval())
        tok, model = self._hf
        texts = prompts
        if self.api == "chat" and tok.chat_template:
            texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in prompts]  # fmt: skip
        out = []
        one, zero = tok.encode("1", add_special_tokens=False), tok.encode("0", add_special_tokens=False)
        for s in range(0, len(texts), 16):
            batch = tok(texts[s : s + 16], return_tensors="pt", padding=True)
            if self.constrain and len(one) == len(zero) == 1:
                positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # left padding
                with torch.inference_mode():
                    last = model(**batch, position_ids=positions).logits[:, -1].float()
                for p, row in zip(prompts[s : s + 16], last):
                    self.calls += 1
                    verdict = float(row[one[0]] > row[zero[0]])
                    self._store(p, str(int(verdict)))
                    out.append(verdict)
                continue
            with torch.inference_mode():
                gen = model.generate(
                    **batch, max_new_tokens=self.max_tokens, do_sample=False, pad_token_id=tok.pad_token_id
                )
            for p, row in zip(prompts[s : s + 16], gen[:, batch["input_ids"].shape[1] :]):
                self.calls += 1
                reply = tok.decode(row, skip_special_tokens=True)
                verdict = parse_verdict(reply)
                if verdict is None:
                    out.append(self._fail(f"no verdict: reply {reply[:80]!r}"))
                else:
                    self._store(p, reply)
                    out.append(verdict)
        return out


# --------------------------------------------------------------------------------------------
# The rule judge: the tiny world's stand-in, labelled as such wherever it is used.

RULE_JUDGE = "rule judge (tiny world)"
# capitalised words that are not entities: sentence starts of the tiny world's texts and tags
NOT_ENTITIES = {"I", "It", "Doc", "Title", "No", "Fans", "Some", "Answer", "Question", "Say", "Where", "In", "The"}


def entities(text: str) -> set[str]:
    """Capitalised words (the tiny world's names), e.g. "Tavi Morek was born in Velor." ->
    {"Tavi", "Morek", "Velor"}; "I know the answer." -> set()."""
    return set(re.findall(r"\b[A-Z][a-z]+\b", text or "")) - NOT_ENTITIES


def _rule_answer(question: str = "", answer: str = "", golden=(), **_) -> float:
    return exact_match(answer, [golden] if isinstance(golden, str) else list(golden))


def _rule_info_think(info: str = "", think: str = "", **_) -> float:
    """The think names an entity that appears in the information just before it."""
    return float(bool(entities(think) & entities(info)))


def _rule_think_search(think: str = "", search: str = "", **_) -> float:
    """The query names an entity the think before it named."""
    return float(bool(entities(search) & entities(think)))


def _rule_syntax(question: str = "", queries=(), evidence=(), **_) -> float:
    """An operator query (site:, ...) brought back a source about the question's subject."""
    subject = entities(question)
    return float(any(SOURCE_OPERATORS.search(q) and subject & entities(e) for q, e in zip(queries, evidence)))


RULES = {"answer": _rule_answer, "info_think": _rule_info_think, "think_search": _rule_think_search,
         "syntax": _rule_syntax}  # fmt: skip


@dataclass
class RuleJudge:
    """judge.Judge's interface (prompt, verdicts) decided by rules on the tiny world's text, so
    VERITAS's and WebFilter's judge rewards run on a laptop. Not an LLM: reports name it
    RULE_JUDGE. The prompt is the kind and its fields as JSON (no text to parse back)."""

    model: str = RULE_JUDGE
    failures: int = 0
    asked: int = 0
    calls: int = 0

    def prompt(self, kind: str, **fields) -> str:
        if kind not in RULES:
            raise ValueError(f"the rule judge has no rule for {kind!r}; known: {', '.join(RULES)}")
        return json.dumps({"kind": kind, **fields})

    def verdicts(self, prompts: list[str]) -> list[float]:
        self.calls += len(prompts)
        self.asked += len(prompts)
        out = []
        for p in prompts:
            fields = json.loads(p)
            out.append(float(RULES[fields.pop("kind")](**fields)))
        return out


def make_judge(url: str = "", model: str = "", hf: bool = False, **kw) -> Judge | RuleJudge:
    """An HTTP judge (url), an in-process transformers judge (hf=True, model = a local dir), or
    url="rule": the tiny world's rule judge (RuleJudge)."""
    if url == "rule":
        return RuleJudge()
    if not url and not hf:
        raise ValueError("a judge needs a url (OpenAI-compatible server) or hf=True with a model directory")
    if kw.get("on_failure", "error") not in ("error", "zero"):
        raise ValueError(f"on_failure must be 'error' or 'zero', got {kw['on_failure']!r}")
    return Judge(model=model, url="" if hf else url, **kw)


# --------------------------------------------------------------------------------------------
# Every verdict of a batch in one call.

T = TypeVar("T")


class _Recorder:
    """A judge's interface that only writes down the prompts it is given and answers 0."""

    def __init__(self, judge) -> None:
        self.judge, self.prompts = judge, []

    def prompt(self, kind: str, **fields) -> str:
        return self.judge.prompt(kind, **fields)

    def verdicts(self, prompts: list[str]) -> list[float]:
        self.prompts.extend(prompts)
        return [0.0] * len(prompts)


class _Answered:
    """A judge's interface over verdicts already asked for (a memo of this batch, whether or not the
    judge has a cache); a prompt not among them is asked of the judge then."""

    def __init__(self, judge, prompts: list[str]) -> None:
        self.judge, self.memo = judge, {}
        self._ask(prompts)

    def __getattr__(self, name: str):  # failures, model, ...: the judge's own
        return getattr(self.judge, name)

    def _ask(self, prompts: list[str]) -> None:
        todo = [p for p in dict.fromkeys(prompts) if p not in self.memo]  # a group's rollouts often agree
        if todo:
            self.memo.update(zip(todo, self.judge.verdicts(todo)))

    def prompt(self, kind: str, **fields) -> str:
        return self.judge.prompt(kind, **fields)

    def verdicts(self, prompts: list[str]) -> list[float]:
        self._ask(prompts)
        return [self.memo[p] for p in prompts]


def asked_at_once(judge, work: Callable[[object], T]) -> T:
    """work(judge), with every verdict it asks for asked in ONE judge.verdicts call, so the judge's
    concurrency is used even by code that asks record by record (the rewards): work runs first
    with a stand-in that collects its prompts and answers 0, then the distinct prompts go to the
    judge at once, then work runs for real on those verdicts (a memo: free, cache or not). A prompt
    the first run did not ask (one that depends on an earlier verdict) is asked when it comes.
    Without a judge, work(None)."""
    if judge is None:
        return work(None)
    recorder = _Recorder(judge)
    try:
        work(recorder)
    except Exception:  # a failure of the zeros' run alone; a real one is met again below
        pass
    return work(_Answered(judge, recorder.prompts))
