"""Training curves from a run's metrics.jsonl: one PNG per family of series.

    python eval.py curves runs/tiny-20261122-010203          # writes runs/.../curves/*.png

Families (a figure is drawn only when its series were logged):
  reward     the reward and each reward component (reward/<name>)
  accuracy   training-batch EM and the evaluations' EM (overall and per question type)
  lagrangian each constraint's multiplier lambda/<name> and statistic constraint/<name>, with
             the threshold it is held to (constrained GRPO, trainer/constraints.py)
  idk        the IDK rate, per BAPO stage when there is one
  kl         KL to the reference and the policy's entropy
  length     policy tokens per rollout
  searches   searches per question
  critic     PPO's value loss and mean value
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FAMILIES = {
    "reward": lambda k: k == "reward" or k.startswith("reward/"),
    "accuracy": lambda k: k == "em" or (k.startswith("eval.em")),
    "lagrangian": lambda k: k.startswith(("lambda/", "constraint/")),
    "idk": lambda k: k.startswith("idk_rate"),
    "kl": lambda k: k in ("kl", "entropy"),
    "length": lambda k: k == "response_len",
    "searches": lambda k: k in ("searches_per_question", "eval.searches"),
    "critic": lambda k: k in ("value_loss", "value_mean"),
}


def read_series(run: Path) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value), ...]} for every numeric metric; eval metrics as eval.<key>."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics to plot: {path} not found")
    series: dict[str, list[tuple[int, float]]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        flat = {k: v for k, v in row.items() if k not in ("eval", "time")}
        flat |= {f"eval.{k}": v for k, v in row.get("eval", {}).items()}
        for key, value in flat.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                series.setdefault(key, []).append((row["step"], float(value)))
    return series


def draw_curves(run: Path, out_dir: Path | None = None, thresholds: dict[str, float] | None = None) -> list[Path]:
    """Write one PNG per family into out_dir (default RUN/curves); returns the files written.
    thresholds: {constraint name: a}, drawn as dashed lines on the lagrangian figure."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    series = read_series(run)
    out_dir = out_dir or run / "curves"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for family, wanted in FAMILIES.items():
        keys = sorted(k for k in series if wanted(k))
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        twin = None
        for i, key in enumerate(keys):
            steps, values = zip(*series[key])
            target = ax
            if key.startswith("lambda/"):  # multipliers on their own axis: a different scale
                twin = twin or ax.twinx()
                target = twin
            # one colour cycle across both axes, so a lambda never shares its statistic's colour
            target.plot(steps, values, marker="o" if len(steps) < 12 else None, ms=3, label=key, color=f"C{i}")
        if family == "lagrangian" and thresholds:
            for name, a in thresholds.items():
                ax.axhline(a, ls="--", color="grey", lw=1, label=f"threshold {name} = {a}")
        ax.set_xlabel("step")
        ax.set_title(f"{run.name}: {family}")
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if twin is not None:
            twin.set_ylabel("lambda")
            h2, l2 = twin.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        ax.legend(handles, labels, fontsize=7, loc="best")
        fig.tight_layout()
        path = out_dir / f"{family}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="eval.py curves", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run directory (holds metrics.jsonl)")
    parser.add_argument("--out", help="output directory (default RUN/curves)")
    args = parser.parse_args(argv)
    run = Path(args.run)
    thresholds = {}
    if (run / "config.yaml").is_file():
        import yaml

        cfg = yaml.safe_load((run / "config.yaml").read_text())
        thresholds = {c["name"]: c.get("threshold", 0.9) for c in cfg.get("train", {}).get("constraints", [])}
    try:
        for path in draw_curves(run, Path(args.out) if args.out else None, thresholds):
            print(path)
    except FileNotFoundError as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
