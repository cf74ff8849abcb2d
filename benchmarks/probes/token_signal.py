"""How fast can GRPO teach one token to depend on the boundary? An isolated-signal experiment.

    python benchmarks/probes/token_signal.py --config configs/reproduction/tiny_papers_boundary.yaml \
        --model cache/tiny-7078567a2759/policy --target conf --steps 60

On teacher-forced contexts of the config's world (as benchmarks/probes/boundary_probe.py's), only ONE
token is trained, with the GRPO advantage of a perfect reward for it, nothing else:
  conf        the confidence digit right before the answer ("...</think><confidence>"):
              reward 1 for c < 5 on unanswerable questions, c >= 5 on answerable ones
              (Deliberative Searcher eq. 5 with an always-right answer on answerable questions)
  conf_after  the same digit written after the answer ("...</answer><confidence>")
  idk         the answer's first token: 0.5 for "I don't know" on unanswerable questions, 1 for
              anything else on answerable ones (BAPO's R_IDK / R_correct)
Each step: 16 contexts x 8 samples of that token, group-normalised advantages, the loss
divided as a 45-token response would be (train.py's token mean), one AdamW step. Printed every
10 steps on 80 held-out contexts: (P on unanswerable, P on answerable) of the rewarded event
there, P(c < 5) or P(IDK). A token whose two numbers move apart learns the boundary; moving
together means it learns a global shift.

The confidence's first digit is trained among 2..9 ("1" begins both 1 and 10). Before 2026-11-27
the contexts lacked the <information> tags, ended before the space that precedes the digit (so the
token read was the one after "<confidence>", not the digit), and took "0" for 10: the numbers below
come from that version, and results/LOG.md's entry of 2026-11-27 says what they can still support.
Measured on the boundary start (results/LOG.md): idk separates by step 10 (0.85 vs 0.04);
conf moves together (0.18 vs 0.17 at step 20) and separates only from step ~40; conf_after
from step ~30. With --lr 1e-3, conf separates by step 10 (0.44 vs 0.07) and fully
by step 20 (0.997 vs 0.001); the full RL task at train.lr=1e-3 did not (results/LOG.md).
--readout (only the output layer and final norm learn, reading the features already there):
idk still separates by step 10 (0.89 vs 0.06), conf and conf_after never do (0.011 vs 0.009 and
0.031 vs 0.011 at step 40, both falling): the SFT policy has no boundary feature where the
confidence is written.
"""

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GROUP, QUESTIONS, RESPONSE_TOKENS = 8, 16, 45  # train.py's group_size / questions_per_step; a typical response


def contexts(cfg, tokenizer, target: str, n: int) -> list[tuple[list[int], bool]]:
    """(token ids, unanswerable?) of the first n training questions, cut where `target`'s token is
    written: the observations in their <information> tags (rollout.tokenize_segments), and for a
    confidence the space after "<confidence>" included, so the next token is the first digit."""
    from rollout import render_prompt, tokenize_segments
    from tiny.sft import world_search_tool
    from tiny.world import Habits, generate_world, read_jsonl, teacher_segments, world_dir

    tool, rng = world_search_tool(cfg, world_dir(cfg)), random.Random(0)
    habits = Habits(cites_source=cfg.sft.think_cites_source, admits_guess=cfg.sft.admits_guess)
    world = generate_world(cfg.world)  # its cities and countries: what a teacher finding nothing guesses from
    out = []
    for q in read_jsonl(world_dir(cfg) / "train.jsonl")[:n]:
        # no flaws: it believes what it reads
        segs = teacher_segments(q, tool, rng, world.countries, list(world.city_country), 0.0, 0.0, habits)
        last = segs[-1][0]
        cut = {"conf": last[: last.rindex("<answer>")] + "<confidence> ", "conf_after": last + "<confidence> ",
               "idk": last[: last.rindex("<answer>")] + "<confidence> 7</confidence><answer>"}[target]  # fmt: skip
        prompt = (render_prompt(q["question"], cfg.rollout.prompt_template), "prompt")
        ids = tokenize_segments(tokenizer, [prompt, *segs[:-1], (cut, "policy")], cfg.rollout.max_obs_tokens)[0]
        out.append((ids, q["metadata"].get("category") == "unanswerable"))
    return out


def run(cfg, model_dir: Path, target: str, steps: int, lr: float, n: int = 400,
        readout: bool = False) -> list[tuple[int, float, float]]:  # fmt: skip
    """[(step, P(event | unanswerable), P(event | answerable))] every 10 steps (module docstring).
    readout: train only the output layer and the final norm, reading the features the SFT policy
    already computes at that position (what a token gets when the body hardly moves for it)."""
    import torch

    from trainer.engine import load_policy, load_tokenizer

    torch.manual_seed(0)
    tokenizer, model = load_tokenizer(model_dir), load_policy(model_dir)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    data = contexts(cfg, tokenizer, target, n)
    train, held = data[: n * 4 // 5], data[n * 4 // 5 :]
    # the first digit of 2..9: "1" is the first token of 1 and of 10 alike (a digit-splitting tokenizer;
    # the token after it decides), so it is left out of the trained token's choices; until 2026-11-27
    # the last token of " 10", "0", stood for 10
    digits = torch.tensor([encode(str(k))[0] for k in range(2, 10)])
    idk = encode("<answer> I don't know")[len(encode("<answer>"))]
    if readout:
        for p in model.parameters():
            p.requires_grad_(False)
        for p in (model.get_output_embeddings().weight, *model.model.norm.parameters()):
            p.requires_grad_(True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)

    def next_logp(batch):
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([[0] * (width - len(i)) + i for i, _ in batch])  # left-padded: the last position predicts
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i, _ in batch])
        return torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, -1].float(), -1)

    def event_prob(logp):  # the rewarded event on unanswerable contexts
        p = logp.exp()
        return p[:, digits[:3]].sum(1) / p[:, digits].sum(1) if target != "idk" else p[:, idk]  # 2-4 of 2-9

    def measure(step: int) -> tuple[int, float, float]:
        model.eval()
        with torch.no_grad():
            v = event_prob(next_logp(held))
        model.train()
        unans = torch.tensor([u for _, u in held])
        return step, round(float(v[unans].mean()), 3), round(float(v[~unans].mean()), 3)

    curve = [measure(0)]
    print(*curve[0], flush=True)
    model.train()
    for step in range(1, steps + 1):
        batch = random.Random(step).sample(train, QUESTIONS)
        logp = next_logp(batch)
        loss = torch.zeros(())
        for i, (_, unanswerable) in enumerate(batch):
            if target == "idk":
                said = torch.rand(GROUP) < logp[i, idk].exp().detach()
                reward = torch.where(said, 0.5 if unanswerable else 0.0, 0.0 if unanswerable else 1.0)
                lp = torch.where(said, logp[i, idk], torch.log1p(-logp[i, idk].exp().clamp(max=1 - 1e-6)))
            else:
                k = torch.multinomial(logp[i, digits].softmax(0).detach(), GROUP, replacement=True)
                reward = ((k < 3) == unanswerable).float()  # digits 2-4 are "unsure" (zeta = 5)
                lp = logp[i, digits[k]]
            adv = (reward - reward.mean()) / (reward.std() + 1e-6)
            loss = loss - (adv * lp).sum() / (QUESTIONS * GROUP * RESPONSE_TOKENS)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            curve.append(measure(step))
            print(*curve[-1], flush=True)
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the config whose world (and SFT teacher) to use")
    parser.add_argument("--model", required=True, help="policy directory or checkpoint")
    parser.add_argument("--target", choices=("conf", "conf_after", "idk"), default="conf", help="the token trained")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate (the tiny runs' train.lr)")
    parser.add_argument("--readout", action="store_true", help="train only the output layer and final norm")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    import torch

    from trainer.config import load_config
    from trainer.precision import resolve as resolve_precision

    torch.set_num_threads(args.threads)
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"model directory not found (no config.json): {args.model}")
    cfg = load_config(args.config, args.set)
    resolve_precision(cfg)  # this machine's bf16 / dtype for the `auto` keys
    print("step  P(event | unanswerable)  P(event | answerable)")
    run(cfg, Path(args.model), args.target, args.steps, args.lr, readout=args.readout)


if __name__ == "__main__":
    main()
