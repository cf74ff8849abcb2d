"""train.py itself under several processes: a 2-process `accelerate launch` whose steps match a
1-process run (and whose sharded checkpoint 1 process refuses to resume), and 2 processes sharing
a vLLM engine of tensor parallel size 2, every rank's engine matching the trainer after the
in-memory sync. One FSDP step against one process, and 2 machines on loopback: test_fsdp.py.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from numerics import assert_close, assert_stats_close, logprob_atol, model_vocab

ROOT = Path(__file__).resolve().parents[1]


def launch_two() -> list[str]:
    """train.py under a 2-process `accelerate launch` (CPU processes, gloo) on a free port."""
    from conftest import free_port

    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), "train.py"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.numeric
def test_two_process_training_run_matches_one_process_and_is_not_resumed_by_one(micro, tmp_path):
    """train.py itself under a 2-process launch (each rank rolls out half the questions with its
    own transformers engine, whose per-request seeds sample what one engine does; both ranks
    update; full weights gathered tensor by tensor into each engine): steps 1-2 match a 1-process
    run (assert_stats_close: logprobs of other batch shapes), and the sharded checkpoint does not
    resume under 1 process (a clear error). It resumes under 2 in the loopback test below and in
    test_dress_rehearsal.py."""
    from conftest import ROOT, run_script, write_micro_config

    cfgs = {}
    for name, fsdp in (("one", False), ("two", True)):
        cfgs[name] = write_micro_config(
            tmp_path / f"{name}.yaml", micro[1].world.cache_dir, rollout={"engine": "hf"},
            train={"steps": 2, "eval_every": 0, "save_every": 1, "threads": 1, "kl_coef": 0.01, "fsdp": fsdp,
                   "run_dir": str(tmp_path / name), "name": name, "seed": 3},
        )  # fmt: skip  # seed 3: both steps' batches hold mixed groups (seed 0's first batch has reward 0)

    one = run_script(["train.py", "--config", str(cfgs["one"])], timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(launch_two() + ["--config", str(cfgs["two"])], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("run directory:") == 1, two.stdout[-3000:]  # rank 0 says it, not each process
    rows = {}
    for name in cfgs:
        run = next((tmp_path / name).glob(f"{name}-*"))
        rows[name] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows["two"]] == [1, 2]
    assert all(r["grad_norm"] > 0.05 for r in rows["one"])  # a real update to compare, not a zero gradient
    for a, b in zip(rows["one"], rows["two"]):
        assert a["reward"] == b["reward"] and a["policy_tokens"] == b["policy_tokens"]  # same rollouts
        # step 1's KL is 0 up to rounding on both sides (the policy is the reference): its floor
        vocab = model_vocab(micro[2])  # on policy, no IS weight: rho w <= 1.2
        assert_stats_close(b, a, logprob_atol(vocab), vocab, f"step {a['step']}", rho_w=1.2)
    assert rows["two"][1]["kl"] > 0  # step 2 moved off the reference: the update and sync happened
    run = next((tmp_path / "two").glob("two-*"))
    ckpt = run / "checkpoints" / "step_2"
    assert {"model.safetensors", "optimizer.rank0.pt", "optimizer.rank1.pt"} <= {p.name for p in ckpt.iterdir()}
    single = run_script(["train.py", "--resume", str(run), "--set", "train.steps=3"])
    assert single.returncode != 0 and "written by 2 processes" in single.stderr and "Traceback" not in single.stderr


@pytest.mark.slow
@pytest.mark.numeric
def test_every_rank_engine_matches_the_trainer_after_an_in_memory_sync(micro, tmp_path):
    """2 processes sharing one vLLM engine of tensor parallel size 2 (vLLM's external_launcher;
    tests/engine_sync.py also runs tp 1, an engine per rank): after an FSDP update and the
    in-memory sync, every rank's engine scores a fixed sequence within logprob_atol of the trainer
    (fp32, vLLM's kernels vs torch's). Before the sync the same check fails (the engine still has
    the old weights): the test can fail."""
    from conftest import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "tests/engine_sync.py", str(micro[0]), str(tmp_path), "2"]  # fmt: skip  # tensor parallel size 2
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lp = logprob_atol(model_vocab(micro[2]))
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["before"] > 1e-2, r  # the update (lr 1e-2) moved the logprobs by far more than rounding
        # one retrieval call per tensor-parallel group (engine.share_tool), its result on both ranks
        assert r["tool"] == {"results": ["hits of q1", "hits of q2"], "calls": 1 - rank}, r["tool"]
        assert_close(r["after"], 0.0, rtol=0, atol=lp, what=f"rank {rank}: logprob gap after the sync")
