"""One-step-off overlap (train.overlap): step k+1's rollout runs while step k scores and updates.

    pipe = Pipeline(version=step0)          # the engine serves the starting weights
    start(pipe, step + 1, lambda: roll_out_mine(...), searched)   # a thread; the engine in its process
    records = collect(pipe, gather)         # joined, gathered, each record tagged with its version
    check_staleness(records, step, max_staleness)   # a token older than the bound: TrainingFault

The form (docs/overlap.md says why): colocated, one rollout in flight. The vLLM engine runs in a
process of its own (rollout.weight_sync's file path), so a thread of the training process only
drives it (tool calls, tokenising: cheap Python) while the main thread's update releases the GIL in
torch. Weights are synced at rollout boundaries only, when no rollout is in flight: a trajectory is
never split across two policies, and the engine never loads weights mid-decode.

Policy versions: version v is the policy after v steps' updates (a checkpoint's step_v; one step
may hold several optimizer steps, train.epochs x mini_batches, and is one version). The rollout of
step k+1 starts when the engine serves version k (synced at the start of step k) and is trained at
step k+1 by policy k+1: staleness 1. Each record carries `versions`, runs of [first response token,
version] (token_versions expands them), so a carried-over partial rollout would span versions
without a new format. max_staleness 0 launches nothing ahead: the synchronous loop.

The off-policy correction is trainer/offpolicy.py's (stale_correction): AReaL's decoupled PPO on the
stale tokens, the engine's logprobs as the behaviour policy, the trainer's before the update as the
proximal one, the importance weight truncated as in verl's TIS.

Resume: a checkpoint written while a rollout is in flight waits for it and keeps its finished
records (in_flight_state): step, version, the records. The data order saved is the one after that
batch was taken, so a resumed run trains on exactly those records, and no question is lost or
counted twice.

Timeline: run/timeline.jsonl, one line per stage per step, {step, who (trainer | engine), stage,
start, end} in seconds since the epoch; benchmarks/bench_overlap.py draws it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from trainer.config import ConfigError, TrainingFault


def overlap_on(train) -> bool:
    """train.overlap with a rollout ahead (a TrainConfig): max_staleness 0 is the synchronous loop."""
    return train.overlap and train.max_staleness > 0


@dataclass
class InFlight:
    """One rollout started ahead: the step it is for, the version the engine served, its result."""

    step: int
    version: int
    future: Future
    gathered: bool = False  # its records are every rank's already, tagged (settled, or from a checkpoint)
    seconds: float = 0.0  # the rollout's wall time in its thread
    retrieve: float = 0.0  # of which its search calls
    waited: float = 0.0  # how long the trainer waited for it


@dataclass
class Pipeline:
    """What the overlapped loop carries from step to step: the engine's version, the rollout in flight."""

    version: int  # the policy version the engine serves now
    pending: InFlight | None = None
    timeline: Path | None = None  # run/timeline.jsonl on the main rank
    collected: InFlight | None = None  # the last rollout collect() joined (its times)
    sync_seconds: float = 0.0  # the sync done since, for the step's row


def start(pipe: Pipeline, step: int, roll_out: Callable[[], list[dict]], searched: Callable[[], float]) -> InFlight:
    """Run roll_out() in a daemon thread (a run stopped by a signal does not wait for it);
    searched() is the run's running total of search seconds, read before and after. The engine
    must not load weights until collect() has joined it."""
    pending = pipe.pending = InFlight(step, pipe.version, Future())

    def work() -> None:
        began, searched0 = time.time(), searched()
        try:
            records = roll_out()
        except BaseException as e:  # handed to the main thread at collect()
            pending.future.set_exception(e)
            return
        pending.seconds, pending.retrieve = time.time() - began, searched() - searched0
        note(pipe.timeline, step, "engine", "rollout", began, time.time())
        pending.future.set_result(records)

    threading.Thread(target=work, name=f"rollout-step-{step + 1}", daemon=True).start()
    return pending


def finished(step: int, version: int, records: list[dict]) -> InFlight:
    """An InFlight already done and gathered: a settled rollout, or a resumed run's checkpointed one."""
    future: Future = Future()
    future.set_result(records)
    return InFlight(step, version, future, gathered=True)


def collect(pipe: Pipeline, gather: Callable[[list[dict]], list[dict]]) -> list[dict]:
    """Join the rollout in flight (its error, if any, raised here), gather every rank's records
    (a collective: the main thread's only), tag each with the version that generated it."""
    pending, pipe.pending = pipe.pending, None
    t0 = time.time()
    mine = pending.future.result()
    pending.waited += note(pipe.timeline, pending.step, "trainer", "wait", t0, time.time()) - t0
    pipe.collected = pending
    records = mine if pending.gathered else gather(mine)
    for r in records:
        r.setdefault("versions", [[0, pending.version]])
    return records


def settle(pipe: Pipeline, gather: Callable[[list[dict]], list[dict]]) -> None:
    """Join the rollout in flight and keep its records as pending (gathered and tagged), so the
    engine is idle: before an evaluation or a checkpoint."""
    if pipe.pending is not None and not pipe.pending.gathered:
        ran = pipe.pending
        pipe.pending = finished(ran.step, ran.version, collect(pipe, gather))
        pipe.pending.seconds, pipe.pending.retrieve, pipe.pending.waited = ran.seconds, ran.retrieve, ran.waited


def token_versions(record: dict) -> list[int]:
    """The policy version of each response token, from the record's runs of [first token, version].

    >>> token_versions({"response_ids": [5, 6, 7, 8], "versions": [[0, 3], [2, 4]]})
    [3, 3, 4, 4]
    """
    runs = record["versions"]
    n = len(record["response_ids"])
    out = []
    for (first, version), nxt in zip(runs, [*runs[1:], [n, None]]):
        out += [version] * (nxt[0] - first)
    return out


def check_staleness(records: list[dict], version: int, max_staleness: int) -> None:
    """The bound: no token trained by policy `version` (at step `version`, 0-based) may be more
    than max_staleness versions older."""
    oldest = min((v for r in records if "versions" in r for _, v in r["versions"]), default=version)
    if version - oldest > max_staleness:
        raise TrainingFault(f"step {version + 1}: a rollout token of policy version {oldest} would be trained by "
                            f"version {version}, beyond train.max_staleness {max_staleness}")  # fmt: skip


def in_flight_state(pipe: Pipeline) -> dict | None:
    """What a checkpoint keeps of the rollout in flight (settle() first): its step, the version that
    generated it and its records; None when there is none."""
    if pipe.pending is None:
        return None
    return {"step": pipe.pending.step, "version": pipe.pending.version, "records": pipe.pending.future.result()}


def restore(pipe: Pipeline, state: dict | None) -> None:
    """A resumed run's rollout in flight, from in_flight_state."""
    if state:
        pipe.pending = finished(state["step"], state["version"], state["records"])


def check_in_flight(state: dict, ckpt: Path, overlap: bool) -> None:
    """Before a resume changes anything: a checkpoint (its trainer_state) holding a rollout in flight
    resumes only with overlap on (train.overlap, max_staleness 1). Its questions have left the saved
    data order, so the synchronous loop would skip them."""
    flight = state.get("in_flight")
    if flight and not overlap:
        raise ConfigError(f"{ckpt} holds the rollout in flight of an overlapped run (step {flight['step'] + 1}'s "
                          "questions): resume it with train.overlap true and train.max_staleness 1")  # fmt: skip


def note(path: Path | None, step: int, who: str, stage: str, start: float, end: float) -> float:
    """One line of the run's timeline (nothing off the main rank); returns `end`."""
    if path is not None:
        with open(path, "a") as f:
            f.write(json.dumps({"step": step + 1, "who": who, "stage": stage, "start": start, "end": end}) + "\n")
    return end
