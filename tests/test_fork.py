"""A fork registers a protocol in one place (issue 56): `agent/protocols.PROTOCOLS`. rollout.protocol's
choices, the rewards' query split, the tiny teacher's tokens and answers, and the world's cache key all
follow that table, and no other file lists the protocols' names."""

import ast
import dataclasses

import pytest
from conftest import ROOT

from agent import protocols
from agent.answers import parse_response, parsed
from tiny.sft import train_tokenizer
from tiny.teachers import render
from tiny.world import FIRST_OPTIONS, data_key, world_key
from trainer.config import PROTOCOLS, ConfigError, SFTConfig, WorldConfig, load_config

# rewards.py's table names rewards, some after a paper that also names a protocol (REWARDS, RANGES)
SKIP = {"tests", "configs", ".venv", "rewards.py"}


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
    proto = dataclasses.replace(
        base, name="parallel", query_sep=" ## ", tokens=("<search>", "</search>"),
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
