"""Experiment tracking (trainer/tracking.py): a real 2-step run writes TensorBoard events and an offline
W&B run holding the scalars of metrics.jsonl; the end of a run prints the before -> after table."""

import json
import os
from pathlib import Path

import pytest
from conftest import ROOT, run_script, write_micro_config

from trainer.config import ConfigError, load_config
from trainer.tracking import effect_note, flat_scalars, summary_table


@pytest.fixture(scope="module")
def tracked_run(micro, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tracked")
    cfg_path = write_micro_config(
        tmp / "c.yaml", micro[1].world.cache_dir, rollout={"engine": "hf"},
        train={"steps": 2, "eval_every": 1, "save_every": 0, "threads": 1, "run_dir": str(tmp / "runs"),
               "name": "tracked", "report_to": ["tensorboard", "wandb"]},
        eval={"max_questions": 4},
    )  # fmt: skip
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    out = run_script(["train.py", "--config", str(cfg_path)], timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    run = next((tmp / "runs").glob("tracked-*"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return run, rows, out.stdout


def test_tensorboard_events_hold_the_logged_scalars(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, rows, _ = tracked_run
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for row in rows:
        for name, value in flat_scalars(row).items():
            assert name in tags, name
            logged = {e.step: e.value for e in acc.Scalars(name)}
            # TensorBoard keeps float32: one rounding, within eps/2 = 6e-8 of the value (rel 1e-6);
            # the floor for values near 0 that float32 flushes or rounds to its smallest steps
            assert logged[row["step"]] == pytest.approx(value, rel=1e-6, abs=1e-7), (name, row["step"])
    assert {"reward", "loss", "eval/em", "time/generate"} <= tags


def wandb_history(path: Path) -> dict[int, dict]:
    """The history rows of an offline W&B run file, read as it is written: a ':W&B' header, then
    LevelDB-log records (32 KiB blocks; crc, length, type; type 1 whole, 2-4 first / middle / last)
    each holding one wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, rows, block = 7, b"", {}, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or kind == 0:  # a block's zero padding
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                rows[items["_step"]] = items
    return rows


def test_wandb_runs_offline_with_the_same_scalars(tracked_run):
    run, rows, _ = tracked_run
    files = list((run / "wandb").glob("offline-run-*/*.wandb"))
    assert len(files) == 1, list((run / "wandb").iterdir())
    history = wandb_history(files[0])
    assert sorted(history) == [r["step"] for r in rows]
    for row in rows:
        for name, value in flat_scalars(row).items():
            # as TensorBoard's: at most a float32 rounding on the way (rel 1e-6), floor 1e-7 near 0
            assert history[row["step"]][name] == pytest.approx(value, rel=1e-6, abs=1e-7), (name, row["step"])


def test_the_end_of_a_run_prints_a_before_after_table(tracked_run):
    _, rows, stdout = tracked_run
    before, after = rows[0]["eval"], rows[-1]["eval"]
    assert f"  EM, all{' ' * 28} {before['em']:6.3f}   {after['em']:.3f}" in stdout
    assert "validation after 2 steps" in stdout and "final eval: {" not in stdout


def test_report_to_names_are_checked_before_anything_starts():
    with pytest.raises(ConfigError, match="train.report_to"):
        load_config(ROOT / "configs/tiny.yaml", ["train.report_to=tensorbord"])
    assert load_config(ROOT / "configs/tiny.yaml", ["train.report_to=tensorboard,wandb"]).train.report_to == [
        "tensorboard", "wandb"]  # fmt: skip


def test_summary_table_shows_only_what_was_measured():
    table = summary_table({"em": 0.25}, {"em": 0.5, "em_2hop": 0.4}, 3, 1.0)
    assert "(+0.250)" in table and "EM, 2-hop" in table and "searches" not in table


def test_a_run_whose_effect_did_not_appear_says_so_and_what_to_try():
    """The capped-AVX2 quick start of issue 46 (2-hop EM 0.040 -> 0.100) would have said so."""
    note = effect_note({"em": 0.4, "em_2hop": 0.04}, {"em": 0.45, "em_2hop": 0.10}, 10)
    assert note.startswith("the effect did not appear: 2-hop EM rose by +0.060 in 10 steps")
    assert "train.steps=20" in note and "train.seed" in note
    # world.seed 1's start (results/quickstart_seeds.md): it never learned to copy, and says so
    no_copy = effect_note({"em_1hop": 0.03, "em_2hop": 0.035}, {"em_1hop": 0.03, "em_2hop": 0.02}, 20)
    assert "did not learn to copy" in no_copy and "raise sft.steps" in no_copy
    assert effect_note({"em_2hop": 0.065}, {"em_2hop": 0.725}, 10) == ""  # the quick start as documented
    assert effect_note({"em": 0.30}, {"em": 0.30}, 5) != "" and effect_note({"em": 0.3}, {"em": 0.31}, 5) == ""
    assert effect_note({}, {"em": 0.5}, 5) == ""  # no step-0 evaluation: nothing to compare
