"""Evaluate policies: every paper's metrics, baselines as modes, per-dataset tables, viewer.

    python eval.py --config configs/tiny.yaml                         # the SFT policy, agentic, val
    python eval.py --config configs/tiny.yaml --split test --modes direct rag agentic \
        --model sft=cache/tiny-X/policy --model grpo=runs/tiny-X/checkpoints/step_30
    python eval.py --config C --datasets data/nq_hotpotqa/test.parquet --out runs/eval-7   # seven benchmarks
    python eval.py --config C --datasets data/flashrag/nq/test.jsonl data/flashrag/hotpotqa/dev.jsonl
    python eval.py curves runs/tiny-X        # PNG training curves of a run (report/plots.py)
    python eval.py view runs/eval-X/rollouts/grpo_agentic__test.jsonl -o view.html   # report/viewer.py

Modes (the baselines of Search-R1 Table 2 / BAPO Table 1, on the same questions):
  direct    answer at once, no retrieval: the response is forced to start with "<answer>"
  cot       reason first ("<think>" forced), no retrieval: a search gets "search is off" back
  rag       naive RAG: the top-k hits for the question itself are put in front of the answer
            (as a forced first search), later searches get "search is off"
  agentic   the policy's own protocol with its tools (what training rolls out)
  reliable  agentic, with the reliable prompt: "I don't know" allowed, a confidence asked for
All modes roll out greedily, one per question. Each (model, mode) is a row of the table, each
dataset x metric a column (report/metrics.py defines every metric: EM, F1, accuracy, reliability, FC%,
IDK rate, ECE, faithfulness, searches, ...). The output directory gets results.md / .csv /
.json, rollouts/<row>__<dataset>.jsonl and viewer.html (report/viewer.py).

`evaluate` (used by train.py for its periodic validation) returns the same metrics overall and
per `metadata.type` (the tiny world: 1hop, 2hop) and per benchmark (a parquet's data_source), e.g.
  {"n": 400, "em": 0.61, "em_1hop": 0.93, "em_2hop": 0.29, "searches_2hop": 1.4, ...}
  {"n": 3000, "em": 0.41, "em/nq": 0.44, "em/hotpotqa": 0.38, "n/nq": 500, ...}      (test.parquet)
Datasets are benchmarks (trainer/questions.benchmarks): FlashRAG's `<dataset>/<split>.jsonl` is named
by its folder, a Search-R1 parquet gives one column group per data_source, any other file its stem.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from agent.answers import parsed
from agent.judge import make_judge
from data import data_paths, starting_policy
from report.metrics import (
    CONFIDENCES,
    certainty_gap,
    compute_metrics,
    p_certain,
    rejection_success_rate,
    search_means,
    unfaithful_share,
)
from report.plots import main as curves_main
from report.viewer import main as viewer_main
from report.viewer import write_viewer
from rewards import score, source_restricting
from rollout import check_chat_template, render_prompt, rollout_batch, tokenize_segments
from search.meta import check_index
from search.tools import check_retriever, make_search_fn
from trainer.batching import continuation_logprobs
from trainer.config import Config, ConfigError, DataError, load_config
from trainer.engine import load_policy, load_tokenizer, make_engine
from trainer.precision import describe as describe_precision
from trainer.precision import resolve as resolve_precision
from trainer.questions import benchmarks, load_confidence_contexts, load_think_contexts

MODES = ("direct", "cot", "rag", "agentic", "reliable")
SEARCH_OFF = "Search is not available in this mode. Answer from what you know."
RELIABLE_SUFFIX = (
    " If you cannot find the answer, answer I don't know. After the answer, rate your "
    "confidence from 1 to 10 inside <confidence> and </confidence>.\n"
)
DEFAULT_COLUMNS = ("em", "f1", "searches")


def summarize(records: list[dict]) -> dict:
    """Mean EM / F1 / format / searches, overall, per question type (`metadata.type`; a null type
    is no type) and per benchmark (`metadata.dataset`: a parquet's data_source, as Search-R1 logs
    val/test_score/<data_source>), e.g. {"em": 0.4, "em_bridge": 0.3, "em/nq": 0.45, "em/hotpotqa": 0.35}."""
    if not records:
        raise ValueError("no rollouts to summarise (empty dataset?)")
    by_type: dict[str, list[dict]] = defaultdict(list)
    by_benchmark: dict[str, list[dict]] = defaultdict(list)
    categories = any("category" in (r.get("metadata") or {}) for r in records)  # the papers' tiny world
    for r in records:
        meta = r.get("metadata") or {}
        by_type[""].append(r)
        if meta.get("type"):  # (88e794b put a typeless record in the overall group twice)
            by_type[str(meta["type"])].append(r)
        if meta.get("dataset"):
            by_benchmark[str(meta["dataset"])].append(r)
        if categories:  # "plain", "unanswerable" or "misinfo" (tiny/world.py); plain + misinfo = answerable
            by_type[meta.get("category", "plain")].append(r)
            if meta.get("category") != "unanswerable":
                by_type["answerable"].append(r)
    out: dict[str, float] = {"n": len(records)}
    for kind, rs in sorted(by_type.items()):
        suffix = f"_{kind}" if kind else ""
        out |= {f"{name}{suffix}": value for name, value in _means(rs).items()}
        if categories:
            out[f"idk{suffix}"] = sum(parsed(r).idk for r in rs) / len(rs)
            out[f"operator{suffix}"] = sum(source_restricting(r)["reward"] for r in rs) / len(rs)  # WebFilter R_src
    for benchmark, rs in sorted(by_benchmark.items()):
        out |= {f"{name}/{benchmark}": value for name, value in _means(rs).items()} | {f"n/{benchmark}": len(rs)}
    for r in records:
        r.pop("_parsed", None)
    return out


def _means(records: list[dict]) -> dict[str, float]:
    """EM, F1, format, searches (queries), search_turns and search_queries (report/metrics.search_counts)
    averaged over `records` (EM-scored rollouts)."""
    n = len(records)
    return {
        "em": sum(r["reward_components"]["em"] for r in records) / n,
        "f1": sum(r["reward_components"]["f1"] for r in records) / n,
        "format_ok": sum(r["reward_components"]["format_ok"] for r in records) / n,
        "searches": sum(r["num_searches"] for r in records) / n,  # queries run (rollout.py's num_searches)
    } | search_means(records)  # search_turns beside search_queries: a parallel call is one turn


def evaluate(engine, tokenizer, questions: list[dict], search_fn, cfg: Config, records_out: list | None = None) -> dict:
    """Greedy (temperature 0) rollouts, one per question, scored with the EM reward."""
    records = rollout_mode("agentic", engine, tokenizer, questions, search_fn, cfg)
    if records_out is not None:
        records_out.extend(records)
    return summarize(records)


def rollout_mode(mode: str, engine, tokenizer, questions: list[dict], search_fn, cfg: Config) -> list[dict]:
    """Greedy rollouts of one baseline mode, scored with every EM-family component.

    Worked example, rag on "Where was Tavi Morek born?" with topk 1: the response starts with
    the forced (untrained, loss_mask 0) "<think> </think><search> Where was Tavi Morek born?
    </search>" and "<information>Doc 1(Title: Tavi Morek) ...</information>", then the model
    writes "<think> ...</think><answer> Velor</answer>".
    """
    if mode not in MODES:
        raise ValueError(f"unknown eval mode {mode!r}: choose from {', '.join(MODES)}")
    rcfg = cfg.rollout
    prefixes = None
    tools = search_fn
    if mode in ("direct", "cot", "rag"):
        tools = lambda queries: [SEARCH_OFF] * len(queries)  # noqa: E731
    if mode == "direct":
        prefixes = [[("<answer>", "prefix")] for _ in questions]
    elif mode == "cot":
        prefixes = [[("<think>", "prefix")] for _ in questions]
    elif mode == "rag":
        if rcfg.protocol != "search_r1":  # the forced first search is written in Search-R1's tags
            raise ValueError(f"eval mode 'rag' is defined for the search_r1 protocol, not {rcfg.protocol!r}")
        hits = search_fn([q["question"] for q in questions])
        prefixes = [[(f"<think> </think><search> {q['question']}</search>", "prefix"), (h, "obs")]
                    for q, h in zip(questions, hits)]  # fmt: skip
    elif mode == "reliable":
        rcfg = replace(
            rcfg, prompt_template=render_prompt("{question}", rcfg.prompt_template).rstrip("\n") + RELIABLE_SUFFIX
        )
    records = rollout_batch(engine, tokenizer, questions, 1, tools, rcfg, greedy=True, prefixes=prefixes)
    score(records, "em")
    for r in records:
        r["mode"] = mode
    return records


def table(rows: dict[str, dict[str, dict]], columns: list[str]) -> tuple[list[str], list[list]]:
    """rows[row][dataset] = metrics -> (header, body): one line per row, dataset x metric columns."""
    datasets = sorted({d for per in rows.values() for d in per})
    header = ["method"] + [f"{d} {c}" for d in datasets for c in columns]
    body = [[name] + [per.get(d, {}).get(c, float("nan")) for d in datasets for c in columns]
            for name, per in rows.items()]  # fmt: skip
    return header, body


def markdown(header: list[str], body: list[list]) -> str:
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, rows: dict, columns: list[str], records: dict, tokenizer=None) -> None:
    """results.md / .csv / .json, rollouts/<row>__<dataset>.jsonl and viewer.html under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    header, body = table(rows, columns)
    (out / "results.md").write_text(markdown(header, body))
    with open(out / "results.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *body])
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "rollouts").mkdir(exist_ok=True)
    for (name, dataset), recs in records.items():
        with open(out / "rollouts" / f"{name}__{dataset}.jsonl", "w") as f:
            for r in recs:
                f.write(json.dumps({k: v for k, v in r.items() if not k.startswith("_")}) + "\n")
    everything = [r | {"group_id": f"{n}/{d}/{r['group_id']}"} for (n, d), rs in records.items() for r in rs]
    write_viewer(everything, out / "viewer.html", tokenizer=tokenizer, title=str(out))


def teacher_forced_readout(model_dir: Path, tokenizer, cfg: Config, zeta: float, confidence: list[dict] | None,
                           think: list[dict] | None) -> dict:  # fmt: skip
    """What the policy believes at the teacher's own contexts, read teacher-forced:
    confidence contexts -> P(c >= zeta) (all ten confidences, each as its whole string), its means
    per category and the gap (report/metrics.certainty_gap); think contexts -> the probability of
    the unfaithful think (report/metrics.unfaithful_share)."""
    if not confidence and not think:
        return {}
    model = load_policy(model_dir).eval()

    def token_ids(contexts: list[dict]) -> list[list[int]]:
        return [tokenize_segments(tokenizer, [tuple(s) for s in c["segments"]], cfg.rollout.max_obs_tokens)[0]
                for c in contexts]  # fmt: skip

    out = {}
    if confidence:
        values = [tokenizer.encode(f" {c}</confidence>", add_special_tokens=False) for c in CONFIDENCES]
        logprobs = continuation_logprobs(model, token_ids(confidence), values, tokenizer.eos_token_id)
        out |= certainty_gap([p_certain(lp, zeta) for lp in logprobs], [c["category"] for c in confidence])
    if think:
        logprobs = []
        for text in dict.fromkeys(c["unfaithful"] for c in think):  # one pass per distinct think (one, here)
            same = [c for c in think if c["unfaithful"] == text]
            cont = [tokenizer.encode(text, add_special_tokens=False)]
            logprobs += [lp[0] for lp in continuation_logprobs(model, token_ids(same), cont, tokenizer.eos_token_id)]
        out |= unfaithful_share(logprobs)
    return out


def run_eval(cfg: Config, rows_spec: list[tuple[str, Path, list[str]]], datasets: list[Path], columns: list[str],
             out: Path, zeta: float = 5, judge=None, reference_row: str = "",
             contexts: list[dict] | None = None, think_contexts: list[dict] | None = None) -> dict:  # fmt: skip
    """Each (label, model dir, modes) row spec on every dataset: one engine, weights swapped
    between models; writes the tables under `out` and returns rows[row name][dataset].
    judge: adds judge_acc (and judges correctness); reference_row: the row whose rollouts every
    other row's "I don't know" answers are held against (BAPO's rejection success rate);
    contexts, think_contexts: each row's teacher_forced_readout on them joins every dataset's metrics
    of the row."""
    questions = benchmarks(datasets, cfg.eval.max_questions)  # FlashRAG folders / data_source: one each
    rows: dict[str, dict] = {}
    records: dict[tuple[str, str], list] = {}
    engine = search_fn = tokenizer = None
    for _, model_dir, _ in rows_spec:
        if _shapes(model_dir) != _shapes(rows_spec[0][1]):  # one engine serves every row
            raise ValueError(f"{model_dir} is not the architecture of {rows_spec[0][1]}: evaluate it separately")
        check_chat_template(load_tokenizer(model_dir), cfg.rollout, model_dir)  # before any engine starts
    for label, model_dir, modes in rows_spec:
        if engine is None:
            engine = make_engine(cfg.rollout.engine, model_dir, cfg.rollout, cfg.model.dtype)  # before bm25s
            search_fn = make_search_fn(cfg, _corpus(cfg), {})
        else:
            engine.load_weights(load_policy(model_dir).state_dict().items())
        tokenizer = load_tokenizer(model_dir)
        readout = teacher_forced_readout(model_dir, tokenizer, cfg, zeta, contexts, think_contexts)
        for mode in modes:
            name = label if len(modes) == 1 and label else f"{label} {mode}".strip()
            for dataset, qs in questions.items():
                t0 = time.time()
                recs = rollout_mode(mode, engine, tokenizer, qs, search_fn, cfg)
                m = compute_metrics(recs, zeta=zeta, judge=judge) | summarize(recs) | {"seconds": time.time() - t0}
                m |= readout  # the policy's, whatever the mode
                rows.setdefault(name, {})[dataset] = m
                records[(name.replace(" ", "_"), dataset)] = recs
                shown = " ".join(f"{c} {m.get(c, float('nan')):.3f}" for c in columns)
                print(f"{name:>24} {dataset:>12}: {shown}", flush=True)
    if reference_row:
        if reference_row not in rows:
            raise ValueError(f"--reference {reference_row!r} is not a row; rows: {', '.join(rows)}")
        for name, per in rows.items():
            for dataset, m in per.items():
                ref = records[(reference_row.replace(" ", "_"), dataset)]
                rate = rejection_success_rate(records[(name.replace(" ", "_"), dataset)], ref, judge)
                if rate is not None and name != reference_row:
                    m["bapo_rejection_success"] = rate
    write_outputs(out, rows, columns, records, tokenizer)
    return rows


def _shapes(model_dir: Path) -> dict:
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size")  # fmt: skip
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return {k: config.get(k) for k in keys}


def _corpus(cfg: Config) -> Path:
    return data_paths(cfg)["corpus"]


def make_parser() -> argparse.ArgumentParser:
    """The evaluation's command line (`curves` and `view` have their own)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config: the retriever, rollout engine and default data")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[LABEL=]DIR",
        help="model directory or checkpoint, repeatable (default: the config's starting policy)",
    )
    parser.add_argument("--datasets", nargs="+", default=[], metavar="FILE",
                        help="FlashRAG jsonl or Search-R1 parquet files; each benchmark is a column group, named "
                             "by its FlashRAG folder (nq/test.jsonl: nq), a parquet's data_source (one group "
                             "each), or the file's stem (default: the config's --split file)")  # fmt: skip
    parser.add_argument(
        "--split",
        default="",
        choices=["", "train", "val", "test"],
        help="split of the config's data (default eval.split)",
    )
    parser.add_argument("--modes", nargs="+", default=["agentic"], choices=MODES, help="baselines to run (docstring)")
    parser.add_argument(
        "--columns",
        nargs="+",
        default=list(DEFAULT_COLUMNS),
        help="metrics shown in results.md/.csv (all metrics go to results.json)",
    )
    parser.add_argument("--zeta", type=float, default=5, help="confidence threshold of reliability / FC%% (1-10)")
    parser.add_argument("--out", help="output directory (default runs/eval-<time>)")
    parser.add_argument("--judge-url", default="", help="OpenAI-compatible judge server: adds judge_acc")
    parser.add_argument("--judge-model", default="", help="the judge server's model name")
    parser.add_argument("--confidence-contexts", default="", metavar="FILE",
                        help="jsonl of contexts cut where a confidence is written (tiny/sft.confidence_contexts): adds "
                             "the teacher-forced P(c >= zeta) per category and their gap, certain_gap "
                             "(report/metrics.p_certain)")  # fmt: skip
    parser.add_argument("--think-contexts", default="", metavar="FILE",
                        help="jsonl of contexts cut where the answer's think begins, each with its unfaithful "
                             "think (tiny/sft.think_contexts): adds p_unfaithful_think, the teacher-forced "
                             "probability of that think (report/metrics.unfaithful_share)")  # fmt: skip
    parser.add_argument("--reference", default="",
                        help="row name whose rollouts the other rows' IDK answers are held against "
                             "(BAPO's rejection success rate, eq. 8)")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["curves"]:  # python eval.py curves RUN_DIR: training curves as PNGs (report/plots.py)
        return curves_main(argv[1:])
    if argv[:1] == ["view"]:  # python eval.py view ROLLOUTS.jsonl -o view.html (report/viewer.py)
        return viewer_main(argv[1:])
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        cfg = resolve_precision(load_config(args.config, args.set))
        check_index(cfg.retriever)  # retriever.index is there and takes search_params: before anything slow
    except (ConfigError, DataError, FileNotFoundError) as e:
        parser.error(str(e))
    print(describe_precision(cfg), flush=True)
    models = []
    for spec in args.model:
        label, _, path = spec.rpartition("=")
        if not (Path(path) / "config.json").is_file():
            parser.error(f"model directory not found (no config.json): {path}")
        models.append((label or Path(path).name, Path(path)))
    if not models:
        models = [("", starting_policy(cfg))]
        if not (models[0][1] / "config.json").is_file():
            parser.error(f"no model at {models[0][1]}: pass --model, set model.path, or build the tiny world "
                         "(python -m tiny.sft --config ...)")  # fmt: skip
    try:
        if args.datasets:
            datasets = [Path(d) for d in args.datasets]
        else:
            datasets = [data_paths(cfg)[args.split or cfg.eval.split]]
        names = benchmarks(datasets)  # a bad dataset, or two of one name, fails before any engine starts
        print(f"benchmarks: {', '.join(f'{k} ({len(v)})' for k, v in names.items())}", flush=True)
    except (DataError, FileNotFoundError, KeyError) as e:
        parser.error(str(e))
    try:
        check_retriever(cfg.retriever)  # retriever.url answers, before any engine starts
    except ConfigError as e:
        parser.error(str(e))
    out = Path(args.out or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}")
    judge = None
    if args.judge_url:
        judge = make_judge(args.judge_url, args.judge_model)
    spec = [(label, path, args.modes) for label, path in models]
    try:
        contexts = load_confidence_contexts(Path(args.confidence_contexts)) if args.confidence_contexts else None
        think_contexts = load_think_contexts(Path(args.think_contexts)) if args.think_contexts else None
    except (DataError, FileNotFoundError) as e:
        parser.error(str(e))
    try:
        rows = run_eval(cfg, spec, datasets, args.columns, out, args.zeta, judge, args.reference, contexts,
                        think_contexts)  # fmt: skip
    except (ConfigError, DataError, FileNotFoundError) as e:  # e.g. chat_template on a base model's tokenizer
        sys.exit(f"error: {e}")
    print((out / "results.md").read_text())
    print(f"wrote {out}/results.md, results.csv, results.json, rollouts/, viewer.html")
    return rows


if __name__ == "__main__":
    main()
