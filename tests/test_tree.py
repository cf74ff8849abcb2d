"""Tree rollouts (rollout_tree.py) and Tree-GRPO's advantages (trainer/tree.py).

A tree with no regrowth (rollout.tree_l 0) is chain GRPO: the same records as rollout_batch and,
through train.update_stage, the same loss and gradient bits. A leaf of a grown tree is the
trajectory a chain rollout with the leaf's per-turn seeds produces: the same tokens and loss mask,
its shared prefix's engine logprobs copied exactly from its parent.
"""

import html
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT
from numerics import assert_close, logprob_atol, model_vocab
from test_masking import roll, setup

import rollout_tree
from report.viewer import render
from rollout import _record, _State, prompt_ids, rollout_batch, run_states
from search.tools import make_search_fn
from train import update_stage
from trainer.config import ConfigError, load_config
from trainer.engine import load_tokenizer
from trainer.tree import tree_advantages

DOC = "Doc 1(Title: P) P was born in the city of C."


def _loss_and_grad(tok, cfg, model, records):
    model.zero_grad()
    p = SimpleNamespace(cfg=cfg, tokenizer=tok, model=model, ref=None, rank=0, world=1, main=False,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.0))  # fmt: skip
    stats = update_stage(p, records, 0)
    return stats["loss"], [q.grad.clone() for q in model.parameters() if q.grad is not None]


def test_a_tree_without_regrowth_trains_as_chain_grpo(tmp_path):
    """L = 0: every tree is one leaf, whose intra-tree advantage is exactly 0, so update_stage's
    loss and gradient are chain GRPO's bits (torch.equal); with two leaves a tree they differ."""
    tok, cfg, model, engine = setup(tmp_path)
    cfg.train.kl_coef, cfg.train.group_size = 0.0, 4
    base = roll(tok, cfg, engine, DOC)
    records = [dict(base, group_id="q1", sample=k, reward=float(r)) for k, r in enumerate([1, 0, 0, 1])]
    chains = [dict(r) for r in records]
    chain_loss, chain_grad = _loss_and_grad(tok, cfg, model, chains)
    cfg.rollout.tree_m = 4
    trees = [dict(r, tree={"tree_id": f"q1/t{k}"}) for k, r in enumerate(records)]
    loss, grad = _loss_and_grad(tok, cfg, model, trees)
    assert loss == chain_loss and all(torch.equal(a, b) for a, b in zip(grad, chain_grad))
    assert [r["advantage"] for r in trees] == [r["advantage"] for r in chains]
    cfg.rollout.tree_m, cfg.rollout.tree_n, cfg.rollout.tree_l = 2, 1, 1
    grown = [dict(r, tree={"tree_id": f"q1/t{k // 2}"}) for k, r in enumerate([records[0], records[2], records[1],
                                                                                records[3]])]  # fmt: skip
    _, grad = _loss_and_grad(tok, cfg, model, grown)
    assert not all(torch.equal(a, b) for a, b in zip(grad, chain_grad))


def test_tree_advantages_add_the_question_and_the_tree():
    assert tree_advantages([1, 0, 0, 0], ["q"] * 4, ["t0", "t0", "t1", "t1"]) == pytest.approx(
        [1.5 + 0.7071, -0.5 - 0.7071, -0.5, -0.5], abs=1e-4)  # fmt: skip
    assert tree_advantages([1, 0], ["q", "q"], ["t0", "t1"]) == pytest.approx([0.7071, -0.7071], abs=1e-4)


@pytest.mark.parametrize("text, said", [
    ("train: {group_size: 5}\nrollout: {tree_m: 2, tree_n: 2, tree_l: 1}\n",
     r"'train.group_size' must be rollout.tree_m .* = 6"),
    ("rollout: {tree_n: 2, tree_l: 1}\n", "'rollout.tree_m' must be >= 1"),
    ("rollout: {tree_m: -1}\n", "'rollout.tree_m' must be >= 0"),
])  # fmt: skip
def test_tree_keys_are_checked_in_one_line(tmp_path, text, said):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=said):
        load_config(path)


@pytest.fixture(scope="module")
def world(micro):
    from data import data_paths
    from trainer.questions import load_questions

    _, cfg, policy, _ = micro
    calls = []
    inner = make_search_fn(cfg, data_paths(cfg)["corpus"], {})

    def search_fn(queries):
        calls.append(len(queries))
        return inner(queries)

    return cfg, load_tokenizer(policy), load_questions(data_paths(cfg)["val"])[:6], search_fn, calls


@pytest.mark.numeric
def test_tree_rollouts_grow_leaves_that_are_their_chains(vllm_engine, world, micro):
    cfg, tok, questions, search_fn, _ = world
    # L = 0: rollout_batch's records, token for token, plus the tree field
    flat = rollout_trees_of(vllm_engine, tok, questions[:3], search_fn, replace(cfg.rollout, tree_m=3))
    chains = rollout_batch(vllm_engine, tok, questions[:3], 3, search_fn, cfg.rollout, seed=5, group_prefix="v:")
    lp = logprob_atol(model_vocab(micro[2]))
    for a, b in zip(flat, chains):
        assert {k: v for k, v in a.items() if k not in ("tree", "logprobs")} == \
            {k: v for k, v in b.items() if k != "logprobs"}  # fmt: skip
        assert_close(a["logprobs"], b["logprobs"], rtol=0, atol=lp, what="L = 0 against a chain")
    # M 2, N 2, L 1: 2 (1 + 2) leaves a question
    rcfg = replace(cfg.rollout, tree_m=2, tree_n=2, tree_l=1)
    leaves = rollout_trees_of(vllm_engine, tok, questions, search_fn, rcfg)
    assert len(leaves) == 6 * len(questions)
    by_sample = {(r["group_id"], r["sample"]): r for r in leaves}
    branches = [r for r in leaves if r["tree"]["parent"] is not None]
    assert len(branches) == 4 * len(questions) and any(r["tree"]["node"] >= 1 for r in branches)
    proto_cfg = rcfg
    for r in branches:
        parent, n = by_sample[(r["group_id"], r["tree"]["parent"])], r["tree"]["shared_prefix_len"]
        assert r["tree"]["tree_id"] == parent["tree"]["tree_id"]
        # the shared prefix is the parent's, engine logprobs and mask included, bit for bit
        for key in ("response_ids", "loss_mask", "logprobs"):
            assert r[key][:n] == parent[key][:n]
        assert r["chunks"][: 2 * r["tree"]["node"]] == parent["chunks"][: 2 * r["tree"]["node"]]
    # each branch rolled out as a chain from the prompt, with the branch's per-turn seeds
    states = []
    for r in branches:
        q = next(q for q in questions if f"v:{q['id']}" == r["group_id"])
        states.append(_State(q, r["group_id"], r["sample"], prompt_ids(tok, q["question"], proto_cfg,
                                                                        rollout_tree.protocols.for_config(proto_cfg)),
                             lineage=[tuple(x) for x in r["tree"]["lineage"]]))  # fmt: skip
    run_states(vllm_engine, tok, states, search_fn, proto_cfg, seed=5)
    for r, s in zip(branches, states):
        chain = _record(s, tok, rollout_tree.protocols.for_config(proto_cfg))
        assert (chain["response_ids"], chain["loss_mask"], chain["finish"]) == \
            (r["response_ids"], r["loss_mask"], r["finish"])  # fmt: skip
        assert_close(r["logprobs"], chain["logprobs"], rtol=0, atol=lp, what="a leaf against its chain")


def rollout_trees_of(engine, tok, questions, search_fn, rcfg):
    return rollout_tree.rollout_trees(engine, tok, questions, search_fn, rcfg, seed=5, group_prefix="v:")


def test_the_viewer_groups_a_trees_leaves_and_fades_the_shared_prefix(tmp_path):
    tok, cfg, _, engine = setup(tmp_path)
    chain = roll(tok, cfg, engine, DOC)
    shared = chain["chunks"][1]["end"]  # the first step: the search and its observation
    records = [dict(chain, tree={"tree_id": "q1/t0", "parent": None, "node": 0, "shared_prefix_len": 0}),
               dict(chain, sample=1, tree={"tree_id": "q1/t0", "parent": 0, "node": 1, "shared_prefix_len": shared}),
               dict(chain, sample=2, tree={"tree_id": "q1/t1", "parent": None, "node": 0, "shared_prefix_len": 0})]
    page = render(records)
    assert page.count('<details class="tree"') == 2 and "tree q1/t0: 2 leaves" in page
    first, branch = page.split('id="r1"')[0].split('id="r0"')[1], page.split('id="r1"')[1].split('id="r2"')[0]
    assert not re.search(r'class="[^"]*\bsh\b', first)  # a first chain shares nothing
    assert "from sample 0 after step 1" in branch
    faded = "".join(re.findall(r'<span class="[^"]*\bsh\b[^"]*"[^>]*>([^<]*)</span>', branch))
    assert html.unescape(faded) == chain["chunks"][0]["text"] + chain["chunks"][1]["text"]


@pytest.mark.numeric
def test_the_fork_recipe_of_docs_tree_md_branches_where_its_rule_says(vllm_engine, world, monkeypatch):
    """docs/tree.md's branching rule, run as written: each branch regrows from the node whose next
    step had the highest mean surprisal."""
    cfg, tok, questions, search_fn, _ = world
    code = (ROOT / "docs" / "tree.md").read_text().split("```python\n")[1].split("```")[0]
    monkeypatch.setattr(rollout_tree, "choose_nodes", rollout_tree.choose_nodes)  # restored after the test
    scope: dict = {}
    exec(code, scope)
    rule = scope["least_sure_step"]
    assert rollout_tree.choose_nodes is rule
    seen, sizes = [], []

    def surprisal(node):  # the step after the node, as the recipe describes it
        c = [c for c in node.state.chunks if c["role"] == "policy"][node.turns]
        return -sum(node.state.logprobs[c["start"] : c["end"]]) / (c["end"] - c["start"])

    def watched(candidates, n, rng):
        seen.append(rule(candidates, n, rng))
        assert surprisal(seen[-1][0]) == max(surprisal(c) for c in candidates)
        sizes.append(len(candidates))
        return seen[-1]

    monkeypatch.setattr(rollout_tree, "choose_nodes", watched)
    one = replace(cfg.rollout, tree_m=1, tree_n=1, tree_l=1)
    leaves = rollout_trees_of(vllm_engine, tok, questions, search_fn, one)
    assert max(sizes) >= 2  # a choice was made somewhere
    branches = [r for r in leaves if r["tree"]["parent"] is not None]
    assert [(r["tree"]["parent"], r["tree"]["node"]) for r in branches] == \
        [(nodes[0].state.sample, nodes[0].turns) for nodes in seen]  # fmt: skip
