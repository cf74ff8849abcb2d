"""Every paper's effect on the tiny world, from one command: train, evaluate, write
results/tiny_papers.md with curves.

    python reproduce.py --world papers                 # 11 configs x 3 seeds, 2 runs at a time
    python reproduce.py --world papers --seeds 0 --set train.steps=2 --out /tmp/papers.md  # smoke

The runs start from three SFT policies (cached in cache/), each with its plain GRPO baseline:
- configs/reproduction/tiny_papers.yaml: the tiny world with unanswerable and misinformation questions
  (tiny/world.py) and a Search-R1-format teacher that has each paper's flaw (world.Habits: random
  confidence, IDK only at random, site: rarely, a think that ignores what it read);
- configs/reproduction/tiny_papers_boundary.yaml, the "boundary world" of BAPO's rows: a third of the
  questions ask about people no passage names (the search finds no namesake), no misinformation,
  and the teacher's random IDK more often;
- configs/reproduction/tiny_evidence.yaml, the "evidence world" of Deliberative Searcher's rows: half
  the questions ask about people no passage names and their search finds nothing, the teacher says
  when it guesses, and its confidence digit is threshold-neutral (world.parity_confidence; the
  config says why the papers' world cannot show this paper's effect).
Each paper's config changes the reward, nothing else, so every row is compared with the plain
GRPO baseline (EM reward) from the same start:

  Search-R1              retrieved-token mask vs none (§3.1, Table 4)       tiny_search_r1_nomask.yaml
  Deliberative Searcher  Lagrangian reliability constraint (§2.1, Alg. 1)  tiny_deliberative.yaml
                         its fixed-lambda ablation (§3.2)                   tiny_deliberative_fixed.yaml
                         eq. 6 against a fair coin (the shuffled control)   tiny_deliberative_shuffled.yaml
                         on the papers' world (--only, the negative)        tiny_deliberative_uniform.yaml
                         ... with advantages by batch std / no std          tiny_deliberative_{batch,none}std.yaml
  BAPO                   boundary-aware reward + modulator (eq. 3-6, §4.2) tiny_bapo.yaml
                         and the fixed +0.5-per-IDK ablation                tiny_bapo_fixed.yaml
  WebFilter              source-restricting reward (eq. 2-8)               tiny_webfilter.yaml
  VERITAS                info-think process reward (eq. 1)                 tiny_veritas.yaml

Deliberative Searcher's confidence is read two ways on the held-out test split: greedy (reliability,
false-certain) and teacher-forced, P(c >= 5) summed over all ten confidences at the teacher's own
150 contexts per start (report/metrics.p_certain: greedy decoding of a digit-split "10" is a coin
flip). Its acceptance is per seed (deliberative_acceptance); why one confidence and not the
paper's one per step with READ: NOTES, which the report prints beside the table.
VERITAS's flaw is read the same two ways: greedy info-think, and the teacher-forced probability of
the teacher's unfaithful think where the answer's think begins (report/metrics.unfaithful_share;
greedy writes the likelier think only, so it reads 1.0 once that is the faithful one); its
acceptance is per seed too (veritas_line).
WebFilter's and VERITAS's judge is the tiny world's rule judge (judge.RuleJudge), and so is the
faithfulness measurement of every row: it is not an LLM, and the report says so. Evaluation is
greedy on the held-out test questions (people no SFT or RL question asked about). `--run-dir`
of an interrupted call continues it: finished runs are kept, killed ones resume from their last
checkpoint (reproduce.train_runs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from report.plots import read_series
from tiny.report import ROOT, build_start, finish_report, last_checkpoint, mean_spread, train_runs
from tiny.sft import confidence_contexts, think_contexts, world_search_tool
from tiny.world import world_dir, write_jsonl
from trainer.config import ConfigError, load_config
from trainer.precision import machine
from trainer.questions import benchmark_name

BASELINE = "GRPO baseline (EM)"
BOUNDARY_BASELINE = "GRPO baseline (EM), boundary world"
EVIDENCE_BASELINE = "Deliberative: EM baseline"
LAGRANGIAN, SHUFFLED = "Deliberative: Lagrangian", "Deliberative: shuffled control"
FIXED_LAMBDA = "Deliberative: fixed λ = 0.1"
UNIFORM = "Deliberative: Lagrangian, uniform teacher"
RUNS = {  # row -> config
    BASELINE: "configs/reproduction/tiny_papers.yaml",
    BOUNDARY_BASELINE: "configs/reproduction/tiny_papers_boundary.yaml",
    EVIDENCE_BASELINE: "configs/reproduction/tiny_evidence.yaml",
    "Search-R1: no retrieved-token mask": "configs/reproduction/tiny_search_r1_nomask.yaml",
    SHUFFLED: "configs/reproduction/tiny_deliberative_shuffled.yaml",
    LAGRANGIAN: "configs/reproduction/tiny_deliberative.yaml",
    FIXED_LAMBDA: "configs/reproduction/tiny_deliberative_fixed.yaml",
    # the documented negative and its adv_std tries, on the papers' world whose teacher's confidence is
    # uniform: research rows, run only when named with --only (results/deliberative_adv_std.md)
    UNIFORM: "configs/reproduction/tiny_deliberative_uniform.yaml",
    f"{UNIFORM}, batch std": "configs/reproduction/tiny_deliberative_batchstd.yaml",
    f"{UNIFORM}, no std": "configs/reproduction/tiny_deliberative_nonestd.yaml",
    "BAPO": "configs/reproduction/tiny_bapo.yaml",
    "BAPO: fixed +0.5 per IDK": "configs/reproduction/tiny_bapo_fixed.yaml",
    "WebFilter": "configs/reproduction/tiny_webfilter.yaml",
    "VERITAS": "configs/reproduction/tiny_veritas.yaml",
}
DEFAULT_ROWS = [row for row in RUNS if not row.startswith(UNIFORM)]  # what a plain call trains
SFT_ROW, BOUNDARY_SFT_ROW, EVIDENCE_SFT_ROW = "SFT start", "SFT start, boundary world", "SFT start, evidence world"
# an SFT start -> the baseline row that builds it
STARTS = {SFT_ROW: BASELINE, BOUNDARY_SFT_ROW: BOUNDARY_BASELINE, EVIDENCE_SFT_ROW: EVIDENCE_BASELINE}
DELIBERATIVE_METRICS = [("certain_gap", "Δ = P(c≥5) answerable − unanswerable"),
                        ("p_certain_answerable", "P(c≥5) answerable"), ("p_certain_unanswerable", "unanswerable"),
                        ("ds_reliability", "greedy reliability"), ("best_constant", "max(acc, 1 − acc)"),
                        ("ds_false_certain", "false-certain"), ("ds_certain_right", "c≥5 among right"),
                        ("em", "EM")]  # fmt: skip
# paper -> (its SFT start, rows, [(metric, label)], the validation series of its curve)
PAPERS = {
    "Search-R1": (SFT_ROW, [BASELINE, "Search-R1: no retrieved-token mask"],
                  [("em", "EM"), ("em_2hop", "EM 2-hop"), ("searches_2hop", "searches / 2-hop q")], "em_2hop"),
    "Deliberative Searcher": (EVIDENCE_SFT_ROW, [EVIDENCE_BASELINE, SHUFFLED, LAGRANGIAN, FIXED_LAMBDA],
                              DELIBERATIVE_METRICS, "ds_reliability"),
    "Deliberative Searcher, uniform teacher": (SFT_ROW, [BASELINE, UNIFORM, f"{UNIFORM}, batch std",
                                                         f"{UNIFORM}, no std"], DELIBERATIVE_METRICS, "ds_reliability"),
    "BAPO": (BOUNDARY_SFT_ROW, [BOUNDARY_BASELINE, "BAPO", "BAPO: fixed +0.5 per IDK"],
             [("idk_unanswerable", "IDK rate, unanswerable"), ("idk_answerable", "IDK rate, answerable"),
              ("em_answerable", "EM, answerable"), ("bapo_reliability", "BAPO reliability")], "idk_unanswerable"),
    "WebFilter": (SFT_ROW, [BASELINE, "WebFilter"],
                  [("operator_use", "operator use"), ("em_misinfo", "EM, misinformation q"), ("em", "EM")],
                  "operator_use"),
    "VERITAS": (SFT_ROW, [BASELINE, "VERITAS"],
                [("p_unfaithful_think", "P(unfaithful think), teacher-forced"), ("info_think", "greedy info-think"),
                 ("think_answer", "think-answer"), ("em", "EM")],
                "info_think"),
}  # fmt: skip
START_OF = {row: start for start, rows, _, _ in PAPERS.values() for row in rows}
NOTES = {  # read with a paper's table
    "Deliberative Searcher": [
        "Reading the table: the Lagrangian and the fixed λ = 0.1 rows agree. With advantages normalised per",
        "group (GRPO's, as the paper's), a group that disagrees on the digit is scaled by its own std, so",
        "λ's size hardly matters (the curves show λ beside U). The paper's Fig. 1 contrast (the fixed λ collapsing",
        "to \"uncertain\") is therefore not a criterion on this world. The paper's own Table 1 reliability for",
        "Deliberative Searcher-7B is 0.01–0.04 above the best constant, max(Acc, 1 − Acc), on each benchmark",
        "(72B: 0.08–0.13). Greedy reliability can mislead: a digit-split \"10\" is \"1\" then \"0\", so greedy",
        "decoding flips between the surest and the least sure answer. Δ, read teacher-forced over all ten",
        "values, is the measure; the greedy columns are shown beside it. The rows write one confidence, before",
        "the answer, not the paper's confidence per step with READ: eq. 5 scores only c(s_T), the final",
        "answer's (§2.2), so per-step digits would carry no reward of their own.",
    ],
    "VERITAS": [
        "Reading the table: 30% of the teacher's trajectories think \"I know the answer.\" after reading, ignoring",
        "it. Greedy decoding writes the likelier think only, so greedy info-think reaches 1.0 as soon as the",
        "faithful think is the more probable at every context, under either reward. The teacher-forced",
        "P(unfaithful think), at the teacher's own contexts where the answer's think begins, is the rate a",
        "sampling policy thinks unfaithfully: the measure. EM alone lowers it too: on this world the restated",
        "fact is what the tiny policy copies its answer (and a second query's city) from. Eq. 1's process",
        "reward lowers it further.",
    ],
}
CONTEXTS = 150  # teacher-forced contexts per start (eval.py --confidence-contexts, --think-contexts)


def seed_rows(rows: dict, row: str) -> list[dict]:
    """The metrics of every seed of a row (one dict for the SFT start)."""
    return [per for name, per in rows.items() if name.rsplit(" seed", 1)[0] == row]


def values(rows: dict, row: str, key: str) -> list[float]:
    """The metric of every seed of a row (one value for the SFT start)."""
    return [per[key] for per in seed_rows(rows, row) if key in per]


def mean(rows: dict, row: str, key: str) -> float:
    vs = values(rows, row, key)
    return statistics.mean(vs) if vs else float("nan")


def deliberative_acceptance(rows: dict) -> list[tuple[str, str, bool]]:
    """Deliberative Searcher's lines, every seed on its own (a mean would count the runs that flip
    the whole confidence one way as half an effect): the start is not calibrated; the EM baseline
    and the shuffled control leave the gap Δ near 0; the Lagrangian opens it, is reliable beyond a
    constant answer, rarely certain when wrong while mostly certain when right, and keeps EM."""
    def seeds(row: str, key: str) -> str:
        return " / ".join(f"{v:.3f}" for v in values(rows, row, key))

    def each(row: str, test) -> bool:
        per = seed_rows(rows, row)
        return bool(per) and all(test(p) for p in per)

    gap, rel, best = "certain_gap", "ds_reliability", "best_constant"
    start = EVIDENCE_SFT_ROW
    out = [("Deliberative: SFT start", f"\\|Δ\\| {seeds(start, gap)} (≤ 0.05); greedy reliability {seeds(start, rel)} "
            f"vs max(acc, 1 − acc) {seeds(start, best)} (≤ +0.05)",
            each(start, lambda p: abs(p[gap]) <= 0.05 and p[rel] <= p[best] + 0.05))]  # fmt: skip
    for row in (EVIDENCE_BASELINE, SHUFFLED):
        if values(rows, row, gap):
            out.append((row, f"Δ per seed {seeds(row, gap)} (\\|Δ\\| ≤ 0.15 each)",
                        each(row, lambda p: abs(p[gap]) <= 0.15)))  # fmt: skip
    row = LAGRANGIAN
    if not values(rows, row, gap):
        return out
    out += [
        (row, f"Δ per seed {seeds(row, gap)} (≥ 0.30 each)", each(row, lambda p: p[gap] >= 0.30)),
        (row, f"greedy reliability {seeds(row, rel)} (≥ 0.85 and ≥ max(acc, 1 − acc) + 0.20: "
              f"{seeds(row, best)})", each(row, lambda p: p[rel] >= 0.85 and p[rel] >= p[best] + 0.20)),
        (row, f"greedy false-certain {seeds(row, 'ds_false_certain')} (≤ 0.05) with c ≥ 5 among right answers "
              f"{seeds(row, 'ds_certain_right')} (≥ 0.80)",
         each(row, lambda p: p["ds_false_certain"] <= 0.05 and p.get("ds_certain_right", 0) >= 0.80)),
        (row, f"mean EM {mean(rows, row, 'em'):.3f} vs the EM baseline's {mean(rows, EVIDENCE_BASELINE, 'em'):.3f} "
              "(drop ≤ 0.03)", mean(rows, row, "em") >= mean(rows, EVIDENCE_BASELINE, "em") - 0.03),
    ]  # fmt: skip
    return out


def veritas_line(rows: dict) -> tuple[str, str, bool]:
    """VERITAS's line, every seed on its own: eq. 1 makes the unfaithful think rarer than EM alone
    does (each VERITAS seed's teacher-forced P below the lowest of the baseline's seeds), and keeps EM."""
    key, b = "p_unfaithful_think", BASELINE
    base, veritas = values(rows, b, key), values(rows, "VERITAS", key)
    per_seed = lambda vs: " / ".join(f"{v:.3f}" for v in vs) or "–"  # noqa: E731
    em_b, em_v = mean(rows, b, "em"), mean(rows, "VERITAS", "em")
    return ("VERITAS", f"P(unfaithful think) start {per_seed(values(rows, SFT_ROW, key))}, EM baseline "
            f"{per_seed(base)} → VERITAS {per_seed(veritas)} (each below the baseline's lowest); EM {em_b:.3f} → "
            f"{em_v:.3f} (drop ≤ 0.03)",
            bool(base and veritas) and max(veritas) < min(base) and em_v >= em_b - 0.03)  # fmt: skip


def acceptance(rows: dict) -> list[tuple[str, str, bool]]:
    """The acceptance lines, each (paper, claim with its numbers, met?): Deliberative Searcher's per
    seed (deliberative_acceptance), the others from the means."""
    m = lambda row, key: mean(rows, row, key)  # noqa: E731
    b, bapo, fixed = BASELINE, "BAPO", "BAPO: fixed +0.5 per IDK"
    bb = PAPERS["BAPO"][1][0]  # BAPO's baseline: its first row
    out = [
        *(deliberative_acceptance(rows) if values(rows, EVIDENCE_SFT_ROW, "certain_gap") else []),
        ("BAPO", f"IDK on unanswerable {m(bapo, 'idk_unanswerable'):.3f} (≥ 0.5; baseline "
         f"{m(bb, 'idk_unanswerable'):.3f}), EM on answerable {m(bb, 'em_answerable'):.3f} → "
         f"{m(bapo, 'em_answerable'):.3f} (drop ≤ 0.05)",
         m(bapo, "idk_unanswerable") >= 0.5 and m(bb, "idk_unanswerable") <= 0.1
         and m(bapo, "em_answerable") >= m(bb, "em_answerable") - 0.05),
        # over-conservatism: IDK where the answer was findable, clearly more often than BAPO's
        ("BAPO ablation", f"fixed reward: IDK on answerable {m(fixed, 'idk_answerable'):.3f} vs BAPO "
         f"{m(bapo, 'idk_answerable'):.3f} (over-conservative: ≥ 0.05 more), EM on answerable "
         f"{m(fixed, 'em_answerable'):.3f} vs {m(bapo, 'em_answerable'):.3f}",
         m(fixed, "idk_answerable") >= m(bapo, "idk_answerable") + 0.05),
        ("WebFilter", f"operator use {m(SFT_ROW, 'operator_use'):.3f} (SFT) / {m(b, 'operator_use'):.3f} (baseline) "
         f"→ {m('WebFilter', 'operator_use'):.3f} (≥ 0.5), EM on misinformation {m(b, 'em_misinfo'):.3f} → "
         f"{m('WebFilter', 'em_misinfo'):.3f}",
         m("WebFilter", "operator_use") >= 0.5 and m("WebFilter", "em_misinfo") > m(b, "em_misinfo")),
        veritas_line(rows),
        ("Search-R1", f"EM 2-hop with the mask {m(b, 'em_2hop'):.3f}, without "
         f"{m('Search-R1: no retrieved-token mask', 'em_2hop'):.3f} (the ablation runs; no direction required)",
         True),
    ]  # fmt: skip
    return out


def acceptance_shown(rows: dict) -> list[tuple[str, str, bool]]:
    """The acceptance lines whose rows ran: a partial report (--only) leaves out the lines with a
    nan, the word alone ("unanswerable" holds the letters, and BAPO's line says it)."""
    return [line for line in acceptance(rows) if not re.search(r"\bnan\b", line[1])]


def draw_curves(done: dict, out_dir: Path, stem: str = "tiny_papers") -> list[Path]:
    """One PNG per paper whose rows ran, `<stem>_<paper>.png` (the report's own stem, so a partial
    report never overwrites the full one's): its validation metric against step, every seed of every
    row it compares (thin), and for the Deliberative Searcher the multiplier lambda beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {key: read_series(info["run"]) for key, info in done.items()}
    paths = []
    out_dir.mkdir(parents=True, exist_ok=True)
    ran = {row for row, _ in done}
    for paper, (_, rows, _, key) in PAPERS.items():
        if not ran & set(rows):
            continue
        extra = paper.startswith("Deliberative Searcher")
        fig, axes = plt.subplots(1, 2 if extra else 1, figsize=(10 if extra else 5.5, 3.6), squeeze=False)
        ax = axes[0][0]
        for i, row in enumerate(rows):
            for (r, seed), s in sorted(series.items()):
                if r == row and f"eval.{key}" in s:
                    xs, ys = zip(*s[f"eval.{key}"])
                    ax.plot(xs, ys, color=f"C{i}", alpha=0.8, label=row if seed == min(k[1] for k in done) else None)
        ax.set(title=f"{paper}: {key} (validation, greedy)", xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        if extra:
            ax = axes[0][1]
            for i, row in enumerate(rows[1:], 1):
                for (r, _), s in sorted(series.items()):
                    if r == row and "lambda/reliability" in s:
                        xs, ys = zip(*s["lambda/reliability"])
                        ax.plot(xs, ys, color=f"C{i}", alpha=0.8)
                        cs = s.get("constraint/reliability")
                        if cs:
                            ax.plot(*zip(*cs), ":", color=f"C{i}", alpha=0.5)
            ax.axhline(0.9, ls="--", color="grey", lw=0.8)
            ax.set(title="λ (solid) and training-batch reliability U (dotted); a = 0.9", xlabel="step")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        slug = paper.split()[0].lower().replace("-", "") + ("_uniform" if paper.endswith("uniform teacher") else "")
        path = out_dir / f"{stem}_{slug}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="reproduce.py --world papers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--world", default="papers", choices=["papers"], help="(the papers' tiny world)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="train.seed of each run")
    parser.add_argument("--parallel", type=int, default=2, help="training runs at once (one torch thread each)")
    parser.add_argument("--only", nargs="+", choices=list(RUNS), metavar="ROW",
                        help="train only these rows (default: all but the research rows '..., batch std' and "
                             "'..., no std')")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="overrides for every run, e.g. train.steps=2")  # fmt: skip
    parser.add_argument("--out", default="results/tiny_papers.md", help="the markdown report")
    parser.add_argument("--run-dir", default="", help="where runs go (default runs/papers-<time>); reuse to resume")
    args = parser.parse_args(argv)
    try:
        for config in RUNS.values():  # a bad config or override fails here, before any work
            load_config(config, args.set)
    except ConfigError as e:
        parser.error(str(e))
    rows_run = args.only or DEFAULT_ROWS
    starts = [start for start in STARTS if any(START_OF[row] == start for row in rows_run)]
    start_dir = {start: world_dir(load_config(RUNS[STARTS[start]], args.set)) for start in starts}
    for row in rows_run:  # a paper's row must share its baseline's start, or the comparison means nothing
        if world_dir(load_config(RUNS[row], args.set)) != start_dir[START_OF[row]]:
            parser.error(f"{RUNS[row]} builds a different SFT start than {RUNS[STARTS[START_OF[row]]]}: "
                         "a row's config may change the reward, not the world or the SFT")  # fmt: skip
    t_start = time.time()
    run_dir = Path(args.run_dir or f"runs/papers-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    timings = {}
    sets = sum((["--set", s] for s in args.set), [])
    print(f"1/4 the papers' tiny worlds and their SFT starts ({len(starts)}; cached after the first time) ...",
          flush=True)  # fmt: skip
    t0 = time.time()
    for start in starts:
        build_start(start_dir[start] / "policy", RUNS[STARTS[start]], args.set)
    timings["worlds + SFT starts"] = time.time() - t0
    # seed-major: every row's first seed finishes first (a look at all papers early)
    jobs = [((row, seed), f"{Path(RUNS[row]).stem.replace('_', '-')}-seed{seed}", RUNS[row], [f"train.seed={seed}"])
            for seed in args.seeds for row in rows_run]  # fmt: skip
    print(f"2/4 training {len(jobs)} runs, {args.parallel} at a time ...", flush=True)
    t0 = time.time()
    done = train_runs(jobs, args.parallel, args.set, run_dir)
    timings["training"] = time.time() - t0
    print("3/4 evaluating on the held-out test questions (rule judge for faithfulness) ...", flush=True)
    t0 = time.time()
    columns = sorted({k for _, _, ms, _ in PAPERS.values() for k, _ in ms} - {"best_constant"})  # that one: below
    rows, test_files, kept_evals = {}, {}, []
    for start in starts:  # each start on its own world's test split, in its own process (one vLLM engine each)
        models = [f"{start}={start_dir[start] / 'policy'}"]
        models += [f"{row} seed{seed}={last_checkpoint(info['run'])}" for (row, seed), info in done.items()
                   if START_OF[row] == start]  # fmt: skip
        out = run_dir / "eval" / {SFT_ROW: "start", BOUNDARY_SFT_ROW: "start-boundary"}.get(start, "start-evidence")
        test_files[start] = start_dir[start] / "test.jsonl"
        cmd = [sys.executable, "eval.py", "--config", RUNS[STARTS[start]], *sets,
               *sum((["--model", m] for m in models), []), "--datasets", str(test_files[start]),
               "--columns", *columns, "--judge-url", "rule", "--out", str(out)]  # fmt: skip
        cfg = load_config(RUNS[STARTS[start]], args.set)
        tool = world_search_tool(cfg, start_dir[start]) if cfg.sft.confidence or cfg.sft.p_unfaithful_think else None
        if cfg.sft.confidence:  # its teacher writes a confidence: read P(c >= 5) where it does
            contexts = confidence_contexts(cfg, start_dir[start], tool, "test", CONTEXTS)
            write_jsonl(run_dir / "eval" / f"{out.name}-contexts.jsonl", contexts)
            cmd += ["--confidence-contexts", str(run_dir / "eval" / f"{out.name}-contexts.jsonl")]
        if cfg.sft.p_unfaithful_think:  # its teacher sometimes thinks unfaithfully: read how often the policy would
            think = think_contexts(cfg, start_dir[start], tool, "test", CONTEXTS)
            write_jsonl(run_dir / "eval" / f"{out.name}-think-contexts.jsonl", think)
            cmd += ["--think-contexts", str(run_dir / "eval" / f"{out.name}-think-contexts.jsonl")]
        # a re-run keeps a finished evaluation of the same models, as it keeps finished runs
        asked = json.dumps(cmd[2:])
        if (out / "results.json").exists() and (out / "command.json").exists() and (
                (out / "command.json").read_text() == asked):  # fmt: skip
            print(f"  {start}: evaluated earlier ({out})", flush=True)
            kept_evals.append(start)
        else:
            subprocess.run(cmd, cwd=ROOT, check=True)
            (out / "command.json").write_text(asked)
        held_out = benchmark_name(test_files[start])  # eval.py's column group of that file
        rows |= {name: per[held_out] for name, per in json.loads((out / "results.json").read_text()).items()}
    for per in rows.values():  # the best reliability a constant confidence gets (all sure or all unsure)
        per["best_constant"] = max(per["acc"], 1 - per["acc"])
    timings["evaluation"] = time.time() - t0
    print("4/4 curves and report ...", flush=True)
    out = Path(args.out)
    curves = draw_curves(done, out.parent / "curves", out.stem)
    timings["total"] = time.time() - t_start
    write_report(out, args, rows, done, timings, curves, run_dir, test_files, kept_evals)
    print(out.read_text())


def write_report(out: Path, args, rows: dict, done: dict, timings: dict, curves: list[Path], run_dir: Path,
                 test_files: dict[str, Path], kept_evals: list[str] = ()) -> None:  # fmt: skip
    per_run = [info["minutes"] for info in done.values() if info["minutes"]]
    reused = sum(info["minutes"] for info in done.values() if info.get("earlier"))
    flags = ""
    if args.seeds != [0, 1, 2]:
        flags += " --seeds " + " ".join(map(str, args.seeds))
    if args.only:  # a partial report says it is one
        flags += " --only" + "".join(f' "{row}"' for row in args.only)
    cmd = "python reproduce.py --world papers" + flags + "".join(f" --set {s}" for s in args.set)
    held_out = " and ".join(f"{rows[start]['n']} ({start})" for start in test_files)
    lines = [
        "# Every paper's effect on the tiny world",
        "",
        f"Produced by `{cmd}` on {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores of {machine()}, in "
        f"**{timings['total'] / 60:.1f} min** ("
        + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items() if k != "total")
        + ").",
        f"Training runs: {len(done)}, {min(per_run, default=0):.1f}–{max(per_run, default=0):.1f} min each, "
        f"{args.parallel} at a time. Seeds {', '.join(map(str, args.seeds))}: mean ± spread (max − min).",
        *(
            [
                f"Runs kept from an earlier call with the same --run-dir took {reused:.1f} min more (run-minutes, "
                f"{args.parallel} at a time), not in the total above."
            ]
            if reused
            else []
        ),
        *([f"Evaluations kept from that call too ({', '.join(kept_evals)}): their time is not in the total."]
          if kept_evals else []),  # fmt: skip
        "",
        f"Greedy evaluation on the first {held_out} held-out test questions of each start's world",
        "(`test.jsonl`: plain, unanswerable and misinformation questions, half 1-hop, half 2-hop). Each",
        "paper's rows start from the same SFT policy as its GRPO baseline, and change only the reward",
        "(configs/reproduction/tiny_<paper>.yaml). BAPO's rows start in the boundary world",
        "(configs/reproduction/tiny_papers_boundary.yaml: a third of the questions ask about people no",
        "passage names, the teacher's random IDK 15%). Deliberative Searcher's rows start in the evidence world",
        "(configs/reproduction/tiny_evidence.yaml: half the questions ask about people no passage names, whose",
        "search finds nothing; the teacher says when it guesses, and its confidence digit is odd after a fact,",
        "even after a guess, P(c ≥ 5) = 0.6 either way). Their P(c ≥ 5) is teacher-forced at the teacher's",
        f"first {CONTEXTS} test contexts, every confidence 1–10 read as its whole string (report/metrics.p_certain).",
        "VERITAS's P(unfaithful think) is teacher-forced at the papers' start's first "
        f"{CONTEXTS} test contexts, where the answer's think begins (report/metrics.unfaithful_share).",
        "Faithfulness (info-think) and WebFilter's c are scored by the **rule judge** (judge.RuleJudge), not an LLM.",
        "",
        "## Acceptance: Deliberative Searcher's every seed, the others from the means below",
        "",
        "| paper | measured | met |",
        "|---|---|---|",
    ]
    # a partial report (--only) shows the papers whose rows ran, not lines of nan
    lines += [f"| {p} | {claim} | {'yes' if ok else '**no**'} |"
              for p, claim, ok in acceptance_shown(rows)]
    for paper, (start, names, metrics, _) in PAPERS.items():
        if not any(values(rows, row, "em") for row in names[1:]):
            continue
        lines += ["", f"## {paper}", "", "| row | " + " | ".join(label for _, label in metrics) + " |",
                  "|---|" + "---|" * len(metrics)]  # fmt: skip
        for row in [start, *names]:
            lines.append(f"| {row} | " + " | ".join(mean_spread(values(rows, row, k)) if values(rows, row, k)
                                                     else "–" for k, _ in metrics) + " |")  # fmt: skip
        lines += ["", *NOTES.get(paper, [])] if paper in NOTES else []
    lines += ["", "## Curves", ""]
    finish_report(out, lines, curves, run_dir, run_dir / "tiny_papers.json", {"timings": timings, "rows": rows})


if __name__ == "__main__":
    main()
