"""Forks that leave the worlds that exist alone (issue 56): question types in a table (compare, the first
new one, asks two independent hops and moves no existing world's key or data), the teacher's new draws on
streams of their own (a dummy draw moves nothing), a fork's cheap start from the base's cached policy,
and docs/fork.md's "Fork a protocol" run as written."""

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections import Counter

import pytest
from conftest import ROOT, write_micro_config

from agent import protocols
from agent.answers import parsed
from eval import summarize
from report.metrics import batch_metrics, search_counts
from rewards import score
from search.tools import make_search_fn
from tiny import questions, teachers, world
from tiny.sft import base_config, ensure_tiny_policy, teacher_examples, world_search_tool
from tiny.teachers import draw_flaws, protocol_trajectories, teacher_rollouts
from tiny.world import data_key, generate_world, read_jsonl, world_dir, world_key
from trainer.config import ConfigError, WorldConfig, load_config
from trainer.engine import load_tokenizer
from trainer.precision import resolve as resolve_precision

# sha256[:16] of the micro world's data and of its teachers' trajectories, computed at e515699, before
# question types and named draws existed: what every later change must leave as it is
GOLDEN = {
    "world": "2478ba3fbf1537e8", "search_r1": "ec3a25b718de41e5", "search_r1 flawed": "615b4c6f55caa32e",
    "bapo": "768f0c3f77e476a7", "deliberative": "2a2f82cbcf12f4d4", "webfilter": "ef95082188bd9df8",
}  # fmt: skip
FLAWED = ["sft.p_site=0.2", "sft.p_idk=0.1", "sft.p_unfaithful_think=0.2", "sft.confidence=random"]


def h(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def digests(micro) -> dict:
    path, _, _, wd = micro
    cfg = load_config(path)
    w = generate_world(cfg.world)
    out = {"world": h([w.corpus, w.questions])}
    tool = world_search_tool(cfg, wd)
    out["search_r1"] = h(teacher_examples(cfg, wd, tool))
    out["search_r1 flawed"] = h(teacher_examples(load_config(path, FLAWED), wd, tool))
    qs = read_jsonl(wd / "train.jsonl")[:40]
    for name in ("bapo", "deliberative", "webfilter"):
        c = load_config(path, [f"rollout.protocol={name}", *FLAWED])
        tools = make_search_fn(c, wd / "corpus.jsonl", {})
        out[name] = h(protocol_trajectories(c, qs, tools, w.countries, list(w.city_country)))
    return out


def test_a_new_type_and_a_new_draw_leave_every_existing_world_byte_for_byte(micro, monkeypatch):
    q = read_jsonl(micro[3] / "train.jsonl")[0]
    before = draw_flaws(q, micro[1].sft, 0)
    monkeypatch.setitem(questions.QUESTION_TYPES, "dummy", lambda qid, person, split, rng: rng.random())
    monkeypatch.setitem(teachers.NAMED_DRAWS, "dummy", lambda rng, sft: rng.random())
    after = draw_flaws(q, micro[1].sft, 0)
    assert set(after.named) == {"parallel", "dummy"} and after.named["parallel"] == before.named["parallel"]
    assert dataclasses.replace(after, rng=None, named={}) == dataclasses.replace(before, rng=None, named={})
    assert digests(micro) == GOLDEN
    cfg = load_config(ROOT / "configs/tiny.yaml", ["sft.bf16=true", "world.question_types=1hop,2hop"])
    assert world_key(cfg) == "2ab02866ae47"  # tests/test_tiny_papers.py's pinned key: the default is unkeyed


def unnumbered(records: list[dict]) -> list[dict]:
    return [r | {"id": None} for r in records if r["metadata"]["type"] != "compare"]


def test_compare_questions_ask_two_independent_hops_and_move_no_other_question():
    plain = generate_world(WorldConfig(n_people=600, n_cities=30))
    both = generate_world(WorldConfig(n_people=600, n_cities=30, question_types=["1hop", "2hop", "compare"]))
    assert both.corpus == plain.corpus
    for split, qs in plain.questions.items():
        assert unnumbered(both.questions[split]) == unnumbered(qs)  # the same questions, in their order
        compare = [r for r in both.questions[split] if r["metadata"]["type"] == "compare"]
        people = {r["metadata"]["person"] for r in qs}
        assert len(compare) == len(people)
        for r in compare:
            m = r["metadata"]
            assert {m["person"], m["person2"]} <= people and m["person"] != m["person2"]  # the same split's
            assert r["question"] == f"Were {m['person']} and {m['person2']} born in the same city?"
            assert r["golden_answers"] == ["yes" if m["city"] == m["city2"] else "no"]
            assert m["gold_ids"] == [f"p{list(plain.people).index(p)}" for p in (m["person"], m["person2"])]
    answers = Counter(r["golden_answers"][0] for r in both.questions["train"] if r["metadata"]["type"] == "compare")
    assert min(answers.values()) > 0.4 * sum(answers.values())  # yes as often as no: a constant answer gains nothing
    keyed = load_config(ROOT / "configs/tiny.yaml", ["world.question_types=1hop,2hop,compare"])
    assert data_key(keyed) != data_key(load_config(ROOT / "configs/tiny.yaml"))
    with pytest.raises(ConfigError, match="'world.question_types' must list some of 1hop, 2hop, compare; got 3hop"):
        generate_world(WorldConfig(question_types=["3hop"]))
    with pytest.raises(ConfigError, match="'world.question_types' must list some of 1hop, 2hop, compare; got none"):
        load_config(None, ["world.question_types="])  # the config refuses it too, before anything starts


def recipe() -> str:
    text = ROOT.joinpath("docs/fork.md").read_text()
    block = text.split("<!-- fork-protocol -->")[1].split("<!-- /fork-protocol -->")[0]
    return block.split("```bash")[1].split("```")[0]


def heredoc(path: str) -> str:
    return recipe().split(f"{path} <<'EOF'\n")[1].split("\nEOF")[0]


@pytest.fixture
def parallel(monkeypatch):
    """docs/fork.md's protocol, its block run in agent/protocols.py's namespace (the entry undone after)."""
    monkeypatch.setitem(protocols.PROTOCOLS, "parallel", None)
    exec(heredoc("agent/protocols.py"), vars(protocols))
    return protocols.PROTOCOLS["parallel"]


def test_the_parallel_teacher_asks_a_comparisons_two_queries_in_one_call_half_the_time(micro, parallel, tmp_path):
    path = write_micro_config(tmp_path / "c.yaml", tmp_path, rollout={"protocol": "parallel"},
                              world={"question_types": ["compare"]})  # fmt: skip
    cfg = load_config(path)
    data = world.ensure_world_data(cfg, tmp_path / "data")
    w, qs = generate_world(cfg.world), read_jsonl(data / "train.jsonl")[:60]
    records = teacher_rollouts(cfg, qs, make_search_fn(cfg, data / "corpus.jsonl", {}), w.countries,
                               list(w.city_country))  # fmt: skip
    counts = Counter(search_counts(r) for r in records)
    assert counts[(1, 2)] > 10 and counts[(2, 2)] > 5  # parallel and sequential; the rest guessed after one
    for r in records:
        if search_counts(r) == (1, 2):
            m = r["metadata"]
            assert parsed(r).queries == [f"{m['person']} born", f"{m['person2']} born"]
            assert parsed(r).answer == r["golden_answers"][0]
    row, m = batch_metrics(score(records, "em")), summarize(records)  # training's and eval's, per question type
    assert row["search_turns_compare"] == m["search_turns_compare"] < m["search_queries_compare"]


def test_a_fork_continues_from_the_base_start_in_a_few_steps(micro, tmp_path):
    """sft.continue_from: auto finds the micro start (the same config with the default protocol and types) and
    trains sft.continue_steps on the new teacher; a protocol's new tags become whole tokens."""
    base_dir = micro[3]
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / base_dir.name).symlink_to(base_dir)  # the base's build, read only; the fork's is its own
    path = write_micro_config(tmp_path / "c.yaml", cache, rollout={"protocol": "deliberative"},
                              world={"question_types": ["compare"]},
                              sft={"continue_from": "auto", "continue_steps": 5})  # fmt: skip
    cfg = resolve_precision(load_config(path))  # as tiny/sft.py's main
    assert world_dir(base_config(cfg)) == cache / base_dir.name and world_key(cfg) != world_key(base_config(cfg))
    policy = ensure_tiny_policy(cfg)
    summary = json.loads((policy / "DONE").read_text())
    assert summary["continued_from"] == str(cache / base_dir.name / "policy") and summary["steps"] == 5
    tok, base_tok = load_tokenizer(policy), load_tokenizer(micro[2])
    assert len(tok.encode("<read>", add_special_tokens=False)) == 1 < len(base_tok.encode("<read>"))
    assert tok.encode("Velor was born", add_special_tokens=False) == base_tok.encode("Velor was born")
    with pytest.raises(ConfigError, match="'sft.continue_from' must be auto or a built policy directory; /nope"):
        ensure_tiny_policy(resolve_precision(load_config(path, ["sft.continue_from=/nope"])))


@pytest.mark.slow
def test_the_fork_a_protocol_recipe_trains(micro, tmp_path):
    """docs/fork.md's two files, written by its block as written into a copy of the repository, and its
    command on the micro world: the fork's start continues the micro start, then 5 GRPO steps on
    comparison questions, each logging search turns and queries for them."""
    repo = tmp_path / "repo"
    for rel in subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split():
        if rel.split("/")[0] not in ("results", "benchmarks", "tests") and (ROOT / rel).is_file():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, repo / rel)
    subprocess.run(["bash", "-c", recipe()], cwd=repo, check=True)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / micro[3].name).symlink_to(micro[3])
    command = ROOT.joinpath("docs/fork.md").read_text().split("<!-- fork-protocol-run -->")[1].split("```bash")[1]
    sets = [a.split()[0] for a in command.split("```")[0].replace("\\\n", " ").split("--set")[1:]]
    cfg_path = write_micro_config(
        tmp_path / "c.yaml", cache, sft={"continue_steps": 20},
        train={"save_every": 0, "eval_every": 0, "run_dir": str(tmp_path / "runs"), "name": "fork",
               "questions_per_step": 2, "group_size": 2},
    )  # fmt: skip
    out = subprocess.run([sys.executable, "train.py", "--config", str(cfg_path), *[f"--set={s}" for s in sets]],
                         cwd=repo, capture_output=True, text=True, timeout=900, env=dict(os.environ))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in next((tmp_path / "runs").glob("fork-*")).joinpath("metrics.jsonl").open()]
    steps = [r for r in rows if "reward" in r]
    assert len(steps) == 5 and all("reward/one_call" in r and r["search_turns_compare"] >= 0 for r in steps)
    assert {"search_queries_compare"} <= set(steps[0]) and "train.steps=5" in sets
    fork = next(d for d in cache.iterdir() if d.name != micro[3].name)
    assert json.loads((fork / "policy/DONE").read_text())["steps"] == 20
