"""The run directory, and checkpoints that let a killed run continue exactly where it stopped.

    runs/<name>-<time>/
        config.yaml        the whole config the run uses (new_run_dir; a resume's --set changes: trainer/rundir.py)
        run.lock, config_changes.jsonl   the process that owns the run; what resumes changed (trainer/rundir.py)
        metrics.jsonl      one JSON row per step: batch means, losses, timings, evaluations (log)
        samples/step_<k>.jsonl   the first `train.samples_per_step` rollouts of step k (write_samples)
    runs/<name>-<time>/checkpoints/step_<k>/
        model.safetensors, config.json, tokenizer files   the policy (loadable by eval.py / vLLM)
        critic/                                           PPO's value model, when there is one
        optimizer.rank<r>.pt  each process's optimizer state (its FSDP shard; rank0 alone otherwise)
        critic_optimizer.rank<r>.pt   the same for PPO's critic
        trainer_state.pt   step, the data order's RNG,
                           torch / numpy / python RNG states, the Lagrange multipliers, the
                           BAPO stage
        metrics.jsonl      the run's metrics up to step k (restored on resume, so the log has
                           no rows from steps that will be redone)
        config.yaml        the config steps up to k were trained with: what a resume compares
                           the run's config with (trainer/rundir.py)

A checkpoint is written into `step_<k>.tmp`, flushed to the disk (fsync), and renamed when
complete, so a crash or a power cut while saving never leaves a half checkpoint that looks whole;
only the newest `keep` are kept, and pruning happens only after the new one is in place. Weights
holding a NaN or inf are never saved (TrainingFault, nothing written, nothing pruned). A write
that fails (disk full) removes the `.tmp` and stops the run with one line naming the path.
`python train.py --resume RUN_DIR` loads the newest checkpoint that reads back whole (train.py,
verified_checkpoint): a broken newer one (a truncated file, a missing trainer_state.pt) is passed
over, in one line, and left in place; its .pt files are loaded with torch.load(weights_only=True):
a checkpoint that would run code as it loads is refused. Other names under checkpoints/
(`step_2.bak`, a copy) are not checkpoints: resume and pruning ignore them.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed.tensor  # noqa: F401  registers DTensor with weights_only loading (FSDP2 optimizer shards)
import yaml

from trainer.config import Config, ConfigError, RunDirError, TrainingFault, config_to_dict
from trainer.distributed import all_reduce, barrier, local_finite, save_full_state
from trainer.fsync import fsync_path, fsync_tree
from trainer.lora import merge_and_save
from trainer.ppo import save_critic
from trainer.rundir import make_unique_dir

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _reconstruct

# What a checkpoint's .pt files may hold beyond tensors and plain data: numpy's RNG state is an
# ndarray of uint32. Anything else (a pickled object whose __reduce__ runs code) is refused.
NUMPY_RNG_GLOBALS = [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _cause(e: OSError) -> str:
    """'No space left on device: /runs/x/checkpoints/step_3.tmp/model.safetensors' from an OSError."""
    return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")


def new_run_dir(cfg: Config) -> Path:
    """runs/<name>-<time>/ with the run's config.yaml, or <name>-<time>-2, -3, ... when another run
    took that name in the same second (rundir.make_unique_dir); one that cannot be made (read-only,
    under a file, disk full) is one line naming the path."""
    run = Path(cfg.train.run_dir) / f"{cfg.train.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    made = False
    try:
        run = make_unique_dir(run)
        made = True
        (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    except OSError as e:
        if made:  # an empty run directory would look like a run that died at once
            shutil.rmtree(run, ignore_errors=True)
        raise RunDirError(f"cannot create the run directory {run} (train.run_dir): {_cause(e)}") from None
    return run


def log(run: Path, row: dict) -> None:
    """Append one row to the run's metrics.jsonl."""
    path = run / "metrics.jsonl"
    try:
        with open(path, "a") as f:
            f.write(json.dumps(row, default=_plain) + "\n")
    except OSError as e:
        raise RunDirError(f"cannot append to {path}: {_cause(e)}") from None


def _plain(value):
    """json's fallback for what it cannot write, met after the step's optimizer update (a numpy
    scalar a fork's reward put in a record): numpy's and torch's values as Python numbers or lists,
    anything else as its repr. Losing the step's samples or metrics row to a type would be worse."""
    return value.tolist() if hasattr(value, "tolist") else repr(value)


def write_samples(run: Path, step: int, records: list[dict]) -> None:
    """samples/step_<step>.jsonl: the records as the viewer reads them."""
    path = run / "samples" / f"step_{step}.jsonl"
    # without private caches such as answers.parsed's "_parsed"; every line made before the file is
    # opened, so nothing leaves an empty file (rewards reach here as floats: agent/scoring.py)
    text = "".join(json.dumps({k: v for k, v in r.items() if not k.startswith("_")}, default=_plain) + "\n"
                   for r in records)  # fmt: skip
    try:
        path.parent.mkdir(exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise RunDirError(f"cannot write {path}: {_cause(e)}") from None


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(run: Path, step: int, model, tokenizer, optimizer, trainer_state: dict, keep: int = 2,
                    critic=None, rank: int = 0, world: int = 1, critic_optimizer=None,
                    config: dict | None = None) -> Path:  # fmt: skip
    """Write step_<step> atomically (temp dir, fsync, then rename) and drop all but the newest `keep`.
    `config` (config_to_dict of the run's Config) goes in as config.yaml: what a resume compares with.
    Every process calls it: under FSDP the full weights are gathered tensor by tensor and written
    by rank 0, and each process writes its own shard of the optimizer state. A write that fails
    (disk full, read-only) removes the partial step_<step>.tmp, which would otherwise hold the disk
    full, keeps the earlier checkpoints, and is a RunDirError naming the path and the cause.
    Weights (policy or critic) holding a NaN or inf are a TrainingFault naming the first such
    tensor, on every process alike, before anything is written or pruned: a resume must never
    start from a poisoned checkpoint, nor lose the last good one to make room for it."""
    ckpt = run / "checkpoints" / f"step_{step}"
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    bad = _first_non_finite({"policy": model, "critic": critic}, world)
    if bad is not None:
        raise TrainingFault(f"refusing to save checkpoint {ckpt}: the {bad} holds a NaN or inf; nothing was "
                            f"written and the earlier checkpoints are kept")  # fmt: skip
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier(world)
        if world > 1:
            save_full_state(model, tmp / "model.safetensors", rank)
            if rank == 0:
                model.config.save_pretrained(tmp)
        elif hasattr(model, "peft_config"):  # LoRA: the merged plain policy, and the adapters in lora/
            merge_and_save(model, tmp)
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        torch.save(optimizer.state_dict(), tmp / f"optimizer.rank{rank}.pt")
        if critic is not None:
            save_critic(critic, tmp, rank, world)  # gathered on every rank, written by rank 0
            torch.save(critic_optimizer.state_dict(), tmp / f"critic_optimizer.rank{rank}.pt")
        barrier(world)
        if rank == 0:
            tokenizer.save_pretrained(tmp)
            torch.save({"step": step, "rng": rng_state(), "world": world} | trainer_state, tmp / "trainer_state.pt")
            if config is not None:  # not run/config.yaml's copy: that file may be edited while the run goes on
                (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            if (run / "metrics.jsonl").exists():
                shutil.copy(run / "metrics.jsonl", tmp / "metrics.jsonl")
            fsync_tree(tmp)  # every process's files are written (barrier above): on the disk before the rename
            shutil.rmtree(ckpt, ignore_errors=True)
            tmp.rename(ckpt)  # a checkpoint directory exists only once it is complete
            fsync_path(ckpt.parent)  # and the rename itself survives a power cut
    except Exception as e:
        _save_failed(e, ckpt, tmp)
        raise  # not a failed write: a bug, with its traceback
    if rank == 0:
        # Only older checkpoints go, never the one just written: a newer one can be there only when
        # it was broken and resume passed over it, and it must not count towards `keep`.
        older = sorted((p for p in checkpoints(run) if _step_of(p) < step), key=_step_of)
        for old in older[: max(0, len(older) - (max(1, keep) - 1))]:
            shutil.rmtree(old)
    barrier(world)
    return ckpt


def _first_non_finite(models: dict[str, object], world: int) -> str | None:
    """The first parameter holding a NaN or inf, as "policy's weight model.norm.weight", over every
    process (the same answer on each, so all raise together), or None. Under FSDP a parameter is
    a DTensor: its local shard is checked, and the first bad index is agreed with one all_reduce
    (the max of count - index over the processes is the smallest bad index)."""
    named = [(f"{who}'s weight {name}", w) for who, m in models.items() if m is not None
             for name, w in m.named_parameters()]  # fmt: skip
    mine = next((i for i, (_, w) in enumerate(named) if not local_finite(w)), None)
    mark = int(all_reduce(torch.tensor([0 if mine is None else len(named) - mine]), world, "max")[0])
    return named[len(named) - mark][0] if mark else None


def _save_failed(e: Exception, ckpt: Path, tmp: Path) -> None:
    """Remove the partial checkpoint; raise a RunDirError for a write that failed (an OSError, or
    any error on a full disk: torch.save reports ENOSPC as a RuntimeError 'unexpected pos',
    safetensors as its own SafetensorError); return for anything else, which the caller re-raises."""
    full = _disk_full(tmp)  # measured before the partial files are removed and free the space
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(e, OSError):
        cause = _cause(e)
    elif full or "No space left on device" in str(e):
        cause = f"No space left on device ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    else:
        return
    raise RunDirError(f"cannot save checkpoint {ckpt}: {cause}; removed the partial {tmp.name}, "
                      f"the earlier checkpoints are kept") from None  # fmt: skip


def _disk_full(path: Path) -> bool:
    """Whether the filesystem that holds `path` has less than 1 MiB left."""
    for p in (path, *path.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free < 1 << 20
            except OSError:
                return False
    return False


def load_checkpoint_file(path: Path, **kwargs) -> object:
    """torch.load with weights_only=True: tensors, plain data and numpy's RNG state only. A file
    holding anything else (a pickled object can run code as it loads) is refused in one line, as
    is an unreadable or truncated one; kwargs go to torch.load (map_location, mmap)."""
    try:
        with torch.serialization.safe_globals(NUMPY_RNG_GLOBALS):
            return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        # torch's message is a paragraph; its "WeightsUnpickler error:" part says what was met
        why = str(e).split("WeightsUnpickler error:", 1)[-1].split("Check the documentation")[0]
        why = " ".join(why.split()).split(" was not an allowed global")[0]  # "Unsupported global: GLOBAL exec"
        if "Unsupported global" in why:
            raise RunDirError(f"refusing to load {path}: it holds more than tensors and plain data, and loading "
                              f"it could run code ({why})") from None  # fmt: skip
        raise RunDirError(f"cannot read {path}: corrupt, or not written by torch.save ({why})") from None
    except OSError as e:
        if e.filename:  # it could not be opened: missing, a directory, no permission
            raise RunDirError(f"cannot read {path}: {_cause(e)}") from None
        raise RunDirError(_corrupt(path, e)) from None
    except (RuntimeError, EOFError) as e:
        raise RunDirError(_corrupt(path, e)) from None


def _corrupt(path: Path, e: Exception) -> str:
    """The line for a .pt file torch cannot read although it opened it: a truncated copy, a crash
    mid-write. torch's own words name no cause ('[Errno 22] Invalid argument', 'failed finding
    central directory. This is an internal miniz error...'), so the line says what it means."""
    why = str(e).splitlines()[0].split(". This is an internal")[0] if str(e) else type(e).__name__
    if "mmap can only be used" in why:  # what torch says of a file that is not even a zip archive
        why = "not a torch.save archive"
    size = Path(path).stat().st_size if Path(path).is_file() else 0
    return f"cannot read {path}: the file is truncated or corrupt ({size} bytes; {why})"


def verify_checkpoint(ckpt: Path) -> None:
    """Check a checkpoint before a resumed run loads a model or starts an engine, so a broken or
    tampered one is refused at once, in one line (RunDirError naming the file and the cause):
    every .pt file reads back (mmap: only the pickled structure is read, not the possibly many GB
    of optimizer tensors), trainer_state.pt and each process's optimizer shard are there, and
    every .safetensors file is as long as its header says (only the header is read)."""
    found, state = set(), None
    for path in sorted(ckpt.rglob("*.pt")):
        loaded = load_checkpoint_file(path, map_location="cpu", mmap=True)
        found.add(path.relative_to(ckpt).as_posix())
        if path == ckpt / "trainer_state.pt":
            state = loaded
    if state is None:
        raise RunDirError(f"checkpoint is incomplete: {ckpt / 'trainer_state.pt'} not found")
    world = state.get("world", 1) if isinstance(state, dict) else 1
    kinds = ["optimizer", "critic_optimizer"] if (ckpt / "critic").is_dir() else ["optimizer"]
    for name in (f"{kind}.rank{r}.pt" for kind in kinds for r in range(world)):
        if name not in found:
            raise RunDirError(f"checkpoint is incomplete: {ckpt / name} not found (written by {world} processes)")
    weights = sorted(ckpt.rglob("*.safetensors"))
    if not any(path.parent == ckpt for path in weights):
        raise RunDirError(f"checkpoint is incomplete: no model weights (*.safetensors) in {ckpt}")
    for path in weights:
        _check_safetensors(path)


def _check_safetensors(path: Path) -> None:
    """A safetensors file is an 8-byte little-endian header length, a JSON header giving each
    tensor's [begin, end) byte offsets in the data that follows, and that data: the file must be
    exactly 8 + header + the largest end long. A truncated copy is caught without loading a weight.
    For example {"a": three float32}: 8 bytes holding 56, the 56-byte header
    {"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}}, then 12 bytes of data; 76 bytes in all.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little")
            if len(head) < 8 or 8 + n > size:
                raise RunDirError(f"cannot read {path}: the file is truncated ({size} bytes, shorter than its header)")
            header = json.loads(f.read(n))
        end = 8 + n + int(max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0))
    except OSError as e:
        raise RunDirError(f"cannot read {path}: {_cause(e)}") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):  # JSON that is no safetensors header
        raise RunDirError(f"cannot read {path}: the file is corrupt (its header is not a safetensors header)") from None
    if end != size:
        state = "truncated" if size < end else "corrupt"
        raise RunDirError(f"cannot read {path}: the file is {state} ({size} bytes; its header says {end})")


def checkpoints(run: Path) -> list[Path]:
    """The run's checkpoint directories, step_<k> with k an integer; anything else under
    checkpoints/ (step_3.tmp being written, a step_2.bak copy someone made) is not one."""
    return [p for p in (run / "checkpoints").glob("step_*") if re.fullmatch(r"step_\d+", p.name) and p.is_dir()]


def latest_checkpoint(run: Path) -> Path | None:
    """The run's newest checkpoint directory (by step), or None; not checked (verified_checkpoint is)."""
    done = checkpoints(run)
    return max(done, key=_step_of) if done else None


def verified_checkpoint(run: Path) -> tuple[Path | None, str | None]:
    """The checkpoint a resumed run starts from: the newest that verify_checkpoint accepts (None
    when the run has no checkpoint), and None or one line naming the newer ones it passed over:

        checkpoint step_5 is broken (cannot read .../trainer_state.pt: the file is truncated or
        corrupt (...)); resuming from step_4, step_5 is left in place

    A broken checkpoint (a crash or a full disk during a copy, a file cut short) is left where it
    is, not deleted: the user may want to look at it, and the resumed run replaces it when it saves
    that step again (save_checkpoint prunes only older ones). When none is intact, a RunDirError
    names each with its cause."""
    broken = []
    for ckpt in sorted(checkpoints(run), key=_step_of, reverse=True):
        try:
            verify_checkpoint(ckpt)
        except RunDirError as e:
            broken.append((ckpt.name, str(e)))
            continue
        if not broken:
            return ckpt, None
        one = len(broken) == 1
        why = broken[0][1] if one else "; ".join(f"{name}: {e}" for name, e in broken)
        names, verb = ", ".join(name for name, _ in broken), "is" if one else "are"
        return ckpt, (f"checkpoint{'' if one else 's'} {names} {verb} broken ({why}); resuming from {ckpt.name}, "
                      f"{names} {verb} left in place")  # fmt: skip
    if broken:
        why = "; ".join(f"{name}: {e}" for name, e in broken)
        raise RunDirError(f"no intact checkpoint to resume in {run / 'checkpoints'} ({why})")
    return None, None


def load_trainer_state(ckpt: Path, run: Path, optimizer, rank: int = 0, world: int = 1) -> dict:
    """The trainer state of a checkpoint; puts this process's optimizer shard, the global RNGs
    and (rank 0) the run's metrics log back as they were when it was written."""
    path = ckpt / "trainer_state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint is incomplete: {path} not found")
    state = load_checkpoint_file(path)
    if state.get("world", 1) != world:
        raise ConfigError(f"{ckpt} was written by {state.get('world', 1)} processes; resume with as many, not {world}")
    optimizer.load_state_dict(load_checkpoint_file(ckpt / f"optimizer.rank{rank}.pt"))
    set_rng_state(state["rng"])
    if rank == 0 and (ckpt / "metrics.jsonl").exists():
        try:
            shutil.copy(ckpt / "metrics.jsonl", run / "metrics.jsonl")
        except OSError as e:
            raise RunDirError(f"cannot restore {run / 'metrics.jsonl'}: {_cause(e)}") from None
    return state


def check_writable(run: Path) -> None:
    """Write and remove a file in `run`, so a resumed run in a read-only directory (a read-only
    mount stops root too) fails before it loads a model, not at its first log line. Every rank of a
    resume checks before the process group starts: each its own file, or one rank removes the
    file another is about to (a FileNotFoundError that read as a read-only directory)."""
    probe = run / f".write_check.{os.getpid()}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise RunDirError(f"cannot write in the run directory {run}: {_cause(e)}") from None


def _step_of(path: Path) -> int:
    """5 for checkpoints/step_5 (only names that `checkpoints` lists)."""
    return int(path.name.removeprefix("step_"))
