"""Bring your own model: a tiny, randomly initialised Llama-architecture chat model goes the path
of configs/smollm2.yaml (warm start in its chat template, then GRPO with vLLM and BM25), and
vLLM agrees with the trainer after every weight sync."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, write_micro_config
from numerics import assert_close, logprob_atol, model_vocab
from protocol_script import CHAT_TEMPLATE


@pytest.fixture(scope="module")
def chat_llama(micro, tmp_path_factory):
    """A random Llama (head_dim 64, as vLLM CPU needs) with the micro world's BPE, ChatML tokens
    and a chat template: an "instruct model" that has never seen the tags."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    _, _, policy, _ = micro
    out = tmp_path_factory.mktemp("chat-llama")
    tok = AutoTokenizer.from_pretrained(policy)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def test_warm_start_examples_are_rollouts_in_the_chat_template(micro, chat_llama, tmp_path):
    """The SFT example of a trajectory has the token ids and mask a rollout of it would have: the
    chat-template prompt (masked), the teacher's turns (trained), the observations (masked)."""
    from agent.protocols import PROTOCOLS
    from rollout import prompt_ids
    from tiny.warm_start import warm_start_examples
    from tiny.world import ensure_world_data, read_jsonl
    from trainer.config import load_config
    from trainer.engine import load_tokenizer

    _, micro_cfg, _, _ = micro
    world = [f"world.{k}={v}" for k, v in vars(micro_cfg.world).items() if k != "cache_dir"]
    cfg = load_config(None, [*world, f"world.cache_dir={tmp_path}", f"model.path={chat_llama}", "sft.warm_start=true",
                             "sft.train_on_observations=false", "rollout.chat_template=true",
                             "rollout.prompt_template=", "retriever.topk=1"])  # fmt: skip
    tok = load_tokenizer(chat_llama)
    data = ensure_world_data(cfg, tmp_path / "data")
    examples = warm_start_examples(cfg, tok, data)
    questions = read_jsonl(data / "train.jsonl")
    assert len(examples) == len(questions)
    for (ids, mask), q in list(zip(examples, questions))[:50]:
        prompt = prompt_ids(tok, q["question"], cfg.rollout, PROTOCOLS["search_r1"])
        assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])  # the system message + question
        assert tok.decode(prompt).startswith("<|im_start|>system\nAnswer the question.")
        trained = tok.decode([i for i, m in zip(ids, mask) if m])
        assert "<answer>" in trained and "<information>" not in trained and trained.endswith("<|im_end|>")
        assert "<information>" in tok.decode(ids[len(prompt) :]) or "<search>" not in trained


@pytest.mark.numeric
def test_a_random_chat_llama_warm_starts_and_trains_with_vllm_in_sync(chat_llama, tmp_path):
    """2 GRPO steps from the warm start: at each step vLLM's sampling logprobs equal the trainer's
    on the same weights (fp32, within logprob_atol: vLLM's kernels vs torch's): at step 1 the
    engine loaded the warm start, at step 2 it runs on the weights synced after step 1's update."""
    config = write_micro_config(
        tmp_path / "byo.yaml", tmp_path / "cache",
        model={"path": str(chat_llama)},
        sft={"warm_start": True, "steps": 6, "train_on_observations": False},
        rollout={"chat_template": True, "temperature": 1.0},
        # the entropy bonus: a gradient even if every advantage is 0 (a barely warm random model)
        train={"steps": 2, "run_dir": str(tmp_path / "runs"), "eval_every": 2, "save_every": 0, "entropy_coef": 0.01},
        eval={"max_questions": 8},
    )  # fmt: skip
    done = subprocess.run([sys.executable, "train.py", "--config", str(config)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (warm,) = (tmp_path / "cache").glob("warm-*")
    assert (warm / "policy" / "DONE").exists() and json.loads((warm / "sft_summary.json").read_text())["steps"] == 6
    assert "chat_template" in (warm / "policy" / "tokenizer_config.json").read_text() or (
        warm / "policy" / "chat_template.jinja").exists()  # fmt: skip
    run = next((tmp_path / "runs").glob("*"))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "engine_logp_gap" in r]
    assert [r["step"] for r in steps] == [1, 2]
    lp = logprob_atol(model_vocab(chat_llama))
    for r in steps:
        assert r["policy_tokens"] > 0
        assert_close(r["engine_logp_gap"], 0.0, rtol=0, atol=lp, what=f"step {r['step']}: engine gap")
    assert steps[0]["grad_norm"] > 0  # the update moved the weights that step 2's engine samples from
    config_used = (run / "config.yaml").read_text()
    assert "warm_start: true" in config_used and str(chat_llama) in config_used


def test_smollm2_config_is_the_byo_path_and_warm_start_needs_a_model():
    from trainer.config import ConfigError, load_config

    cfg = load_config(ROOT / "configs" / "smollm2.yaml")
    assert cfg.model.path == "models/smollm2-135m-instruct"  # what `python convert_gguf.py smollm2` writes
    assert cfg.sft.warm_start and not cfg.sft.train_on_observations and cfg.rollout.chat_template
    assert cfg.rollout.prompt_template == "" and cfg.rollout.protocol == "search_r1"  # Search-R1's instruction
    assert cfg.data.corpus == cfg.data.train == ""  # the tiny world, keyed on the world alone
    with pytest.raises(ConfigError, match="config key 'sft.warm_start' .* needs model.path"):
        load_config(None, ["sft.warm_start=true"])
