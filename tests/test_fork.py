"""A fork registers a protocol in one place (issue 56): `agent/protocols.PROTOCOLS`. rollout.protocol's
choices, the rewards' query split, the tiny teacher's tokens and answers, and the world's cache key all
follow that table, and no other file lists the protocols' names. The metrics tell a parallel search
call (one turn, two queries) from two sequential searches, in training and in eval."""

import ast
import dataclasses

import pytest
from conftest import ROOT
from protocol_script import run  # bpe: conftest.py's fixture

from agent import protocols
from agent.answers import parse_response, parsed
from eval import summarize
from report.metrics import batch_metrics, behaviour_metrics, search_counts
from rewards import RANGES, REWARDS, TURN_RANGES, bapo, score, stepsearch
from search.tools import make_search_fn
from tiny.sft import train_tokenizer
from tiny.teachers import render
from tiny.world import FIRST_OPTIONS, data_key, world_key
from trainer.config import PROTOCOLS, ConfigError, SFTConfig, WorldConfig, load_config

SKIP = {"tests", "configs", ".venv"}


def _name_lists(tree: ast.AST) -> list[tuple[int, list[str]]]:
    """Literal tuples / lists / sets / dict keys holding two or more protocol names."""
    found = []
    for node in ast.walk(tree):
        items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) or not items:
            continue
        names = [n.value for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        if len(names) >= 2 and set(names) <= set(protocols.PROTOCOLS):
            found.append((node.lineno, names))
    return found


def test_no_file_but_the_table_lists_the_protocols():
    hits = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP or rel.as_posix() == "agent/protocols.py":
            continue
        hits += [f"{rel}:{line} lists {names}" for line, names in _name_lists(ast.parse(path.read_text()))]
    assert not hits, hits
    # the scan can see a list: the table itself is one
    assert _name_lists(ast.parse(ROOT.joinpath("agent/protocols.py").read_text()))


@pytest.fixture
def parallel(monkeypatch):
    """A throwaway ParallelSearch-style protocol, registered by one entry and nothing else."""
    base = protocols.PROTOCOLS["search_r1"]

    def parse(text, cfg):  # Search-R1's turn, its search block split into independent queries
        act = protocols.parse_search_r1(text, cfg)
        queries = [q.strip() for c in act.get("calls", []) for q in c["query"].split(" ## ")]
        return act | {"calls": [{"name": "search", "query": q} for q in queries]} if act.get("calls") else act

    proto = dataclasses.replace(
        base, name="parallel", parse=parse, query_sep=" ## ", tokens=("<search>", "</search>"),
        teach=lambda think, action, arg, conf, after: f"<think> {think}</think><{action}> {arg} ## {arg}</{action}>",
    )  # fmt: skip
    monkeypatch.setitem(protocols.PROTOCOLS, "parallel", proto)
    return proto


def test_a_new_protocol_is_one_entry_in_the_table(parallel):
    assert PROTOCOLS is protocols.PROTOCOLS  # the config checks against the table itself
    assert load_config(None, ["rollout.protocol=parallel"]).rollout.protocol == "parallel"
    with pytest.raises(ConfigError, match="'rollout.protocol' must be one of search_r1, .*parallel; got 'nope'"):
        load_config(None, ["rollout.protocol=nope"])
    # the rewards' parser splits its searches into queries; other protocols' records keep one query
    text = "<think>a</think><search> P born ## Q born </search><information>..</information><think>b</think>"
    assert parsed({"protocol": "parallel", "response": text}).queries == ["P born", "Q born"]
    assert parsed({"response": text}).queries == ["P born ## Q born"] == parse_response(text).queries
    # the teacher writes its turns, and its tokenizer knows its tags
    assert render("parallel", "go", "search", "P born", None) == "<think> go</think><search> P born ## P born</search>"
    assert protocols.get("parallel").tokens == ("<search>", "</search>")
    # its world has a key of its own; search_r1's keeps its own
    cfg = load_config("configs/tiny.yaml")
    key = world_key(cfg)
    cfg.rollout.protocol = "parallel"
    assert world_key(cfg) != key and data_key(cfg) == data_key(load_config("configs/tiny.yaml"))


def test_the_tools_of_an_unknown_protocol_are_refused_not_guessed(tmp_path):
    cfg = load_config(None)
    cfg.rollout.protocol = "nope"  # past load_config's check, as a script that never imported the table would be
    with pytest.raises(ConfigError, match="'rollout.protocol' 'nope' is not in agent/protocols.py's table"):
        make_search_fn(cfg, tmp_path / "corpus.jsonl", {})


def test_a_later_option_is_keyed_only_away_from_its_default(monkeypatch):
    """A new world or SFT option needs no list: at its default the key is the one before it existed."""
    cfg = load_config("configs/tiny.yaml")
    key, data = world_key(cfg), data_key(cfg)
    extended = dataclasses.make_dataclass("SFTConfig", [("p_new_flaw", float, 0.0)], bases=(SFTConfig,))
    cfg.sft = extended(**vars(cfg.sft))
    assert world_key(cfg) == key
    cfg.sft.p_new_flaw = 0.1
    assert world_key(cfg) != key and data_key(cfg) == data
    world = dataclasses.make_dataclass("WorldConfig", [("comparison_frac", float, 0.0)], bases=(WorldConfig,))
    cfg.world = world(**vars(cfg.world))
    assert data_key(cfg) == data
    cfg.world.comparison_frac = 0.2
    assert data_key(cfg) != data
    assert "comparison_frac" not in FIRST_OPTIONS


def test_the_tokenizer_takes_the_protocols_tags(tmp_path, parallel):
    tok = train_tokenizer(["<think> a </think> b c"] * 4, 300, tmp_path, protocols.get("deliberative").tokens)
    assert len(tok.encode("<read>", add_special_tokens=False)) == 1


def docs(queries):
    return [f"Doc 1(Title: {q}) {q.split()[0]} was born in Velor." for q in queries]


ANSWER = "<think> both in Velor</think><answer> yes</answer>"


def test_metrics_tell_a_parallel_call_from_sequential_searches(bpe, parallel):
    (par,), _, _ = run(bpe, "parallel", ["<think> two people</think><search> Tavi born ## Ari born</search>", ANSWER],
                       tools=docs)  # fmt: skip
    one, two = "<think> one</think><search> Tavi born</search>", "<think> two</think><search> Ari born</search>"
    (seq,), _, _ = run(bpe, "search_r1", [one, two, ANSWER], tools=docs)
    assert [c["query"] for c in par["tool_calls"]] == ["Tavi born", "Ari born"] and parsed(par).format_ok
    assert par["num_searches"] == seq["num_searches"] == 2  # the query count alone reads them the same
    assert search_counts(par) == (1, 2) and search_counts(seq) == (2, 2)
    par["metadata"], seq["metadata"] = {"type": "compare"}, {"type": "2hop"}
    records = score([par, seq], "em")
    row = batch_metrics(records)
    assert (row["search_turns"], row["search_queries"], row["searches_per_question"]) == (1.5, 2.0, 2.0)
    assert (row["search_turns_compare"], row["search_turns_2hop"], row["search_queries_compare"]) == (1, 2, 2)
    m = summarize(records)
    assert (m["search_turns_compare"], m["search_queries_compare"], m["searches_compare"]) == (1, 2, 2)
    assert (m["search_turns_2hop"], m["search_queries_2hop"], m["searches_2hop"]) == (2, 2, 2)
    assert behaviour_metrics(records)["search_turns"] == 1.5
    # without a tool log the response is read: the protocol's split gives the queries
    assert search_counts({"protocol": "parallel", "response": par["response_text"]}) == (1, 2)


@pytest.mark.parametrize(("value", "error"), [("all", None), ("64", None), ("-1", "must be >= 0; got -1"),
                                              ("some", "wants a whole number or all, got 'some'")])  # fmt: skip
def test_samples_per_step_may_be_all_to_audit_every_mask(value, error):
    if error is None:
        assert load_config(None, [f"train.samples_per_step={value}"]).train.samples_per_step in ("all", 64)
        return
    with pytest.raises(ConfigError, match=f"config key 'train.samples_per_step' {error}"):
        load_config(None, [f"train.samples_per_step={value}"])


def test_a_rewards_range_is_said_on_its_function():
    """README "Fork a reward": a line in REWARDS, and `fn.range` if it leaves [0, 1]; RANGES (which
    tests/test_rewards_properties.py holds every reward to) and TURN_RANGES read it."""
    assert bapo.range == RANGES["bapo"] == (-1.0, 1.5) and stepsearch.turn_range == TURN_RANGES["stepsearch"]
    assert RANGES == {name: getattr(fn, "range", (0.0, 1.0)) for name, fn in REWARDS.items()}
    assert RANGES["em"] == (0.0, 1.0) and set(TURN_RANGES) == {"turn_hit", "stepsearch", "ig_search"}
    assert "`fn.range = (lo, hi)` if it leaves [0, 1]" in ROOT.joinpath("README.md").read_text()
