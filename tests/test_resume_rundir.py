"""A run directory has one owner (issue "Nothing silent", case 6; trainer/rundir.py):

- two `--resume` of one run directory at once: one is refused naming the other's pid;
- two fresh runs with one train.run_dir in the same second both run, in two directories.

All real: one micro-world run of 2 steps (transformers engine, a checkpoint each step), copied for
each test, and train.py in processes of its own.
"""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, run_script, write_micro_config


@pytest.fixture(scope="module")
def base_run(micro, tmp_path_factory) -> Path:
    """A finished run of 2 steps with checkpoints step_1 and step_2 (each test works on a copy)."""
    tmp = tmp_path_factory.mktemp("base_run")
    config = write_micro_config(
        tmp / "base.yaml", micro[1].world.cache_dir, rollout={"engine": "hf"},
        train={"steps": 2, "save_every": 1, "threads": 1, "run_dir": str(tmp / "runs"), "name": "base"},
    )  # fmt: skip
    out = run_script(["train.py", "--config", str(config)], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = (tmp / "runs").iterdir()
    return run


def copy_of(base_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / base_run.name
    shutil.copytree(base_run, run)
    return run


def launch(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


@pytest.mark.slow
def test_two_resumes_of_one_run_dir_one_is_refused_naming_the_other(base_run, tmp_path):
    """Two `train.py --resume` of the same run directory, started together: one trains step 3, the
    other is refused in one line naming the first's pid (at b1d2632 both ran, into one metrics.jsonl)."""
    run = copy_of(base_run, tmp_path)
    procs = [launch(["--resume", str(run), "--set", "train.steps=3"]) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [(p.returncode, err[-2000:]) for p, (_, err) in zip(procs, outs)]
    loser = next(i for i, p in enumerate(procs) if p.returncode == 2)
    winner = procs[1 - loser]
    err = outs[loser][1]
    assert "Traceback" not in err and "run directory:" not in outs[loser][0], err[-3000:]
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert f"the run directory {run} is in use: pid {winner.pid} on " in line, line
    rows = [yaml.safe_load(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


@pytest.mark.slow
def test_two_fresh_runs_in_the_same_second_both_run(micro, tmp_path):
    """A sweep's jobs launched at once with one train.run_dir. The names of the next 5 minutes are
    taken first, as jobs started in the same second before them would take them, so both runs meet
    a taken name for sure, then race for the same -2: each gets a directory of its own and trains.
    (At b1d2632 both stopped with `File exists`.)"""
    runs = tmp_path / "runs"
    config = write_micro_config(
        tmp_path / "sweep.yaml", micro[1].world.cache_dir, rollout={"engine": "hf"},
        train={"steps": 1, "save_every": 1, "threads": 1, "run_dir": str(runs), "name": "sweep"},
    )  # fmt: skip
    now = int(time.time())
    taken = {f"sweep-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now + s))}" for s in range(300)}
    for name in taken:
        (runs / name).mkdir(parents=True)
    procs = [launch(["--config", str(config)]) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    said = [next(x.removeprefix("run directory: ") for x in out.splitlines() if x.startswith("run directory: "))
            for out, _ in outs]  # fmt: skip
    made = sorted(p for p in runs.iterdir() if p.name not in taken)
    assert len(made) == 2 and sorted(Path(s) for s in said) == made, (said, made)
    assert all(p.name.rsplit("-", 1)[-1] in ("2", "3") for p in made), made  # the taken name, then the next free
    for run in made:
        assert (run / "checkpoints" / "step_1").is_dir() and len((run / "metrics.jsonl").read_text().splitlines()) == 1
