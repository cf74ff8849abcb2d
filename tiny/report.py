"""What the two reproductions share (reproduce.py: Search-R1 in miniature; tiny/papers.py: every
paper's effect): the SFT starts, training runs as parallel train.py processes that resume, and
the report.

    cfg = load_config("configs/tiny.yaml")
    build_start(world_dir(cfg) / "policy", "configs/tiny.yaml", [])  # python -m tiny.sft, unless built
    done = train_runs([(key, "grpo-seed0", "configs/tiny.yaml", ["train.seed=0"])], 2, [], run_dir)
    last_checkpoint(done[key]["run"])            # runs/.../checkpoints/step_30
    mean_spread([0.70, 0.74, 0.72])              # '0.720 ± 0.040'  (spread = max - min)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]  # the repository: train.py runs from here


def build_start(policy: Path, config: str, sets: list[str]) -> None:
    """The tiny world and SFT start `policy` (world_dir of `config` with overrides `sets`, plus
    /policy): built by `python -m tiny.sft` in a process of its own (its teacher imports
    bm25s/numba, which must not come before a vLLM engine in this process: docs/design.md §6). A start
    built before is kept without starting that process (its imports alone are ~5 s on 2 cores),
    as train.py keeps it."""
    if (policy / "DONE").exists():
        print(f"  {policy}: built earlier", flush=True)
        return
    subprocess.run([sys.executable, "-m", "tiny.sft", "--config", config, *sum((["--set", s] for s in sets), [])],
                   cwd=ROOT, check=True)  # fmt: skip


def train_runs(jobs: list[tuple], parallel: int, sets: list[str], run_dir: Path) -> dict:
    """Every job (key, run name, config, overrides) as its own train.py process, `parallel` at
    a time. Returns {key: {"run": path, "minutes": m}} in the jobs' order, not the order they
    finished in: a caller that lists the runs (an evaluation's models) lists them the same way on a
    re-run that finds them all finished."""
    jobs = list(jobs)
    order = [job[0] for job in jobs]
    threads = 1 if parallel > 1 else 2
    # vLLM CPU reserves host RAM from gpu_memory_utilization; two runs at 0.3 run out of 24 GB
    memory = ["rollout.gpu_memory_utilization=0.1"] if parallel > 1 else []
    running: dict = {}
    done: dict = {}
    while jobs or running:
        while jobs and len(running) < parallel:
            key, name, config, extra = jobs.pop(0)
            overrides = [f"train.name={name}", f"train.threads={threads}", f"train.run_dir={run_dir}", *memory,
                         *extra, *sets]  # fmt: skip
            cmd = [sys.executable, "train.py", "--config", config, *sum((["--set", o] for o in overrides), [])]
            earlier = sorted(run_dir.glob(f"{name}-*/checkpoints/step_*"), key=lambda p: int(p.name.split("_")[1]))
            if earlier:  # the same --run-dir again: keep finished runs, resume killed ones
                steps = load_config(config, [*extra, *sets]).train.steps
                if int(earlier[-1].name.split("_")[1]) >= steps:
                    run = earlier[-1].parents[1]
                    wall = float((run / "wall_minutes.txt").read_text()) if (run / "wall_minutes.txt").exists() else 0.0
                    done[key] = {"run": run, "minutes": wall, "earlier": True}
                    print(f"  {name}: finished earlier ({run})", flush=True)
                    continue
                cmd = [sys.executable, "train.py", "--resume", str(earlier[-1].parents[1]),
                       *sum((["--set", o] for o in (f"train.threads={threads}", *memory)), [])]  # fmt: skip
            env = os.environ | {"OMP_NUM_THREADS": str(threads)}
            log = open(run_dir / f"{name}.log", "w")
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            running[key] = (proc, time.time(), name, log)
            print(f"  started {name}", flush=True)
        time.sleep(2)
        for key, (proc, t0, name, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[key]
            if proc.returncode != 0:
                for other, *_ in running.values():
                    other.kill()
                tail = (run_dir / f"{name}.log").read_text()[-3000:]
                raise RuntimeError(f"training run {name} failed (log {run_dir / (name + '.log')}):\n{tail}")
            run = max(run_dir.glob(f"{name}-*"), key=lambda p: p.stat().st_mtime)
            done[key] = {"run": run, "minutes": (time.time() - t0) / 60}
            (run / "wall_minutes.txt").write_text(f"{done[key]['minutes']:.2f}")  # kept when a rerun reuses it
            print(f"  finished {name} in {done[key]['minutes']:.1f} min", flush=True)
    return {key: done[key] for key in order}


def last_checkpoint(run: Path) -> Path:
    ckpts = sorted((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    if not ckpts:
        raise FileNotFoundError(f"no checkpoint in {run / 'checkpoints'}")
    return ckpts[-1]


def mean_spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {max(values) - min(values):.3f}"


def repo_relative(path: Path) -> str:
    """A path as a committed report shows it: relative to the repository when inside it (a report
    must not name one checkout's absolute path), else as given.

    >>> repo_relative(Path(__file__).resolve().parents[1] / "runs" / "r1")
    'runs/r1'
    """
    try:
        return str(Path(path).resolve().relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        return str(path)


def finish_report(out: Path, lines: list[str], curves: list[Path], run_dir: Path, data_path: Path, data: dict) -> None:
    """Append the curves and where the runs are, write the markdown, and the numbers as JSON."""
    lines = lines + [f"![{p.stem}](curves/{p.name})" for p in curves]
    lines += ["", f"Runs, logs, rollouts and the trajectory viewer: `{repo_relative(run_dir)}` (not committed).", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    data_path.write_text(json.dumps(data, indent=1, default=str))
