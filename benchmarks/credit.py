"""Credit per search step, measured on the tiny world (issue 43, item 6): results/credit.md.

    python benchmarks/credit.py                          # every row a-h, seeds 0 1 2, 2 runs at a time
    python benchmarks/credit.py --rows a b e --budget-min 40
    python benchmarks/credit.py --report-only            # re-collect the runs already in runs/

Runs `train.py --config configs/experiments/credit.yaml` (a weak SFT start on which the outcome
reward is sparse on 2-hop questions; every row shares it, since rows differ only in train.* keys)
once per row and seed, two at a time with one torch thread each (OMP_NUM_THREADS=1; on two
cores that beats one run with two threads, benchmarks/tiny_seeds.py). The rows, in priority
order (ROWS): outcome-only GRPO, GRPO + retrieval-hit turn credit (group and per-turn-index
normalisation), GRPO + StepSearch's information gain, DAPO's dynamic sampling, PPO outcome-only
and PPO + retrieval-hit, and IG-Search's policy-scored information gain (its reward-stage cost;
`--ig-seeds` seeds). With `--budget-min`, no run starts after that many minutes; the rows left
out are named in the report.

Per run it collects, from RUN/metrics.jsonl: the step-0 and last greedy validation 2-hop EM,
searches per 2-hop question and 1-hop EM; the mean share of zero-variance groups in the trained
batch (`groups_alike`) over the steps; the questions rolled out per step (dynamic sampling's
oversampling; 16 without it); the mean seconds of the reward stage per step; the run's wall
minutes. It draws each run's curves (`eval.py curves RUN`, into RUN/curves/) and one comparison
figure per metric over the rows (mean over seeds) into results/curves/credit/, and writes
results/credit.md: the command, machine, date, a per-seed table per row and a summary table
(mean ± spread, spread = max - min over seeds). The discussion is written by hand below the
marker line, which a re-run keeps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from trainer.precision import machine  # noqa: E402

CONFIG = "configs/experiments/credit.yaml"
# PPO on the tiny world as configs/tiny_ppo.yaml runs it: Search-R1's KL-in-reward (k1), gamma =
# lambda = 1, and a critic learning rate a zero-initialised value head can track returns with.
PPO = ["train.algo=ppo", "train.kl_in_reward=true", "train.kl_estimator=k1", "train.critic_lr=1.0e-3",
       "train.gae_gamma=1.0", "train.gae_lambda=1.0", "train.value_clip=0.5"]  # fmt: skip
ROWS: dict[str, tuple[str, list[str]]] = {
    "a": ("GRPO, outcome only (EM)", ["train.reward=em"]),
    "b": ("GRPO + turn_hit, group norm", ["train.reward=em + turn_hit"]),
    "c": ("GRPO + turn_hit, turn_index norm", ["train.reward=em + turn_hit", "train.turn_norm=turn_index"]),
    "d": ("GRPO + stepsearch (information gain)", ["train.reward=em + stepsearch"]),
    "e": ("GRPO, EM, filter_groups on (DAPO)", ["train.reward=em", "train.filter_groups=true"]),
    "f": ("PPO, outcome only (EM)", [*PPO, "train.reward=em"]),
    "g": ("PPO + turn_hit", [*PPO, "train.reward=em + turn_hit"]),
    "h": ("GRPO + ig_search (IG-Search)", ["train.reward=em + ig_search"]),
}
MARKER = "<!-- discussion: written by hand, kept by benchmarks/credit.py -->"


@dataclass
class Job:
    """One training run: a row of the grid and a seed."""

    row: str
    seed: int
    start: float = 0.0
    proc: subprocess.Popen | None = None
    result: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"credit-{self.row}{self.seed}"


def launch(job: Job, threads: int) -> None:
    """Start train.py for job with `threads` torch threads; stdout is dropped, stderr kept."""
    sets = [*ROWS[job.row][1], f"train.seed={job.seed}", f"train.name={job.name}", f"train.threads={threads}"]
    cmd = [sys.executable, "train.py", "--config", CONFIG, *sum((["--set", s] for s in sets), [])]
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    job.start = time.time()
    job.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def latest_run(name: str) -> Path | None:
    """The newest runs/<name>-<time>/ that has metrics, or None."""
    runs = [p for p in (ROOT / "runs").glob(f"{name}-*") if (p / "metrics.jsonl").is_file()]
    return max(runs, key=lambda p: p.stat().st_mtime) if runs else None


def collect(run: Path, minutes: float | None) -> dict:
    """The numbers of one run (see the module docstring); minutes None: from the run's own times."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval" in r]
    steps = [r for r in rows if "reward" in r and "eval" not in r]
    if not evals or not steps:
        raise ValueError(f"{run}: no eval or no training step in metrics.jsonl")
    start, end = evals[0]["eval"], evals[-1]["eval"]
    if minutes is None:  # --report-only: from the run directory's start time to its last metrics line
        started = datetime.datetime.strptime(run.name.rsplit("-", 2)[-2] + run.name.rsplit("-", 1)[-1], "%Y%m%d%H%M%S")
        minutes = (datetime.datetime.fromtimestamp((run / "metrics.jsonl").stat().st_mtime) - started).seconds / 60
    turn = {k: statistics.mean(r.get(f"turn_reward/{k}", 0.0) for r in steps) for k in (1, 2)}
    questions = [r["filter"]["questions"] for r in steps if isinstance(r.get("filter"), dict)]
    return {
        "run": str(run.relative_to(ROOT)),
        "steps": steps[-1]["step"],
        "eval_steps": [r["step"] for r in evals],
        "em_2hop": (start["em_2hop"], end["em_2hop"]),
        "searches_2hop": (start["searches_2hop"], end["searches_2hop"]),
        "em_1hop": (start["em_1hop"], end["em_1hop"]),
        "em_2hop_curve": [r["eval"]["em_2hop"] for r in evals],
        "searches_2hop_curve": [r["eval"]["searches_2hop"] for r in evals],
        "groups_alike": statistics.mean(r["groups_alike"] for r in steps),
        "groups_alike_curve": [r["groups_alike"] for r in steps],
        "questions": statistics.mean(questions) if questions else None,
        "groups_kept": statistics.mean(r["filter"]["groups"] for r in steps) if questions else None,
        "reward_s": statistics.mean(r["time"]["reward"] for r in steps),
        "turn_reward": turn if any("turn_reward/1" in r for r in steps) else None,
        "minutes": minutes,
    }


def run_grid(jobs: list[Job], parallel: int, threads: int, budget_min: float | None) -> list[Job]:
    """Run jobs `parallel` at a time in list order; returns the jobs never started (budget)."""
    pending, running, t0 = list(jobs), [], time.time()
    while pending or running:
        while pending and len(running) < parallel:
            if budget_min is not None and (time.time() - t0) / 60 > budget_min:
                return pending if not running else _drain(running, pending)
            job = pending.pop(0)
            launch(job, threads)
            running.append(job)
            print(f"started {job.name}", flush=True)
        time.sleep(5)
        for job in [j for j in running if j.proc.poll() is not None]:
            running.remove(job)
            finish(job)
    return []


def _drain(running: list[Job], pending: list[Job]) -> list[Job]:
    """Wait for the runs still going (the budget is spent); returns the pending ones."""
    for job in running:
        job.proc.wait()
        finish(job)
    return pending


def finish(job: Job) -> None:
    """Collect a finished run and draw its curves; a failed run is reported with its stderr tail."""
    minutes = (time.time() - job.start) / 60
    err = job.proc.stderr.read() if job.proc.stderr else ""
    run = latest_run(job.name)
    if job.proc.returncode != 0 or run is None:
        job.result = {"error": f"exit {job.proc.returncode}: {err[-2000:]}"}
        print(f"{job.name} FAILED (exit {job.proc.returncode}):\n{err[-2000:]}", flush=True)
        return
    job.result = collect(run, minutes)
    subprocess.run([sys.executable, "eval.py", "curves", str(run)], cwd=ROOT, check=False, stdout=subprocess.DEVNULL)
    print(f"{job.name} done in {minutes:.1f} min: 2-hop EM {job.result['em_2hop']}", flush=True)


def fmt(values: list[float], digits: int = 3) -> str:
    """mean ± spread (max - min) over seeds; one value as itself."""
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {max(values) - min(values):.{digits}f}"


def draw(results: dict[str, list[dict]], out: Path) -> list[Path]:
    """Comparison figures, one line per row (mean over its seeds): validation 2-hop EM and searches
    per 2-hop question against the step, and groups_alike per training step."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, ylabel in [("em_2hop_curve", "validation 2-hop EM (greedy)"),
                        ("searches_2hop_curve", "validation searches per 2-hop question"),
                        ("groups_alike_curve", "share of zero-variance groups (trained batch)")]:  # fmt: skip
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=80)
        for row, rs in results.items():
            if not rs:
                continue
            n = min(len(r[key]) for r in rs)
            ys = [statistics.mean(r[key][i] for r in rs) for i in range(n)]
            xs = rs[0]["eval_steps"][:n] if key != "groups_alike_curve" else list(range(1, n + 1))
            ax.plot(xs, ys, marker="o", label=f"{row}: {ROWS[row][0]}")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{key.removesuffix('_curve')}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def report(results: dict[str, list[dict]], errors: list[str], dropped: list[str], command: str, out: Path) -> None:
    """Write results/credit.md (keeping a hand-written discussion below MARKER)."""
    kept = ""
    if out.is_file() and MARKER in out.read_text():
        kept = out.read_text().split(MARKER, 1)[1]
    figures = draw(results, ROOT / "results" / "curves" / "credit")
    lines = [
        "# Credit per search step on the tiny world: outcome only vs per-turn credit vs dynamic sampling",
        "",
        f"Issue 43, item 6. Command: `{command}` (config `{CONFIG}`, driver `benchmarks/credit.py`).",
        f"Machine: {machine()}, 2 cores, runs two at a time with one torch thread each. "
        f"Date: {datetime.date.today().isoformat()}.",
        "",
        "Start and end are greedy validation (200 1-hop and 200 2-hop questions) at step 0 (the SFT "
        "start) and at the last step. groups_alike: the share of zero-variance groups in the trained "
        "batch, mean over the steps. questions/step: questions rolled out per step (16 without "
        "dynamic sampling; in brackets the groups it kept and trained on, of 16). turn reward 1 / 2: "
        "the mean turn reward of first and second searches over "
        "the training steps (logged whenever the reward gives turn rewards). reward s: the reward "
        "stage's seconds per step, mean. Summary: mean ± "
        "spread (max - min) over seeds.",
        "",
        "## Summary",
        "",
        "| row | seeds | 2-hop EM start → end | searches/2-hop start → end | 1-hop EM end | groups_alike "
        "| questions/step | reward s/step | minutes/run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row, rs in results.items():
        if not rs:
            continue
        q = [r["questions"] for r in rs if r["questions"] is not None]
        kept = f" ({fmt([r['groups_kept'] for r in rs], 1)})" if q else ""
        lines.append(
            f"| {row}: {ROWS[row][0]} | {len(rs)} | {fmt([r['em_2hop'][0] for r in rs])} → "
            f"{fmt([r['em_2hop'][1] for r in rs])} | {fmt([r['searches_2hop'][0] for r in rs], 2)} → "
            f"{fmt([r['searches_2hop'][1] for r in rs], 2)} | {fmt([r['em_1hop'][1] for r in rs])} | "
            f"{fmt([r['groups_alike'] for r in rs])} | {fmt(q, 1) + kept if q else '16'} | "
            f"{fmt([r['reward_s'] for r in rs], 2)} | {fmt([r['minutes'] for r in rs], 1)} |"
        )
    lines += ["", "## Per seed", ""]
    for row, rs in results.items():
        if not rs:
            continue
        lines += [f"**{row}: {ROWS[row][0]}** (`{' '.join('--set ' + shlex.quote(s) for s in ROWS[row][1])}`)", "",
                  "| seed | 2-hop EM | searches/2-hop | 1-hop EM | groups_alike | questions/step | turn reward 1 / 2 "
                  "| reward s/step | minutes | run |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in rs:
            q = f"{r['questions']:.1f} ({r['groups_kept']:.1f})" if r["questions"] is not None else "16"
            t = f"{r['turn_reward'][1]:.3f} / {r['turn_reward'][2]:.3f}" if r["turn_reward"] else "—"
            lines.append(
                f"| {r['seed']} | {r['em_2hop'][0]:.3f} → {r['em_2hop'][1]:.3f} | "
                f"{r['searches_2hop'][0]:.2f} → {r['searches_2hop'][1]:.2f} | {r['em_1hop'][1]:.3f} | "
                f"{r['groups_alike']:.3f} | {q} | {t} | {r['reward_s']:.2f} | {r['minutes']:.1f} | `{r['run']}` |"
            )
        lines.append("")
    if dropped:
        lines += [f"Not run (the time budget): {', '.join(dropped)}.", ""]
    if errors:
        lines += ["Failed runs:", "", *[f"- {e}" for e in errors], ""]
    links = ", ".join(f"[{p.name}](curves/credit/{p.name})" for p in figures)
    lines += ["## Curves", "", f"Mean over seeds per row, in `results/curves/credit/`: {links}. Each run's own "
              "curves: `RUN/curves/` (`python eval.py curves RUN`), RUN as named above.", ""]  # fmt: skip
    out.write_text("\n".join(lines) + "\n" + MARKER + (kept or "\n"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), help="rows of the grid")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="train.seed values")
    parser.add_argument("--ig-seeds", type=int, default=1, help="seeds for row h (IG-Search is slow)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at once (one torch thread each)")
    parser.add_argument("--budget-min", type=float, help="start no run after this many minutes")
    parser.add_argument("--report-only", action="store_true", help="collect the runs in runs/, train nothing")
    parser.add_argument("--out", default="results/credit.md", help="the report")
    args = parser.parse_args()
    jobs = [Job(row, seed) for row in args.rows for seed in (args.seeds[: args.ig_seeds] if row == "h" else args.seeds)]
    dropped: list[str] = []
    if args.report_only:
        for job in jobs:
            run = latest_run(job.name)
            if run is not None:
                job.result = collect(run, None)
    else:
        threads = 1 if args.parallel > 1 else 2
        dropped = [j.name for j in run_grid(jobs, args.parallel, threads, args.budget_min)]
    results: dict[str, list[dict]] = {row: [] for row in args.rows}
    errors = []
    for job in jobs:
        if "error" in job.result:
            errors.append(f"{job.name}: {job.result['error'][-500:]}")
        elif job.result:
            results[job.row].append({"seed": job.seed, **job.result})
    command = "python benchmarks/credit.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    report(results, errors, dropped, command.strip(), ROOT / args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
