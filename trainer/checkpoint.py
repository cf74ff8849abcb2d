"""The run directory, and checkpoints that let a killed run continue exactly where it stopped.

    runs/<name>-<time>/
        config.yaml        the whole config the run used (new_run_dir)
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

A checkpoint is written into `step_<k>.tmp` and renamed when complete, so a crash while
saving never leaves a half checkpoint that looks whole; only the newest `keep` are kept. A write
that fails (disk full) removes the `.tmp` and stops the run with one line naming the path.
`python train.py --resume RUN_DIR` loads the newest one (train.py), its .pt files with
torch.load(weights_only=True): a checkpoint that would run code as it loads is refused.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed.tensor  # noqa: F401  registers DTensor with weights_only loading (FSDP2 optimizer shards)
import yaml

from trainer.config import Config, ConfigError, RunDirError, config_to_dict
from trainer.distributed import barrier, save_full_state
from trainer.lora import merge_and_save
from trainer.ppo import save_critic

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
    """runs/<name>-<time>/ with the run's config.yaml; an existing directory is an error, and so
    is one that cannot be made (read-only, under a file, disk full): one line naming the path."""
    run = Path(cfg.train.run_dir) / f"{cfg.train.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    made = False
    try:
        run.mkdir(parents=True, exist_ok=False)
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
            f.write(json.dumps(row) + "\n")
    except OSError as e:
        raise RunDirError(f"cannot append to {path}: {_cause(e)}") from None


def write_samples(run: Path, step: int, records: list[dict]) -> None:
    """samples/step_<step>.jsonl: the records as the viewer reads them."""
    path = run / "samples" / f"step_{step}.jsonl"
    try:
        path.parent.mkdir(exist_ok=True)
        with open(path, "w") as f:
            for r in records:  # without private caches such as answers.parsed's "_parsed"
                f.write(json.dumps({k: v for k, v in r.items() if not k.startswith("_")}) + "\n")
    except OSError as e:
        raise RunDirError(f"cannot write {path}: {_cause(e)}") from None


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(run: Path, step: int, model, tokenizer, optimizer, trainer_state: dict, keep: int = 2,
                    critic=None, rank: int = 0, world: int = 1, critic_optimizer=None) -> Path:  # fmt: skip
    """Write step_<step> atomically (temp dir, then rename) and drop all but the newest `keep`.
    Every process calls it: under FSDP the full weights are gathered tensor by tensor and written
    by rank 0, and each process writes its own shard of the optimizer state. A write that fails
    (disk full, read-only) removes the partial step_<step>.tmp, which would otherwise hold the disk
    full, keeps the earlier checkpoints, and is a RunDirError naming the path and the cause."""
    ckpt = run / "checkpoints" / f"step_{step}"
    tmp = ckpt.with_name(ckpt.name + ".tmp")
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
            if (run / "metrics.jsonl").exists():
                shutil.copy(run / "metrics.jsonl", tmp / "metrics.jsonl")
            shutil.rmtree(ckpt, ignore_errors=True)
            tmp.rename(ckpt)  # a checkpoint directory exists only once it is complete
    except Exception as e:
        _save_failed(e, ckpt, tmp)
        raise  # not a failed write: a bug, with its traceback
    if rank == 0:
        done = sorted((p for p in ckpt.parent.glob("step_*") if not p.name.endswith(".tmp")), key=_step_of)
        for old in done[: -max(1, keep)]:
            shutil.rmtree(old)
    barrier(world)
    return ckpt


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
    except (OSError, RuntimeError, EOFError) as e:  # truncated / not a torch file
        raise RunDirError(f"cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def verify_checkpoint(ckpt: Path) -> None:
    """Check every .pt file of a checkpoint before a resumed run loads a model or starts an engine,
    so a tampered or broken checkpoint is refused at once. mmap: only the pickled structure is
    read, not the (possibly many GB of) optimizer tensors."""
    for path in sorted(ckpt.rglob("*.pt")):
        load_checkpoint_file(path, map_location="cpu", mmap=True)


def latest_checkpoint(run: Path) -> Path | None:
    done = [p for p in (run / "checkpoints").glob("step_*") if not p.name.endswith(".tmp")]
    return max(done, key=_step_of) if done else None


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
    mount stops root too) fails before it loads a model, not at its first log line."""
    probe = run / ".write_check"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise RunDirError(f"cannot write in the run directory {run}: {_cause(e)}") from None


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[1].removesuffix(".tmp"))
