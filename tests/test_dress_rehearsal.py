"""The box's configuration, rehearsed in the suite (issue 33): the paper config that died on CPU
before (`configs/search_r1_ppo_qwen2.5-7b-base.yaml`: bf16 mixed precision, cpu_offload,
gradient checkpointing, a reference, PPO's critic, its epochs and mini-batches) with its own
train.* and rollout.* flags and only sizes shrunk, on the micro world's Qwen2 policy, in 2
processes for 2 steps, then a resume for a third. `benchmarks/dress_rehearsal.py` runs every
paper config the same way (results/multiprocess.md); `-s` prints what is overridden and skipped.
"""

import json
import sys
from pathlib import Path

import psutil
import pytest

from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from dress_rehearsal import chat_policy, rehearse  # noqa: E402


@pytest.mark.slow
def test_the_ppo_7b_config_trains_two_steps_and_resumes_in_two_processes(micro, tmp_path):
    world = micro[3]
    name = "search_r1_ppo_qwen2.5-7b-base"
    result = rehearse(name, world, chat_policy(world, tmp_path), tmp_path)
    assert (result["first"], result.get("resume"), result.get("steps")) == (0, 0, [1, 2, 3]), result
    # one machine of 2 processes (the resume's layout): each rank's engine takes half the host's
    # KV share (engine.cpu_kv_cache_size; 2 machines of one: test_fsdp.py's loopback test)
    run = next((tmp_path / "runs" / name).iterdir())
    cfg = load_config(run / "config.yaml")
    assert cfg.rollout.engine == "vllm" and cfg.rollout.weight_sync == "memory"  # an engine in each rank
    kv = int(cfg.rollout.gpu_memory_utilization / 2 * psutil.virtual_memory().total)
    layout = json.loads((run / "processes.json").read_text())
    assert [(p["machine"], p["local_rank"], p["local_world_size"], p["engine_kv_cache_bytes"]) for p in layout] == [
        (0, 0, 2, kv), (0, 1, 2, kv)]  # fmt: skip
