"""The weight check after each sync (issue 52): train.py, in process, on the micro world with the
transformers engine. A sync that corrupts one tensor stops the run in one line at that step, before
the next rollout; a clean run passes the check every step (no false alarm)."""

import pytest
from conftest import write_micro_config

import train
from trainer.config import ConfigError, load_config
from trainer.engine import HFEngine


def run_micro(micro, tmp_path, monkeypatch, checked: list, rollouts: list, steps: int = 2) -> None:
    """train.main on the micro world; the checks' largest differences into checked, a 1 into
    rollouts for each rollout run."""
    cfg_path = write_micro_config(
        tmp_path / "c.yaml", micro[1].world.cache_dir, rollout={"engine": "hf"},
        train={"steps": steps, "eval_every": 0, "save_every": 0, "questions_per_step": 2, "group_size": 2,
               "threads": 1, "run_dir": str(tmp_path / "runs")},
    )  # fmt: skip
    check, roll = train.check_sync, train.rollout_batch

    def watched_check(*a, **kw):
        checked.append(check(*a, **kw))
        return checked[-1]

    def watched_rollout(*a, **kw):
        rollouts.append(1)
        return roll(*a, **kw)

    monkeypatch.setattr(train, "check_sync", watched_check)  # observed, not replaced
    monkeypatch.setattr(train, "rollout_batch", watched_rollout)
    train.main(["--config", str(cfg_path)])


def test_a_clean_run_passes_the_check_every_step(micro, tmp_path, monkeypatch):
    checked, rollouts = [], []
    run_micro(micro, tmp_path, monkeypatch, checked, rollouts)
    assert len(checked) == 2 and len(rollouts) == 2
    assert all(d <= 1.1e-4 for d in checked), checked  # fp32 micro policy: tests/numerics.logprob_atol


def test_a_corrupted_sync_is_caught_in_one_line_at_its_step(micro, tmp_path, monkeypatch):
    load = HFEngine.load_weights

    def corrupting(self, named_tensors, before_kv_cache=None):  # one tensor arrives wrong, as a bad sync's
        tensors = list(named_tensors)  # not the embedding: tied, lm_head.weight would load it again
        at = next(i for i, (name, _) in enumerate(tensors) if "layers.0." in name)
        tensors[at] = (tensors[at][0], tensors[at][1] + 1.0)
        load(self, tensors, before_kv_cache)

    monkeypatch.setattr(HFEngine, "load_weights", corrupting)
    checked, rollouts = [], []
    with pytest.raises(SystemExit) as e:
        run_micro(micro, tmp_path, monkeypatch, checked, rollouts)
    line = str(e.value.code)
    assert "\n" not in line
    assert line.startswith("error: step 1: weight check after the sync") and "not serving the trainer's weights" in line
    assert "train.sync_check_every=0" in line and "(bound 0.000107)" in line  # fp32, 768 logits
    assert rollouts == [1]  # stopped before step 2's rollout


def test_a_negative_sync_check_every_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="config key .train.sync_check_every. must be >= 0; got -1"):
        load_config(None, ["train.sync_check_every=-1"])
