"""Faults of a multi-process run, launched for real (CPU processes over gloo, a few seconds of
train.dist_timeout): a rank that stops answering is named within the timeout and the job ends;
`accelerate launch --cpu --num_processes 2` is refused instead of training one process; Ctrl-C
and SIGTERM stop train.py with one line and 130 / 143, the last checkpoint intact.

Every launch and the processes under it are killed at the end (SIGKILL reaches a stopped
process too), so a test that fails leaves nothing behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, free_port, write_micro_config

TIMEOUT = 5  # train.dist_timeout of the launches, seconds
MARGIN = 25  # a loaded machine: the line must come within TIMEOUT + MARGIN of the wait's start


def start(cmd: list[str], **kw) -> subprocess.Popen:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, text=True, **kw)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the launch and every process under it (torchrun starts each rank in a session of its own)."""
    import psutil  # accelerate's dependency

    try:
        under = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        under = []
    for child in under:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def torchrun(logs: Path, *args: str) -> list[str]:
    """2 CPU processes; each one's stdout and stderr in logs/<run>/attempt_0/<rank>/, the launcher's apart."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
            "--log-dir", str(logs), "--redirects", "3", *args]  # fmt: skip


def rank_log(logs: Path, rank: int, name: str) -> str:
    found = list(logs.glob(f"*/attempt_0/{rank}/{name}.log"))
    return found[0].read_text() if found else ""


def wait_for(condition, seconds: float, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if condition():
            return True
        if proc is not None and proc.poll() is not None:
            return bool(condition())
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("mode", ["stop", "raw"])  # "sleep" works too: the same path as "stop"
def test_a_rank_that_stops_answering_is_named_within_the_timeout(tmp_path, mode):
    """Rank 1 sleeps, or is stopped (SIGSTOP), or rank 0 waits in a bare collective (FSDP's):
    rank 0 says in one line that rank 1 stopped answering, within train.dist_timeout (torch's
    default is 30 min, and gloo's own error names no rank)."""
    logs = tmp_path / "logs"
    proc = start(torchrun(logs, "tests/dist_fault.py", mode, str(TIMEOUT)), stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT)  # fmt: skip
    try:
        assert wait_for(lambda: rank_log(logs, 0, "stdout").startswith("waiting"), 120, proc), proc.stdout.read()
        waiting = float(rank_log(logs, 0, "stdout").split()[1])
        assert wait_for(lambda: rank_log(logs, 0, "stderr"), TIMEOUT + MARGIN, proc), "rank 0 still waits"
        said = time.time()
        if mode != "stop":  # the launcher ends rank 1 (SIGTERM) and exits non-zero; a stopped rank takes it 30 s
            assert proc.wait(timeout=MARGIN) != 0
    finally:
        kill(proc)
    lines = rank_log(logs, 0, "stderr").splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: rank 1 stopped answering: no reply within train.dist_timeout={TIMEOUT} s; "
                               "rank 0 waited "), lines  # fmt: skip
    where = "at tests/dist_fault.py:" if mode == "raw" else "in gather_lists, called at tests/dist_fault.py:"
    assert where in lines[0], lines
    assert TIMEOUT - 1 < said - waiting < TIMEOUT + MARGIN
    assert rank_log(logs, 1, "stderr") == ""


def test_a_rank_that_exits_mid_collective_is_named_in_one_line(tmp_path):
    """Rank 1 exits while rank 0 waits in a collective: rank 0 says so in one line at once, not
    with gloo's traceback ("Connection closed by peer"). The launcher looks at its ranks every
    10 s here, so that it does not stop rank 0 before rank 0 has spoken. An exit is seen at once (the
    peer's socket closes), not at the collective timeout, so the launch gets a long one: at TIMEOUT
    (5 s) a rank starved on a loaded CI machine timed out in the group's first gather instead."""
    logs = tmp_path / "logs"
    cmd = torchrun(logs, "tests/dist_fault.py", "exit", "60")
    cmd[3:3] = ["--monitor-interval", "10"]
    proc = start(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: rank_log(logs, 0, "stderr"), 120, proc), proc.stdout.read()[-3000:]
        assert proc.wait(timeout=60) != 0
    finally:
        kill(proc)
    lines = rank_log(logs, 0, "stderr").splitlines()
    said = "error: rank 1 exited during a collective (its own log says why); rank 0 waited in gather_lists, called at "
    assert len(lines) == 1 and lines[0].startswith(said), lines


def test_waiting_for_rank_0_is_not_bounded_by_the_timeout(tmp_path):
    """wait_for_main: rank 0 working alone for longer than train.dist_timeout (the tiny world's
    build, 10-20 min on a CPU, against 600 s) is not taken for a rank that stopped answering. The
    timeout is 3 x TIMEOUT: the group's first gather, before the wait, is bounded by it too, and at
    5 s a rank starved on a loaded CI machine timed out there once (rank 1 exit 1)."""
    timeout = 3 * TIMEOUT
    logs = tmp_path / "logs"
    proc = start(torchrun(logs, "tests/dist_fault.py", "slow_main", str(timeout)), stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT)  # fmt: skip
    try:
        out = proc.communicate(timeout=150)[0]
    finally:
        kill(proc)
    assert proc.returncode == 0, (rank_log(logs, 0, "stderr") + rank_log(logs, 1, "stderr"))[-3000:] or out[-3000:]
    for rank in (0, 1):
        assert rank_log(tmp_path / "logs", rank, "stdout") == "world 2\n"


def test_cpu_launch_of_two_processes_is_refused():
    """`accelerate launch --cpu --num_processes 2` starts ONE process (accelerate 1.x, no mpirun):
    init() refuses it in one line naming the launch that works, instead of training with world 1.
    (accelerate's launcher prints its own traceback when the process exits non-zero.)"""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           "tests/dist_fault.py", "launch", str(TIMEOUT)]  # fmt: skip
    proc = start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        kill(proc)
    assert "world" not in out, out
    assert proc.returncode != 0
    said = [line for line in err.splitlines() if line.startswith("error: this launch gives the processes no rank")]
    assert len(said) == 1 and "accelerate launch --multi_gpu --num_processes N" in said[0], err[-3000:]
    assert "ConfigError" not in err  # one line from the process; accelerate then adds its own CalledProcessError


def test_check_launch_refuses_unranked_launches(monkeypatch):
    from trainer.config import ConfigError
    from trainer.faults import check_launch

    for name in ("WORLD_SIZE", "MASTER_ADDR", "ACCELERATE_USE_CPU", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    check_launch()  # plain python
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    check_launch()  # `accelerate launch --cpu` with one process: no MASTER_ADDR
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ConfigError, match="--multi_gpu"):
        check_launch()
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun, `accelerate launch --multi_gpu`
    check_launch()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")  # mpirun: N processes, each would think it is alone
    with pytest.raises(ConfigError):
        check_launch()


def micro_run(micro, tmp_path: Path, **train) -> Path:
    return write_micro_config(
        tmp_path / "c.yaml", micro[1].world.cache_dir, rollout={"engine": "hf"},
        train={"steps": 50, "save_every": 1, "threads": 1, "run_dir": str(tmp_path / "runs"), "name": "sig"} | train,
    )  # fmt: skip


def lines_of(stderr: str) -> list[str]:
    """stderr without the progress bars (tqdm redraws its line with \\r)."""
    parts = [p.strip() for line in stderr.split("\n") for p in line.split("\r")]
    return [p for p in parts if p and not p.startswith(("grpo:", "Loading weights", "Writing model shards"))]


@pytest.mark.parametrize("signum", [signal.SIGTERM], ids=["SIGTERM"])  # SIGINT: the 2-process test below
def test_signal_stops_train_with_one_line(micro, tmp_path, signum):
    """SIGTERM (or Ctrl-C's SIGINT, the same handler) during step 2 of a plain `python train.py`:
    one line saying where to resume from, exit 128 + signal, no traceback; the step-1 checkpoint
    stays and verifies."""
    from trainer.checkpoint import latest_checkpoint, verify_checkpoint

    proc = start([sys.executable, "train.py", "--config", str(micro_run(micro, tmp_path))], stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE)  # fmt: skip
    try:
        assert wait_for(lambda: list((tmp_path / "runs").glob("sig-*/checkpoints/step_1")), 120, proc)
        time.sleep(0.5)  # step 2 under way
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        kill(proc)
    run = next((tmp_path / "runs").glob("sig-*"))
    assert "run directory:" in out
    assert proc.returncode == 128 + signum, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = latest_checkpoint(run)  # step_1, or step_2 if that step ended before the signal came
    assert lines_of(err) == [f"interrupted by {signum.name} ({run}). The last good checkpoint is {last}: "
                             f"python train.py --resume {run}"], err[-3000:]  # fmt: skip
    verify_checkpoint(last)


FINALIZER_SIGNAL = """
import os, signal, sys
sys.path.insert(0, os.getcwd())
from trainer import faults
faults.stop_on_signals()
class Collected:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(100000))  # the handler runs here, inside __del__
Collected()
print("went on", flush=True)
faults.raise_if_interrupted()
"""


def test_a_signal_inside_a_finalizer_is_not_lost():
    """Ctrl-C while a __del__ runs (CI saw it in a tokenizer's regex object): an exception there
    would be printed as "Exception ignored ... Traceback" and lost, and the run would go on. The
    handler holds it until the next step or collective (raise_if_interrupted), silently."""
    code = FINALIZER_SIGNAL + "print('not raised')\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout == "went on\n", (out.stdout, out.stderr)
    assert "Exception ignored" not in out.stderr and out.stderr.rstrip().endswith("trainer.faults.Interrupted: SIGINT")


def test_sigint_to_a_two_process_launch_gives_one_line(micro, tmp_path):
    """Ctrl-C on torchrun (2 CPU processes, FSDP): the launcher passes SIGINT to both ranks; rank 0
    says one line, rank 1 nothing, neither prints a traceback (the launcher's own output aside)."""
    logs = tmp_path / "logs"
    config = micro_run(micro, tmp_path, fsdp=True, save_every=0)
    proc = start(torchrun(logs, "train.py", "--config", str(config)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: "grpo:" in rank_log(logs, 0, "stderr"), 150, proc), proc.stdout.read()[-3000:]
        time.sleep(1)  # a step under way
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        kill(proc)
    err0, err1 = rank_log(logs, 0, "stderr"), rank_log(logs, 1, "stderr")
    assert "Traceback" not in err0 + err1, (err0[-3000:], err1[-3000:])
    run = next((tmp_path / "runs").glob("sig-*"))
    assert lines_of(err0) == [f"interrupted by SIGINT ({run}). No checkpoint was written yet"], err0[-3000:]
    assert lines_of(err1) == [], err1[-3000:]
