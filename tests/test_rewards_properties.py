"""Property tests: arbitrary and adversarial model output never crashes a reward, and every
reward stays finite and inside its documented range (rewards.RANGES)."""

import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.answers import parse_response
from agent.bapo import bapo_resample_groups
from report.metrics import compute_metrics
from rewards import RANGES, REWARDS, compute

TAGS = ["<think>", "</think>", "<search>", "</search>", "<information>", "</information>", "<answer>",
        "</answer>", "<confidence>", "</confidence>", "<tool_call>", "</tool_call>", "<tool_response>",
        "</tool_response>", "<read>", "</read>", "\\boxed{", "}", "{", '"', "I DON'T KNOW", "Velor", "site:",
        " AND ", " or ", "-", "10", "0", "11", "\n"]  # fmt: skip
JSON_NOT_OBJECTS = ["[1, 2]", '"query"', "null", "3", '{"arguments": "x"}', '{"arguments": {"query": 5}}',
                    '{"arguments": {"query": [1, "a"]}}', "{", "[" * 500]  # fmt: skip

pieces = st.one_of(st.sampled_from(TAGS), st.text(max_size=20), st.sampled_from(JSON_NOT_OBJECTS))
responses = st.one_of(
    st.lists(pieces, max_size=40).map("".join),
    st.text(max_size=300),  # arbitrary unicode
    st.sampled_from(JSON_NOT_OBJECTS).map(lambda j: f"<think>x</think><tool_call>{j}</tool_call><answer>a</answer>"),
)
golden = st.one_of(st.lists(st.text(max_size=10), max_size=3), st.just(["Velor"]), st.none(), st.integers())


def check(records, params=None):
    for name in REWARDS:
        lo, hi = RANGES[name]
        if name == "deliberative":
            hi = 1.0 + (params or {}).get("lam", 0.0)
        for out in compute([dict(r) for r in records], name, params):
            # 1e-9: a float64 sum of a few weighted terms may round past its range by ~1e-16
            assert math.isfinite(out["reward"]) and lo - 1e-9 <= out["reward"] <= hi + 1e-9, (name, out)
            json.dumps(out)  # components serialise


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(responses, golden), min_size=1, max_size=6), st.floats(0, 2))
def test_every_reward_is_finite_and_in_range(rows, lam):
    records = [{"response": t, "golden_answers": g, "group_id": "g", "question": "q"} for t, g in rows]
    check(records, {"lam": lam, "stage": "plateau"})
    check(records, {"stage": "exploration", "idk_ratio": 0.0})
    bapo_resample_groups(records)
    json.dumps(compute_metrics(records))  # every metric of any input, serialisable


def test_huge_nested_and_non_string_inputs():
    huge = "<think>" + "a" * 100_000 + "</think><answer>" + "Velor " * 20_000 + "</answer>"
    nested = "<answer>" * 5_000 + "Velor" + "</answer>" * 5_000
    repeated = "<think>x</think><search>q</search>" * 3_000
    records = [{"response": t, "golden_answers": ["Velor"], "group_id": "g"} for t in (huge, nested, repeated)]
    records += [{"response": None, "golden_answers": ["Velor"]}, {"golden_answers": "Velor"}, {"response": 42}]
    check(records, {"lam": 0.5})
    assert parse_response("<answer>" * 5_000 + "x").answer is None
