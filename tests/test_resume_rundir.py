"""A run directory across resumes and processes (issue "Nothing silent", cases 5 and 6;
trainer/rundir.py): a resume applies no config change silently, and a run directory has one owner.

- an edited config.yaml (group_size, lr x 100) is refused in one line naming each changed key,
  before any model or engine; named by --set, the change is applied from the next step and
  recorded (config.yaml rewritten, config_changes.jsonl, the checkpoints keep their own config);
- the architecture and the world cannot change on a resume, even named: refused with that cause
  (before: `corpus file not found`);
- train.steps at or below the checkpoint's step is one line, at once (before: an engine started,
  nothing ran, exit 0);
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


def edit(run: Path, **changes: object) -> None:
    """Edit the run's config.yaml by hand, as a user would: {"train.lr": 0.1}."""
    data = yaml.safe_load((run / "config.yaml").read_text())
    for key, value in changes.items():
        section, name = key.split("__")
        data[section][name] = value
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def resume(run: Path, *sets: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.time()
    out = run_script(["train.py", "--resume", str(run), *sum((["--set", s] for s in sets), [])], timeout=timeout)
    return out, time.time() - t0


def refusal(out: subprocess.CompletedProcess) -> str:
    """The one error line of a refused command (exit 2, argparse's usage line above it), no
    traceback, and nothing started: train.py prints `run directory:` just before it builds the run."""
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "run directory:" not in out.stdout, out.stdout[-3000:]
    (line,) = [x for x in out.stderr.splitlines() if "error:" in x]
    return line


def test_an_edited_config_is_refused_naming_each_changed_key(base_run, tmp_path):
    """group_size 4 -> 2 and lr x 100 in config.yaml: listed, both, in one line, at once; --set
    naming one of them leaves the other refused. (At b1d2632 the resume trained step 3 with them.)"""
    run = copy_of(base_run, tmp_path)
    edit(run, train__group_size=2, train__lr=0.1)
    out, seconds = resume(run, "train.steps=3")
    line = refusal(out)
    assert "train.group_size 4 -> 2" in line and "train.lr 0.001 -> 0.1" in line, line
    assert "differs from the config step_2 was trained with" in line and "--set train.lr=0.1" in line, line
    assert seconds < 60, seconds  # no model, no engine: config and checkpoint files only
    line = refusal(resume(run, "train.steps=3", "train.lr=0.1")[0])
    assert "train.group_size 4 -> 2" in line and "train.lr" not in line, line
    assert not (run / "checkpoints" / "step_3").exists() and not (run / "config_changes.jsonl").exists()
    print(f"refused in {seconds:.1f} s")


def test_a_change_named_by_set_is_applied_and_recorded(base_run, tmp_path):
    """The same edit, named on the command line: step 3 runs with it, and the run directory says
    from which step: config.yaml holds the new values, config_changes.jsonl the change from step 3,
    step_2's checkpoint the config steps 1-2 ran with, step_3's the new one."""
    run = copy_of(base_run, tmp_path)
    edit(run, train__group_size=2, train__lr=0.1)
    out, _ = resume(run, "train.steps=3", "train.lr=0.1", "train.group_size=2")
    assert out.returncode == 0, out.stderr[-3000:]
    (said,) = [x for x in out.stdout.splitlines() if x.startswith("config changed from step 3 on:")]
    assert "train.steps 2 -> 3" in said and "train.lr 0.001 -> 0.1" in said and "train.group_size 4 -> 2" in said
    rows = [yaml.safe_load(x) for x in (run / "config_changes.jsonl").read_text().splitlines()]
    assert [(r["from_step"], r["checkpoint"], r["changes"]) for r in rows] == [
        (3, "step_2", {"train.steps": [2, 3], "train.group_size": [4, 2], "train.lr": [0.001, 0.1]})]  # fmt: skip
    cfg = {name: yaml.safe_load((run / name).read_text())["train"] for name in (
        "config.yaml", "checkpoints/step_2/config.yaml", "checkpoints/step_3/config.yaml")}  # fmt: skip
    assert [(c["lr"], c["group_size"], c["steps"]) for c in cfg.values()] == [(0.1, 2, 3), (0.001, 4, 2), (0.1, 2, 3)]
    metrics = [yaml.safe_load(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["lr"]) for r in metrics] == [(1, 0.001), (2, 0.001), (3, 0.1)]
    # resumed again from step_2 (step_3 lost, say): the change is the one recorded, not a silent one
    shutil.rmtree(run / "checkpoints" / "step_3")
    again, _ = resume(run)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len((run / "config_changes.jsonl").read_text().splitlines()) == 1  # the same change, recorded once


@pytest.mark.parametrize(
    "edited, named, cause",
    [
        ({"model__hidden_size": 256}, [], "the model's architecture"),
        ({"model__hidden_size": 256}, ["model.hidden_size=256"], "the model's architecture"),
        ({}, ["world.n_people=301"], "the tiny world's questions and corpus"),
        ({}, ["retriever.topk=2"], "part of the tiny world's build"),
    ],
)
def test_what_cannot_change_on_a_resume_is_refused_with_its_cause(base_run, tmp_path, edited, named, cause):
    """Named or not: the checkpoint's weights have the architecture's shape, and the tiny world
    (its corpus, questions, SFT start) is keyed on the world and the keys the teacher used. At
    b1d2632 each of these failed later with `corpus file not found` (the world's cache keyed on them)."""
    run = copy_of(base_run, tmp_path)
    edit(run, **edited)
    line = refusal(resume(run, "train.steps=3", *named)[0])
    key = next(iter(edited), named[0] if named else "").replace("__", ".").split("=")[0]
    assert f"cannot resume {run} from step_2 with {key} " in line and cause in line, line
    assert line.endswith("these cannot change on a resume, even named by --set; start a new run (--config) for them")


def test_steps_at_the_checkpoint_is_one_line_before_any_engine(base_run, tmp_path):
    """The run finished at step 2: resuming it (train.steps 2) or asking for fewer is one line, at
    once. At b1d2632 it started the engine, ran nothing and exited 0."""
    run = copy_of(base_run, tmp_path)
    out, seconds = resume(run)
    line = refusal(out)
    ckpt = run / "checkpoints" / "step_2"
    said = "error: train.steps 2 is not beyond the checkpoint's step 2: nothing to do; --set train.steps=K to continue"
    assert line.endswith(f"{said} (K > 2; checkpoint {ckpt})"), line
    assert seconds < 60, seconds
    assert "train.steps 1 is not beyond" in refusal(resume(run, "train.steps=1")[0])
    print(f"refused in {seconds:.1f} s")


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


def test_every_rank_of_a_resume_checks_the_run_dir_is_writable_at_once(tmp_path):
    """Both ranks of a 2-process resume run check_writable before the process group starts. With one
    probe file for both, one rank removed the file the other was about to, and its FileNotFoundError
    read as "cannot write in the run directory" (exit 2 in the dress rehearsal, 1 CI run in 3)."""
    script = "import sys, time; from pathlib import Path; from trainer.checkpoint import check_writable\n" \
             "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\n" \
             "while time.time() < float(sys.argv[2]) + 2: check_writable(Path(sys.argv[1]))\n"  # fmt: skip
    start = str(time.time() + 15)  # both past their imports: 2 s of checks side by side
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), start], cwd=ROOT, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]  # fmt: skip
    said = [(p.wait(timeout=300), p.stderr.read()) for p in ranks]
    assert [rc for rc, _ in said] == [0, 0], [err[-500:] for _, err in said]
    assert list(tmp_path.iterdir()) == []  # each rank's probe removed
