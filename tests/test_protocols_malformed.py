"""Malformed actions of rollout.py's protocols, driven by a scripted engine (protocol_script.py):
bad JSON, an unknown tool, a read of a missing id, an empty search, a confidence outside 1-10,
\\boxed{} nested or missing get an invalid-action observation (a turn spent) or a format failure in
the reward, never an exception. Then truncation (never inside a closing tag), the query cap, one
batched tool call per turn, and the protocol as a config key. Good trajectories: test_protocols.py.
"""

import pytest
from protocol_script import (  # bpe, chat_tok: conftest.py's fixtures
    WF_ANSWER,
    CharTokenizer,
    check_bookkeeping,
    question,
    run,
    tool_texts,
)

from agent import protocols
from agent.answers import parsed
from rewards import score
from rollout import SEARCH_R1_TEMPLATE, render_prompt, rollout_batch, tool_message_wrap
from trainer.config import ConfigError, RolloutConfig, load_config

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
