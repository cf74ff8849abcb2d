"""Agent protocols of rollout.py (search_r1, bapo, deliberative, webfilter), driven by a scripted engine.

One file on purpose (about 580 lines): the four protocols share one scripted engine and one set of
malformed-action cases, and are read side by side.

The engine replays fixed policy turns (what a model would write), so these tests check the
rollout bookkeeping of each protocol, not sampling: the observations it appends, the records
(loss_mask 0 exactly on observation tokens, logprobs as generated), the parse of the answer
through answers.parsed and rewards.score, and malformed actions (bad JSON, unknown tool, read of
a missing id, empty search, confidence outside 1-10, \\boxed{} nested or missing), which get an
invalid-action observation or a format failure in the reward, never an exception.

The first test pins search_r1 (the default) to the records the code produced before protocols
existed: a hash of every record and every engine call, recorded on the unchanged rollout.py.
"""

import hashlib
import json
import re

import pytest

from agent import protocols
from agent.answers import parsed
from report import metrics
from rewards import score
from rollout import SEARCH_R1_TEMPLATE, render_prompt, rollout_batch, tool_message_wrap
from trainer.config import ConfigError, RolloutConfig, load_config
from trainer.engine import Completion

# ---------------------------------------------------------------------------------- helpers


class CharTokenizer:
    """One token per character: token counts are string lengths (as in test_metrics.py)."""

    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A real byte-level BPE (sft.train_tokenizer: the tags are whole tokens), trained in ~1 s."""
    from tiny.sft import train_tokenizer

    texts = ["Tavi Morek was born in the city of Velor. Doc Title information result answer " * 5] * 10
    return train_tokenizer(texts, 300, tmp_path_factory.mktemp("tok"))


class ScriptedEngine:
    """The engine interface (trainer/engine.py) replaying SCRIPT[qid][k] at turn k.

    The question id is read from the context ("[q3]" in the question text); the turn is the
    number of the script's turns already present, in order, in the context. Token ids are the
    tokenizer's encoding of the scripted text, cut at max_tokens (finish "length"); a turn is
    "stop" unless it is marked ("text", "length"). Logprobs depend on the seed, so seeds are
    pinned too. Every call is logged."""

    def __init__(self, tokenizer, script):
        self.tok, self.script, self.calls, self.outputs = tokenizer, script, [], []

    def generate(self, prompts, max_tokens, temperature, top_p, stop, seeds=None):
        self.calls.append({"n": len(prompts), "max_tokens": list(max_tokens), "temperature": temperature,
                           "top_p": top_p, "stop": list(stop), "seeds": list(seeds or [])})  # fmt: skip
        out = []
        for i, ids in enumerate(prompts):
            context = self.tok.decode(ids)
            turns = self.script[re.search(r"\[(q\d+)\]", context).group(1)]
            k, pos = 0, 0
            while k < len(turns):
                text = turns[k][0] if isinstance(turns[k], tuple) else turns[k]
                at = context.find(text, pos)
                if at < 0:
                    break
                k, pos = k + 1, at + len(text)
            turn = turns[min(k, len(turns) - 1)]
            text, reason = turn if isinstance(turn, tuple) else (turn, "stop")
            new = self.tok.encode(text, add_special_tokens=False)
            if len(new) > max_tokens[i]:
                new, reason = new[: max_tokens[i]], "length"
            seed = seeds[i] if seeds else 0
            out.append(Completion(new, [-((seed + j) % 997) / 1000 for j in range(len(new))], reason))
        self.outputs += out
        return out


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


# ------------------------------------------------------------ search_r1: unchanged, bit for bit

GOLDEN_SCRIPT = {
    "q1": ["<think> find P</think><search> Tavi Morek born</search>",
           "<think> it is Velor</think><answer> Velor</answer>"],
    "q2": ["<think> hmm</think></search>"],  # a closing tag with no block: finish "format"
    "q3": ["<think> a</think><search> x</search>", "<think> b</think><search> y</search>",
           "<think> c</think><search> z</search>"],  # searches on the last turn: finish "max_turns"
    "q4": [("<think> this goes on and on", "length")],
    "q5": [("<think> stop here</think>", "stop")],  # an EOS without a stop string
    "q6": ["<think> e</think><search></search>", "<think> f</think><answer> \\boxed{Velor} </answer>"],
    "q7": ["<think> long</think><search> long</search>", "<think> g</think><answer> Kesh</answer>"],
    "q8": ["<think> a very long first turn that will not fit into the small budget at all, no</think>"
           "<search> Tavi</search>", "<answer> x</answer>"],
}  # fmt: skip
GOLDEN_QUESTIONS = [
    {"id": k, "question": f"[{k}] Where was Tavi Morek born?", "golden_answers": ["Velor"], "metadata": {"n": i}}
    for i, k in enumerate(GOLDEN_SCRIPT)
]


def golden_search(queries):
    return [("Doc 1(Title: Long) " + "word " * 80) if q == "long" else f"Doc 1(Title: {q}) {q} was born in Velor."
            for q in queries]  # fmt: skip


def golden_runs(tok) -> list:
    """Every search_r1 code path: search/answer, format, max_turns, length, eos, empty query,
    truncated observation, budget, greedy, forced prefixes (eval's rag), a custom template."""
    out = []
    cases = [
        (RolloutConfig(max_turns=2, max_tokens_per_turn=200, max_obs_tokens=30), {"seed": 3, "group_prefix": "t:"}),
        (RolloutConfig(max_turns=3, max_tokens_per_turn=40, max_obs_tokens=500), {"greedy": True}),
        (RolloutConfig(max_turns=2, max_tokens_per_turn=200, max_model_len=200,
                       prompt_template="Q: {question}\n"), {"seed": 1}),
    ]  # fmt: skip
    for cfg, kw in cases:
        engine = ScriptedEngine(tok, GOLDEN_SCRIPT)
        records = rollout_batch(engine, tok, GOLDEN_QUESTIONS, 2, golden_search, cfg, **kw)
        out.append({"records": records, "calls": engine.calls})
    engine = ScriptedEngine(tok, GOLDEN_SCRIPT)
    prefixes = [[("<think> </think><search> Tavi</search>", "prefix"), ("Doc 1(Title: Tavi) born in Velor", "obs")]
                for _ in GOLDEN_QUESTIONS[:2]]  # fmt: skip
    records = rollout_batch(engine, tok, GOLDEN_QUESTIONS[:2], 1, golden_search, RolloutConfig(max_tokens_per_turn=200),
                            greedy=True, prefixes=prefixes)  # fmt: skip
    out.append({"records": records, "calls": engine.calls})
    return out


# Recorded on rollout.py as it was before protocols (git HEAD), with the two tokenizers below.
# GOLDEN_CHAR changed once, with rollout.run_in_turns: the records are the same, and the old loop's
# one empty engine call (every trajectory out of room, the third case) is no longer made.
GOLDEN_CHAR = "1fa565886c8775b5d06e192d14837cbe112e58d92680a7708793a2c62b2fc97a"
GOLDEN_BPE = "22a30fdc65990725f89c870e7e10cd3fa3482b08d33d8bb2009fb1d66463fe4e"


def test_search_r1_records_are_unchanged_char_tokenizer():
    runs = golden_runs(CharTokenizer())
    first = runs[0]["records"]
    assert [r["finish"] for r in first[::2]] == ["answer", "format", "max_turns", "length", "eos", "answer",
                                                  "answer", "answer"]  # fmt: skip
    assert digest(runs) == GOLDEN_CHAR


def test_search_r1_records_are_unchanged_bpe_tokenizer(bpe):
    assert digest(golden_runs(bpe)) == GOLDEN_BPE


# ------------------------------------------------------------------------- the other protocols

DOCS = {  # id: title, url, date, text: the misinformation page disagrees
    "p1": ("Tavi Morek", "https://tinypedia.org/wiki/Tavi_Morek", "2011-03-09", "Tavi Morek was born in Velor."),
    "p2": ("Velor", "https://tinypedia.org/wiki/Velor", "2009-01-02", "Velor is a city of Ostland."),
    "r1": ("Tavi Morek facts", "https://rumormill.net/tavi", "2020-05-05", "Tavi Morek was born in Kesh, sources say."),
}


class FakeWeb:
    """search/web.py's web_search / read result shapes over DOCS; every batched call is logged."""

    def __init__(self):
        self.calls = []

    def search(self, queries):
        self.calls.append(("search", list(queries)))
        out = []
        for q in queries:
            words = [w.lower() for w in q.split() if ":" not in w]
            site = next((w[5:] for w in q.split() if w.startswith("site:")), "")
            if not words:
                out.append({"query": q, "results": [], "error": "the query has no search words, only operators"})
                continue
            hits = [
                {"id": i, "title": t, "url": u, "date": d, "domain": u.split("/")[2], "snippet": x, "score": 1.0}
                for i, (t, u, d, x) in DOCS.items()
                if any(w in (t + " " + x).lower() for w in words) and (not site or site in u)
            ]
            out.append({"query": q, "results": hits, "error": None})
        return out

    def read(self, ids):
        self.calls.append(("read", list(ids)))
        return [
            {"id": i, "title": DOCS[i][0], "url": DOCS[i][1], "date": DOCS[i][2], "text": DOCS[i][3], "error": None}
            if i in DOCS
            else {"id": i, "error": f"no document with id or url {i!r}"}
            for i in ids
        ]

    def tools(self):
        return {"search": self.search, "read": self.read}


CHAT_TEMPLATE = (  # Qwen2.5's layout (system + tools, user, assistant, tool as <tool_response> in a user turn)
    "{% if tools %}{{ '<|im_start|>system\\n' }}{% if messages[0].role == 'system' %}"
    "{{ messages[0].content + '\\n\\n' }}{% endif %}{{ '# Tools\\n<tools>\\n' }}{% for t in tools %}"
    "{{ t | tojson }}{{ '\\n' }}{% endfor %}{{ '</tools><|im_end|>\\n' }}"
    "{% elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{% endif %}{% for m in messages %}"
    "{% if m.role == 'user' %}{{ '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{% elif m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + m.content + '<|im_end|>\\n' }}"
    "{% elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + "
    "'\\n</tool_response><|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    """An "instruct" tokenizer: the BPE plus <|im_start|> / <|im_end|> and a chat template."""
    from tiny.sft import train_tokenizer

    texts = ["Tavi Morek was born in the city of Velor. Doc Title information result answer " * 5] * 10
    tok = train_tokenizer(texts, 300, tmp_path_factory.mktemp("chat"))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def question(k="q1"):
    return {"id": k, "question": f"[{k}] Where was Tavi Morek born?", "golden_answers": ["Velor"]}


def run(tok, protocol, turns, tools=None, group_size=1, **cfg_kw):
    """One question rolled out with the scripted turns; returns (records, engine, tools)."""
    cfg = RolloutConfig(protocol=protocol, max_turns=cfg_kw.pop("max_turns", 3), max_tokens_per_turn=400,
                        max_model_len=4096, **cfg_kw)  # fmt: skip
    web = FakeWeb()
    engine = ScriptedEngine(tok, {"q1": turns})
    records = rollout_batch(engine, tok, [question()], group_size, tools or web.tools(), cfg, seed=5)
    return records, engine, web


def check_bookkeeping(r, tok, engine):
    """loss_mask 1 exactly on the policy's tokens, kept as generated; 0 (and logprob 0) on the rest."""
    assert len(r["response_ids"]) == len(r["loss_mask"]) == len(r["logprobs"])
    policy_ids = []
    for c in r["chunks"]:
        ids = r["response_ids"][c["start"] : c["end"]]
        assert tok.decode(ids) == c["text"]
        if c["role"] == "policy":
            assert set(r["loss_mask"][c["start"] : c["end"]]) == {1}
            policy_ids += ids
        else:
            assert set(r["loss_mask"][c["start"] : c["end"]]) == {0}
            assert set(r["logprobs"][c["start"] : c["end"]]) == {0.0}
    assert sum(r["loss_mask"]) == len(policy_ids)
    assert [c["start"] for c in r["chunks"][1:]] == [c["end"] for c in r["chunks"][:-1]]
    if all(call["n"] == 1 for call in engine.calls):  # one rollout: its turns are all the engine's outputs
        assert policy_ids == [i for out in engine.outputs for i in out.token_ids]  # exactly as generated
        assert [lp for lp, m in zip(r["logprobs"], r["loss_mask"]) if m] == [
            lp for out in engine.outputs for lp in out.logprobs]  # fmt: skip


def tool_texts(r):
    return [c["text"] for c in r["chunks"] if c["role"] == "tool"]


# ---- good trajectories


def test_bapo_good_trajectory(bpe):
    turns = ["<think> look it up</think><search> Tavi Morek born</search>",
             "<think> the result says Velor</think><answer> So it is \\boxed{Velor} </answer>"]  # fmt: skip
    (r,), engine, web = run(bpe, "bapo", turns, tools=lambda qs: [f"Doc 1(Title: {q}) born in Velor." for q in qs])
    check_bookkeeping(r, bpe, engine)
    assert engine.calls[0]["stop"] == ["</search>", "</answer>"]
    assert tool_texts(r) == ["\n<result>Doc 1(Title: Tavi Morek born) born in Velor.</result>\n"]
    assert r["finish"] == "answer" and r["answer"] == "Velor" and r["idk"] is False and r["protocol"] == "bapo"
    assert r["tool_calls"] == [{"turn": 1, "name": "search", "query": "Tavi Morek born",
                                "result": "Doc 1(Title: Tavi Morek born) born in Velor."}]  # fmt: skip
    p = parsed(r)
    assert p.answer == "Velor" and p.format_ok and p.queries == ["Tavi Morek born"]
    prompt = bpe.decode(r["prompt_ids"])
    assert "\\boxed{}" in prompt and "<result>" in prompt and "I DON'T KNOW" not in prompt
    assert score([r], "bapo")[0]["reward"] == 1.0  # char-F1 1, valid format


def test_bapo_reliable_prompt_and_idk(bpe):
    turns = ["<think> nothing known</think><answer> \\boxed{I DON'T KNOW} </answer>"]
    records, _, _ = run(bpe, "bapo", turns, group_size=4, allow_idk=True)
    assert "\\boxed{I DON'T KNOW}" in bpe.decode(records[0]["prompt_ids"])
    assert all(r["idk"] and r["answer"] == "I DON'T KNOW" for r in records)
    # no rollout of the group is right, and it agrees (1 distinct answer < G/2): the IDK bonus (eq. 5-6)
    assert [r["reward"] for r in score(records, "bapo")] == [0.5] * 4


def test_deliberative_good_trajectory_search_read_confidence(bpe):
    turns = ["<think> not sure</think><confidence> 3 </confidence><search> Tavi Morek</search>",
             "<think> p1 looks right</think><confidence> 5 </confidence><read> p1 </read>",
             "<think> it says Velor</think><confidence> 9 </confidence><answer> Velor </answer>"]  # fmt: skip
    (r,), engine, web = run(bpe, "deliberative", turns)
    check_bookkeeping(r, bpe, engine)
    assert engine.calls[0]["stop"] == ["</search>", "</read>", "</answer>"]
    assert tool_texts(r) == [
        "\n<result>[p1] Tavi Morek\n[r1] Tavi Morek facts</result>\n",  # sources: ids and titles
        "\n<result>[p1] Tavi Morek\nTavi Morek was born in Velor.</result>\n",  # one source read
    ]
    assert web.calls == [("search", ["Tavi Morek"]), ("read", ["p1"])]
    assert [(c["name"], c.get("query", c.get("id")), c["confidence"]) for c in r["tool_calls"]] == [
        ("search", "Tavi Morek", 3), ("read", "p1", 5)]  # fmt: skip
    assert (r["answer"], r["confidence"], r["num_searches"], r["num_reads"], r["invalid_actions"]) == (
        "Velor", 9, 1, 1, [])  # fmt: skip
    p = parsed(r)
    assert (p.answer, p.confidence) == ("Velor", 9)
    m = metrics.behaviour_metrics([r])
    assert (m["searches"], m["reads"], m["turns"]) == (1.0, 1.0, 3.0)
    out = score([r], "deliberative")[0]
    assert out["reward_components"]["acc"] == 1.0 and out["reward_components"]["confidence"] == 9.0


def test_deliberative_final_confidence_only_scores_full_reward(bpe):
    turns = ["<think> x</think><search> Tavi Morek</search>",
             "<think> Velor</think><confidence> 9 </confidence><answer> Velor </answer>"]  # fmt: skip
    (r,), _, _ = run(bpe, "deliberative", turns)
    out = score([r], "deliberative")[0]
    # rewards: float64 sums of a few weighted terms, exact up to ~1e-16 (approx: rel 1e-6, abs 1e-12)
    assert out["reward_components"]["format"] == 1.0 and out["reward"] == pytest.approx(1.0)


@pytest.mark.parametrize("protocol", ["search_r1", "deliberative"])
def test_confidence_after_answer_is_the_policys_own_continuation(bpe, protocol):
    """rollout.confidence_after_answer: after </answer> the same turn goes on to </confidence>."""
    turns = ["<think> x</think><search> Tavi Morek</search>", "<think> Velor</think><answer> Velor</answer>",
             "<confidence> 3</confidence>"]  # fmt: skip
    (r,), engine, _ = run(bpe, protocol, turns, confidence_after_answer=True)
    check_bookkeeping(r, bpe, engine)  # the digit is trained (loss_mask 1), its logprobs as sampled
    assert engine.calls[-1]["stop"] == ["</confidence>"] and engine.calls[-1]["max_tokens"] == [400]
    assert r["chunks"][-1]["text"].endswith("<answer> Velor</answer><confidence> 3</confidence>")
    assert (r["finish"], r["turns"], r["answer"]) == ("answer", 2, "Velor")  # no extra turn
    assert parsed(r).confidence == 3 and parsed(r).format_ok
    out = score([r], "deliberative", {"lam": 0.5})[0]["reward_components"]
    assert (out["format"], out["acc"], out["confidence"], out["reliability"]) == (1.0, 1.0, 3.0, 0.0)
    (plain,), engine, _ = run(bpe, protocol, turns)  # off (the default): the answer ends the rollout
    assert parsed(plain).confidence is None and len(engine.calls) == 2


@pytest.mark.parametrize("continuation", ["<confidence> high</confidence>", "</confidence>", ""])
def test_a_bad_confidence_after_the_answer_is_a_format_failure(bpe, continuation):
    turns = ["<think> Velor</think><answer> Velor</answer>", continuation or ("<confidence> 9", "length")]
    (r,), _, _ = run(bpe, "search_r1", turns, confidence_after_answer=True)
    assert r["finish"] == "answer" and r["answer"] == "Velor"
    out = score([r], "deliberative", {"lam": 0.5})[0]
    assert out["reward_components"]["format"] == 0.0 and out["reward"] == 0.0


def test_deliberative_reward_accepts_step_confidences(bpe):
    turns = ["<think> x</think><confidence> 3 </confidence><search> Tavi Morek</search>",
             "<think> Velor</think><confidence> 9 </confidence><answer> Velor </answer>"]  # fmt: skip
    (r,), _, _ = run(bpe, "deliberative", turns)
    assert score([r], "deliberative")[0]["reward_components"]["format"] == 1.0


WF_CALL = ('<think> check a trusted site</think><tool_call>{"name": "search", "arguments": {"queries": '
           '["Tavi Morek born site:tinypedia.org", "Velor city"]}}</tool_call>')  # fmt: skip
WF_ANSWER = "<think> tinypedia says Velor</think><answer> Velor </answer>"
WF_BODY = (
    "Results for Tavi Morek born site:tinypedia.org:\n"
    "[1] Tavi Morek | https://tinypedia.org/wiki/Tavi_Morek | 2011-03-09\nTavi Morek was born in Velor.\n"
    "Results for Velor city:\n"
    "[1] Tavi Morek | https://tinypedia.org/wiki/Tavi_Morek | 2011-03-09\nTavi Morek was born in Velor.\n"
    "[2] Velor | https://tinypedia.org/wiki/Velor | 2009-01-02\nVelor is a city of Ostland."
)


def test_webfilter_good_trajectory_plain_prompt(bpe):
    (r,), engine, web = run(bpe, "webfilter", [WF_CALL, WF_ANSWER], max_obs_tokens=1000)
    check_bookkeeping(r, bpe, engine)
    assert engine.calls[0]["stop"] == ["</tool_call>", "</answer>"]
    assert tool_texts(r) == ["\n<tool_response>\n" + WF_BODY + "\n</tool_response>\n"]
    assert web.calls == [("search", ["Tavi Morek born site:tinypedia.org", "Velor city"])]  # one batched call
    assert [c["query"] for c in r["tool_calls"]] == ["Tavi Morek born site:tinypedia.org", "Velor city"]
    assert r["num_searches"] == 2 and r["answer"] == "Velor"
    assert "<|im_start|>" not in bpe.decode(r["prompt_ids"]) and "at most 3 queries" in bpe.decode(r["prompt_ids"])
    p = parsed(r)
    assert p.format_ok and p.queries == ["Tavi Morek born site:tinypedia.org", "Velor city"]
    out = score([r], "webfilter")[0]
    # float64, 0.4 z + 0.4 F1: exact up to ~1e-16 (approx: rel 1e-6, abs 1e-12)
    assert out["reward_components"]["src"] == 1.0 and out["reward"] == pytest.approx(0.8)


def test_webfilter_chat_template_tool_message(chat_tok):
    (r,), engine, web = run(chat_tok, "webfilter", [WF_CALL, WF_ANSWER], chat_template=True, max_obs_tokens=1000)
    check_bookkeeping(r, chat_tok, engine)
    prompt = chat_tok.decode(r["prompt_ids"])
    assert prompt.startswith("<|im_start|>system\nAnswer the question with the help of a web search tool")
    assert '"name": "search"' in prompt  # the tool schema went through the model's own template
    assert prompt.endswith("[q1] Where was Tavi Morek born?<|im_end|>\n<|im_start|>assistant\n")
    # the observation is a tool message: close the policy's turn, the tool's turn, reopen the policy's
    assert tool_texts(r) == ["<|im_end|>\n<|im_start|>user\n<tool_response>\n" + WF_BODY
                             + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"]  # fmt: skip
    im_end = chat_tok.convert_tokens_to_ids("<|im_end|>")
    tool = r["chunks"][1]
    assert r["response_ids"][tool["start"]] == im_end  # one special token, and masked
    # the rewards read the transcript in the protocol's tags, without the template's markup
    assert r["response"] == WF_CALL + "\n<tool_response>\n" + WF_BODY + "\n</tool_response>\n" + WF_ANSWER
    assert parsed(r).format_ok
    assert score([r], "webfilter")[0]["reward"] == pytest.approx(0.8)  # float64, a few terms: ~1e-16


def test_search_r1_with_chat_template(chat_tok):
    turns = ["<think> a</think><search> Tavi Morek</search>", "<think> b</think><answer> Velor</answer>"]
    (r,), engine, _ = run(chat_tok, "search_r1", turns, chat_template=True,
                          tools=lambda qs: ["Doc 1(Title: T) born in Velor."] * len(qs))  # fmt: skip
    check_bookkeeping(r, chat_tok, engine)
    assert chat_tok.decode(r["prompt_ids"]).startswith("<|im_start|>system\nAnswer the question. Reason inside")
    assert tool_texts(r) == ["\n<information>Doc 1(Title: T) born in Velor.</information>\n"]  # inline, as Search-R1
    assert set(r) == set(rollout_batch(ScriptedEngine(chat_tok, {"q1": turns}), chat_tok, [question()], 1,
                                       lambda qs: ["x"] * len(qs), RolloutConfig())[0])  # fmt: skip
    assert r["answer"] == "Velor" and "protocol" not in r


# ---- malformed actions: an invalid-action observation (a turn spent) or a format failure, never a crash

BAD = {  # protocol, bad turn, what the observation says
    "json": ("webfilter", '<think> x</think><tool_call>{"name": "search", "arguments": {"queries": ["a"]}</tool_call>',
             "not JSON"),
    "not_json": ("webfilter", "<think> x</think><tool_call>search Tavi</tool_call>", "not JSON"),
    "unknown_tool": ("webfilter", '<think> x</think><tool_call>{"name": "browse", "arguments": {"url": "x"}}'
                     "</tool_call>", "unknown tool 'browse'"),
    "queries_not_strings": ("webfilter", '<think> x</think><tool_call>{"name": "search", "arguments": '
                            '{"queries": [1, 2]}}</tool_call>', "list of non-empty strings"),
    "unopened_call": ("webfilter", "<think> x</think></tool_call>", "not JSON"),
    "confidence_11": ("deliberative", "<think> x</think><confidence> 11 </confidence><search> Tavi</search>",
                      "from 1 to 10, not '11'"),
    "confidence_word": ("deliberative", "<think> x</think><confidence>high</confidence><read> p1 </read>",
                        "from 1 to 10"),
    "read_missing_id": ("deliberative", "<think> x</think><confidence> 4 </confidence><read> p99 </read>",
                        "read failed: no document with id or url 'p99'"),
    "read_empty": ("deliberative", "<think> x</think><read> </read>", "empty or unopened <read> block"),
    "search_empty": ("deliberative", "<think> x</think><search>  </search>", "empty or unopened <search> block"),
    "bapo_search_empty": ("bapo", "<think> x</think><search></search>", "empty search"),
    "boxed_missing": ("bapo", "<think> x</think><answer> Velor </answer>", "\\boxed{}"),
    "boxed_nested": ("bapo", "<think> x</think><answer> \\boxed{\\boxed{Velor}} </answer>", "\\boxed{}"),
    "boxed_unclosed": ("bapo", "<think> x</think><answer> \\boxed{Velor </answer>", "\\boxed{}"),
    "boxed_empty": ("bapo", "<think> x</think><answer> \\boxed{ } </answer>", "\\boxed{}"),
}  # fmt: skip
GOOD_END = {
    "webfilter": "<think> y</think><answer> Velor </answer>",
    "deliberative": "<think> y</think><confidence> 6 </confidence><answer> Velor </answer>",
    "bapo": "<think> y</think><answer> \\boxed{Velor} </answer>",
}
REWARD = {"webfilter": "webfilter", "deliberative": "deliberative", "bapo": "bapo"}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_action_gets_invalid_observation_and_costs_a_turn(bpe, case):
    protocol, bad, says = BAD[case]
    (r,), engine, web = run(bpe, protocol, [bad, GOOD_END[protocol]], max_turns=2)
    check_bookkeeping(r, bpe, engine)
    (obs,) = tool_texts(r)
    head, tail = protocols.PROTOCOLS[protocol].obs
    assert obs.startswith(head + "Invalid action: ") and obs.endswith("Try again." + tail)
    assert says in obs, obs
    assert r["turns"] == 2 and r["finish"] == "answer" and len(r["invalid_actions"]) == 1
    assert r["invalid_actions"][0]["turn"] == 1 and r["tool_calls"] == [] and r["num_searches"] == 0
    assert web.calls == ([("read", ["p99"])] if case == "read_missing_id" else [])  # nothing else ran
    # the parser the rewards use also sees the damage where it can: a call that is not well-formed
    # JSON with queries, an answer followed by more turns, a confidence outside 1-10; an empty
    # search or read block, or a read of a missing id, followed by an observation is a well-formed
    # step (the observation told it off)
    assert parsed(r).format_ok == (case in ("read_empty", "search_empty", "bapo_search_empty", "read_missing_id"))
    out = score([r], REWARD[protocol])[0]
    if not parsed(r).format_ok:
        assert out["reward"] == -1.0 if protocol in ("webfilter", "bapo") else out["reward_components"]["format"] == 0


@pytest.mark.parametrize("protocol", ["webfilter", "deliberative", "bapo"])
def test_malformed_action_on_the_last_turn_ends_the_rollout(bpe, protocol):
    bad = {p: t for p, t, _ in BAD.values()}[protocol]
    (r,), _, web = run(bpe, protocol, [bad], max_turns=0)
    assert r["finish"] == "max_turns" and r["turns"] == 1 and tool_texts(r) == [] and web.calls == []


def test_final_confidence_outside_range_is_a_format_failure(bpe):
    turns = ["<think> sure</think><confidence> 0 </confidence><answer> Velor </answer>"]
    (r,), _, _ = run(bpe, "deliberative", turns)
    assert r["finish"] == "answer" and r["confidence"] is None
    assert score([r], "deliberative")[0]["reward_components"]["format"] == 0.0


def test_read_without_a_read_tool_is_invalid(bpe):
    turns = ["<think> x</think><read> p1 </read>", GOOD_END["deliberative"]]
    (r,), _, _ = run(bpe, "deliberative", turns, tools=lambda qs: ["hits"] * len(qs))
    assert "the read tool is not available" in tool_texts(r)[0] and r["finish"] == "answer"


def test_search_error_is_shown_not_crashed(bpe):
    """websearch's error result (a query of only operators) is the tool's answer in webfilter."""
    call = '<think> x</think><tool_call>{"name": "search", "arguments": {"query": "site:tinypedia.org"}}</tool_call>'
    (r,), _, _ = run(bpe, "webfilter", [call, GOOD_END["webfilter"]])
    assert "Search error: the query has no search words" in tool_texts(r)[0] and r["invalid_actions"] == []


# ---- truncation, query cap, batching, config


@pytest.mark.parametrize("protocol", ["search_r1", "bapo", "deliberative", "webfilter"])
@pytest.mark.parametrize("chat", [False, True])
def test_truncation_never_cuts_the_closing_tag(bpe, chat_tok, protocol, chat):
    tok = chat_tok if chat else bpe
    act = {
        "search_r1": "<think> x</think><search> Tavi</search>",
        "bapo": "<think> x</think><search> Tavi</search>",
        "deliberative": "<think> x</think><read> p1 </read>",
        "webfilter": '<think> x</think><tool_call>{"name": "search", "arguments": {"queries": ["Tavi"]}}</tool_call>',
    }
    long = "Velor " * 300
    web_hit = {"results": [{"id": "p1", "title": "T", "url": "u", "date": "d", "snippet": long}], "error": None}
    tools = {
        "search": lambda qs: [web_hit if protocol == "webfilter" else "Doc 1(Title: T) " + long for _ in qs],
        "read": lambda ids: [{"id": "p1", "title": "T", "text": long, "error": None} for _ in ids],
    }
    end = GOOD_END.get(protocol, "<think> y</think><answer> Velor</answer>")
    (r,), engine, _ = run(tok, protocol, [act[protocol], end], tools=tools, max_obs_tokens=7, chat_template=chat)
    check_bookkeeping(r, tok, engine)
    proto = protocols.PROTOCOLS[protocol]
    head, tail = tool_message_wrap(tok, proto) if chat and proto.tool_message else proto.obs
    tool = r["chunks"][1]
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert tool["text"].startswith(head) and tool["text"].endswith(tail)
    assert tool["end"] - tool["start"] == len(enc(head)) + 7 + len(enc(tail))  # exactly 7 body tokens kept
    assert parsed(r).format_ok  # the observation block is closed


def test_query_count_is_capped(bpe):
    call = ('<think> x</think><tool_call>{"name": "search", "arguments": {"queries": '
            '["Tavi a", "Tavi b", "Tavi c", "Tavi d", "Tavi e"]}}</tool_call>')  # fmt: skip
    (r,), _, web = run(bpe, "webfilter", [call, WF_ANSWER], max_queries_per_call=2)
    assert web.calls == [("search", ["Tavi a", "Tavi b"])]
    obs = tool_texts(r)[0]
    assert obs.startswith("\n<tool_response>\n(only the first 2 of 5 queries were run)\nResults for Tavi a")
    assert r["num_searches"] == 2 and "at most 2 queries" in bpe.decode(r["prompt_ids"])


def test_one_batched_tool_call_per_turn(bpe):
    turns = ["<think> a</think><confidence> 3 </confidence><search> Tavi</search>",
             "<think> b</think><confidence> 5 </confidence><read> p1 </read>", GOOD_END["deliberative"]]  # fmt: skip
    records, _, web = run(bpe, "deliberative", turns, group_size=3)
    assert web.calls == [("search", ["Tavi"] * 3), ("read", ["p1"] * 3)]
    assert [r["finish"] for r in records] == ["answer"] * 3


def test_protocol_is_a_config_key():
    assert load_config(None, ["rollout.protocol=webfilter", "rollout.max_queries_per_call=5"]).rollout.protocol == (
        "webfilter")  # fmt: skip
    with pytest.raises(ConfigError, match="rollout.protocol"):
        rollout_batch(None, CharTokenizer(), [question()], 1, lambda q: q, RolloutConfig(protocol="nope"))


def test_every_protocol_prompt_is_our_own_and_plain_by_default():
    assert render_prompt("Who?") == SEARCH_R1_TEMPLATE.format(question="Who?")
    for name in protocols.PROTOCOLS:
        text = render_prompt(" Who? ", cfg=RolloutConfig(protocol=name))
        assert text.endswith(" Question: Who?\n") and "{max_queries}" not in text
        assert "<answer>" in text


def test_max_turns_counts_searches_as_search_r1_does(bpe):
    # issue 23.7: Search-R1's run_llm_loop runs max_turns turns that may search, then a final
    # generation that may not: max_turns = 2 allows two searches and the answer after them
    search = "<think> look</think><search> Tavi Morek born</search>"
    answer = "<think> Velor</think><answer> Velor </answer>"
    (r,), _, _ = run(bpe, "search_r1", [search, search, answer], max_turns=2)
    assert r["finish"] == "answer" and r["num_searches"] == 2 and r["turns"] == 3
    (r,), _, _ = run(bpe, "search_r1", [search, search, search], max_turns=2)
    assert r["finish"] == "max_turns" and r["num_searches"] == 2  # the third search is not run
