"""Warm start for your own model: SFT on the tiny world's teacher, in the model's chat template.

A pretrained instruct model (SmolLM2, Qwen2.5-Instruct, ...) does not write Search-R1's tags on
the tiny world: every rollout scores 0, every group's advantages are 0, and GRPO has no signal
(train.py warns). The tiny policy gets its format from SFT on scripted teacher trajectories
(tiny/sft.py, docs/design.md §5); this file does the same for a model you bring, with `sft.warm_start: true`:

    the teacher's trajectory, as segments          rendered for the model, token by token
    ("<think> I need .. </think><search> X</search>", policy)  -> prompt_ids(): the chat template,
    ("Doc 1(Title: X) X was born in ..", obs)                     system = the instruction, user = Q
    ("<think> .. </think><answer> Velor</answer>", policy)     -> then each segment tokenised on its
                                                                  own, obs wrapped in <information>,
                                                                  exactly as a rollout builds it

so the SFT examples carry the same token ids and loss mask as a rollout of the same trajectory
(rollout.tokenize_segments), in the tokenizer and template the model will see in RL. The loss is
the masked next-token loss of sft.sft_train over policy tokens (+ the end-of-turn token), and over
the observations too if `sft.train_on_observations`. The model keeps its own tokenizer and
vocabulary: nothing is resized.

The result is cached under `cache/warm-<key>/policy` (the key: the model directory, the world,
the SFT, prompt and retrieval settings) and train.py / eval.py start from it. Built in a child
process by data.ensure_policy (bm25s must not be imported before vLLM starts, docs/design.md §6).

Run: `python -m tiny.warm_start --config configs/smollm2.yaml` prints the policy directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch

from agent import protocols
from rollout import check_chat_template, prompt_ids, tokenize_segments
from tiny.sft import sft_train, teacher_examples, world_search_tool
from tiny.world import FORMAT_VERSION, data_key, ensure_world_data, read_jsonl, world_data_dir
from trainer.config import Config, ConfigError, load_config
from trainer.engine import load_policy, load_tokenizer
from trainer.precision import describe as describe_precision
from trainer.precision import resolve as resolve_precision

# Settings that change the warm start's weights besides the model and the world (the key).
SFT_KEYS = ("steps", "batch_tokens", "lr", "warmup_steps", "decay_frac", "weight_decay", "train_on_observations",
            "bf16", "p_guess_second_hop", "p_no_search")  # fmt: skip


def model_fingerprint(model_dir: Path) -> dict:
    """Which model: its resolved path, its config and the size and mtime of its weight files."""
    weights = sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin"))
    return {
        "path": str(model_dir.resolve()),
        "config": hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:16],
        "weights": [(w.name, w.stat().st_size, int(w.stat().st_mtime)) for w in weights],
    }


def warm_start_dir(cfg: Config) -> Path:
    """cache/warm-<key>: keyed on the model, the world's data, the SFT and the prompt format."""
    r = cfg.rollout
    parts = {
        "model": model_fingerprint(Path(cfg.model.path)),
        "world": data_key(cfg),
        "sft": {k: getattr(cfg.sft, k) for k in SFT_KEYS},
        "seed": cfg.world.seed,
        "prompt": [r.chat_template, r.prompt_template, r.protocol, r.max_obs_tokens],
        "retriever": [cfg.retriever.method, cfg.retriever.topk],
        "format": FORMAT_VERSION,
    }
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]
    return Path(cfg.world.cache_dir) / f"warm-{key}"


def warm_start_examples(cfg: Config, tokenizer, data_dir: Path) -> list[tuple[list[int], list[int]]]:
    """(ids, loss_mask) per training question: the teacher's trajectory in the model's format."""
    if cfg.rollout.protocol != "search_r1":
        raise ConfigError("sft.warm_start writes Search-R1's teacher: set rollout.protocol: search_r1")
    questions = read_jsonl(data_dir / "train.jsonl")
    trajectories = teacher_examples(cfg, data_dir, world_search_tool(cfg, data_dir))
    assert len(trajectories) == len(questions), "the Search-R1 teacher writes one trajectory per question"
    proto = protocols.get(cfg.rollout.protocol)
    examples = []
    for q, segments in zip(questions, trajectories):
        prompt = prompt_ids(tokenizer, q["question"], cfg.rollout, proto)
        ids, mask = tokenize_segments(tokenizer, segments[1:], cfg.rollout.max_obs_tokens)  # [0]: the plain prompt
        if cfg.sft.train_on_observations:
            mask = [1] * len(mask)
        # the end-of-turn token after </answer>: a chat model's turn ends there (vLLM stops on the tag)
        examples.append((prompt + ids + [tokenizer.eos_token_id], [0] * len(prompt) + mask + [1]))
    return examples


def ensure_warm_start(cfg: Config) -> Path:
    """Fine-tune `model.path` on the teacher once per key; return the policy directory."""
    out = warm_start_dir(cfg)
    policy_dir = out / "policy"
    if (policy_dir / "DONE").exists():
        return policy_dir
    t0 = time.time()
    tokenizer = load_tokenizer(cfg.model.path)
    check_chat_template(tokenizer, cfg.rollout, cfg.model.path)
    data_dir = ensure_world_data(cfg, world_data_dir(cfg))
    examples = warm_start_examples(cfg, tokenizer, data_dir)
    torch.manual_seed(cfg.world.seed)
    model = load_policy(cfg.model.path, "float32")  # fp32 master weights; sft.bf16 autocasts
    lengths = sorted(len(ids) for ids, _ in examples)
    print(f"warm start of {cfg.model.path}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, "
          f"{cfg.sft.steps} steps over {len(examples)} teacher trajectories, median {lengths[len(lengths) // 2]} "
          f"tokens", flush=True)  # fmt: skip
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    history, _ = sft_train(model, examples, cfg.sft, pad_id, cfg.world.seed)
    model.save_pretrained(policy_dir, safe_serialization=True)
    tokenizer.save_pretrained(policy_dir)
    tail = history[-20:] or [float("nan")]
    summary = {"model": cfg.model.path, "sft_seconds": round(time.time() - t0, 1), "steps": len(history),
               "first_loss": history[0] if history else None, "final_loss": sum(tail) / len(tail)}  # fmt: skip
    (out / "sft_summary.json").write_text(json.dumps(summary, indent=1))
    with open(out / "sft_loss.jsonl", "w") as f:
        for step, loss in enumerate(history):
            f.write(json.dumps({"step": step, "loss": loss}) + "\n")
    (policy_dir / "DONE").write_text(json.dumps(summary))
    return policy_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config with model.path and sft.warm_start: true")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = parser.parse_args()
    cfg = resolve_precision(load_config(args.config, args.set))
    if not cfg.model.path:
        raise SystemExit("tiny/warm_start.py needs model.path (the tiny policy's own warm start is python -m tiny.sft)")
    print(describe_precision(cfg), flush=True)
    print(ensure_warm_start(cfg))


if __name__ == "__main__":
    main()
