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
0.89 vs 0.10. Those contexts lacked the <information> tags (fixed 2026-11-27; LOG.md's entry of that
day says which conclusions change). eval.py --confidence-contexts reads conf_ge5 the same way.
"""

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def teacher_segments_before_answer(cfg, question: dict, tool, rng: random.Random) -> list[tuple[str, str]]:
    """Prompt + the teacher's trajectory (no flaws: it believes what it reads; its thinks cite their
    sources when the config's teacher does; it admits a guess when the config's does) as (text,
    role) segments, cut right before "<answer>". The observations stay "obs" segments, so
    rollout.tokenize_segments wraps them in the <information> tags the policy sees (joining the
    texts, as this probe did before 2026-11-27, left the tags out)."""
    from rollout import render_prompt
    from tiny.world import Habits, generate_world, teacher_segments

    world = generate_world(cfg.world)  # its cities and countries: what a teacher finding nothing guesses from
    habits = Habits(cites_source=cfg.sft.think_cites_source, admits_guess=cfg.sft.admits_guess)
    segs = teacher_segments(question, tool, rng, world.countries, list(world.city_country), 0.0,
                            0.0, habits)  # fmt: skip
    last = segs[-1][0]
    segs[-1] = (last[: last.rindex("<answer>")], "policy")
    return [(render_prompt(question["question"], cfg.rollout.prompt_template), "prompt")] + segs


def probe(cfg, model_dir: Path, n: int = 150) -> dict[str, dict[str, float]]:
    """{category: {"n", "idk", "conf_ge5"}} for one model (see the module docstring)."""
    import math

    from report.metrics import CONFIDENCES, p_certain
    from rollout import tokenize_segments
    from tiny.sft import world_search_tool
    from tiny.world import read_jsonl, world_dir
    from trainer.batching import continuation_logprobs
    from trainer.engine import load_policy, load_tokenizer

    tool = world_search_tool(cfg, world_dir(cfg))
    rng = random.Random(0)  # the same contexts for every model
    tokenizer, model = load_tokenizer(model_dir), load_policy(model_dir).eval()
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    # every confidence as its whole string: "10" is "1" then "0" in a digit-splitting tokenizer
    confidences = [encode(f" {k}</confidence>") for k in CONFIDENCES]
    sums: dict[str, dict[str, float]] = {}
    for q in read_jsonl(world_dir(cfg) / "val.jsonl")[:n]:
        segs = teacher_segments_before_answer(cfg, q, tool, rng)
        def ids(tail: str, segs=segs) -> list[int]:  # the context, its last turn cut at the answer, + tail
            return tokenize_segments(tokenizer, segs[:-1] + [(segs[-1][0] + tail, "policy")],
                                     cfg.rollout.max_obs_tokens)[0]  # fmt: skip

        idk = continuation_logprobs(model, [ids("<confidence> 7</confidence><answer>")], [encode(" I don't know")[:1]],
                                    tokenizer.eos_token_id)[0][0]  # fmt: skip
        conf = p_certain(continuation_logprobs(model, [ids("<confidence>")], confidences, tokenizer.eos_token_id)[0])
        s = sums.setdefault(q["metadata"].get("category", "plain"), {"n": 0, "idk": 0.0, "conf_ge5": 0.0})
        s["n"] += 1
        s["idk"] += math.exp(idk)
        s["conf_ge5"] += conf
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
