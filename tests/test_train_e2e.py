"""train.py end to end in a subprocess (real vLLM, real BM25): run dir, kill, resume."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, run_script, write_micro_config
from numerics import assert_close


def run_train(args, **kw):
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, start_new_session=True, **kw)


def _metric_rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _close(a, b, key=""):
    """Equal up to rounding (numbers), recursively; wall-clock fields are skipped. The resumed steps
    are the whole run's steps on restored bits (weights, Adam state, RNG, data order), one thread
    each; what a fresh process may change is the memory alignment, by which MKL picks a GEMM code
    path (it only promises bit-reproducibility in its CNR mode): the same sums rounded otherwise,
    a few eps. 8 eps relative (1e-6), floor 1e-6 for metrics near 0 (measured: bit-equal on AVX2)."""
    if isinstance(a, dict):
        assert set(a) == set(b), key
        for k in a:
            if k not in ("time", "tokens_per_s"):
                _close(a[k], b[k], f"{key}.{k}")
    elif isinstance(a, float):
        assert_close(a, b, rtol=1e-6, atol=1e-6, what=key)
    else:
        assert a == b, (key, a, b)


@pytest.mark.slow
@pytest.mark.numeric
def test_killed_run_resumes_exactly(micro, tmp_path):
    """Kill a run after step 2's checkpoint, resume it: steps 3-5 match an uninterrupted run to
    1e-6 (transformers engine; weights, optimizer, data order and RNG all come back)."""
    # a constraint that comes on at step 2, so the resumed steps depend on the restored lambda
    fmt = {"name": "em", "stat": "reward", "threshold": 0.9, "warmup_frac": 0.4, "eta": 0.5}
    train = {"steps": 5, "eval_every": 2, "threads": 1, "keep_checkpoints": 2, "constraints": [fmt]}
    configs = {}
    for name, save_every in (("whole", 0), ("killed", 1)):
        configs[name] = write_micro_config(
            tmp_path / f"{name}.yaml", micro[1].world.cache_dir, rollout={"engine": "hf"}, eval={"max_questions": 8},
            train=train | {"save_every": save_every, "run_dir": str(tmp_path / name), "name": name},
        )  # fmt: skip
    whole = run_script(["train.py", "--config", str(configs["whole"])], timeout=900)
    assert whole.returncode == 0, whole.stderr[-3000:]
    log = open(tmp_path / "log.txt", "w")
    proc = run_train(["--config", str(configs["killed"])], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    run = None
    while time.time() < deadline and proc.poll() is None:
        runs = list((tmp_path / "killed").glob("killed-*"))
        if runs and (runs[0] / "checkpoints" / "step_2").exists():
            run = runs[0]
            break
        time.sleep(0.2)
    assert run is not None, (tmp_path / "log.txt").read_text()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)  # killed mid-run, as a crash or a pre-empted job would be
    proc.wait()
    assert not (run / "checkpoints" / "step_5").exists()

    out = run_script(["train.py", "--resume", str(run)], timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stdout
    rows = _metric_rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]  # no duplicated rows from the redone step
    reference = _metric_rows(next((tmp_path / "whole").glob("whole-*")))
    resumed_from = int(out.stdout.split("at step ")[1].split()[0])
    assert resumed_from in (2, 3, 4)
    for mine, ref in zip(rows[resumed_from + 1 :], reference[resumed_from + 1 :]):
        _close(mine, ref)
    for key in ("reward", "em", "kl", "loss", "grad_norm", "response_len", "searches_per_question", "lr"):
        assert all(isinstance(r[key], float) for r in rows[1:]), key
    assert set(rows[1]["time"]) == {"generate", "retrieve", "reward", "train", "sync"}
    assert "em_2hop" in rows[2]["eval"] and "em_2hop" in rows[5]["eval"]
    assert [r["lambda/em"] for r in rows[1:3]] == [0.0, 0.0] and rows[3]["lambda/em"] > 0  # warm-up, then on
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == ["step_4", "step_5"], kept  # keep_checkpoints: 2
    assert (run / "checkpoints" / "step_5" / "model.safetensors").exists()
    sample = json.loads((run / "samples" / "step_3.jsonl").read_text().splitlines()[0])
    assert len(sample["loss_mask"]) == len(sample["response_ids"]) == len(sample["logprobs"])


def _bad_input_run(micro, tmp_path, **data):
    _, cfg, policy, world = micro
    files = {k: str(world / f"{k}.jsonl") for k in ("corpus", "train", "val")} | data
    cfg_path = write_micro_config(
        tmp_path / "c.yaml", cfg.world.cache_dir, model={"path": str(policy)}, data=files,
        train={"steps": 1, "run_dir": str(tmp_path / "runs")},
    )  # fmt: skip
    return run_script(["train.py", "--config", str(cfg_path)], timeout=600)


def test_missing_corpus_file_is_a_clear_error(micro, tmp_path):
    out = _bad_input_run(micro, tmp_path, corpus=str(tmp_path / "no_corpus.jsonl"))
    assert out.returncode != 0
    assert "corpus file not found" in out.stderr and "no_corpus.jsonl" in out.stderr
    assert "Traceback" not in out.stderr


def test_empty_question_is_a_clear_error(micro, tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text(json.dumps({"id": "a", "question": "  ", "golden_answers": ["x"]}) + "\n")
    out = _bad_input_run(micro, tmp_path, train=str(bad))
    assert out.returncode != 0
    assert "empty question" in out.stderr and "train.jsonl:1" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_fork_recipe_trains(micro, tmp_path):
    """The README's fork recipe, copied from the README as written, trains for two steps."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- fork-recipe -->")[1].split("<!-- /fork-recipe -->")[0]
    code = block.split("```python")[1].split("```")[0]
    (tmp_path / "my_reward.py").write_text(code)
    cfg_path = write_micro_config(
        tmp_path / "c.yaml", micro[1].world.cache_dir,
        train={"steps": 2, "save_every": 0, "eval_every": 0, "run_dir": str(tmp_path / "runs"), "name": "fork"},
    )  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "train.py", "--config", str(cfg_path), "--set", "train.reward=my_reward:short_em",
         "--set", "train.reward_params.max_words=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    run = next((tmp_path / "runs").glob("fork-*"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    assert len(steps) == 2 and all(0.0 <= r["reward/short"] <= 1.0 for r in steps)
    # short_em never exceeds EM; 1e-9: float64 means of a few rewards, rounded differently (~1e-16)
    assert all(r["reward"] <= r["reward/em"] + 1e-9 for r in steps)
