"""Agent protocols of rollout.py (search_r1, bapo, deliberative, webfilter), driven by a scripted engine.

The engine (protocol_script.py) replays fixed policy turns (what a model would write), so these
tests check the rollout bookkeeping of each protocol, not sampling: the observations it appends,
the records (loss_mask 0 exactly on observation tokens, logprobs as generated) and the parse of
the answer through answers.parsed and rewards.score, on each protocol's good trajectories, side
by side. Malformed actions, truncation, the query cap and the config: test_protocols_malformed.py.

The first test pins search_r1 (the default) to the records the code produced before protocols
existed: a hash of every record and every engine call, recorded on the unchanged rollout.py.
"""

import pytest
from protocol_script import (  # bpe, chat_tok: conftest.py's fixtures
    WF_ANSWER,
    WF_BODY,
    WF_CALL,
    CharTokenizer,
    ScriptedEngine,
    check_bookkeeping,
    digest,
    question,
    run,
    tool_texts,
)

from agent.answers import parsed
from report import metrics
from rewards import score
from rollout import rollout_batch
from trainer.config import RolloutConfig

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
