"""Classroom reproduction on the embedded tiny world: train, evaluate, write results/tiny.md.

    python reproduce.py --world tiny                   # 3 seeds, 2 runs at a time
    python reproduce.py --world tiny --seeds 0 --set train.steps=10 --out /tmp/tiny.md

What it does, in order (all on CPU, the cached world and SFT start reused when present):
  1. builds the tiny world, its tokenizer and the SFT warm start (tiny/world.py; cached in cache/)
  2. trains GRPO with search (configs/tiny.yaml) and Search-R1's ablation without the
     retrieved-token loss mask (train.mask_retrieved false), one run per seed, `--parallel`
     at a time with one torch thread each (two threads per run on two cores is far slower)
  3. evaluates greedily on the held-out test questions (eval.run_eval, report/metrics.py):
     direct answer and naive RAG (the SFT policy in eval.py's baseline modes), the SFT start
     with search, and every trained run's last checkpoint
  4. writes the table (mean ± spread over seeds, spread = max - min; the baselines are greedy
     and deterministic, one value), the wall time of each part and the curves
     (results/curves/tiny_*.png) to `--out`

Search-R1's claim it reproduces in miniature (Search-R1 §4, Table 2; the mask: §3.1, Table 4):
RL with search beats naive RAG and the SFT start on multi-hop questions; training on the
retrieved tokens too changes the outcome (reported whichever way it falls).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from eval import run_eval
from report.plots import main as plots_main
from report.plots import read_series
from tiny.papers import main as papers_main
from tiny.report import build_start, finish_report, last_checkpoint, mean_spread, train_runs
from tiny.world import world_dir
from trainer.config import ConfigError, load_config
from trainer.precision import machine
from trainer.precision import resolve as resolve_precision

VARIANTS = {  # name -> extra overrides of the training config
    "GRPO with search": [],
    "GRPO, no retrieved-token mask": ["train.mask_retrieved=false"],
}
KEYS = ("em", "em_1hop", "em_2hop", "f1", "searches_2hop")


def results_table(rows: dict, seeds: list[int]) -> str:
    """One line per method; seeded methods as mean ± spread over their seeds."""
    methods: dict[str, list[dict]] = {}
    for name, per in rows.items():
        base = name.rsplit(" seed", 1)[0]
        methods.setdefault(base, []).append(next(iter(per.values())))
    lines = ["| method | runs | " + " | ".join(KEYS) + " |", "|---|---|" + "---|" * len(KEYS)]
    for base, ms in methods.items():
        cells = [mean_spread([m.get(k, float("nan")) for m in ms]) for k in KEYS]
        lines.append(f"| {base} | {len(ms)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draw_curves(done: dict, out_dir: Path) -> list[Path]:
    """Validation EM (2-hop) against step for every run, one panel per variant, plus each
    seed-0 run's own report/plots.py figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(VARIANTS), figsize=(5 * len(VARIANTS), 3.5), sharey=True)
    for ax, variant in zip(axes, VARIANTS):
        for (v, seed), info in sorted(done.items()):
            if v != variant:
                continue
            series = read_series(info["run"])
            for key, style in (("eval.em_2hop", "-"), ("eval.em_1hop", ":")):
                if key in series:
                    xs, ys = zip(*series[key])
                    ax.plot(xs, ys, style, color=f"C{seed}", label=f"{key[5:]} seed {seed}")
        ax.set_title(variant)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation EM (greedy)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    paths = [out_dir / "tiny_val_em.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    for (variant, seed), info in done.items():
        if seed == min(s for _, s in done):
            plots_main([str(info["run"])])
            tag = "nomask" if VARIANTS[variant] else "grpo"
            for png in sorted((info["run"] / "curves").glob("*.png")):
                if png.stem in ("reward", "accuracy", "searches"):
                    target = out_dir / f"tiny_{tag}_{png.name}"
                    target.write_bytes(png.read_bytes())
                    paths.append(target)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="reproduce.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument(
        "--world",
        default="tiny",
        choices=["tiny", "papers"],
        help="tiny: Search-R1 in miniature (this file); papers: every paper's effect (tiny/papers.py)",
    )
    parser.add_argument("--config", default="configs/tiny.yaml", help="training config of the GRPO runs")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="train.seed of each run")
    parser.add_argument("--parallel", type=int, default=2, help="training runs at once (one torch thread each)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra training overrides, e.g. train.steps=10")  # fmt: skip
    parser.add_argument("--out", default="results/tiny.md", help="the markdown report")
    parser.add_argument("--run-dir", default="", help="where runs go (default runs/reproduce-<time>)")
    world = argparse.ArgumentParser(add_help=False)
    world.add_argument("--world", default="tiny")
    if world.parse_known_args(argv)[0].world == "papers":  # its own options and --help (tiny/papers.py)
        return papers_main(argv)
    args = parser.parse_args(argv)
    try:
        cfg = resolve_precision(load_config(args.config, args.set))  # a bad config or override fails here
    except ConfigError as e:
        parser.error(str(e))
    t_start = time.time()
    run_dir = Path(args.run_dir or f"runs/reproduce-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    timings = {}
    print("1/4 tiny world and SFT warm start (cached after the first time) ...", flush=True)
    t0 = time.time()
    sft = world_dir(cfg) / "policy"
    build_start(sft, args.config, args.set)
    timings["world + SFT start"] = time.time() - t0
    print(f"2/4 training {len(VARIANTS) * len(args.seeds)} runs, {args.parallel} at a time ...", flush=True)
    t0 = time.time()
    jobs = [((v, s), f"{'nomask' if VARIANTS[v] else 'grpo'}-seed{s}", args.config, [f"train.seed={s}", *VARIANTS[v]])
            for v in VARIANTS for s in args.seeds]  # fmt: skip
    done = train_runs(jobs, args.parallel, args.set, run_dir)
    timings["training"] = time.time() - t0
    print("3/4 evaluating on the held-out test questions ...", flush=True)
    t0 = time.time()
    spec = [("direct (SFT policy)", sft, ["direct"]), ("naive RAG (SFT policy)", sft, ["rag"]),
            ("SFT start, with search", sft, ["agentic"])]  # fmt: skip
    spec += [
        (f"{variant} seed{seed}", last_checkpoint(info["run"]), ["agentic"]) for (variant, seed), info in done.items()
    ]
    test_file = world_dir(cfg) / "test.jsonl"
    rows = run_eval(cfg, spec, [test_file], list(KEYS), run_dir / "eval")
    timings["evaluation"] = time.time() - t0
    print("4/4 curves and report ...", flush=True)
    out = Path(args.out)
    curves = draw_curves(done, out.parent / "curves")
    timings["total"] = time.time() - t_start
    write_report(out, args, rows, done, timings, curves, run_dir, test_file)
    print(out.read_text())


def write_report(out: Path, args, rows, done, timings, curves, run_dir: Path, test_file: Path) -> None:
    n_test = next(iter(next(iter(rows.values())).values()))["n"]
    per_run = [info["minutes"] for info in done.values()]
    cmd = "python reproduce.py --world tiny" + "".join(
        f" {flag} {' '.join(map(str, val)) if isinstance(val, list) else val}"
        for flag, val in (("--seeds", args.seeds), ("--parallel", args.parallel))
        if val != {"--seeds": [0, 1, 2], "--parallel": 2}[flag]
    ) + "".join(f" --set {s}" for s in args.set)  # fmt: skip
    lines = [
        "# Tiny-world reproduction (Search-R1 in miniature)",
        "",
        f"Produced by `{cmd}` on {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores of {machine()}, in "
        f"**{timings['total'] / 60:.1f} min** ("
        + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items() if k != "total")
        + ").",  # fmt: skip
        f"Training runs took {min(per_run):.1f}–{max(per_run):.1f} min each, {args.parallel} at a time.",
        "",
        f"Greedy evaluation on the {n_test} held-out test questions (`{test_file.name}`: half 1-hop, half 2-hop).",
        f"Seeds {', '.join(map(str, args.seeds))}: mean ± spread (max − min) over the trained runs; the",
        "baselines are greedy and deterministic (one value). `searches_2hop` is searches per 2-hop question.",
        "",
        results_table(rows, args.seeds),
        "",
        "Methods: *direct* and *naive RAG* are eval.py's `direct` and `rag` modes on the SFT policy",
        "(no retrieval / the top hit for the question itself, then answer); *SFT start, with search* is",
        "the same policy with its search tool; the GRPO rows are each run's last checkpoint",
        "(configs/tiny.yaml; the ablation trains on retrieved tokens too: `train.mask_retrieved=false`).",
        "",
        "Curves:",
        "",
    ]
    finish_report(out, lines, curves, run_dir, run_dir / "reproduce.json", {"timings": timings, "rows": rows})


if __name__ == "__main__":
    main()
