"""Sync against one-step-off overlap (train.overlap, issue 52), side by side, on the quick start.

    python benchmarks/bench_overlap.py                        # 10 steps x 2 reps each, alternated
    python benchmarks/bench_overlap.py --steps 3 --reps 1     # a quick check that it runs
    python benchmarks/bench_overlap.py --seeds 0 1 2          # 2-hop EM at equal steps, 3 seeds

Throughput: each repetition runs train.py on configs/quickstart.yaml (its warm start cached under
world.cache_dir: built once by the quick start, reused here) in both modes, the order alternating
(sync first in even repetitions, overlap first in odd ones), validation and checkpoints off but
the last. "Same total threads on 2 processes": the machine's compute threads are split the same
way in both modes, and the count is --threads (default: the CPUs this process may use, 2 here):
  * sync:    train.threads = T, the vLLM engine in the training process (its forward passes use
             the same T torch threads); rollout and update take turns on all T;
  * overlap: train.threads = T - E for the update, the engine in its own process bound to the last
             E CPUs (VLLM_CPU_OMP_THREADS_BIND, E = --engine-threads, default T // 2): both at once.
The Python threads that drive the rollout (tokenising, the tool calls) are not counted in either.
--modes adds `sync-part`: sync on the overlap trainer's T - E threads alone, a control for how
rollout and update scale with threads (and for a loaded machine, where T threads may lose to fewer).
Reported per mode: questions per second over all steps (from the first rollout's start to the last
update's end, the overlap's pipeline fill included) and over steps 2.. (steady state), medians of
the repetitions; and the timeline of the last repetition, from each run's timeline.jsonl
(trainer/overlap.note: which process does what, when), as a table and a png.

--seeds S1 S2 ..: for each train.seed, the quick start as shipped (20 steps, validation every 5) in
both modes; the report is 2-hop EM at each validation step, overlap beside sync, and each mode's
mean and spread over the seeds at the last step (the same world and warm start: train.seed moves
the data order and the sampling).

Output: --out (default runs/bench_overlap-<time>/): report.md, report.json, timeline.png and the
runs. Nothing is written under results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.config import load_config  # noqa: E402
from trainer.precision import cpu_name  # noqa: E402

MAIN_STAGES = ("rollout", "wait", "reward", "train", "sync")  # the step itself: eval and save are apart
COLOURS = {"rollout": "tab:blue", "wait": "lightgrey", "reward": "tab:orange", "train": "tab:green",
           "sync": "tab:red", "eval": "tab:purple", "save": "tab:brown"}  # fmt: skip


def mode_settings(mode: str, threads: int, engine_threads: int) -> tuple[list[str], dict]:
    """(--set overrides, environment) of a mode: module docstring, "same total threads"."""
    if mode in ("sync", "sync-part"):
        return [f"train.threads={threads if mode == 'sync' else threads - engine_threads}", "train.overlap=false"], {}
    cpus = sorted(os.sched_getaffinity(0))[-engine_threads:]
    return [f"train.threads={threads - engine_threads}", "train.overlap=true", "train.max_staleness=1"], {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cpus)}


def run_train(config: str, mode: str, name: str, out: Path, sets: list[str], threads: int, engine_threads: int) -> Path:
    """train.py in a subprocess; its run directory."""
    mode_sets, env = mode_settings(mode, threads, engine_threads)
    args = [sys.executable, "train.py", "--config", config, "--set", f"train.run_dir={out / 'runs'}",
            "--set", f"train.name={name}"] + [x for s in [*mode_sets, *sets] for x in ("--set", s)]  # fmt: skip
    log = out / f"{name}.log"
    with open(log, "w") as f:
        done = subprocess.run(args, cwd=ROOT, env=os.environ | env, stdout=f, stderr=subprocess.STDOUT)
    text = log.read_text()
    if done.returncode != 0:
        sys.exit(f"{name}: train.py exited {done.returncode}; its log: {log}\n{text[-2000:]}")
    return Path(next(line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("run directory: ")))


def timeline(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines() if line.strip()]


def questions_per_s(run: Path, per_step: int, from_step: int = 1) -> float:
    """Questions trained per second of the steps from_step.. (rollout start to the step's last stage)."""
    rows = [r for r in timeline(run) if r["stage"] in MAIN_STAGES]
    steps = sorted({r["step"] for r in rows if r["step"] >= from_step})
    begin = min(r["start"] for r in rows if r["step"] == steps[0])
    end = max(r["end"] for r in rows if r["step"] == steps[-1])
    return len(steps) * per_step / (end - begin)


def stage_table(run: Path, mode: str) -> list[str]:
    """Per step: each stage's start and end, seconds from the run's first stage, and who ran it."""
    rows = timeline(run)
    t0 = min(r["start"] for r in rows)
    out = []
    for r in sorted(rows, key=lambda r: r["start"]):
        out.append(f"| {mode} | {r['step']} | {r['who']} | {r['stage']} | {r['start'] - t0:.2f} | {r['end'] - t0:.2f} "
                   f"| {r['end'] - r['start']:.2f} |")  # fmt: skip
    return out


def draw(runs: dict[str, Path], path: Path) -> None:
    """One lane per process (trainer, engine) per mode; a bar per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = [(mode, who) for mode in runs for who in ("engine", "trainer")]
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(lanes)))
    for y, (mode, who) in enumerate(lanes):
        rows = timeline(runs[mode])
        t0 = min(r["start"] for r in rows)
        for r in rows:
            if r["who"] == who:
                ax.barh(y, r["end"] - r["start"], left=r["start"] - t0, color=COLOURS.get(r["stage"], "black"),
                        edgecolor="white", linewidth=0.3)  # fmt: skip
    ax.set_yticks(range(len(lanes)), [f"{mode}: {who}" for mode, who in lanes])
    ax.set_xlabel("seconds from the first rollout")
    ax.legend(handles=[matplotlib.patches.Patch(color=c, label=s) for s, c in COLOURS.items()], ncol=7,
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(lanes) < 4 else -0.15), fontsize=8)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def throughput(args: argparse.Namespace, out: Path) -> dict:
    sets = [f"train.steps={args.steps}", "train.eval_every=0", "train.save_every=0", *args.set]
    per_step = load_config(args.config, sets).train.questions_per_step
    found: dict[str, list[tuple[float, float]]] = {mode: [] for mode in args.modes}
    last: dict[str, Path] = {}
    for rep in range(args.reps):
        for mode in args.modes if rep % 2 == 0 else args.modes[::-1]:
            run = run_train(args.config, mode, f"{mode}-rep{rep}", out, sets, args.threads, args.engine_threads)
            found[mode].append((questions_per_s(run, per_step), questions_per_s(run, per_step, 2)))
            last[mode] = run
            print(f"rep {rep} {mode}: {found[mode][-1][0]:.3f} questions/s ({found[mode][-1][1]:.3f} from step 2)",
                  flush=True)  # fmt: skip
    med = {m: [statistics.median(x[i] for x in v) for i in (0, 1)] for m, v in found.items()}
    draw(last, out / "timeline.png")
    lines = [f"# Sync vs overlap on {args.config}: {args.steps} steps x {args.reps} reps, {per_step} questions a step",
             "", f"command: python benchmarks/bench_overlap.py {' '.join(sys.argv[1:])}",
             f"CPU: {cpu_name()}, {args.threads} threads (overlap: {args.threads - args.engine_threads} trainer + "
             f"{args.engine_threads} engine)", "",
             "| mode | questions/s (all steps) | questions/s (steps 2..) | reps |", "|---|---|---|---|"]  # fmt: skip
    for mode, (q_all, q_steady) in med.items():
        reps = ", ".join(f"{a:.3f}" for a, _ in found[mode])
        lines.append(f"| {mode} | {q_all:.3f} | {q_steady:.3f} | {reps} |")
    if "overlap" in med and "sync" in med:
        lines += ["", f"overlap / sync: {med['overlap'][0] / med['sync'][0]:.2f} (all steps), "
                  f"{med['overlap'][1] / med['sync'][1]:.2f} (steps 2..)"]
    lines += ["",
              "Timeline of the last repetition (timeline.png; seconds from each run's first stage):", "",
              "| mode | step | who | stage | start | end | seconds |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for mode, run in last.items():
        lines += stage_table(run, mode)
    return {"report": lines, "questions_per_s": found, "median": med, "runs": {m: str(r) for m, r in last.items()}}


def em_seeds(args: argparse.Namespace, out: Path) -> dict:
    """2-hop EM at each validation step, per seed and mode."""
    em: dict[str, dict[int, dict[int, float]]] = {"sync": {}, "overlap": {}}
    for seed in args.seeds:
        for mode in ("sync", "overlap") if seed % 2 == 0 else ("overlap", "sync"):
            sets = [f"train.seed={seed}", *args.set] + ([f"train.steps={args.steps}"] if args.steps_given else [])
            run = run_train(args.config, mode, f"{mode}-seed{seed}", out, sets, args.threads, args.engine_threads)
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
            em[mode][seed] = {r["step"]: r["eval"]["em_2hop"] for r in rows if "eval" in r and "em_2hop" in r["eval"]}
            print(f"seed {seed} {mode}: 2-hop EM {em[mode][seed]}", flush=True)
    steps = sorted(em["sync"][args.seeds[0]])
    lines = [f"# 2-hop EM at equal steps, overlap beside sync: {args.config}, train.seed {args.seeds}", "",
             f"command: python benchmarks/bench_overlap.py {' '.join(sys.argv[1:])}", "",
             "| seed | mode | " + " | ".join(f"step {s}" for s in steps) + " |",
             "|---|---|" + "---|" * len(steps)]  # fmt: skip
    for seed in args.seeds:
        for mode in ("sync", "overlap"):
            lines.append(f"| {seed} | {mode} | " + " | ".join(f"{em[mode][seed].get(s, float('nan')):.3f}"
                                                             for s in steps) + " |")  # fmt: skip
    lines.append("")
    for mode in ("sync", "overlap"):
        final = [em[mode][s][steps[-1]] for s in args.seeds]
        spread = f"{min(final):.3f}-{max(final):.3f}"
        lines.append(f"{mode}: step {steps[-1]} 2-hop EM mean {statistics.mean(final):.3f}, range {spread}")
    return {"report": lines, "em_2hop": em}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--steps", type=int, default=None, help="steps a run (throughput: 10; --seeds: the config's)")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of each mode, alternated (throughput)")
    parser.add_argument("--seeds", type=int, nargs="*", help="the EM comparison instead, one train.seed each")
    parser.add_argument("--modes", nargs="+", default=["sync", "overlap"], choices=["sync", "overlap", "sync-part"],
                        help="throughput: the modes, in the even repetitions' order (odd ones reverse it)")
    cpus = len(os.sched_getaffinity(0))
    parser.add_argument("--threads", type=int, default=cpus, help=f"total compute threads, both modes ({cpus})")
    parser.add_argument("--engine-threads", type=int, default=None, help="of which overlap's engine (threads // 2)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more train.py overrides")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.steps_given = args.steps is not None
    args.steps = args.steps or 10
    args.engine_threads = args.engine_threads or max(1, args.threads // 2)
    if not 0 < args.engine_threads < args.threads:
        parser.error(f"--engine-threads {args.engine_threads} must leave the trainer at least one of --threads "
                     f"{args.threads}")  # fmt: skip
    out = args.out or ROOT / "runs" / f"bench_overlap-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    result = em_seeds(args, out) if args.seeds else throughput(args, out)
    (out / "report.md").write_text("\n".join(result["report"]) + "\n")
    (out / "report.json").write_text(json.dumps({k: v for k, v in result.items() if k != "report"}, indent=1))
    print("\n".join(result["report"][:12]))
    print(f"report: {out / 'report.md'}")


if __name__ == "__main__":
    main()
