"""What a fault probe of the rewards found (issue 55), and the class behind it: any reward failure
names the reward and the record, and stops the step before the optimizer runs.

Real parts: real rollout records (rollout.py with test_masking's scripted two-turn engine: a
search turn, then an answer turn), real scoring (rewards.compute / score), DAPO's dynamic sampling
on them, and train.py itself on the micro world (the transformers engine, a real optimizer whose
steps a global torch hook counts) for what happens before and after the optimizer.
"""

import json
import math
import os

import pytest
from conftest import run_script, write_micro_config
from test_masking import roll, setup

from rewards import REWARDS, compute, score
from sampling import fill_varied_groups, varied_groups
from trainer.config import TrainingFault
from trainer.reward_spec import judge_note

HIT = "Doc 1(Title: P) P was born in the city of C."
MISS = "Doc 1(Title: Q) Q was born in the city of D."

# Rewards a fork might write, each wrong in one way (imported as probe_rewards:<name>).
PROBE = '''
import numpy as np

def raises(record, **_):
    return {"reward": 1 / 0}

def text(record, **_):
    return {"reward": "0.5"}

def huge_int(record, **_):
    return {"reward": 10**400}

def flag(record, **_):
    return {"reward": True}

def nothing(record, **_):
    return None

def no_reward(record, **_):
    return {"em": 1.0}

def text_component(record, **_):
    return {"reward": 0.5, "verdict": "yes"}

def none_component(record, **_):
    return {"reward": 0.5, "hit_rate": None}

def huge_component(record, **_):
    return {"reward": 0.5, "count": 10**400}

def array_component(record, **_):
    return {"reward": 0.5, "scores": np.array([1.0, 2.0])}

def tuple_key(record, **_):
    return {"reward": 0.5, ("hit", 1): 1.0}

def text_turn(record, **_):
    return {"reward": 0.0, "turn_rewards": ["1", None]}

def huge_turn(record, **_):
    return {"reward": 0.0, "turn_rewards": [10**400, None]}

def far_out(record, **_):  # finite, but its group's std overflows: advantages of 0 without a word
    return {"reward": 1e200 if record["sample"] == 0 else -1e200}

def five_turns(record, **_):
    return {"reward": 0.0, "turn_rewards": [1.0, 0.0, 1.0, 0.0, 1.0]}

def numpy_scalars(record, **_):
    return {"reward": np.float32(0.5), "count": np.int64(3), "flag": np.bool_(True),
            "turn_rewards": [np.float32(0.25), None]}

def short_group(group, **_):
    return [{"reward": 1.0}]

short_group.group = True

def group_raises(group, **_):
    raise KeyError("golden")

group_raises.group = True
'''


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """Two real rollouts of one question (group 'q1'): both answer C, the golden answer (EM ties);
    the first's search found it, the second's did not (turn_hit [1, None] vs [0, None])."""
    tmp = tmp_path_factory.mktemp("probe")
    tok, cfg, _, engine = setup(tmp)
    hit, miss = roll(tok, cfg, engine, HIT), roll(tok, cfg, engine, MISS)
    return [dict(hit, group_id="q1", sample=0), dict(miss, group_id="q1", sample=1)]


@pytest.fixture()
def probe(tmp_path, monkeypatch):
    (tmp_path / "probe_rewards.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def fresh(rollouts: list[dict]) -> list[dict]:
    return [dict(r) for r in rollouts]


# ------------------------------------------------ 7 and the class: one line, the reward and the record


@pytest.mark.parametrize("name, says", [
    ("raises", "raised ZeroDivisionError: division by zero at probe_rewards.py:5 in raises"),
    ("text", "non-numeric reward from 'probe_rewards:text': '0.5', a str"),
    ("huge_int", "non-finite reward from 'probe_rewards:huge_int': an int of 1329 bits (beyond a float)"),
    ("flag", "non-numeric reward from 'probe_rewards:flag': True, a bool"),
    ("nothing", "non-numeric reward from 'probe_rewards:nothing': None, a NoneType (a dict"),
    ("no_reward", "no 'reward' key in {'em': 1.0}"),
    ("text_component", "non-numeric reward component 'verdict' of 'probe_rewards:text_component': 'yes', a str"),
    ("none_component", "reward component 'hit_rate' of 'probe_rewards:none_component': None"),
    ("huge_component", "non-finite reward component 'count' of 'probe_rewards:huge_component': an int of 1329"),
    ("array_component", "reward component 'scores' of 'probe_rewards:array_component': array([1., 2.]), a ndarray"),
    ("tuple_key", "reward 'probe_rewards:tuple_key' gave a component named ('hit', 1), a tuple"),
    ("text_turn", "non-numeric turn reward from 'probe_rewards:text_turn': '1', a str"),
    ("huge_turn", "non-finite turn reward from 'probe_rewards:huge_turn': an int of 1329 bits"),
    ("far_out", "reward from 'probe_rewards:far_out' out of range: 1e+200"),
    ("short_group", "group reward 'probe_rewards:short_group' returned 1 results for a group of 2 rollouts"),
    ("group_raises", "group reward 'probe_rewards:group_raises' raised KeyError: 'golden' at probe_rewards.py"),
])  # fmt: skip
def test_a_bad_reward_is_one_line_naming_the_reward_and_the_record(rollouts, probe, name, says):
    """Each was a raw traceback naming neither (or, for "0.5", True, a None component and 1e200,
    accepted: a string reward, a bool, a component json writes only after the optimizer step,
    advantages of 0); now a TrainingFault before anything is attached to the records."""
    records = fresh(rollouts)
    for spec in (f"probe_rewards:{name}", f"em + 0.5*probe_rewards:{name}"):  # alone and inside a sum
        with pytest.raises(TrainingFault) as e:
            score(records, spec)
        msg = str(e.value)
        assert says in msg and "\n" not in msg, msg
        assert "record 0 (question_id 'q1', sample 0, group_id 'q1')" in msg, msg
        assert not any("reward" in r for r in records)  # nothing reaches the advantages


def test_a_weighted_sum_beyond_the_range_is_refused_too(rollouts):
    """Each term in range (EM and F1: 1), their weighted sum not: the advantages would overflow."""
    with pytest.raises(TrainingFault, match=r"reward from '1e100\*em \+ 1e100\*f1' out of range: 2e\+100 .* "
                                            r"record 0 \(question_id 'q1'"):  # fmt: skip
        score(fresh(rollouts), "1e100*em + 1e100*f1")


def test_numpy_scalars_are_taken_as_floats_and_every_score_serialises(rollouts, probe):
    """A numpy float32 reward, int64 and bool_ components and float32 turn rewards are real
    numbers: taken, as Python floats, so the samples and metrics json writes after the optimizer
    step cannot fail on them (it did: samples/step_1.jsonl left empty, no metrics row)."""
    for spec in ("probe_rewards:numpy_scalars", "em + 2*probe_rewards:numpy_scalars"):
        records = score(fresh(rollouts), spec)
        for r in records:
            values = [r["reward"], *r["reward_components"].values(), *(v for v in r["turn_rewards"] if v is not None)]
            assert all(type(v) is float for v in values), (spec, r["reward_components"], r["turn_rewards"])
            json.dumps({k: r[k] for k in ("reward", "reward_components", "turn_rewards")}, allow_nan=False)
    one = score(fresh(rollouts), "probe_rewards:numpy_scalars")[0]
    assert one["reward_components"] == {"reward": 0.5, "count": 3.0, "flag": 1.0}
    assert one["turn_rewards"] == [0.25, None]
    assert score(fresh(rollouts), "em + 2*probe_rewards:numpy_scalars")[0]["turn_rewards"] == [0.5, None]


def test_every_table_reward_still_scores_real_rollouts_as_floats(rollouts):
    for name in REWARDS:
        if name == "ig_search":  # needs the policy's scorer (test_credit.py trains with it)
            continue
        for out in compute(fresh(rollouts), name, {"stage": "plateau"}):
            assert math.isfinite(out["reward"]) and all(type(v) is float for v in out["components"].values()), name


# ------------------------------------------------------- 4: each term's turn rewards, checked alone


def test_a_terms_turn_rewards_of_the_wrong_length_are_refused_inside_a_sum_too(rollouts, probe):
    """`a + b` with `a` giving 5 turn values for a 2-turn rollout was cut to the shortest term
    (zip) and accepted, though `a` alone is refused."""
    for spec in ("probe_rewards:five_turns", "turn_hit + probe_rewards:five_turns",
                 "probe_rewards:five_turns + 0.5*turn_hit"):  # fmt: skip
        with pytest.raises(TrainingFault) as e:
            score(fresh(rollouts), spec)
        msg = str(e.value)
        assert "reward 'probe_rewards:five_turns' gave 5 turn rewards for a rollout of 2 action turns" in msg, msg
        assert "question_id 'q1'" in msg and "\n" not in msg, msg


# ------------------------------------------- 6: filter_groups keeps a group whose turn rewards differ


def test_filter_groups_keeps_a_group_whose_outcomes_tie_but_whose_turn_rewards_differ(rollouts):
    """Both rollouts answer right (EM 1, 1: the outcome advantages are 0), but one search found the
    answer and one did not (turn_hit 1 vs 0): MT-GRPO's turn advantages train on that group, so
    DAPO's dynamic sampling must keep it, not drop it and roll out another question."""
    records = score(fresh(rollouts), "em + turn_hit")
    assert [r["reward"] for r in records] == [1.0, 1.0] and [r["turn_rewards"] for r in records] == [[1.0, None],
                                                                                                      [0.0, None]]
    refills = []

    def roll_out_next(n, k):
        refills.append(n)
        return []

    kept, counts = fill_varied_groups(records, 1, 2, lambda rs: None, roll_out_next, "group")
    assert kept == records and counts["groups"] == 1 and refills == [], (counts, refills)
    assert [len(varied_groups(records, norm)) for norm in (None, "group", "turn_index")] == [0, 1, 1]
    # without turn credit (train.turn_coef 0) the turns train nothing: dropped and refilled, as before
    kept, counts = fill_varied_groups(records, 1, 1, lambda rs: None, roll_out_next)
    assert counts["groups"] == 0 and refills == [1]
    # turns that tie too: nothing to learn from either
    tied = score(fresh(rollouts[:1]) + [dict(rollouts[0], sample=1)], "em + turn_hit")
    assert varied_groups(tied, "group") == []


# ------------------------------------------------------------- 13: a judge's terms without a judge


@pytest.mark.parametrize("spec, params, says", [
    ("webfilter", {}, "'webfilter' (z (answer correct) is EM and c (the operators helped) is 0)"),
    ("veritas", {}, "'veritas' (its info_think term is 0)"),
    ("em + 0.1*info_think", {}, "'info_think' (it is 0 on every rollout)"),
    ("deliberative", {"acc_metric": "judge"}, "'deliberative' (r_acc is EM)"),
])  # fmt: skip
def test_a_run_whose_reward_asks_a_judge_it_lacks_says_so_in_one_line(spec, params, says):
    note = judge_note(spec, params, REWARDS, "")
    assert says in note and "config key 'train.judge' is empty" in note and "\n" not in note, note
    assert judge_note(spec, params, REWARDS, "rule") == ""  # with a judge: nothing to say


def test_no_judge_note_for_rewards_that_ask_none():
    for spec, params in (("em", {}), ("deliberative", {}), ("deliberative", {"acc_metric": "f1"}), ("bapo", {})):
        assert judge_note(spec, params, REWARDS, "") == "", spec


# -------------------------------------------------- train.py: before the optimizer, and after it


TRAIN_PROBE = '''
import json
import os

import numpy as np
from torch.optim.optimizer import register_optimizer_step_post_hook

STEPS = []  # the optimizer steps taken so far in this process (a global torch hook, on the real AdamW)
register_optimizer_step_post_hook(lambda opt, args, kwargs: STEPS.append(1))


def numpy_then_raises(record, **_):
    """Step 1: numpy scalars (taken as floats). Step 2, after step 1's update: raises."""
    if STEPS:
        with open(os.environ["PROBE_LOG"], "w") as f:
            json.dump({"optimizer_steps_at_fault": len(STEPS)}, f)
        return {"reward": {"nested": 1}["missing"]}
    turns = sum(c["role"] == "policy" for c in record["chunks"])
    record["probe_note"] = np.float32(0.75)  # outside the contract, written into the record: still no crash
    return {"reward": np.float32(0.5), "count": np.int64(2), "turn_rewards": [np.float32(0.25)] * turns}


def at_exit():
    with open(os.environ["PROBE_LOG"]) as f:
        seen = json.load(f)
    with open(os.environ["PROBE_LOG"], "w") as f:
        json.dump(seen | {"optimizer_steps_at_exit": len(STEPS)}, f)


import atexit  # noqa: E402

atexit.register(at_exit)
'''


def _train(micro, tmp_path, reward: str, train: dict, rollout: dict | None = None, env: dict | None = None):
    cfg = write_micro_config(
        tmp_path / "c.yaml", micro[1].world.cache_dir, rollout={"engine": "hf", **(rollout or {})},
        train={"questions_per_step": 2, "group_size": 2, "eval_every": 0, "run_dir": str(tmp_path / "runs"),
               "name": "probe", "reward": reward, **train},
    )  # fmt: skip
    out = run_script(["train.py", "--config", str(cfg)], timeout=300, env=env)
    runs = list((tmp_path / "runs").glob("probe-*"))
    return out, runs[0] if runs else None


def test_a_reward_that_fails_stops_the_step_before_the_optimizer_and_numpy_scalars_are_written(micro, tmp_path):
    """Step 1 scores numpy scalars: taken, so its samples, metrics row and checkpoint are written
    (they were not: json failed after the optimizer step, samples/step_1.jsonl left empty). Step 2's
    reward raises: one line naming the reward and the record, and no optimizer step, samples,
    metrics row or checkpoint after it. The run has a WebFilter term and no judge: said once, at
    the start."""
    (tmp_path / "train_probe.py").write_text(TRAIN_PROBE)
    log = tmp_path / "probe.json"
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PROBE_LOG=str(log))
    out, run = _train(micro, tmp_path, "0.5*webfilter + train_probe:numpy_then_raises",
                      {"steps": 2, "save_every": 1}, env=env)  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 2: reward 'train_probe:numpy_then_raises' raised KeyError: 'missing' at "
                           "train_probe.py:"), last  # fmt: skip
    assert "on record 0 (question_id " in last and "group_id " in last and "--resume" in last, last
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    seen = json.loads(log.read_text())
    assert seen["optimizer_steps_at_exit"] == seen["optimizer_steps_at_fault"] > 0, seen  # none after the fault
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["reward/train_probe:numpy_then_raises/count"] == 2.0
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["step_1.jsonl"]
    samples = [json.loads(line) for line in (run / "samples" / "step_1.jsonl").read_text().splitlines()]
    assert samples and all(s["reward_components"]["train_probe:numpy_then_raises"] == 0.5 for s in samples)
    assert all(set(s["turn_rewards"]) == {0.25} for s in samples), [s["turn_rewards"] for s in samples]
    assert all(s["probe_note"] == 0.75 for s in samples)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1"]
    notes = [line for line in out.stdout.splitlines() if "config key 'train.judge' is empty" in line]
    assert len(notes) == 1 and "'webfilter' (z (answer correct) is EM" in notes[0], out.stdout[-2000:]


def test_mask_truncated_with_every_rollout_cut_stops_and_names_the_limit(micro, tmp_path):
    """Every rollout cut at rollout.max_tokens_per_turn=2: with train.mask_truncated the step had
    nothing to train on, and the run said "only the KL term", saved the same weights and exited 0."""
    out, run = _train(micro, tmp_path, "em", {"steps": 1, "save_every": 1, "mask_truncated": True},
                      {"max_tokens_per_turn": 2})  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 1: every one of the 4 rollouts was cut before it answered (4 by length "
                           "(rollout.max_tokens_per_turn=2, rollout.max_model_len=512))"), last  # fmt: skip
    assert "train.mask_truncated" in last and "No checkpoint was written yet" in last, last
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip()
    assert "only the KL term" not in out.stdout + out.stderr
