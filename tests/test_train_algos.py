"""train.py's other algorithms end to end on the micro world (transformers engine, 2 steps
each): PPO with its critic, Reliable RFT, the BAPO loop, and a LoRA policy
(adapters trained, merged weights pushed to the engine, checkpoint and resume)."""

import json

import pytest
from conftest import run_script, write_micro_config
from numerics import logprob_atol, model_vocab

RUNS = {
    "ppo": {"algo": "ppo", "kl_in_reward": True, "kl_estimator": "k1", "critic_lr": 1e-3},
    "rft": {"algo": "rft", "rft_accept": 1.0},
    # word F1, as configs/reproduction/tiny_bapo.yaml: the resampling must judge "correct" in the reward's unit
    "bapo": {
        "reward": "bapo",
        "reward_params": {"f1_unit": "word"},
        "resample_groups": 2,
        "resample_stage": "always",  # the default waits for the plateau stage, which 2 steps may not reach
        "epochs": 2,
        "mini_batches": 2,
        "bapo_patience": 1,
    },
    # char F1 differs between any two different answers, so step 1 has a non-zero advantage (and
    # the adapters a gradient) whatever the micro SFT start learnt; with EM, a start built on one
    # thread could give every group equal rewards at step 1, no update, and kl 0 at step 2
    "lora": {"lora_rank": 4, "lora_alpha": 8.0, "lr": 1e-2, "kl_coef": 0.01, "reward": "char_f1"},
}


@pytest.mark.slow
@pytest.mark.numeric
def test_ppo_rft_and_bapo_loops_train_and_checkpoint(micro, tmp_path):
    rows = {}
    for name, extra in RUNS.items():  # one after another, each forked from the warm zygote (conftest.run_script)
        cfg = write_micro_config(
            tmp_path / f"{name}.yaml", micro[1].world.cache_dir, rollout={"engine": "hf"}, eval={"max_questions": 4},
            train={"steps": 2, "eval_every": 1, "save_every": 1, "threads": 1, "run_dir": str(tmp_path / name),
                   "name": name} | extra,
        )  # fmt: skip
        done = run_script(["train.py", "--config", str(cfg)], timeout=900)
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
        run = next((tmp_path / name).glob(f"{name}-*"))
        rows[name] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
        assert [r["step"] for r in rows[name]] == [1, 2]
    for r in rows["ppo"]:
        assert r["value_loss"] >= 0 and r["critic_grad_norm"] > 0 and "value_mean" in r
    # KL in the reward: 0 until the first update, up to the k1 terms' rounding: the engine's sampling
    # logprobs vs the reference's in a training forward, another batch shape (logprob_atol per
    # token, and so for their mean); after the update, more than that
    lp = logprob_atol(model_vocab(micro[2]))
    assert abs(rows["ppo"][0]["kl"]) <= lp < rows["ppo"][1]["kl"], [r["kl"] for r in rows["ppo"]]
    ppo_run = next((tmp_path / "ppo").glob("ppo-*"))
    assert (ppo_run / "checkpoints" / "step_2" / "critic" / "value_head.safetensors").exists()
    for r in rows["rft"]:
        assert 0.0 <= r["rft_kept"] <= 1.0
        assert (r["rft_kept"] > 0) == ("loss" in r)  # no accepted rollout: no update
    for r in rows["bapo"]:
        assert r["resampled_groups"] >= 0 and r["bapo_stage"] in ("exploration", "plateau")
        assert f"idk_rate/{r['bapo_stage']}" in r
        assert {"reward/correct", "reward/idk_bonus", "reward/gate"} <= set(r)
    assert rows["bapo"][0]["bapo_stage"] == "exploration"  # the stage logic itself: test_rewards.py
    assert sum(r["resampled_groups"] for r in rows["bapo"]) > 0  # (with char F1 here: 0, the 2026-11-22 bug)

    lora_run = next((tmp_path / "lora").glob("lora-*"))
    ckpt = lora_run / "checkpoints" / "step_2"
    assert (ckpt / "config.json").is_file() and (ckpt / "lora").is_dir()  # a plain merged policy + adapters
    assert rows["lora"][1]["kl"] > 0  # the adapters moved the policy off the reference
    resumed = run_script(["train.py", "--resume", str(lora_run), "--set", "train.steps=3"], timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (lora_run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-3:] == [1, 2, 3]
