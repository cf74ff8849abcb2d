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
saving never leaves a half checkpoint that looks whole; only the newest `keep` are kept.
`python train.py --resume RUN_DIR` loads the newest one (train.py).
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from config import Config, ConfigError, config_to_dict


def new_run_dir(cfg: Config) -> Path:
    """runs/<name>-<time>/ with the run's config.yaml; an existing directory is an error."""
    run = Path(cfg.train.run_dir) / f"{cfg.train.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run.mkdir(parents=True, exist_ok=False)
    (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return run


def log(run: Path, row: dict) -> None:
    """Append one row to the run's metrics.jsonl."""
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def write_samples(run: Path, step: int, records: list[dict]) -> None:
    """samples/step_<step>.jsonl: the records as the viewer reads them."""
    (run / "samples").mkdir(exist_ok=True)
    with open(run / "samples" / f"step_{step}.jsonl", "w") as f:
        for r in records:  # without private caches such as answers.parsed's "_parsed"
            f.write(json.dumps({k: v for k, v in r.items() if not k.startswith("_")}) + "\n")


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
    by rank 0, and each process writes its own shard of the optimizer state."""
    from distributed import barrier, save_full_state

    ckpt = run / "checkpoints" / f"step_{step}"
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(world)
    if world > 1:
        save_full_state(model, tmp / "model.safetensors", rank)
        if rank == 0:
            model.config.save_pretrained(tmp)
    elif hasattr(model, "peft_config"):  # LoRA: the merged plain policy, and the adapters in lora/
        from lora import merge_and_save

        merge_and_save(model, tmp)
    else:
        model.save_pretrained(tmp, safe_serialization=True)
    torch.save(optimizer.state_dict(), tmp / f"optimizer.rank{rank}.pt")
    if critic is not None:
        from ppo import save_critic

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
        done = sorted((p for p in ckpt.parent.glob("step_*") if not p.name.endswith(".tmp")), key=_step_of)
        for old in done[: -max(1, keep)]:
            shutil.rmtree(old)
    barrier(world)
    return ckpt


def latest_checkpoint(run: Path) -> Path | None:
    done = [p for p in (run / "checkpoints").glob("step_*") if not p.name.endswith(".tmp")]
    return max(done, key=_step_of) if done else None


def load_trainer_state(ckpt: Path, run: Path, optimizer, rank: int = 0, world: int = 1) -> dict:
    """The trainer state of a checkpoint; puts this process's optimizer shard, the global RNGs
    and (rank 0) the run's metrics log back as they were when it was written."""
    path = ckpt / "trainer_state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint is incomplete: {path} not found")
    state = torch.load(path, weights_only=False)
    if state.get("world", 1) != world:
        raise ConfigError(f"{ckpt} was written by {state.get('world', 1)} processes; resume with as many, not {world}")
    optimizer.load_state_dict(torch.load(ckpt / f"optimizer.rank{rank}.pt", weights_only=False))
    set_rng_state(state["rng"])
    if rank == 0 and (ckpt / "metrics.jsonl").exists():
        shutil.copy(ckpt / "metrics.jsonl", run / "metrics.jsonl")
    return state


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[1].removesuffix(".tmp"))
