"""Who owns a run directory, and what a resumed run may change in it.

    runs/<name>-<time>[-<n>]/
        run.lock              held (fcntl.flock) by the process that trains in the directory; holds its pid
        config.yaml           the config of the newest steps (rewritten when a resume changes a key)
        config_changes.jsonl  one line per resume that changed the config: the step it applies from
        checkpoints/step_<k>/config.yaml   the config step k was trained with (trainer/checkpoint.py)

One run at a time. A second `train.py` in a directory that a run owns (a `--resume` of a run that
is still going, a scheduler that resumed it twice) would write the same metrics.jsonl and
checkpoints; it is refused in one line naming the pid that holds run.lock (`own_run_dir`). Under
several processes only rank 0 takes the lock: the other ranks are the same run. Fresh runs never
share a directory: two started in the same second with the same train.run_dir (a sweep launched at
once) get <name>-<time> and <name>-<time>-2 (`make_unique_dir`, an atomic mkdir).

Nothing changes silently on a resume (`check_resume_config`). The run's config.yaml (with the
command line's --set) is compared with the config the checkpoint was trained with; a changed key is
refused in one line unless --set names it, since an edit of config.yaml (group_size 8 -> 4, lr x 100)
would otherwise apply from the next step with no notice, and the run directory would no longer say
what steps 1..k ran with. A key --set names is an intended change: applied, said in one line,
config.yaml rewritten, and a line appended to config_changes.jsonl:

    {"from_step": 3, "checkpoint": "step_2", "changes": {"train.lr": [0.001, 0.1]}, "time": "..."}

Some keys cannot change on a resume even when named, each refused with its cause: the model's
architecture (the checkpoint's weights have its shape), model.path (the reference policy and LoRA's
base are read from it), world.* (the questions the data order indexes) and, for the tiny world's
policy, every key of tiny/world.py's world_key (the cached world, tokenizer and SFT start the run
reads its corpus and reference from would be another one: before this check, `corpus file not
found`). `train.steps` at or below the checkpoint's step is one line too: nothing would run.
"""

from __future__ import annotations

import copy
import fcntl
import itertools
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from trainer.config import Config, ConfigError, RunDirError, config_from_dict, config_to_dict
from trainer.fsync import write_file

LOCK = "run.lock"
CHANGES = "config_changes.jsonl"

# Held for the process's lifetime: the lock goes when the process does, however it ends (a
# SIGKILL too), so a killed run never leaves its directory locked. The descriptor is
# close-on-exec (Python's default), so a spawned engine or SFT child does not hold it after us.
_held: dict[Path, int] = {}

ARCHITECTURE = ("model.hidden_size", "model.num_layers", "model.num_heads", "model.intermediate_size",
                "model.vocab_size")  # fmt: skip


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


UNSTARTED = ("config.yaml", LOCK, "processes.json")  # all a fresh run holds before its first step


def discard_unstarted(run: Path) -> None:
    """Remove a fresh run's directory that a refusal stopped before anything ran (a bad data line,
    a missing index, a model path with no model): it holds only UNSTARTED, and left behind it would
    read as a run that died at once (every refused train.py left one). A directory holding anything
    else (metrics, samples, checkpoints) is kept whole; nothing is removed but those names, so a
    directory someone shares is never emptied. train.py calls it for a fresh run only, never a
    resumed one; rank 0 only. Best effort: a directory it cannot remove is left as it is."""
    if not _main_rank():
        return
    try:
        if not run.is_dir() or {p.name for p in run.iterdir()} - set(UNSTARTED):
            return
        key = run.resolve()
        for name in UNSTARTED:
            (run / name).unlink(missing_ok=True)
        run.rmdir()
    except OSError:
        return
    fd = _held.pop(key, None)  # the lock's file is gone: let its descriptor go too
    if fd is not None:
        os.close(fd)


def _holder(fd: int) -> str:
    """'pid 1234 on host-a' from a held lock file; the holder writes it just after it locks, so an
    empty file is read again for up to a second."""
    for _ in range(20):
        words = os.pread(fd, 200, 0).decode(errors="replace").split()
        if words:
            return f"pid {words[0]}" + (f" on {words[1]}" if len(words) > 1 else "")
        time.sleep(0.05)
    return "another process (its pid not yet written)"


# ---------------------------------------------------------------------------------------------
# The config across a resume.


def _flat(data: dict) -> dict[str, object]:
    """{"train.lr": 0.001, ...}: a config dict's keys as --set names them (a mapping value such as
    train.reward_params stays one key)."""
    return {f"{section}.{key}": value for section, values in data.items() if isinstance(values, dict)
            for key, value in values.items()}  # fmt: skip


def _named(overrides: list[str]) -> set[str]:
    """The keys the command line's --set overrides name: train.lr for `train.lr=0.1`, train.reward_params
    for `train.reward_params.lam=0.2`, each key of a mapping given to a whole section."""
    named = set()
    for item in overrides:
        key, _, raw = item.partition("=")
        parts = key.strip().split(".")
        if len(parts) >= 2:
            named.add(".".join(parts[:2]))
            continue
        value = yaml.safe_load(raw) if raw.strip() else None  # load_config parsed it already: no error here
        if isinstance(value, dict):
            named |= {f"{parts[0]}.{k}" for k in value}
    return named


def _show(value: object) -> str:
    return json.dumps(value, default=str)


def _fixed(key: str, before: dict, after: object, world_key: Callable[[Config], str]) -> str | None:
    """Why `key` cannot change on a resume (None: it may, when named). `before` is the checkpoint's
    config dict, `after` the value this resume would give the key; `world_key` names the tiny
    world a config builds (tiny/world.py's, handed down by train.py: trainer/ imports nothing above it)."""
    if key in ARCHITECTURE:
        return "the model's architecture, the shape of the checkpoint's weights"
    if key == "model.path":
        return "the model the run started from, its reference policy and LoRA's base"
    if key.startswith("world.") and key != "world.cache_dir":  # cache_dir says where the world is, not which
        return "the tiny world's questions and corpus, which the checkpoint's data order indexes"
    if before.get("model", {}).get("path"):
        return None
    section, name = key.split(".", 1)
    moved = copy.deepcopy(before)
    moved[section][name] = after
    try:
        changed = world_key(config_from_dict(moved)) != world_key(config_from_dict(before))
    except (ConfigError, TypeError, AttributeError):  # a checkpoint of an older config: its world cannot be keyed
        return None
    if changed:
        return ("part of the tiny world's build (tiny/world.py world_key): its corpus, tokenizer and SFT start, the "
                "run's reference policy, would be another world's")  # fmt: skip
    return None


def check_resume_config(run: Path, ckpt: Path, cfg: Config, overrides: list[str],
                        world_key: Callable[[Config], str]) -> None:  # fmt: skip
    """Compare the config a resume would run with (`cfg`: the run's config.yaml and `overrides`)
    with the one checkpoint `ckpt` was trained with; ConfigError (one line) for a key that cannot
    change, for a changed key --set does not name, and for train.steps not beyond the checkpoint's
    step. Rank 0 then says the changes and records them (module docstring). Before any model loads."""
    step = int(ckpt.name.removeprefix("step_"))
    now = yaml.safe_load(yaml.safe_dump(config_to_dict(cfg)))  # as a config.yaml reads back: lists, not tuples
    saved = ckpt / "config.yaml"
    try:
        before = yaml.safe_load(saved.read_text()) if saved.is_file() else None
    except (OSError, yaml.YAMLError) as e:
        raise RunDirError(f"cannot read {saved}: {e}".splitlines()[0]) from None
    if before is not None and not isinstance(before, dict):
        raise RunDirError(f"cannot read {saved}: not a config (a mapping of sections)")
    if before is None:  # written before checkpoints kept their config: only --set's own changes can be seen
        if _main_rank():
            print(f"checkpoint {ckpt.name} holds no config.yaml (written before checkpoints kept their config): "
                  f"the resume is checked against {run / 'config.yaml'}", flush=True)  # fmt: skip
        # the run's config.yaml without this command line's --set (load_config read it already: it loads)
        before = yaml.safe_load(yaml.safe_dump(config_to_dict(config_from_dict(
            yaml.safe_load((run / "config.yaml").read_text())))))  # fmt: skip
    old, new = _flat(before), _flat(now)
    changed = {k: (old[k], new[k]) for k in new if k in old and old[k] != new[k]}  # a key new in the code: not one

    def listing(keys: list[str]) -> str:
        return ", ".join(f"{k} {_show(changed[k][0])} -> {_show(changed[k][1])}" for k in keys)

    causes: dict[str, list[str]] = {}
    for key in changed:
        if (why := _fixed(key, before, changed[key][1], world_key)) is not None:
            causes.setdefault(why, []).append(key)
    if causes:
        raise ConfigError(f"cannot resume {run} from {ckpt.name} with " + "; ".join(
            f"{listing(keys)} ({why})" for why, keys in causes.items()
        ) + ": these cannot change on a resume, even named by --set; start a new run (--config) for them")  # fmt: skip
    named, recorded = _named(overrides), _recorded(run, step, new)
    silent = [k for k in changed if k not in named and k not in recorded]
    if silent:
        sets = " ".join(f"--set {k}={_show(changed[k][1])}" for k in silent)
        raise ConfigError(f"{run / 'config.yaml'} differs from the config {ckpt.name} was trained with: "
                          f"{listing(silent)}; a resume changes no key silently: name each on the command line to "
                          f"apply it from step {step + 1} ({sets}), or put the checkpoint's value back")  # fmt: skip
    if cfg.train.steps <= step:
        raise ConfigError(f"train.steps {cfg.train.steps} is not beyond the checkpoint's step {step}: nothing to do; "
                          f"--set train.steps=K to continue (K > {step}; checkpoint {ckpt})")  # fmt: skip
    if _main_rank():
        _record(run, ckpt, step, changed, cfg)


def _recorded(run: Path, step: int, new: dict) -> set[str]:
    """Keys whose change an earlier resume from this checkpoint (or an older one) already recorded,
    at the value they have now: that resume's --set, kept in config.yaml; a resume that died before
    its next checkpoint must not then refuse its own recorded change."""
    keys: set[str] = set()
    for row in _rows(run):
        if row.get("from_step", 0) > step:
            keys |= {k for k, v in row.get("changes", {}).items() if isinstance(v, list) and v[-1:] == [new.get(k)]}
    return keys


def _rows(run: Path) -> list[dict]:
    path = run / CHANGES
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line cut short by a crash: the others still say what they say
            continue
    return [r for r in rows if isinstance(r, dict)]


def _record(run: Path, ckpt: Path, step: int, changed: dict, cfg: Config) -> None:
    """Say the changes, append them to config_changes.jsonl (once per resume point) and make
    config.yaml the config the next steps run with (written whole, then renamed: the other ranks
    may be reading it)."""
    try:
        if changed:
            print(f"config changed from step {step + 1} on: " + ", ".join(
                f"{k} {_show(a)} -> {_show(b)}" for k, (a, b) in changed.items()
            ) + f"; recorded in {run / CHANGES}", flush=True)  # fmt: skip
            row = {"from_step": step + 1, "checkpoint": ckpt.name, "changes": {k: list(v) for k, v in changed.items()}}
            last = (_rows(run) or [{}])[-1]
            if {k: last.get(k) for k in row} != row:
                with open(run / CHANGES, "a") as f:
                    f.write(json.dumps(row | {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
        path, text = run / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False)  # as new_run_dir
        if yaml.safe_load(path.read_text()) != yaml.safe_load(text):
            write_file(path, lambda tmp: tmp.write_text(text))
    except OSError as e:
        raise RunDirError(f"cannot record the config change in {run}: {_cause(e)}") from None
