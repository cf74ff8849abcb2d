"""Ctrl-C (or SIGTERM) in the first seconds of a run, while train.py's imports load, is one line and
exit 128 + signal; 88e794b printed the traceback of whichever import the signal landed in."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("after, signum", [(0.3, signal.SIGINT), (1.5, signal.SIGINT), (1.0, signal.SIGTERM)])
def test_a_signal_while_train_py_starts_is_one_line(tmp_path, after, signum):
    child = subprocess.Popen([sys.executable, "train.py", "--set", f"train.run_dir={tmp_path}"], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(after)
    child.send_signal(signum)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 128 + signum, (child.returncode, err[-2000:])
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    assert "interrupted" in err and not any(tmp_path.iterdir())  # nothing written
