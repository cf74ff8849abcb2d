"""Credit per search step, the rewards' side: the per-step rewards of the table on real rollout
records (test_masking.py's scripted two-turn rollout through rollout.py, a real tiny Qwen2 for
IG-Search's scorer), the reward contract's checks, DAPO's dynamic sampling, and the README's
per-turn fork recipe trained by train.py as written."""

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, write_micro_config
from test_masking import roll, setup

from agent.steps import documents, ig_search_steps, information_spans
from rewards import compute, score
from sampling import fill_varied_groups, varied_groups
from trainer.config import TrainingFault
from trainer.turns import answer_logprob_fn

HIT = "Doc 1(Title: P) P was born in the city of C."
MISS = "Doc 1(Title: Q) Q was born in the city of D."


def _rollout(tmp_path, result: str):
    tok, cfg, model, engine = setup(tmp_path)
    r = roll(tok, cfg, engine, result)
    return tok, cfg, model, dict(r, group_id="q1")


def test_turn_hit_scores_the_search_turn_only(tmp_path):
    _, _, _, hit = _rollout(tmp_path, HIT)
    _, _, _, miss = _rollout(tmp_path, MISS)
    out = compute([hit, miss], "turn_hit")
    assert [o["turn_rewards"] for o in out] == [[1.0, None], [0.0, None]]  # the answer turn did not search
    assert [o["reward"] for o in out] == [0.0, 0.0]  # the outcome is another term's
    # in a sum: EM stays the outcome, the turn rewards are weighted, each term's components logged
    both = compute([hit], "em + 0.5*turn_hit")[0]
    assert both["reward"] == 1.0 and both["turn_rewards"] == [0.5, None]
    assert both["components"]["turn_hit/hit_rate"] == 1.0 and both["components"]["em/f1"] == 1.0


def test_stepsearch_gains_on_new_gold_text_and_pays_for_repeats(tmp_path):
    _, _, _, r = _rollout(tmp_path, HIT)
    gold = {"p1": "P was born in the city of C."}
    r["metadata"] = {"gold_ids": ["p1"]}
    first = compute([r], "stepsearch", given={"passage": gold.get})[0]["turn_rewards"]
    assert first[1] is None and 0.5 < first[0] <= 1.0  # TF-IDF cosine of the hit with its gold passage
    # the same search twice: no new gold text, and every document seen before
    again = dict(r, chunks=r["chunks"][:2] + r["chunks"][:2] + r["chunks"][2:],
                 tool_calls=r["tool_calls"] + [dict(r["tool_calls"][0], turn=2)])  # fmt: skip
    steps = compute([again], "stepsearch", given={"passage": gold.get})[0]["turn_rewards"]
    assert steps[0] == first[0] and steps[1] == -1.0 and steps[2] is None
    assert documents("Doc 1(Title: a) x\nDoc 2(Title: b) y") == ["Doc 1(Title: a) x", "Doc 2(Title: b) y"]


def test_ig_search_is_the_policys_gain_over_swapped_documents(tmp_path):
    """IG = log p(gold | real results) - mean log p(gold | another rollout's results), scored by
    the real tiny policy; checked against the scorer called directly."""
    tok, cfg, model, hit = _rollout(tmp_path, HIT)
    *_, miss = _rollout(tmp_path, MISS)
    scorer = answer_logprob_fn(model, tok, 4096)
    group = [hit, dict(miss, sample=1)]
    steps = ig_search_steps(group, scorer)
    assert [s[1] for s in steps] == [None, None] and all(s[0] is not None for s in steps)
    (a, b), = [information_spans(hit)[0]]
    (c, d), = [information_spans(miss)[0]]
    head = hit["prompt_ids"] + hit["response_ids"][:a]
    real, swapped = scorer([head + hit["response_ids"][a:b], head + miss["response_ids"][c:d]], ["C", "C"])
    assert steps[0][0] == pytest.approx(real - swapped, abs=1e-6)
    out = compute(group, "ig_search", given={"answer_logprob": scorer})
    assert out[0]["turn_rewards"][0] == pytest.approx(steps[0][0], abs=1e-6)
    with pytest.raises(TrainingFault, match="answer_logprob"):
        compute(group, "ig_search")  # offline, without the policy: said, not scored as 0


def test_turn_rewards_of_the_wrong_length_stop_the_step(tmp_path, monkeypatch):
    _, _, _, r = _rollout(tmp_path, HIT)
    one_turn = "def one(record, **_):\n    return {'reward': 0.0, 'turn_rewards': [1.0]}\n"
    (tmp_path / "short_turns.py").write_text(one_turn)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TrainingFault, match="1 turn rewards for a rollout of 2 action turns"):
        score([r], "short_turns:one")


def test_filter_groups_keeps_only_varied_groups_and_refills_or_says_why_not():
    rec = lambda g, r: {"group_id": g, "reward": r}  # noqa: E731
    batch = [rec("a", 1.0), rec("a", 1.0), rec("b", 0.0), rec("b", 1.0), rec("c", 0.0), rec("c", 0.0)]
    fresh = iter([[rec("d", 0.0), rec("d", 0.0)], [rec("e", 0.5), rec("e", 0.0)]])
    kept, counts = fill_varied_groups(batch, 3, 2, lambda rs: None, lambda n, k: next(fresh))
    assert len(varied_groups(kept)) == len({r["group_id"] for r in kept}) == 2  # no zero-variance group
    assert counts == {"varied_first": 1 / 3, "rounds": 2, "questions": 5, "groups": 2}  # short: the counts say so
    filled, counts = fill_varied_groups(batch, 1, 0, lambda rs: None, lambda n, k: [])
    assert [r["group_id"] for r in filled] == ["b", "b"] and counts["groups"] == 1
    alike, counts = fill_varied_groups(batch[:2], 1, 0, lambda rs: None, lambda n, k: [])
    assert alike == batch[:2] and counts["groups"] == 0  # none varied: the first batch as it was


def test_a_reward_that_cannot_take_its_keywords_is_refused_in_one_line_before_anything_loads(tmp_path):
    (tmp_path / "bad_reward.py").write_text("def no_kwargs(record):\n    return {'reward': 0.0}\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    t = time.time()
    out = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.yaml", "--set",
                          "train.reward=em + bad_reward:no_kwargs", "--set", f"train.run_dir={tmp_path}/runs"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    took = time.time() - t
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    error = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and "cannot take the keyword arguments 'answer_logprob', 'judge', 'passage'" in error[0]
    assert "**_" in error[0] and took < 10, took
    assert not (tmp_path / "runs").exists()  # nothing was written: refused before the run directory


@pytest.mark.slow
def test_the_per_turn_fork_recipe_trains_with_dynamic_sampling(micro, tmp_path):
    """docs/fork.md's per-turn recipe, copied as written, trains two GRPO steps; the same run has
    train.filter_groups and train.mask_truncated on, so their wiring is exercised too."""
    readme = (ROOT / "docs/fork.md").read_text()
    block = readme.split("<!-- fork-recipe-turns -->")[1].split("<!-- /fork-recipe-turns -->")[0]
    code, command = block.split("```python")[1].split("```")[0], block.split("```bash")[1].split("```")[0]
    (tmp_path / "my_turn_reward.py").write_text(code)
    spec = command.split("train.reward=")[1].split('"')[0]
    cfg_path = write_micro_config(
        tmp_path / "c.yaml", micro[1].world.cache_dir,
        train={"steps": 2, "save_every": 0, "eval_every": 0, "run_dir": str(tmp_path / "runs"), "name": "turns",
               "filter_groups": True, "filter_max_rounds": 2, "mask_truncated": True},
    )  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run([sys.executable, "train.py", "--config", str(cfg_path), "--set", f"train.reward={spec}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    run = next((tmp_path / "runs").glob("turns-*"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    assert len(steps) == 2
    for row in steps:
        f = row["filter"]
        assert f["questions"] >= f["groups"] and f["rounds"] <= 2
        filled = f["groups"] == 4  # conftest.MICRO's questions_per_step
        assert (row["groups_alike"] == 0.0) if f["groups"] else True  # kept groups all vary
        assert filled or "filter_groups: step" in out.stdout + out.stderr  # short: said in one line
        assert "reward/my_turn_reward:repeat_penalty/repeats" in row and "truncated_masked" in row, sorted(row)
    samples = [json.loads(line) for line in (run / "samples" / "step_1.jsonl").read_text().splitlines()]
    assert all(len(s["turn_rewards"]) == sum(c["role"] == "policy" for c in s["chunks"]) for s in samples)


@pytest.mark.slow
def test_ig_search_trains_and_validates_with_the_policys_scorer(micro, tmp_path):
    """IG-Search needs the policy: train.py gives it to the reward in the update and in validation
    (which once scored without it, and stopped at step 0)."""
    cfg_path = write_micro_config(
        tmp_path / "c.yaml", micro[1].world.cache_dir, eval={"max_questions": 4},
        train={"steps": 1, "save_every": 0, "eval_every": 1, "run_dir": str(tmp_path / "runs"), "name": "ig",
               "reward": "em + ig_search"},
    )  # fmt: skip
    out = subprocess.run([sys.executable, "train.py", "--config", str(cfg_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in next((tmp_path / "runs").glob("ig-*")).joinpath("metrics.jsonl").open()]
    step = next(r for r in rows if "reward" in r)
    assert "reward/ig_search/ig_mean" in step and step["time"]["reward"] > 0
    assert [r["step"] for r in rows if "eval" in r] == [0, 1]
