"""Tree rollouts (Tree-GRPO: Ji et al., "Tree Search for LLM Agent Reinforcement Learning", arXiv
2509.21240; its code AMAP-ML/Tree-GRPO 90b1709, search_r1/llm_agent/generation_ts.py and tree_node.py).

A node is one whole agent step: the policy's turn (think + search) and the observation it got back.
Per question (docs/tree.md):

    1. grow M = rollout.tree_m chains (trees), each the same tool loop as rollout.py's;
    2. L = rollout.tree_l times: in each tree draw N = rollout.tree_n nodes that are not leaves (the
       root, the prompt alone, is one of them) with `choose_nodes`, and from each regrow the rest of
       the trajectory once, through the same tool loop and protocol (rollout.run_states): the branch
       is a new trajectory whose state is a copy of the node's, its prefix's tokens, loss mask and
       engine logprobs exactly the parent's;
    3. every leaf is one plain rollout record, M (1 + N L) per question, with its place in the tree:

       "tree": {"tree_id": "<group_id>/t<m>", "parent": the sample it branched from (None: the tree's
                first chain), "node": the turns it shares with that parent, "shared_prefix_len": the
                response tokens it shares with it (copied, not generated), "lineage" (branches):
                [[first turn, sample], ..] whose seeds its turns drew with}

    tree 0 of a question with M = 1, N = 2, L = 1 (the root drawn once, node 1 of sample 0 once):

       prompt ─ s0.t1 ─ s0.t2 (answer)          sample 0: the chain
          │        └─── s2.t2 ─ s2.t3 (answer)  sample 2: branched at node 1 (shares turn 1)
          └──── s1.t1 ─ s1.t2 (answer)          sample 1: branched at the root (a fresh chain)

The branching rule, as in the paper's code (tree_node.get_expand_node, expand_mode "random"): N draws
with replacement, uniform over the tree's root and its non-leaf nodes, the branches of earlier
rounds included. `choose_nodes` is the one function to replace for another rule (docs/tree.md).

Seeds: turn t of a trajectory is sampled with the seed of rollout.py's chain, keyed by the sample
that owns turn t (rollout._seed_sample): a branch's copied turns keep its parent's, its own turns
draw with its own sample id. A chain given the same lineage therefore reproduces a leaf token for
token (tests/test_tree.py), and with L = 0 the tree rollout is rollout_batch with group_size M.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from agent import protocols
from rollout import _record, _State, prompt_ids, run_states
from trainer.config import RolloutConfig


@dataclass
class Node:
    """A node of a tree: `state`'s trajectory after `turns` agent steps (0: the root, the prompt)."""

    state: _State
    turns: int


def uniform_nodes(candidates: list[Node], n: int, rng: random.Random) -> list[Node]:
    """Tree-GRPO's rule: n draws, uniform and with replacement, over the candidates (tree_node.py's
    get_expand_node: random.choices over the root and the non-leaf nodes)."""
    return rng.choices(candidates, k=n)


# The branching rule: (the tree's non-leaf nodes, how many to draw, the tree's own random stream)
# -> the nodes to regrow from (a node may come twice). Each Node's state holds the step's tokens and
# engine logprobs (state.chunks[..] spans, state.logprobs), e.g. for a highest-entropy rule.
choose_nodes: Callable[[list[Node], int, random.Random], list[Node]] = uniform_nodes


def node_end(s: _State, turns: int) -> tuple[int, int]:
    """(response tokens, chunks) of s up to node `turns`: through the observation of its turn
    `turns`. A turn is one policy chunk and, when it acted, the tool chunk after it."""
    if turns == 0:
        return 0, 0
    policy = [i for i, c in enumerate(s.chunks) if c["role"] == "policy"]
    i = policy[turns - 1] + 1  # the observation that closes the step
    return s.chunks[i]["end"], i + 1


def branch(s: _State, turns: int, sample: int) -> _State:
    """A new trajectory from node `turns` of s: a copy of s's state there (tokens, mask, logprobs,
    chunks, calls), which the tool loop continues with turn `turns` + 1 under sample's seeds."""
    end, n_chunks = node_end(s, turns)
    lineage = [(t, k) for t, k in (s.lineage or [(1, s.sample)]) if t <= turns] + [(turns + 1, sample)]
    return _State(s.question, s.group_id, sample, s.prompt_ids, s.response_ids[:end], s.loss_mask[:end],
                  s.logprobs[:end], [dict(c) for c in s.chunks[:n_chunks]],
                  [c for c in s.tool_calls if c["turn"] <= turns], [c for c in s.invalid if c["turn"] <= turns],
                  turns=turns, lineage=lineage)  # fmt: skip


def candidates(tree: list[_State], first_own: dict[int, int]) -> list[Node]:
    """The tree's nodes that are not leaves, each once: the root, then each trajectory's own steps
    (those after the node it branched at) that a later turn was generated from."""
    root = [Node(tree[0], 0)]
    return root + [Node(s, k) for s in tree for k in range(first_own[id(s)], s.turns)]


def rollout_trees(engine, tokenizer, questions: list[dict], search_fn, cfg: RolloutConfig, greedy: bool = False,
                  seed: int = 0, group_prefix: str = "") -> list[dict]:  # fmt: skip
    """rollout.rollout_batch's contract with trees for groups: M (1 + N L) leaf records per question
    (cfg.tree_m, tree_n, tree_l), per question tree by tree, each tree's first chain, then its
    branches in the order they were grown. Each round's branches of every tree run in one tool loop."""
    proto = protocols.for_config(cfg)
    trees: list[list[_State]] = []
    where: dict[int, dict] = {}  # id(state) -> its record's "tree" field
    first_own: dict[int, int] = {}  # id(state) -> its first own node (the turn after its branch point)
    for q in questions:
        ids = prompt_ids(tokenizer, q["question"], cfg, proto)
        for m in range(cfg.tree_m):
            s = _State(q, group_prefix + str(q["id"]), m, ids)
            trees.append([s])
            where[id(s)] = {"tree_id": f"{s.group_id}/t{m}", "parent": None, "node": 0, "shared_prefix_len": 0}
            first_own[id(s)] = 1
    run_states(engine, tokenizer, [t[0] for t in trees], search_fn, cfg, greedy, seed)
    next_sample = {t[0].group_id: cfg.tree_m for t in trees}
    for round_ in range(cfg.tree_l):
        grown = []
        for tree in trees:
            tree_id = where[id(tree[0])]["tree_id"]
            rng = random.Random(f"{seed}|{tree_id}|{round_}")  # the tree's own stream: no other draw moves it
            for node in choose_nodes(candidates(tree, first_own), cfg.tree_n, rng):
                b = branch(node.state, node.turns, next_sample[tree[0].group_id])
                next_sample[b.group_id] += 1
                where[id(b)] = {"tree_id": tree_id, "parent": node.state.sample, "node": node.turns,
                                "shared_prefix_len": len(b.response_ids), "lineage": b.lineage}  # fmt: skip
                first_own[id(b)] = node.turns + 1
                grown.append((tree, b))
        run_states(engine, tokenizer, [b for _, b in grown], search_fn, cfg, greedy, seed)
        for tree, b in grown:  # candidates of the next round
            tree.append(b)
    return [_record(s, tokenizer, proto) | {"tree": where[id(s)]} for tree in trees for s in tree]
