"""The tool loop's cost: multi-turn rollout tokens/s over pure generation of the same tokens.

    python benchmarks/bench_tool_loop.py --config configs/tiny.yaml            # 32 x 8, 3 reps
    python benchmarks/bench_tool_loop.py --config configs/smollm2.yaml --questions 16 --group 5
    python benchmarks/bench_tool_loop.py --config configs/quickstart.yaml --latency-ms 0 20 100   # issue 52
    python benchmarks/bench_tool_loop.py --config configs/quickstart.yaml --profile   # where the 0 ms gap goes

One vLLM engine, side by side in each repetition (the order rotates):
  * `turns`: rollout.continuous false, every trajectory of a turn waits for the slowest one,
    then all their queries go to the retriever, then the next turn starts;
  * `continuous`: rollout.continuous true (engine.run_continuous), a trajectory's next turn is
    queued as soon as its own tool call returns;
  * `pure`: the ceiling, vLLM generating exactly the policy tokens of those rollouts (same
    prompts, each request `ignore_eos` for its trajectory's policy-token count), no tools;
  * `pure+obs`: the same with each trajectory's observation tokens appended to its prompt: the
    prefill a multi-turn rollout cannot avoid (its observations), in one piece, no tools.
Rollout tokens/s counts policy tokens (loss_mask 1) over the whole loop's wall time, retrieval
included. The report is the median of each and the ratios; `same_token_ids` says whether the
two schedules gave the same token ids and masks, `max_logprob_gap` how far their logprobs
differ (prefix-cached KV against recomputed KV: fp32 rounding).

--latency-ms L1 L2 ..: the search's latency hidden or not. Each batched search call sleeps L ms
(a retrieval server's e5 encode + faiss search on the box: tens to hundreds of ms), and each
repetition runs, side by side, for every L: `loop` (rollout.tool_workers 0, every call made in the
engine's loop, which stops every trajectory for its length), `beside` (tool_workers 4: the
engine decodes the others meanwhile) and `beside, text stops` (the same with vLLM's stop strings,
engine.stop_on_ids off: the engine before it stopped on ids), then `pure+obs` with and without
vLLM's text. The report: each one's tokens/s over pure+obs, and over its own ratio at the first L
(issue 52's acceptance: beside >= 0.95 of its 0 ms ratio at 20 ms, >= 0.90 at 100 ms).
"""

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data import cached_policy, data_paths  # noqa: E402
from rollout import rollout_batch  # noqa: E402
from search.tools import make_search_fn
from trainer import precision  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.engine import load_tokenizer, make_engine  # noqa: E402
from trainer.questions import load_questions


def pure_generation(engine, records: list[dict], seed: int, with_observations: bool = False,
                    detokenize: bool = True) -> float:  # fmt: skip
    """Seconds for vLLM to generate each record's policy-token count from its prompt (and its
    observation tokens, with_observations), no tools. detokenize False: vLLM decodes no text,
    as the rollout does when its stop strings are single tokens (engine.VLLMEngine._stop_ids)."""
    from vllm import SamplingParams, TokensPrompt

    def prompt(r: dict) -> list[int]:
        obs = [t for t, m in zip(r["response_ids"], r["loss_mask"]) if not m] if with_observations else []
        return r["prompt_ids"] + obs

    params = [SamplingParams(max_tokens=max(1, sum(r["loss_mask"])), ignore_eos=True, logprobs=0, seed=seed + i,
                             detokenize=detokenize) for i, r in enumerate(records)]  # fmt: skip
    t = time.perf_counter()
    engine.llm.generate([TokensPrompt(prompt_token_ids=prompt(r)) for r in records], params, use_tqdm=False)
    return time.perf_counter() - t


def compare(a: list[dict], b: list[dict]) -> tuple[bool, float]:
    """(same token ids and masks, the largest logprob difference) of two runs' records."""
    same = all(x["response_ids"] == y["response_ids"] and x["loss_mask"] == y["loss_mask"] for x, y in zip(a, b))
    gap = max((abs(p - q) for x, y in zip(a, b) for p, q in zip(x["logprobs"], y["logprobs"])), default=0.0)
    return same and len(a) == len(b), gap


def latency_sweep(engine, tok, questions: list[dict], group: int, search_fn: Callable, rollout_cfg, reps: int,
                  latencies: list[float]) -> dict:  # fmt: skip
    """Tokens/s of the tool loop with each search call L ms slower, in the loop and beside the
    engine, over pure generation with the observations prefilled (module docstring)."""
    speeds: dict[str, list[float]] = {"pure+obs": [], "pure+obs, no text": []}
    calls: list[int] = []
    for rep in range(reps):
        runs = [(mode, ms) for ms in latencies for mode in ("loop", "beside", "beside, text stops")]
        records = None
        for mode, ms in runs if rep % 2 == 0 else runs[::-1]:
            n = [0]

            def slow(queries: list[str], ms: float = ms, n: list = n) -> list[str]:
                n[0] += 1
                time.sleep(ms / 1000)
                return search_fn(queries)

            engine.llm.reset_prefix_cache()
            rcfg = replace(rollout_cfg, continuous=True, tool_workers=0 if mode == "loop" else 4)
            engine.stop_on_ids = mode != "beside, text stops"  # that arm: vLLM's stop strings, as before
            t = time.perf_counter()
            recs = rollout_batch(engine, tok, questions, group, slow, rcfg, seed=rep)
            dt = time.perf_counter() - t
            engine.stop_on_ids = True
            speeds.setdefault(f"{mode} {ms:g} ms", []).append(sum(sum(r["loss_mask"]) for r in recs) / dt)
            calls.append(n[0])
            if mode == "beside" and ms == latencies[0]:
                records = recs  # pure+obs generates these rollouts' tokens
        for name in ["pure+obs", "pure+obs, no text"] if rep % 2 == 0 else ["pure+obs, no text", "pure+obs"]:
            engine.llm.reset_prefix_cache()
            dt = pure_generation(engine, records, rep, with_observations=True, detokenize=name == "pure+obs")
            speeds[name].append(sum(sum(r["loss_mask"]) for r in records) / dt)
    med = {k: statistics.median(v) for k, v in speeds.items()}
    over = {k: v / med["pure+obs"] for k, v in med.items() if not k.startswith("pure")}
    first = f"{latencies[0]:g} ms"
    return {"tokens_per_s": med, "all": speeds, "over_pure_obs": over,
            "over_pure_obs_no_text": {k: v * med["pure+obs"] / med["pure+obs, no text"] for k, v in over.items()},
            "over_own_first_latency": {k: v / over[f"{k.rsplit(' ', 2)[0]} {first}"] for k, v in over.items()},
            "batched_calls_per_rollout": statistics.median(calls)}  # fmt: skip


def tail_cost(engine, tok, questions: list[dict], group: int, search_fn: Callable, rollout_cfg) -> dict:
    """One rollout with the engine's steps timed: the tail's share of the steps and of the wall
    time, and the seconds it costs over decoding its tokens at the full batch's rate (--tail)."""
    core = engine.llm.llm_engine
    steps: list[tuple[int, float]] = []  # (requests in the batch, seconds)
    step = core.step

    def timed_step():
        batch, t = core.get_num_unfinished_requests(), time.perf_counter()
        out = step()
        steps.append((batch, time.perf_counter() - t))
        return out

    engine.llm.reset_prefix_cache()
    core.step = timed_step
    try:
        t = time.perf_counter()
        rollout_batch(engine, tok, questions, group, search_fn, replace(rollout_cfg, continuous=True), seed=0)
        wall = time.perf_counter() - t
    finally:
        core.step = step
    peak = max(b for b, _ in steps)
    tail = [(b, dt) for b, dt in steps if b <= peak / 4]
    full = [(b, dt) for b, dt in steps if b > peak / 4]
    rate = sum(b for b, _ in full) / sum(dt for _, dt in full)  # sequences advanced per second, full batch
    tail_s = sum(dt for _, dt in tail)
    return {"engine_steps": len(steps), "peak_batch": peak, "tail_steps": len(tail),
            "tail_step_share": len(tail) / len(steps), "tail_seconds": tail_s, "rollout_seconds": wall,
            "tail_time_share": tail_s / wall, "tail_sequence_steps": sum(b for b, _ in tail),
            "tail_cost_seconds": tail_s - sum(b for b, _ in tail) / rate,
            "tail_cost_share": (tail_s - sum(b for b, _ in tail) / rate) / wall}  # fmt: skip


PARTS = {  # a part of the wall time: (file suffix, function) whose cumulative seconds it sums
    "engine steps": [("v1/engine/llm_engine.py", "step")],
    "  model forward and sampling": [("v1/executor/uniproc_executor.py", "execute_model"),
                                     ("v1/executor/uniproc_executor.py", "sample_tokens")],
    "  scheduler": [("v1/core/sched/scheduler.py", "schedule"), ("v1/core/sched/scheduler.py", "update_from_output")],
    "  output processing": [("v1/engine/output_processor.py", "process_outputs")],
    "    of which logprobs (their tokens decoded, text on)": [("v1/engine/logprobs.py", "update_from_output")],
    "    of which incremental detokenizing (text on)": [("v1/engine/detokenizer.py", "update")],
    "requests added": [("v1/engine/llm_engine.py", "add_request")],
}  # fmt: skip


def profiled_parts(run: Callable[[], object]) -> dict[str, float]:
    """Seconds of `run` under cProfile, split into PARTS (cProfile slows Python more than kernels:
    the split, not the total, is the point)."""
    profile = cProfile.Profile()
    t = time.perf_counter()
    profile.runcall(run)
    wall = time.perf_counter() - t
    stats = pstats.Stats(profile).stats  # (file, line, function) -> (calls, primitive, own s, cumulative s, callers)
    parts = {"wall": wall} | {name: sum(ct for (f, _, fn), (_, _, _, ct, _) in stats.items()
                                        if any(f.endswith(sfx) and fn == want for sfx, want in where))
                              for name, where in PARTS.items()}  # fmt: skip
    return parts | {"outside the engine's steps": wall - parts["engine steps"]}


def where_time_goes(engine, tok, questions: list[dict], group: int, search_fn: Callable, rollout_cfg,
                    reps: int) -> dict:  # fmt: skip
    """The rollout (searches beside, no added latency) and pure+obs of its tokens, each under
    cProfile, alternated `reps` times: the medians of each part (--profile)."""
    chain = replace(rollout_cfg, continuous=True)
    runs: dict[str, list[dict]] = {"rollout": [], "pure+obs": []}
    for rep in range(reps):
        engine.llm.reset_prefix_cache()
        records = rollout_batch(engine, tok, questions, group, search_fn, chain, seed=rep)  # the same seed: these
        jobs = {"rollout": partial(rollout_batch, engine, tok, questions, group, search_fn, chain, seed=rep),
                "pure+obs": partial(pure_generation, engine, records, rep, with_observations=True)}  # fmt: skip
        for name in list(jobs) if rep % 2 == 0 else list(jobs)[::-1]:
            engine.llm.reset_prefix_cache()
            runs[name].append(profiled_parts(jobs[name]))
    return {name: {part: round(statistics.median(r[part] for r in rs), 3) for part in rs[0]}
            for name, rs in runs.items()}  # fmt: skip


def schedules(engine, tok, questions: list[dict], group: int, search_fn: Callable, rollout_cfg, reps: int,
              timings: dict[str, float]) -> dict:  # fmt: skip
    """The four side by side (module docstring): turns, continuous, pure and pure+obs, `reps` times,
    the order alternating; timings is the search function's, for the retrieval share."""
    speeds: dict[str, list[float]] = {"turns": [], "continuous": [], "pure": [], "pure+obs": []}
    retrieve_share: dict[str, list[float]] = {"turns": [], "continuous": []}
    same_ids, gaps, records = [], [], {}
    for rep in range(reps):
        names = ["turns", "continuous"] if rep % 2 == 0 else ["continuous", "turns"]
        names += ["pure", "pure+obs"] if rep % 2 == 0 else ["pure+obs", "pure"]  # they need this rep's records
        for name in names:
            engine.llm.reset_prefix_cache()  # no run reuses another's KV blocks
            if name.startswith("pure"):
                recs = records["continuous"]
                dt = pure_generation(engine, recs, rep, with_observations=name == "pure+obs")
            else:
                timings.clear()
                rcfg = replace(rollout_cfg, continuous=name == "continuous")
                t = time.perf_counter()
                recs = records[name] = rollout_batch(engine, tok, questions, group, search_fn, rcfg, seed=rep)
                dt = time.perf_counter() - t
                retrieve_share[name].append(timings.get("retrieve", 0.0) / dt)
            speeds[name].append(sum(sum(r["loss_mask"]) for r in recs) / dt)
        same, gap = compare(records["turns"], records["continuous"])
        same_ids.append(same)
        gaps.append(gap)
    med = {k: statistics.median(v) for k, v in speeds.items()}
    return {
        "policy_tokens_per_batch": sum(sum(r["loss_mask"]) for r in records["continuous"]),
        "tokens_per_s": med, "all": speeds,
        "continuous_over_pure": med["continuous"] / med["pure"], "turns_over_pure": med["turns"] / med["pure"],
        "continuous_over_pure_obs": med["continuous"] / med["pure+obs"],
        "turns_over_pure_obs": med["turns"] / med["pure+obs"],
        "observation_tokens_per_batch": sum(len(r["loss_mask"]) - sum(r["loss_mask"]) for r in records["continuous"]),
        "retrieve_share": {k: statistics.median(v) for k, v in retrieve_share.items()},
        "same_token_ids": same_ids, "max_logprob_gap": max(gaps), "kv_block_size": rollout_cfg.kv_block_size,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml", help="config whose policy, world and rollout to use")
    parser.add_argument("--questions", type=int, default=32, help="validation questions per batch")
    parser.add_argument("--group", type=int, default=8, help="rollouts per question")
    parser.add_argument("--reps", type=int, default=3, help="repetitions; each runs all four, the order alternating")
    parser.add_argument("--out", default="", help="also write the JSON report to this file")
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[],
                        help="instead: each search call L ms slower, in the loop and beside the engine")  # fmt: skip
    parser.add_argument("--tail", action="store_true", help="instead: what the rollout's tail costs (docstring)")
    parser.add_argument("--profile", action="store_true",
                        help="instead: the rollout and pure+obs under cProfile, split into vLLM's parts")  # fmt: skip
    args = parser.parse_args()
    cfg = load_config(args.config)
    precision.resolve(cfg)
    policy = cached_policy(cfg)
    engine = make_engine("vllm", policy, cfg.rollout, cfg.model.dtype, seed=cfg.train.seed)  # before bm25s
    paths = data_paths(cfg)
    timings: dict[str, float] = {}
    search_fn = make_search_fn(cfg, paths["corpus"], timings)
    tok = load_tokenizer(policy)
    questions = load_questions(paths["val"])[: args.questions]
    rollout_batch(engine, tok, questions[:4], 2, search_fn, cfg.rollout, seed=999)  # warm-up: compile, caches
    run = (engine, tok, questions, args.group, search_fn, cfg.rollout)
    if args.tail:
        found = tail_cost(*run)
    elif args.profile:
        found = {"reps": args.reps, **where_time_goes(*run, args.reps)}
    elif args.latency_ms:
        found = {"reps": args.reps, **latency_sweep(*run, args.reps, args.latency_ms)}
    else:
        found = {"reps": args.reps, **schedules(*run, args.reps, timings)}
    report = {"config": args.config, "questions": args.questions, "group": args.group, **found,
              "machine": precision.machine()}  # fmt: skip
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

if __name__ == "__main__":
    main()
