"""The faults of a multi-process run: a process that stops answering, a launch that would give
every process world 1, and Ctrl-C / SIGTERM. trainer/distributed.py's collectives go through
`collective`; train.py's main() installs `stop_on_signals` and says one line for each.

A process that stops answering (hung, stopped, dead) must not hang the others: every collective
waits at most train.dist_timeout seconds (distributed.init(timeout), the process group's
timeout), then the run stops with one line naming the rank that did not get there (TrainingFault
from the trainer's own broadcast, gather_lists, barrier and all_reduce; train.py's main() turns
FSDP's timeouts into the same line with `stopped_answering`). With NCCL, torch's watchdog ends
the processes at that timeout with its own message. Work only rank 0 does that may take longer
(the tiny world's build) ends in `wait_for_main`, which has no time limit.

    python -m pytest -q tests/test_dist_faults.py     # real 2-process launches over gloo
"""

from __future__ import annotations

import datetime
import os
import signal
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.config import ConfigError, TrainingFault

# The group's timeout (train.dist_timeout, set by `init`) and this process's count of the trainer's
# collectives so far, which each rank posts to the launcher's store before every collective: when
# one times out, the ranks whose count is behind are the ones that did not get there.
_timeout = 600.0
_calls = 0
_progress = None  # the store client (torch.distributed.TCPStore), or None if there is none to reach
_interrupted = 0  # the signal that arrived (stop_on_signals), 0 if none: see raise_if_interrupted

# Multi-CPU launches that give each process no RANK / WORLD_SIZE: the MPI's own process counts
MPI_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def watch(rank: int, timeout: float) -> None:
    """After the process group starts (distributed.init): the timeout its collectives wait, and
    the store this rank posts its count of collectives to."""
    global _timeout, _progress
    _timeout = timeout
    _progress = _progress_store(rank, timeout)


def forget() -> None:
    """Drop the store client before the process exits (distributed.close)."""
    global _progress
    _progress = None


def check_launch() -> None:
    """ConfigError when the processes were launched but not told their rank and world, so each
    would train alone: `accelerate launch --cpu --num_processes N` on one machine (accelerate 1.x
    then starts ONE process, with MASTER_ADDR set and no WORLD_SIZE; its multi-CPU mode needs
    mpirun), or mpirun itself (which sets its own OMPI_COMM_WORLD_SIZE / PMI_SIZE instead)."""
    if "WORLD_SIZE" in os.environ:
        return
    cpu_launch = os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true" and "MASTER_ADDR" in os.environ
    if cpu_launch or any(int(os.environ.get(name, "1") or "1") > 1 for name in MPI_SIZES):
        raise ConfigError("this launch gives the processes no rank (`accelerate launch --cpu --num_processes N` "
                          "starts one process); for N CPU processes use `accelerate launch --multi_gpu "
                          "--num_processes N` or `torchrun --nproc_per_node N` (gloo)")  # fmt: skip


def _progress_store(rank: int, timeout: float):
    """A client of the launcher's rendezvous store (MASTER_ADDR:MASTER_PORT; torchrun and
    `accelerate launch` keep it in their agent, not in a worker), with this rank's count at 0.
    None when there is no such store: a timeout then names the ranks less precisely."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout))
        store.set(f"trainer/calls/{rank}", "0")
    except (RuntimeError, ValueError):
        return None
    return store


def collective(run: Callable, *args):
    """run(*args), one of the trainer's collectives. When it times out (gloo: a RuntimeError
    "Timed out waiting ...ms"), a TrainingFault names the rank(s) that stopped answering and
    where this rank waited, instead of gloo's message that names no peer. (NCCL's own watchdog
    ends a process whose GPU collective times out, with its message, at the same timeout.)"""
    global _calls
    raise_if_interrupted()  # not into a collective the interrupted ranks will never reach
    _calls += 1
    if _progress is not None:
        _progress.set(f"trainer/calls/{dist.get_rank()}", str(_calls))
    try:
        return run(*args)
    except RuntimeError as e:  # torch.distributed.DistBackendError is one
        raise_if_interrupted()  # the others stopped for the same signal: not their fault
        fault = stopped_answering(e)
        if fault is None:
            raise
        raise fault from None


def stopped_answering(error: BaseException) -> TrainingFault | None:
    """A collective's timeout as a TrainingFault of one line: which rank(s) stopped answering,
    the timeout (train.dist_timeout) and where this rank waited (the collective and the
    innermost project line). None for any other error, or without a process group.

    gloo names no peer ("[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms
    for recv operation to complete"): of 2 processes the other one is the culprit; of more, the
    ranks whose count of collectives in the store is behind this rank's never got here."""
    text = str(error).lower()
    collective = "gloo" in text or isinstance(error, dist.DistBackendError)  # not, say, an HTTP timeout
    gone = "closed by peer" in text or "reset by peer" in text  # the other process exited mid-collective
    if not (collective and ("timed out" in text or "timeout" in text or gone)) or not dist.is_initialized():
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    others = [r for r in range(world) if r != rank]
    late = others if world == 2 else _behind(others)
    if len(late) == 1:
        who = f"rank {late[0]}"
    else:
        who = f"ranks {', '.join(map(str, late))}" if late else f"one of ranks {', '.join(map(str, others))}"
    if gone:  # its own log says why; this rank's traceback would only repeat gloo's message
        return TrainingFault(f"{who} exited during a collective (its own log says why); "
                             f"rank {rank} waited {_where(error)}")  # fmt: skip
    return TrainingFault(f"{who} stopped answering: no reply within train.dist_timeout={_timeout:g} s; "
                         f"rank {rank} waited {_where(error)}")  # fmt: skip


def _behind(others: list[int]) -> list[int]:
    """The ranks whose count of collectives in the store is below this rank's: they never
    reached the collective this rank waits in. [] when the store cannot tell."""
    if _progress is None:
        return []
    try:
        calls = [int(v or 0) for v in _progress.multi_get([f"trainer/calls/{r}" for r in others])]
    except (RuntimeError, ValueError):  # the store itself gone or stopped
        return []
    return [r for r, n in zip(others, calls) if n < _calls]


def _where(error: BaseException) -> str:
    """'in gather_lists, called at train.py:317 in roll_out': the trainer's collective (if the
    wait was in one) and the innermost line of the project's own code around it."""
    outer = [f for f, _ in traceback.walk_stack(None)][::-1]  # main ... here
    frames = outer + [f for f, _ in traceback.walk_tb(error.__traceback__)]  # ... down to where it was raised
    root, here = Path(__file__).resolve().parents[1], Path(__file__).resolve()
    wrapper = here.with_name("distributed.py")  # the trainer's collectives, which call collective()
    ours = [f for f in frames if (path := Path(f.f_code.co_filename).resolve()).is_relative_to(root)
            and "site-packages" not in path.parts and path not in (here, wrapper)]  # fmt: skip
    public = {"broadcast", "gather_lists", "barrier", "all_reduce"}
    collective = next((f.f_code.co_name for f in frames if f.f_code.co_name in public
                       and Path(f.f_code.co_filename).resolve() == wrapper), None)  # fmt: skip
    line = ""
    if ours:
        f = ours[-1]
        line = f"{Path(f.f_code.co_filename).resolve().relative_to(root)}:{f.f_lineno} in {f.f_code.co_name}"
    if collective:
        return f"in {collective}, called at {line}" if line else f"in {collective}"
    return f"at {line}" if line else "in a collective"


class Interrupted(BaseException):  # like KeyboardInterrupt: `except Exception` lets it through
    """SIGINT or SIGTERM arrived (Ctrl-C, `kill`, a launcher stopping its processes): raised in
    the main thread wherever it is, so the run unwinds, and train.py's main() says one line."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_on_signals() -> None:
    """SIGINT and SIGTERM raise Interrupted (one line and exit 128 + signal in main(), not a
    traceback, nor a silent SIGTERM). A second one while the run unwinds exits at once, silently.

    Python runs the handler wherever the main thread is, and an exception raised inside a
    __del__ (a tokenizer's regex object being collected, say: seen in CI) is printed as
    "Exception ignored in ..." with a traceback, and lost. So the signal is remembered, the
    handler does not raise inside a __del__, and raise_if_interrupted, at every step and every
    collective, raises it there (or again, after any other place that swallowed it)."""

    def stop(signum, frame):
        global _interrupted
        _interrupted = signum
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, lambda n, f: os._exit(128 + n))
        if not _in_finalizer(frame):
            raise Interrupted(signum)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, stop)


def _in_finalizer(frame) -> bool:
    """Whether the interrupted frame runs inside a __del__ (which would swallow an exception)."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def interrupted() -> Interrupted | None:
    """The Interrupted of the signal that came (stop_on_signals), or None if none came."""
    return Interrupted(_interrupted) if _interrupted else None


def raise_if_interrupted() -> None:
    """Interrupted, if a signal came: again, in case its first raise was swallowed."""
    if (stop := interrupted()) is not None:
        raise stop


def wait_for_main(world: int, what: str) -> None:
    """Every rank waits here for rank 0, with no time limit: after work only rank 0 does that may
    take longer than train.dist_timeout (building the tiny world and its SFT start, a warm start:
    10-20 min on a CPU). A barrier would time out and blame rank 0; if rank 0 fails instead, it
    exits and the launcher stops the others. `what` names the wait (one key per wait)."""
    if world == 1:
        return
    if _progress is None:  # no store to wait on: a plain barrier, within train.dist_timeout
        collective(dist.barrier)
    elif dist.get_rank() == 0:
        _progress.set(f"trainer/done/{what}", "1")
    else:
        _progress.wait([f"trainer/done/{what}"], datetime.timedelta(days=7))


def check_engine_logprobs(records: list[dict], engine: str, step: int) -> None:
    """A rollout engine that returns non-finite sampling log-probabilities stops the step with one
    line naming the engine: left alone they reach the PPO ratio and the run stopped one stage later
    with "non-finite loss ... see rewards, advantages", pointing away from the cause (seen: vLLM CPU
    0.32 under ATEN_CPU_CAPABILITY=avx2 on a CPU with AVX-512-BF16 generated garbage with NaN
    log-probabilities; results/cpu_kernels.md says which overrides it tolerates).

    >>> check_engine_logprobs([{"logprobs": [-0.5, float("nan")], "loss_mask": [1, 1]}], "vllm", 3)
    Traceback (most recent call last):
    ...
    trainer.config.TrainingFault: step 3: the rollout engine (vllm) returned non-finite log-probabilities ...
    """
    bad = total = 0
    for r in records:
        lp = torch.tensor(r["logprobs"], dtype=torch.float64)
        mine = torch.tensor(r["loss_mask"], dtype=torch.bool)  # the policy's own tokens; tool text has 0.0
        bad += int((~torch.isfinite(lp[mine])).sum())
        total += int(mine.sum())
    if bad:
        raise TrainingFault(
            f"step {step}: the rollout engine ({engine}) returned non-finite log-probabilities for {bad} of {total} "
            "generated tokens: the engine's numerics, not the rewards or advantages; on a CPU, an "
            "ATEN_CPU_CAPABILITY or oneDNN override vLLM does not tolerate is a known cause (results/cpu_kernels.md)"
        )
