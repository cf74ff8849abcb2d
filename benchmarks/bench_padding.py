"""Padding of the training step's micro-batches: padded positions / all positions.

    python benchmarks/bench_padding.py [--budgets 8192 4096 2048] [--step-size 128] [--json F]

The lengths are those of the saved tiny-world rollouts (runs/*/samples/*.jsonl), or, with none
saved, of the SFT teacher's trajectories in cache/*/sft.jsonl. They are shuffled into simulated
steps of --step-size rollouts, and each step is cut three ways:
  * train.py's cut, batching.token_budget_batches under micro_batch_tokens = each budget;
  * naive: fixed-size batches in arrival order, of the same mean size;
  * greedy: the cut train.py used before (sort, fill each batch to the budget).
Seconds, no model. Results: results/memory.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import AutoTokenizer  # noqa: E402

from trainer.batching import token_budget_batches  # noqa: E402


def rollout_lengths() -> tuple[list[int], str]:
    """Token lengths (prompt + response) of saved tiny-world rollouts; else of the SFT teacher's
    trajectories in cache/*/sft.jsonl, tokenised with that world's tokenizer."""
    files = sorted(ROOT.glob("runs/*/samples/*.jsonl"))
    lengths = []
    for f in files:
        for line in f.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                lengths.append(len(r["prompt_ids"]) + len(r["response_ids"]))
    if lengths:
        return lengths, f"{len(lengths)} saved rollouts from {len(files)} files in runs/*/samples/"
    for sft in sorted(ROOT.glob("cache/*/sft.jsonl")):
        if (sft.parent / "policy" / "tokenizer.json").exists():
            tok = AutoTokenizer.from_pretrained(sft.parent / "policy")
            for line in sft.read_text().splitlines()[:2000]:
                lengths.append(sum(len(tok(text)["input_ids"]) for text, _ in json.loads(line)))
            return lengths, f"no saved rollouts; {len(lengths)} SFT teacher trajectories from {sft}"
    raise FileNotFoundError("no rollouts (runs/*/samples/*.jsonl) and no tiny world (cache/*/sft.jsonl)")


def token_counts(lengths: list[int], batches: list[list[int]]) -> tuple[int, int]:
    """(real tokens, all positions) of the batches, each padded to its longest member."""
    return sum(lengths[i] for b in batches for i in b), sum(len(b) * max(lengths[i] for i in b) for b in batches)


def greedy_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """The cut train.py used before the padding fix: sort, fill each batch to the budget."""
    batches, current, width = [], [], 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if current and max(width, lengths[i]) * (len(current) + 1) > budget:
            batches.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, lengths[i])
    return batches + [current] if current else batches


def run_padding(step_size: int, budgets: list[int], seed: int = 0) -> list[dict]:
    """Shuffle the lengths into simulated steps of `step_size` rollouts; per step, batch with
    the token budget (as train.py) and naively (fixed size = the budget batches' mean size)."""
    lengths, source = rollout_lengths()
    rng = random.Random(seed)
    rng.shuffle(lengths)
    steps = [lengths[k : k + step_size] for k in range(0, len(lengths), step_size)]
    rows = []
    for budget in budgets:
        pad = {"budget": [0, 0], "naive": [0, 0], "greedy": [0, 0]}  # [real tokens, positions]
        n_batches = n_greedy = 0
        for ls in steps:
            budget_b = token_budget_batches(ls, budget, random.Random(0))
            size = max(1, round(len(ls) / len(budget_b)))
            naive_b = [list(range(k, min(k + size, len(ls)))) for k in range(0, len(ls), size)]
            greedy_b = greedy_batches(ls, budget)
            n_greedy += len(greedy_b)
            for kind, bs in (("budget", budget_b), ("naive", naive_b), ("greedy", greedy_b)):
                real, positions = token_counts(ls, bs)
                pad[kind][0] += real
                pad[kind][1] += positions
            n_batches += len(budget_b)
        rows.append({
            "budget": budget, "source": source, "step_size": step_size, "steps": len(steps), "micro_batches": n_batches,
            "seqs_per_batch": len(lengths) / n_batches,
            "padding_budget": 1 - pad["budget"][0] / pad["budget"][1],
            "padding_naive": 1 - pad["naive"][0] / pad["naive"][1],
            "padding_greedy": 1 - pad["greedy"][0] / pad["greedy"][1], "micro_batches_greedy": n_greedy,
            "lengths": [min(lengths), statistics.median(lengths), max(lengths)],
        })  # fmt: skip
    return rows


def padding_table(rows: list[dict]) -> str:
    lo, mid, hi = rows[0]["lengths"]
    lines = [
        f"{rows[0]['source']}; lengths min/median/max {lo}/{mid:g}/{hi}; "
        f"simulated steps of {rows[0]['step_size']} rollouts: {rows[0]['steps']}",
        "micro_batch_tokens  micro-batches  seqs/batch  padding (budget)  padding (naive)"
        "  padding (greedy cut, its micro-batches)",
    ]
    for r in rows:
        lines.append(
            f"{r['budget']:>18}  {r['micro_batches']:>13}  {r['seqs_per_batch']:>10.1f}"
            f"  {100 * r['padding_budget']:>15.1f}%  {100 * r['padding_naive']:>14.1f}%"
            f"  {100 * r['padding_greedy']:>8.1f}% ({r['micro_batches_greedy']})"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[8192, 4096, 2048],
                        help="micro_batch_tokens values to cut with")  # fmt: skip
    parser.add_argument("--step-size", type=int, default=128, help="rollouts per simulated step")
    parser.add_argument("--json", help="also write the raw numbers to this file")
    args = parser.parse_args()
    rows = run_padding(args.step_size, args.budgets)
    print(f"padding fraction:\n{padding_table(rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
