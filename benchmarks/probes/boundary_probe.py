"""Does a policy know where its knowledge ends? Two teacher-forced probes per question category.

    python benchmarks/probes/boundary_probe.py --config configs/reproduction/tiny_papers_boundary.yaml \
        --model cache/tiny-7078567a2759/policy --model runs/papers-main/tiny-bapo-seed0-*/checkpoints/step_20

For the first --n validation questions of the config's world, the teacher's trajectory (it
believes what it reads) is cut right before the answer, and the policy is asked:
- idk:  P(first token of " I don't know" | ... <confidence> 7</confidence><answer>)   (BAPO)
- conf: P(confidence >= 5 | ... <confidence>), over the ten continuations " 1" .. " 10"
        (Deliberative Searcher's zeta = 5)
Printed per category (plain, unanswerable, misinfo): the mean of each. A policy that knows its
boundary puts more IDK and less confidence on unanswerable contexts than on plain ones; the
greedy evaluation only shows the result once the argmax flips, this shows the drift before.
Measured (results/LOG.md): after 10 BAPO steps in the namesake world of 2026-11-22, idk 0.14 on
unanswerable vs 0.15 on plain contexts (no separation); after 20 steps in the boundary world,
0.89 vs 0.10.
"""

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def teacher_text(cfg, question: dict, tool, rng: random.Random) -> str:
    """Prompt + the teacher's whole trajectory (no flaws: it believes what it reads; its thinks
    cite their sources when the config's teacher does), ending with "<answer> X</answer>"."""
    from rollout import render_prompt
    from tiny.world import Habits, teacher_segments

    segs = teacher_segments(question, tool, rng, [], [], 0.0, 0.0, Habits(cites_source=cfg.sft.think_cites_source))
    return render_prompt(question["question"], cfg.rollout.prompt_template) + "".join(s for s, _ in segs)


def probe(cfg, model_dir: Path, n: int = 150) -> dict[str, dict[str, float]]:
    """{category: {"n", "idk", "conf_ge5"}} for one model (see the module docstring)."""
    import torch

    from tiny.sft import world_search_tool
    from tiny.world import read_jsonl, world_dir
    from trainer.engine import load_policy, load_tokenizer

    tool = world_search_tool(cfg, world_dir(cfg))
    rng = random.Random(0)  # the same contexts for every model
    tokenizer, model = load_tokenizer(model_dir), load_policy(model_dir).eval()
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731

    @torch.no_grad()
    def logprob(context: list[int], continuation: list[int]) -> float:
        logits = model(input_ids=torch.tensor([context + continuation])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        return sum(lp[len(context) - 1 + i, t].item() for i, t in enumerate(continuation))

    sums: dict[str, dict[str, float]] = {}
    for q in read_jsonl(world_dir(cfg) / "val.jsonl")[:n]:
        before = teacher_text(cfg, q, tool, rng)
        before = before[: before.rindex("<answer>")]
        answer_ctx = encode(before + "<confidence> 7</confidence><answer>")
        idk = logprob(answer_ctx, encode(" I don't know")[:1])
        conf_ctx = before + "<confidence>"
        conf = torch.tensor([logprob(encode(conf_ctx), encode(conf_ctx + f" {k}</confidence>")[len(encode(conf_ctx)) :])
                             for k in range(1, 11)]).softmax(0)  # fmt: skip
        s = sums.setdefault(q["metadata"].get("category", "plain"), {"n": 0, "idk": 0.0, "conf_ge5": 0.0})
        s["n"] += 1
        s["idk"] += float(torch.tensor(idk).exp())
        s["conf_ge5"] += float(conf[4:].sum())
    return {cat: {"n": s["n"], "idk": s["idk"] / s["n"], "conf_ge5": s["conf_ge5"] / s["n"]} for cat, s in sums.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the config whose world (and SFT teacher) to probe on")
    parser.add_argument("--model", action="append", required=True, help="policy directory or checkpoint, repeatable")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--n", type=int, default=150, help="validation questions (the first n, every category)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    import torch

    from trainer.config import load_config
    from trainer.precision import resolve as resolve_precision

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.set)
    resolve_precision(cfg)  # this machine's bf16 / dtype for the `auto` keys
    for model_dir in args.model:
        if not (Path(model_dir) / "config.json").is_file():
            parser.error(f"model directory not found (no config.json): {model_dir}")
        for cat, m in sorted(probe(cfg, Path(model_dir), args.n).items()):
            print(f"{model_dir}  {cat:>12} n={m['n']:>3}  P(IDK) {m['idk']:.3f}  P(conf >= 5) {m['conf_ge5']:.3f}")


if __name__ == "__main__":
    main()
