"""Every config in configs/ loads (a typo key fails here), and the paper configs hold the values
docs/design.md §9 fixes."""

from pathlib import Path

import pytest

from agent import protocols
from rewards import parse_spec
from rollout import render_prompt
from trainer.config import load_config
from trainer.constraints import parse_constraints

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SEARCH_R1 = sorted(CONFIGS.glob("search_r1_*.yaml"))


def load(name: str):
    return load_config(CONFIGS / name)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("**/*.yaml")), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_config_loads(path):
    cfg = load_config(path)
    parse_spec(cfg.train.reward)  # the reward names exist
    render_prompt("Who?", cfg.rollout.prompt_template)  # a template survives str.format
    parse_constraints(cfg.train.constraints)  # the trainer's own check: known keys, valid values


def test_search_r1_configs():
    assert len(SEARCH_R1) == 8
    for path in SEARCH_R1:
        cfg = load_config(path)
        t, r = cfg.train, cfg.rollout
        algo, size, kind = path.stem.split("_")[2], path.stem.split("-")[1], path.stem.split("-")[2]
        assert cfg.model.path == f"models/Qwen2.5-{size.upper()}" + ("-Instruct" if kind == "instruct" else "")
        assert t.algo == algo and t.name == path.stem
        assert (t.lr, t.questions_per_step, t.mini_batches, t.epochs, t.steps) == (1e-6, 512, 2, 1, 1005)
        assert (t.kl_coef, t.clip_eps, t.entropy_coef, t.grad_clip, t.warmup_frac) == (0.001, 0.2, 0.001, 1.0, 0.285)
        assert (r.max_turns, r.max_tokens_per_turn, r.max_obs_tokens, r.temperature, r.top_p) == (4, 500, 500, 1, 1)
        assert r.engine == "vllm" and r.max_model_len == 4096
        assert r.chat_template == (kind == "instruct")  # an instruct model is prompted in its chat format
        assert (cfg.retriever.method, cfg.retriever.topk, cfg.retriever.index_factory) == ("dense", 3, "Flat")
        assert "e5-base-v2" in cfg.retriever.model and t.reward == "em" and t.mask_retrieved
        assert t.fsdp and t.bf16 and t.grad_checkpointing and cfg.model.dtype == "bfloat16"
        # per phase where the rollout needs it (PPO 7B), else none: docs/box.md, "Memory on the box"
        assert t.cpu_offload == ("phase" if (algo, size) == ("ppo", "7b") else False)
        assert cfg.hardware.vllm_memory_fraction == r.gpu_memory_utilization
        if algo == "grpo":
            assert (t.group_size, t.kl_estimator, t.kl_in_reward) == (5, "k3", False)
        else:
            assert (t.group_size, t.kl_estimator, t.kl_in_reward, t.critic_lr) == (1, "k1", True, 1e-5)
            assert (t.gae_gamma, t.gae_lambda, t.value_clip) == (1.0, 1.0, 0.5)


def test_deliberative_searcher_configs():
    for name, fixed in (("deliberative_searcher.yaml", None), ("deliberative_searcher_fixed_lambda.yaml", 0.1)):
        t = load(name).train
        assert (t.algo, t.reward, t.lr, t.kl_coef, t.reward_params["zeta"]) == ("grpo", "deliberative", 1e-6, 1e-3, 5)
        (c,) = t.constraints
        assert (c["stat"], c["threshold"], c["direction"], c["param"]) == ("reward/reliability", 0.9, ">=", "lam")
        assert (c["lambda0"], c["eta"], c["warmup_frac"], c["fixed_lambda"]) == (0.01, 0.1, 0.25, fixed)
    rollout = load("deliberative_searcher.yaml").rollout
    assert (rollout.protocol, rollout.chat_template, rollout.prompt_template) == ("deliberative", True, "")
    assert "<confidence>" in protocols.instructions(protocols.get(rollout.protocol), rollout)


def test_webfilter_config():
    cfg = load("webfilter.yaml")
    t = cfg.train
    assert (t.reward, t.lr, t.questions_per_step, t.group_size, t.mini_batches) == ("webfilter", 1e-5, 256, 16, 1)
    assert (t.reward_params["alpha"], t.reward_params["beta"], cfg.rollout.temperature) == (0.4, 0.2, 1.0)
    assert cfg.rollout.max_turns == 10  # up to 10 retrievals; one more turn must answer
    assert cfg.model.path.endswith("Qwen2.5-7B-Instruct")
    assert (cfg.rollout.protocol, cfg.rollout.chat_template, cfg.rollout.prompt_template) == ("webfilter", True, "")


def test_bapo_configs():
    cfg = load("bapo.yaml")
    t = cfg.train
    assert (t.reward, t.lr, t.warmup_frac, t.questions_per_step, t.group_size) == ("bapo", 1e-6, 0.0, 64, 8)
    assert (t.epochs, t.mini_batches, t.clip_eps, t.kl_coef) == (2, 4, 0.1, 0.001)
    assert (t.resample_groups, t.bapo_patience, t.reward_params["alpha"]) == (2, 5, 0.05)
    # eq. 5's group test is EM while R_correct is char-F1 (agent/bapo.bapo_solved); the paper's resampling
    assert (t.reward_params["correct"], t.reward_params["f1_unit"]) == ("em", "char")
    assert (t.resample_stage, t.resample_mode) == ("plateau", "enlarge")
    assert (cfg.retriever.topk, cfg.rollout.max_model_len, cfg.rollout.max_turns) == (5, 8192, 3)
    assert (cfg.rollout.protocol, cfg.rollout.allow_idk, cfg.rollout.prompt_template) == ("bapo", True, "")
    assert r"\boxed{I DON'T KNOW}" in render_prompt("q", cfg=cfg.rollout)
    rft = load("bapo_rft.yaml").train
    assert (rft.algo, rft.lr, rft.warmup_frac, rft.epochs, rft.group_size, rft.kl_coef) == ("rft", 7e-6, 0.1, 3, 8, 0)


def test_veritas_config():
    cfg = load("veritas.yaml")
    t = cfg.train
    assert cfg.model.path == "models/Qwen2.5-7B" and (t.algo, t.lr, t.kl_in_reward) == ("ppo", 1e-6, True)
    assert parse_spec(t.reward) == [(1.0, "veritas")]
    p = t.reward_params
    assert (p["w_em"], p["w_info_think"], p["w_think_answer"]) == (0.9, 0.05, 0.02)
