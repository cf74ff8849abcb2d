"""Tokenizer, tiny Qwen2 policy and its SFT warm start on the scripted teacher (docs/design.md §5).

`ensure_tiny_policy(cfg)` builds, once per config, under `cache/tiny-<key>/`:
  corpus.jsonl, {train,val,test}.jsonl   the world (tiny/world.py)
  sft.jsonl                              teacher trajectories as (text, trained?) segments
  policy/                                tokenizer + Qwen2 model after SFT (safetensors)
and returns the policy directory. The same directory layout is what `AutoModelForCausalLM`
and vLLM load, so the tiny policy and a real Qwen2.5 checkout take the same code path.

SFT loss: next-token cross-entropy on everything after the prompt, `<information>` blocks
included (`sft.train_on_observations`, default on). This is a warm start, not RL (train.py
always masks retrieved tokens): predicting the retrieved passage is itself a copy task
(title from the query, subject from the title), and it is what gets the model copying from
context early.

The main cost of the tiny world is the moment the policy starts copying the answer from the
retrieved passage (docs/design.md §10: 23 minutes in a prototype). Measured here, 2 cores, same
3.2M-parameter model, held-out "copy accuracy" (the city read off the passage into the think
block, teacher-forced):
  policy-only targets, top-3 passages            0.00 at step 400 (stopped)
  + observation targets, top-3                   0.71 at step 500 in one run; 0.00 at step
                                                 700 and 0.08 at step 1000 in two others
  + top-1 passage, think restates its words      0.29 at step 300, 0.81 at step 400; in the
                                                 shipped build 0.43 at 500, 0.81 at 600, 0.92
                                                 at 800 (`copy_acc` in sft_summary.json)
so the tiny config uses the last row (configs/tiny.yaml). Also faster than the prototype:
tags and most names are single tokens (BPE of 2,048 on the world), a one-line prompt,
batches of similar lengths (little padding), bf16 autocast, constant lr until the last
quarter (copying appears only after some time at full lr).

Run: `python -m tiny.sft --config configs/tiny.yaml` builds the world, the tokenizer and this policy
(train.py does it for you when the cache is missing).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from agent import protocols
from agent.answers import exact_match, last_block
from rollout import TAGS, render_prompt, tokenize_segments
from search.corpus import format_hits
from search.tools import make_search_fn, open_search
from tiny.teachers import protocol_trajectories
from tiny.world import (
    GUESSED,
    UNFAITHFUL_THINK,
    Habits,
    ensure_world_data,
    generate_world,
    hinted_confidence,
    parity_confidence,
    read_jsonl,
    teacher_segments,
    world_dir,
)
from trainer.batching import pad_batch, token_budget_batches, token_logprobs
from trainer.config import Config, ConfigError, ModelConfig, RolloutConfig, SFTConfig, WorldConfig, load_config
from trainer.engine import load_policy, load_tokenizer
from trainer.precision import describe as describe_precision
from trainer.precision import resolve as resolve_precision

EOS = "<|endoftext|>"


def qwen_style_bpe(texts: list[str], vocab_size: int, special: list[str]):
    """A byte-level BPE (a `tokenizers.Tokenizer`) trained on `texts`, splitting text as Qwen2's
    tokenizer does (its regex: one token per digit; NFC). tests/test_search_r1_text.py builds its
    stand-in for Qwen2.5's tokenizer with it too."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    return tok


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path, extra_tags: tuple[str, ...] | list[str] = ()):
    """Byte-level BPE trained on the world; tags are whole tokens. Saved as a HF tokenizer.

    It splits text as Qwen2's tokenizer does (qwen_style_bpe), because that is what
    `AutoTokenizer.from_pretrained` rebuilds next to our Qwen2 config, for the trainer, eval and
    vLLM. With GPT-2's split, SFT had learnt " 1" as one token and every later observation
    (" Doc 1(") came in as two (tests/test_world_retriever.py has the round trip).
    """
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=qwen_style_bpe(texts, vocab_size, [EOS]), eos_token=EOS,
                                   pad_token=EOS)  # fmt: skip
    fast.add_tokens(TAGS + list(extra_tags))  # the protocol's own tags after Search-R1's (same ids as before)
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_model(mcfg: ModelConfig, tokenizer):
    """A Qwen2-architecture causal LM (head_dim = hidden/heads = 64 for vLLM CPU)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = 64 * math.ceil(len(tokenizer) / 64)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=mcfg.hidden_size,
        intermediate_size=mcfg.intermediate_size,
        num_hidden_layers=mcfg.num_layers,
        num_attention_heads=mcfg.num_heads,
        num_key_value_heads=mcfg.num_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        torch_dtype=mcfg.dtype,
    )
    return Qwen2ForCausalLM(config)


def sft_train(
    model, examples: list[tuple[list[int], list[int]]], scfg: SFTConfig, pad_id: int, seed: int = 0, probe=None
) -> tuple[list[float], list[dict]]:
    """Masked next-token loss on (ids, loss_mask) examples; AdamW, warm-up/constant/cosine.

    Returns the loss per step and, every `scfg.probe_every` steps, {"step", "copy_acc"} from
    `probe(model)` (no gradient, no randomness: it does not change the training run).
    """
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=scfg.lr, weight_decay=scfg.weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        # warm-up, constant, then cosine over the last `decay_frac` of steps ("WSD"): copying
        # from context appears only after a few hundred steps at full lr (see the module doc)
        if step < scfg.warmup_steps:
            return (step + 1) / scfg.warmup_steps
        decay_start = int(scfg.steps * (1 - scfg.decay_frac))
        if step < decay_start:
            return 1.0
        frac = (step - decay_start) / max(1, scfg.steps - decay_start)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    history: list[float] = []
    probes: list[dict] = []
    batches: list[list[int]] = []
    bar = tqdm(range(scfg.steps), desc="sft", mininterval=5)
    for step in bar:
        if not batches:  # a new epoch: fresh random batches of similar-length examples
            batches = token_budget_batches([len(e[0]) for e in examples], scfg.batch_tokens, rng)
        batch = [examples[i] for i in batches.pop()]
        ids, attn, mask = pad_batch([b[0] for b in batch], [b[1] for b in batch], pad_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scfg.bf16):
            logp = token_logprobs(model, ids, attn)
        target_mask = mask[:, 1:]
        loss = -(logp * target_mask).sum() / target_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        history.append(loss.item())
        if step % 20 == 0:
            bar.set_postfix(loss=f"{sum(history[-20:]) / len(history[-20:]):.3f}")
        at_probe = step + 1 == scfg.steps or (scfg.probe_every and (step + 1) % scfg.probe_every == 0)
        if probe is not None and at_probe:  # probe_every 0: only at the end, so the copy warning still runs
            probes.append({"step": step + 1, "copy_acc": probe(model)})
            bar.write(f"sft step {step + 1}: held-out copy accuracy {probes[-1]['copy_acc']:.2f}")
    model.eval()
    return history, probes


def world_search_tool(cfg: Config, world_path: Path):
    """query -> rendered hits over the world's corpus: the tool the policy uses in rollouts."""
    search = open_search(cfg.retriever, world_path / "corpus.jsonl")
    cache: dict[str, str] = {}

    def tool(query: str) -> str:
        if query not in cache:
            cache[query] = format_hits(search([query], cfg.retriever.topk)[0])
        return cache[query]

    return tool


def teacher_examples(cfg: Config, world_path: Path, tool) -> list[list[tuple[str, str]]]:
    """Teacher trajectories for every training question, with real BM25 observations."""
    world = generate_world(cfg.world)  # deterministic: the same world as on disk
    countries, cities = world.countries, list(world.city_country)
    if cfg.rollout.protocol != "search_r1":  # the teacher as a policy through rollout.py (tiny/teachers.py)
        if cfg.sft.confidence == "parity" or cfg.sft.admits_guess:
            raise ConfigError("sft.confidence: parity and sft.admits_guess are written for rollout.protocol "
                              "search_r1 only")  # fmt: skip
        if cfg.rollout.chat_template:
            raise ConfigError("the tiny world's teachers write plain prompts: set rollout.chat_template: false")
        tools = make_search_fn(cfg, world_path / "corpus.jsonl", {})
        return protocol_trajectories(cfg, read_jsonl(world_path / "train.jsonl"), tools, countries, cities)
    rng = random.Random(cfg.world.seed + 1)
    confidence_rng = random.Random(cfg.world.seed + 2)  # its own stream: the trajectories stay the same
    habits = Habits(cfg.sft.p_site, cfg.sft.p_unfaithful_think, cfg.sft.think_cites_source,
                    random.Random(cfg.world.seed + 3), cfg.sft.admits_guess)  # fmt: skip
    trajectories = []
    for q in tqdm(read_jsonl(world_path / "train.jsonl"), desc="teacher", mininterval=5):
        segs = teacher_segments(q, tool, rng, countries, cities, cfg.sft.p_guess_second_hop, cfg.sft.p_no_search,
                                habits)  # fmt: skip
        if cfg.sft.p_idk and habits.rng.random() < cfg.sft.p_idk:  # BAPO's teacher: IDK at random only
            segs[-1] = (re.sub(r"<answer>.*</answer>", "<answer> I don't know</answer>", segs[-1][0]), segs[-1][1])
        if cfg.sft.confidence:  # Deliberative Searcher's format: at random, or by guess-or-fact (parity)
            right = exact_match(last_block(segs[-1][0], "answer"), q["golden_answers"]) == 1.0
            if cfg.sft.confidence == "parity":
                conf = parity_confidence(confidence_rng, bool(GUESSED.search(segs[-1][0])))
            else:
                conf = hinted_confidence(confidence_rng, right, cfg.sft.p_confidence_hint,
                                         confidence_rng.randint(1, 10))  # fmt: skip
            text = f"<confidence> {conf}</confidence>"
            if cfg.rollout.confidence_after_answer:  # the answer annotated with it (rollout.py)
                text = segs[-1][0].replace("</answer>", "</answer>" + text)
            else:
                text = segs[-1][0].replace("<answer>", text + "<answer>")
            segs[-1] = (text, segs[-1][1])
        trajectories.append([(render_prompt(q["question"], cfg.rollout.prompt_template), "prompt")] + segs)
    return trajectories


def copy_probe(cfg: Config, world_path: Path, tool, tokenizer, n: int = 200):
    """A held-out diagnostic: can the policy read the city off the retrieved passage?

    For n validation questions, the teacher's correct trajectory is cut right after the first
    passage and "<think> P was born in the city of"; the probe is the share of questions whose
    next token(s), argmax and teacher-forced, are the city. Returns model -> accuracy.
    """
    rng = random.Random(0)
    examples = []
    plain = [q for q in read_jsonl(world_path / "val.jsonl") if "category" not in q["metadata"]]
    for q in plain[:n]:  # unanswerable and misinformation questions have no right city to copy
        segs = teacher_segments(q, tool, rng, [], [], 0.0, 0.0)  # always the full, correct path
        k = [i for i, (_, role) in enumerate(segs) if role == "obs"][0] + 1
        before = segs[k][0].split(" city of ", 1)[0] + " city of"
        context = [(render_prompt(q["question"], cfg.rollout.prompt_template), "prompt")] + [
            (text, "prompt" if role == "policy" else role) for text, role in segs[:k]
        ]
        target = [(before, "prompt"), (" " + q["metadata"]["city"], "policy")]
        examples.append(tokenize_segments(tokenizer, context + target))

    @torch.no_grad()
    def accuracy(model) -> float:
        was_training = model.training
        model.eval()
        right = 0
        for i in range(0, len(examples), 50):
            ids, attn, mask = pad_batch([e[0] for e in examples[i : i + 50]], [e[1] for e in examples[i : i + 50]],
                                        tokenizer.eos_token_id)  # fmt: skip
            pred = model(input_ids=ids, attention_mask=attn).logits.argmax(-1)[:, :-1]
            right += int(((pred == ids[:, 1:]) | (mask[:, 1:] == 0)).all(-1).sum())
        model.train(was_training)
        return right / len(examples)

    return accuracy


def confidence_contexts(cfg: Config, world_path: Path, tool, split: str = "test", n: int = 150) -> list[dict]:
    """The teacher's trajectories on the first n questions of `split`, cut where the answer's
    confidence is written: {"question_id", "category", "segments"}, the last segment ending in
    "<confidence>". eval.py --confidence-contexts reads every confidence's probability there
    (report/metrics.p_certain); the same contexts for every policy, so rows differ only in the policy.
    category: the question's metadata.category ("unanswerable", "misinfo"), else "answerable".
    """
    return _teacher_cuts(cfg, world_path, tool, split, n, lambda last: last[: last.index("<answer>")] + "<confidence>")


def think_contexts(cfg: Config, world_path: Path, tool, split: str = "test", n: int = 150) -> list[dict]:
    """The teacher's trajectories cut where the answer's think begins, just after the last
    information: as confidence_contexts, the last segment "<think>", and "unfaithful": the text of
    the teacher's unfaithful think there (" I know the answer.</think>", world.UNFAITHFUL_THINK).
    eval.py --think-contexts reads its probability (report/metrics.unfaithful_share): VERITAS's
    flaw read as a belief, where greedy decoding shows only the likelier think.
    """
    rows = _teacher_cuts(cfg, world_path, tool, split, n, lambda last: "<think>")
    return [r | {"unfaithful": f" {UNFAITHFUL_THINK}</think>"} for r in rows]


def _teacher_cuts(cfg: Config, world_path: Path, tool, split: str, n: int, cut) -> list[dict]:
    """The flawless teacher on the first n questions of `split` (it searches every hop), its last
    segment (the answer's think and answer) replaced by cut(last)."""
    rng = random.Random(cfg.world.seed + 5)
    habits = Habits(admits_guess=cfg.sft.admits_guess)  # the teacher's evidence, none of its flaws
    world = generate_world(cfg.world)
    out = []
    for q in read_jsonl(world_path / f"{split}.jsonl")[:n]:
        segs = teacher_segments(q, tool, rng, world.countries, list(world.city_country), 0.0, 0.0, habits)
        segs[-1] = (cut(segs[-1][0]), "policy")
        out.append({"question_id": q["id"], "category": q["metadata"].get("category", "answerable"),
                    "segments": [[render_prompt(q["question"], cfg.rollout.prompt_template), "prompt"]]
                    + [list(s) for s in segs]})  # fmt: skip
    return out


# Below this held-out copy accuracy the SFT start has not learnt to read a passage. Seen: a
# teacher differing only in its confidence digits moved the jump past 800 steps (0.35 at 800,
# validation EM 0.16; configs/experiments/tiny_papers_calibrated.yaml). The tiny starts end at 0.84-0.92.
MIN_COPY_ACC = 0.5


def warn_if_it_cannot_copy(policy_dir: Path) -> None:
    """Say on stderr when a built start's last copy probe (its DONE summary) is below MIN_COPY_ACC."""
    probes = json.loads((policy_dir / "DONE").read_text()).get("copy_acc") or []
    if probes and probes[-1]["copy_acc"] < MIN_COPY_ACC:
        print(f"WARNING: {policy_dir} copies the city off the passage on {probes[-1]['copy_acc']:.0%} of held-out "
              f"questions (< {MIN_COPY_ACC:.0%}): RL from it searches in vain. Copying is learnt in a jump "
              f"(docs/design.md §10); raise sft.steps.", file=sys.stderr)  # fmt: skip


def base_config(cfg: Config) -> Config:
    """sft.continue_from: auto: the config whose start a fork continues from, this one with rollout.protocol,
    world.question_types and sft.continue_* at their defaults (configs/quickstart.yaml's fork: the quick start)."""
    base = copy.deepcopy(cfg)
    base.rollout.protocol, base.world.question_types = RolloutConfig.protocol, WorldConfig().question_types
    base.sft.continue_from, base.sft.continue_steps = SFTConfig.continue_from, SFTConfig.continue_steps
    return base


def base_policy(cfg: Config) -> Path:
    """The policy directory a fork continues from (sft.continue_from): auto, base_config's start (built first
    where it is not cached), or a built policy directory."""
    if cfg.sft.continue_from == "auto":
        return ensure_tiny_policy(base_config(cfg))
    base = Path(cfg.sft.continue_from)
    if not (base / "DONE").exists():
        raise ConfigError(f"config key 'sft.continue_from' must be auto or a built policy directory; {base} has no "
                          "DONE file")  # fmt: skip
    return base


def continued_start(cfg: Config, base: Path, policy_dir: Path):
    """(model, tokenizer) of a fork's start: the base start's weights and tokenizer, the protocol's tags added as
    whole tokens (the embedding grows to the next multiple of 64 where they do not fit). The same world's
    corpus, so the same BPE serves."""
    tokenizer, model = load_tokenizer(base), load_policy(base, "float32")
    tokenizer.add_tokens([t for t in protocols.get(cfg.rollout.protocol).tokens if t not in tokenizer.get_vocab()])
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(64 * math.ceil(len(tokenizer) / 64))
    tokenizer.save_pretrained(policy_dir)
    return model, tokenizer


def ensure_tiny_policy(cfg: Config) -> Path:
    """Build world, tokenizer and SFT policy once per config key; return the policy dir."""
    out = world_dir(cfg)
    policy_dir = out / "policy"
    if (policy_dir / "DONE").exists():
        warn_if_it_cannot_copy(policy_dir)
        return policy_dir
    t0 = time.time()
    base = base_policy(cfg) if cfg.sft.continue_from else None  # a bad path is refused before anything is built
    torch.manual_seed(cfg.world.seed)
    ensure_world_data(cfg)
    tool = world_search_tool(cfg, out)
    trajectories = teacher_examples(cfg, out, tool)
    with open(out / "sft.jsonl", "w") as f:
        for t in trajectories:
            f.write(json.dumps(t) + "\n")
    corpus_texts = [json.loads(line)["contents"] for line in open(out / "corpus.jsonl")]
    texts = corpus_texts + ["".join(s for s, _ in t) for t in trajectories[:2000]]
    if cfg.sft.continue_from:  # a fork: the base start's tokenizer and weights, a short SFT on this teacher
        model, tokenizer = continued_start(cfg, base, policy_dir)
    else:
        tokenizer = train_tokenizer(texts, cfg.model.vocab_size, policy_dir, protocols.get(cfg.rollout.protocol).tokens)
    examples = []
    for t in trajectories:
        ids, mask = tokenize_segments(tokenizer, t, cfg.rollout.max_obs_tokens)
        if cfg.sft.train_on_observations:  # every token after the prompt is a target
            mask = [0] * mask.index(1) + [1] * (len(ids) - mask.index(1))
        examples.append((ids + [tokenizer.eos_token_id], mask + [1]))
    scfg = cfg.sft
    if cfg.sft.continue_from:  # continue_steps at the same lr, its warm-up at most a fifth of them
        steps = cfg.sft.continue_steps
        scfg = replace(cfg.sft, steps=steps, warmup_steps=min(cfg.sft.warmup_steps, steps // 5))
    else:
        model = build_tiny_model(cfg.model, tokenizer)
    lengths = sorted(len(e[0]) for e in examples)
    print(
        f"tiny policy: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
        f"{len(examples)} SFT trajectories, median {lengths[len(lengths) // 2]} tokens"
        + (f", {scfg.steps} steps on from {base}" if cfg.sft.continue_from else "")
    )
    # the probe is written in Search-R1's tags; another protocol's policy is not probed
    probe = copy_probe(cfg, out, tool, tokenizer) if cfg.rollout.protocol == "search_r1" else None
    history, probes = sft_train(model, examples, scfg, tokenizer.eos_token_id, cfg.world.seed, probe)
    model.save_pretrained(policy_dir, safe_serialization=True)
    summary = {"sft_seconds": round(time.time() - t0, 1), "final_loss": sum(history[-50:]) / len(history[-50:]),
               "copy_acc": probes} | ({"continued_from": str(base), "steps": scfg.steps} if cfg.sft.continue_from
                                      else {})  # fmt: skip
    (out / "sft_summary.json").write_text(json.dumps(summary, indent=1))
    with open(out / "sft_loss.jsonl", "w") as f:
        for step, loss in enumerate(history):
            f.write(json.dumps({"step": step, "loss": loss}) + "\n")
    (policy_dir / "DONE").write_text(json.dumps(summary))
    warn_if_it_cannot_copy(policy_dir)
    return policy_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (default: built-in defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = parser.parse_args()
    cfg = resolve_precision(load_config(args.config, args.set))
    print(describe_precision(cfg), flush=True)
    print(ensure_tiny_policy(cfg))


if __name__ == "__main__":
    main()

