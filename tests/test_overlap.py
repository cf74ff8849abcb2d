"""train.overlap (issue 52, docs/overlap.md): the loss at staleness 0 is today's bit for bit, a
stale token takes the decoupled, truncated-IS loss; no trained token is older than
train.max_staleness; the weight check still catches a corrupted sync; a killed overlapped run
resumes on the same questions as an unkilled one; with vLLM in its own process, the rollout runs
beside the update. Micro world; the transformers engine where exactness or time matters (its
rollout runs in the same thread as vLLM's client does)."""

import json
import math
import os
import signal
import subprocess
import time

import pytest
import torch
from conftest import run_script, write_micro_config
from test_grpo import _records_with
from test_masking import setup
from test_sync_check import run_micro
from test_train_e2e import _close, _metric_rows, run_train

import train
from trainer.checkpoint import load_checkpoint_file
from trainer.config import ConfigError, TrainingFault, load_config
from trainer.engine import HFEngine
from trainer.grpo import grpo_step
from trainer.offpolicy import STALE_IS_CAP
from trainer.overlap import check_staleness, token_versions

OVERLAP = {"overlap": True, "max_staleness": 1}


def _grads(model, records, cfg, tok, step: int) -> tuple[dict, list[torch.Tensor]]:
    frozen = torch.optim.SGD(model.parameters(), lr=0.0)  # the gradients, not a step
    stats = grpo_step(model, None, records, frozen, cfg, tok.pad_token_id, step)
    return stats, [p.grad.clone() for p in model.parameters()]


def test_staleness_zero_is_bit_identical_and_a_stale_token_is_corrected(tmp_path):
    tok, cfg, model, _ = setup(tmp_path)
    cfg.train.kl_coef = 0.0
    records = _records_with(model, tok, engine_shift=-0.5, advantages=(1.0,))  # engine 0.5 nats below
    today, today_grads = _grads(model, records, cfg, tok, step=3)  # no versions: the synchronous loop's records
    fresh = [dict(r, versions=[[0, 3]]) for r in records]  # staleness 0: the version that trains them
    same, same_grads = _grads(model, fresh, cfg, tok, step=3)
    assert same == today
    assert all(torch.equal(a, b) for a, b in zip(same_grads, today_grads))
    # one version old: pi_prox = the trainer's (ratio 1, nothing clips), weight min(e^0.5, C) = 1.65
    stale, stale_grads = _grads(model, [dict(r, versions=[[0, 2]]) for r in records], cfg, tok, step=3)
    assert today["clip_frac"] == 1.0 and stale["clip_frac"] == 0.0
    lp_max = max(abs(x) for r in records for x in r["logprobs"])
    assert stale["loss"] == pytest.approx(-min(math.exp(0.5), STALE_IS_CAP), rel=4e-7 * lp_max + 1e-6)
    assert not all(torch.equal(a, b) for a, b in zip(stale_grads, today_grads))


def test_versions_per_token_and_the_staleness_bound():
    record = {"response_ids": [1, 2, 3, 4, 5], "versions": [[0, 6], [3, 7]]}  # a rollout spanning two versions
    assert token_versions(record) == [6, 6, 6, 7, 7]
    check_staleness([record], 7, 1)  # 6 is one version old: within the bound
    with pytest.raises(TrainingFault, match="step 9: a rollout token of policy version 6 would be trained by "
                                            "version 8, beyond train.max_staleness 1"):  # fmt: skip
        check_staleness([record], 8, 1)


def test_overlap_config_is_checked_in_one_line():
    with pytest.raises(ConfigError, match="'train.overlap' .* cannot run with train.filter_groups, train.reward "):
        load_config(None, ["train.overlap=true", "train.reward=bapo", "train.filter_groups=true"])
    with pytest.raises(ConfigError, match="config key 'train.max_staleness' must be in \\[0, 1\\]; got 2"):
        load_config(None, ["train.max_staleness=2"])


def _trained_versions(micro, tmp_path, monkeypatch, max_staleness: int, steps: int = 3) -> list[set]:
    """train.main with overlap on: the set of token versions each step's update got."""
    seen = []
    tmp_path.mkdir()
    update = train.update_stage

    def watched(p, records, step):
        seen.append({v for r in records for v in token_versions(r)} | {("step", step)})
        return update(p, records, step)

    monkeypatch.setattr(train, "update_stage", watched)
    cfg_path = write_micro_config(
        tmp_path / "o.yaml", micro[1].world.cache_dir, rollout={"engine": "hf"},
        train={"steps": steps, "eval_every": 0, "save_every": 0, "questions_per_step": 2, "group_size": 2,
               "threads": 1, "run_dir": str(tmp_path / "runs"), "overlap": True, "max_staleness": max_staleness},
    )  # fmt: skip
    train.main(["--config", str(cfg_path)])
    return seen


def test_no_trained_token_is_older_than_max_staleness(micro, tmp_path, monkeypatch):
    # one-step-off: step 1 on the starting policy's rollout, then each step on the one before's
    assert _trained_versions(micro, tmp_path / "a", monkeypatch, 1) == [{0, ("step", 0)}, {0, ("step", 1)},
                                                                        {1, ("step", 2)}]  # fmt: skip
    monkeypatch.undo()
    # max_staleness 0: nothing started ahead, every step on its own policy (the synchronous loop)
    assert _trained_versions(micro, tmp_path / "b", monkeypatch, 0) == [{s, ("step", s)} for s in range(3)]


def test_a_corrupted_sync_is_caught_in_overlap_mode(micro, tmp_path, monkeypatch):
    load = HFEngine.load_weights

    def corrupting(self, named_tensors, before_kv_cache=None):
        tensors = list(named_tensors)
        at = next(i for i, (name, _) in enumerate(tensors) if "layers.0." in name)
        tensors[at] = (tensors[at][0], tensors[at][1] + 1.0)
        load(self, tensors, before_kv_cache)

    monkeypatch.setattr(HFEngine, "load_weights", corrupting)
    monkeypatch.setattr(train, "load_config", lambda path, sets: load_config(path, [*sets, "train.overlap=true"]))
    checked, rollouts = [], []
    with pytest.raises(SystemExit) as e:
        run_micro(micro, tmp_path, monkeypatch, checked, rollouts, steps=3)
    line = str(e.value.code)
    assert "\n" not in line
    # overlap syncs at the start of step 2, once step 2's rollout (started during step 1) is in
    assert line.startswith("error: step 2: weight check after the sync") and "not serving the trainer's weights" in line
    assert rollouts == [1, 1]  # stopped before step 3's rollout started


@pytest.mark.slow
def test_a_killed_overlapped_run_resumes_on_the_same_questions(micro, tmp_path):
    """train.py in a subprocess, SIGKILLed after its first checkpoint (a rollout in flight), resumed:
    every step trains on the questions an unkilled run does, once each, and its metrics match."""
    train_keys = {"steps": 4, "eval_every": 0, "questions_per_step": 2, "group_size": 2, "threads": 1,
                  "samples_per_step": "all", **OVERLAP}  # fmt: skip
    configs = {name: write_micro_config(
        tmp_path / f"{name}.yaml", micro[1].world.cache_dir, rollout={"engine": "hf"},
        train=train_keys | {"save_every": save, "run_dir": str(tmp_path / name), "name": name})
        for name, save in (("whole", 0), ("killed", 1))}  # fmt: skip
    whole = run_script(["train.py", "--config", str(configs["whole"])], timeout=600)
    assert whole.returncode == 0, whole.stderr[-3000:]
    with open(tmp_path / "log.txt", "w") as log:
        proc = run_train(["--config", str(configs["killed"])], stdout=log, stderr=subprocess.STDOUT)
    run, deadline = None, time.time() + 300
    while time.time() < deadline and proc.poll() is None and run is None:
        found = [r for r in (tmp_path / "killed").glob("killed-*") if (r / "checkpoints" / "step_1").exists()]
        run = found[0] if found else time.sleep(0.05)
    assert run is not None, (tmp_path / "log.txt").read_text()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "checkpoints" / "step_4").exists(), "the run ended before the kill: nothing was tested"
    # the checkpoint names the rollout in flight: the next step's, by the version before it
    saved = max((run / "checkpoints").iterdir(), key=lambda p: int(p.name.split("_")[1]))
    k = int(saved.name.split("_")[1])
    flight = load_checkpoint_file(saved / "trainer_state.pt")["in_flight"]
    assert (flight["step"], flight["version"]) == (k, k - 1) and len(flight["records"]) == 4

    # its rollout in flight cannot resume in the synchronous loop (the questions would be skipped)
    sync = run_script(["train.py", "--resume", str(run), "--set", "train.overlap=false"], timeout=600)
    assert sync.returncode != 0 and "holds the rollout in flight of an overlapped run" in sync.stderr, sync.stderr
    out = run_script(["train.py", "--resume", str(run)], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    reference = next((tmp_path / "whole").glob("whole-*"))

    def questions(r, step):
        return [json.loads(line)["question_id"] for line in (r / "samples" / f"step_{step}.jsonl").open()]

    for step in range(1, 5):
        assert questions(run, step) == questions(reference, step), step
    rows = _metric_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # none lost, none twice
    for mine, ref in zip(rows[k:], _metric_rows(reference)[k:]):  # the resumed steps, the unkilled run's
        _close(mine, ref)


def test_plan_counts_the_overlapped_layout():
    """--plan under train.overlap: each GPU's engine rolls out beside its rank's update, so the
    rollout peak is vLLM's share plus the whole training peak (not the resident state alone)."""
    from trainer.plan import format_plan, memory_plan

    sets = ["rollout.sleep_mode=false", "hardware.vllm_memory_fraction=0.35", "rollout.gpu_memory_utilization=0.35"]
    cfg = load_config("configs/search_r1_grpo_qwen2.5-7b-base.yaml", sets)
    sync = memory_plan(cfg, with_advice=False)
    cfg.train.overlap = True
    plan = memory_plan(cfg, with_advice=False)
    assert plan["train_total"] == sync["train_total"] and plan["rollout_total"] > sync["rollout_total"]
    assert plan["rollout_total"] == pytest.approx(0.35 * 80 + plan["train_total"])
    assert plan["fits"]  # docs/box.md's overlap layout for 7B: 71.8 of 80 GB
    assert "overlap one-step-off: each of the 8 GPUs trains" in format_plan(cfg, plan)


@pytest.mark.slow  # ~32 s of CPU: the engine core and its worker are spawned processes (imports, warm-up)
def test_vllm_in_its_own_process_rolls_out_beside_the_update(micro, tmp_path):
    """train.py with the vLLM engine (in a process of its own, weights through files): step 2's
    rollout runs while step 1 updates (the run's timeline), the sync before step 2 passes the
    weight check, and the rows say how long the trainer waited."""
    cfg_path = write_micro_config(
        tmp_path / "v.yaml", micro[1].world.cache_dir, rollout={"engine": "vllm"},
        train={"steps": 2, "eval_every": 0, "save_every": 0, "questions_per_step": 2, "group_size": 2,
               "threads": 1, "run_dir": str(tmp_path / "runs"), **OVERLAP},
    )  # fmt: skip
    out = run_script(["train.py", "--config", str(cfg_path)], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    run = next((tmp_path / "runs").glob("tiny-*"))
    stages = {(r["step"], r["who"], r["stage"]): r for r in map(json.loads, (run / "timeline.jsonl").open())}
    rollout, update = stages[(2, "engine", "rollout")], stages[(1, "trainer", "train")]
    assert rollout["start"] <= update["start"] < rollout["end"]  # both at once
    assert (2, "trainer", "sync") in stages  # the weight check ran there (a failed one stops the run)
    rows = _metric_rows(run)
    assert {"generate", "retrieve", "wait", "sync", "reward", "train"} == set(rows[1]["time"])
    assert [r["versions"] for r in map(json.loads, (run / "samples" / "step_2.jsonl").open())] == [[[0, 0]]] * 4
