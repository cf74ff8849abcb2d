"""Who owns a run directory.

    runs/<name>-<time>[-<n>]/
        run.lock              held (fcntl.flock) by the process that trains in the directory; holds its pid

One run at a time. A second `train.py` in a directory that a run owns (a `--resume` of a run that
is still going, a scheduler that resumed it twice) would write the same metrics.jsonl and
checkpoints; it is refused in one line naming the pid that holds run.lock (`own_run_dir`). Under
several processes only rank 0 takes the lock: the other ranks are the same run. Fresh runs never
share a directory: two started in the same second with the same train.run_dir (a sweep launched at
once) get <name>-<time> and <name>-<time>-2 (`make_unique_dir`, an atomic mkdir).
"""

from __future__ import annotations

import fcntl
import itertools
import os
import socket
import time
from pathlib import Path

from trainer.config import RunDirError

LOCK = "run.lock"

# Held for the process's lifetime: the lock goes when the process does, however it ends (a
# SIGKILL too), so a killed run never leaves its directory locked. The descriptor is
# close-on-exec (Python's default), so a spawned engine or SFT child does not hold it after us.
_held: dict[Path, int] = {}


def _cause(e: OSError) -> str:
    return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")


def _main_rank() -> bool:
    """Rank 0 (RANK as torchrun / accelerate set it; distributed.init reads the same), or one process.
    Read from the environment: a resume checks its run directory before the process group starts."""
    return int(os.environ.get("RANK", "0")) == 0


def make_unique_dir(base: Path, tries: int = 1000) -> Path:
    """Make `base`, or base-2, base-3, ... when taken: mkdir is atomic, so of two processes that
    pick the same name in the same second one gets it and the other the next (before, the second
    failed with `File exists` and a sweep launched at once kept one job). OSError as mkdir gives it."""
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        run = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            run.mkdir()
            return run
        except FileExistsError:
            if n >= tries:
                raise
    raise AssertionError("unreachable")


def own_run_dir(run: Path) -> None:
    """Lock `run` for this process (rank 0 only; see the module docstring), or a RunDirError
    naming the pid (and host) of the process that holds it."""
    if not _main_rank() or run.resolve() in _held:
        return
    path = run / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RunDirError(f"cannot write in the run directory {run}: {_cause(e)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise RunDirError(f"the run directory {run} is in use: {holder} holds {path}; one process trains in a run "
                          "directory at a time (wait for it to end, or stop it, then --resume)") from None  # fmt: skip
    except OSError as e:  # a filesystem without locks: one line, not a run that might share the directory
        os.close(fd)
        raise RunDirError(f"cannot lock {path}: {_cause(e)}") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    _held[run.resolve()] = fd


def _holder(fd: int) -> str:
    """'pid 1234 on host-a' from a held lock file; the holder writes it just after it locks, so an
    empty file is read again for up to a second."""
    for _ in range(20):
        words = os.pread(fd, 200, 0).decode(errors="replace").split()
        if words:
            return f"pid {words[0]}" + (f" on {words[1]}" if len(words) > 1 else "")
        time.sleep(0.05)
    return "another process (its pid not yet written)"
