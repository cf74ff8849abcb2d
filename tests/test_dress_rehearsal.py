"""The box's configuration, rehearsed in the suite (issue 33): the paper config that died on CPU
before (`configs/search_r1_ppo_qwen2.5-7b-base.yaml`: bf16 mixed precision, cpu_offload,
gradient checkpointing, a reference, PPO's critic, its epochs and mini-batches) with its own
train.* and rollout.* flags and only sizes shrunk, on the micro world's Qwen2 policy, in 2
processes for 2 steps, then a resume for a third. `benchmarks/dress_rehearsal.py` runs every
paper config the same way (results/multiprocess.md); `-s` prints what is overridden and skipped.
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from dress_rehearsal import chat_policy, rehearse  # noqa: E402


@pytest.mark.slow
def test_the_ppo_7b_config_trains_two_steps_and_resumes_in_two_processes(micro, tmp_path):
    world = micro[3]
    result = rehearse("search_r1_ppo_qwen2.5-7b-base", world, chat_policy(world, tmp_path), tmp_path)
    assert (result["first"], result.get("resume"), result.get("steps")) == (0, 0, [1, 2, 3]), result
