"""Broken checkpoints and failed saves (issue 34): a resume never starts from a broken or poisoned
checkpoint and never loses the last good one.

- a stray `step_2.bak` directory (a copy someone made) is not a checkpoint: resume and pruning
  ignore it;
- a truncated model.safetensors is caught by reading its header only; a truncated
  trainer_state.pt is one line that names the file and says it is truncated or corrupt;
- `--resume` passes over a broken newest checkpoint to the newest intact one, says so in one
  line, and leaves the broken one in place;
- every file of a checkpoint, and its directory, is fsynced before the rename that publishes it;
- weights holding a NaN or inf are never saved, on every process alike, and nothing is pruned.

The checkpoints are real (a 2-layer Llama with hidden size 32, its AdamW state, save_checkpoint
itself), so each test takes a second or two; tests/test_fault_injection.py runs `train.py --resume`
past a truncated checkpoint end to end.
"""

import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import ROOT, free_port

import trainer.config as config
from trainer import checkpoint
from trainer.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint, verify_checkpoint
from trainer.config import RunDirError


class Tokenizer:
    """What save_checkpoint needs of a tokenizer: save_pretrained writes its file."""

    def save_pretrained(self, directory) -> None:
        (Path(directory) / "tokenizer.json").write_text("{}")


def tiny_policy() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, num_key_value_heads=2, max_position_embeddings=64, **shape))


@pytest.fixture
def policy():
    """(model, optimizer) after one AdamW step, so the optimizer state is real."""
    model = tiny_policy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    return model, opt


def save(run: Path, step: int, policy, keep: int = 3) -> Path:
    model, opt = policy
    return save_checkpoint(run, step, model, Tokenizer(), opt, {"order": [2, 0, 1]}, keep=keep)


def cut(path: Path, size: int | None = None) -> None:
    """Truncate a file (to half its size by default), as a crash mid-copy or a full disk leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if size is None else size])


def names(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def test_a_stray_directory_is_not_a_checkpoint(tmp_path, policy):
    """step_2.bak (a copy), step_9.tmp (a save that died) and a file named step_7 are ignored by
    resume and by pruning: at 9eafa61 int('2.bak') was a traceback."""
    save(tmp_path, 1, policy)
    step2 = save(tmp_path, 2, policy)
    shutil.copytree(step2, step2.with_name("step_2.bak"))
    (tmp_path / "checkpoints" / "step_9.tmp").mkdir()
    (tmp_path / "checkpoints" / "step_7").write_text("not a checkpoint")
    assert latest_checkpoint(tmp_path) == step2
    save(tmp_path, 3, policy, keep=2)
    assert names(tmp_path) == ["step_2", "step_2.bak", "step_3", "step_7", "step_9.tmp"]  # only step_1 pruned
    assert checkpoint.verified_checkpoint(tmp_path) == (tmp_path / "checkpoints" / "step_3", None)


@pytest.mark.parametrize("size", [None, 4])  # half the file (the data cut short), or not even its header length
def test_a_truncated_model_safetensors_is_a_broken_checkpoint(tmp_path, policy, size):
    ckpt = save(tmp_path, 1, policy)
    verify_checkpoint(ckpt)
    cut(ckpt / "model.safetensors", size)
    with pytest.raises(RunDirError, match=f"cannot read {ckpt / 'model.safetensors'}: the file is truncated") as e:
        verify_checkpoint(ckpt)
    assert "\n" not in str(e.value)


def test_a_truncated_trainer_state_says_so_in_one_line(tmp_path, policy):
    """At 9eafa61 the line was 'cannot read .../trainer_state.pt: [Errno 22] Invalid argument'."""
    ckpt = save(tmp_path, 1, policy)
    path = ckpt / "trainer_state.pt"
    cut(path)
    expected = f"cannot read {path}: the file is truncated or corrupt"
    with pytest.raises(RunDirError, match=expected) as e:
        verify_checkpoint(ckpt)
    assert "\n" not in str(e.value)
    with pytest.raises(RunDirError, match=expected):
        load_trainer_state(ckpt, tmp_path, policy[1])


def break_checkpoint(ckpt: Path, how: str) -> None:
    if how == "missing trainer_state.pt":
        (ckpt / "trainer_state.pt").unlink()
    else:
        cut(ckpt / how)


@pytest.mark.parametrize("how", ["trainer_state.pt", "optimizer.rank0.pt", "model.safetensors",
                                 "missing trainer_state.pt"])  # fmt: skip
def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, policy, how):
    """The function train.py --resume uses: the broken newest checkpoint is passed over (and kept),
    in one line naming it and the cause; with every one broken, one line naming each."""
    for step in (1, 2, 3):
        save(tmp_path, step, policy)
    ckpts = tmp_path / "checkpoints"
    break_checkpoint(ckpts / "step_3", how)
    ckpt, note = checkpoint.verified_checkpoint(tmp_path)
    assert ckpt == ckpts / "step_2"
    assert note.startswith("checkpoint step_3 is broken (") and str(ckpts / "step_3") in note and "\n" not in note, note
    assert note.endswith("; resuming from step_2, step_3 is left in place"), note
    assert names(tmp_path) == ["step_1", "step_2", "step_3"]  # the broken one is not deleted

    break_checkpoint(ckpts / "step_2", how)
    ckpt, note = checkpoint.verified_checkpoint(tmp_path)
    assert ckpt == ckpts / "step_1" and note.startswith("checkpoints step_3, step_2 are broken (step_3: "), note

    break_checkpoint(ckpts / "step_1", how)
    with pytest.raises(RunDirError, match=f"no intact checkpoint to resume in {ckpts} \\(step_3: .*; step_1: "):
        checkpoint.verified_checkpoint(tmp_path)


def test_a_save_never_prunes_the_checkpoint_it_wrote(tmp_path, policy):
    """After resuming from step_1 past a broken step_3, saving step 2 with keep_checkpoints 1
    must keep step_2: at 9eafa61 the newest `keep` by step were kept, so step_2 (just written)
    went and only the broken step_3 was left."""
    save(tmp_path, 1, policy)
    cut(save(tmp_path, 3, policy) / "trainer_state.pt")
    save(tmp_path, 2, policy, keep=1)
    assert names(tmp_path) == ["step_2", "step_3"]
    assert checkpoint.verified_checkpoint(tmp_path)[0] == tmp_path / "checkpoints" / "step_2"


def test_every_file_is_fsynced_before_the_rename(tmp_path, policy, monkeypatch):
    """Each file and directory of step_<k>.tmp is flushed while it is still .tmp; the directory
    that holds the checkpoints is flushed after the rename."""
    synced = []  # (path, whether step_1 existed yet)
    real_fsync = os.fsync

    def fsync(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), (tmp_path / "checkpoints" / "step_1").exists()))  # fmt: skip
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    ckpt = save(tmp_path, 1, policy).resolve()
    tmp = str(ckpt.with_name("step_1.tmp"))
    before = {path for path, renamed in synced if not renamed}
    expected = {tmp} | {p.replace(str(ckpt), tmp) for p in map(str, ckpt.rglob("*"))}
    assert expected <= before, sorted(expected - before)
    assert (str(ckpt.parent), True) in synced


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_weights_are_never_saved(tmp_path, policy, value):
    """TrainingFault naming the first bad tensor, before anything is written: the earlier
    checkpoints all stay (keep_checkpoints 2 would otherwise prune step_1) and no .tmp is left."""
    save(tmp_path, 1, policy, keep=2)
    save(tmp_path, 2, policy, keep=2)
    model = policy[0]
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = value
        model.lm_head.weight[0, 0] = value  # a later one: the message names the first
    bad = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(RuntimeError, match=f"refusing to save checkpoint .*step_3: the policy's weight {bad} "
                                           "holds a NaN or inf; nothing was written") as e:  # fmt: skip
        save(tmp_path, 3, policy, keep=2)
    assert type(e.value) is config.TrainingFault
    assert names(tmp_path) == ["step_1", "step_2"]
    assert checkpoint.verified_checkpoint(tmp_path) == (tmp_path / "checkpoints" / "step_2", None)


RANK_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    from torch.distributed.fsdp import fully_shard
    from trainer.checkpoint import save_checkpoint
    from trainer.distributed import init

    class Writes:  # a config / tokenizer: save_pretrained writes its file
        def __init__(self, name):
            self.name = name

        def save_pretrained(self, directory):
            (Path(directory) / self.name).write_text("{}")

    rank, world, _ = init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    model.config = Writes("config.json")
    fully_shard(model)  # each weight is a DTensor; rank 1 holds rows 4-7 of the first one
    if rank == 1:
        with torch.no_grad():
            model[0].weight.to_local()[0, 0] = float("nan")
    opt = torch.optim.AdamW(model.parameters())
    try:
        save_checkpoint(Path(sys.argv[1]), 1, model, Writes("tokenizer.json"), opt, {}, rank=rank, world=world)
        print(f"rank {rank}: saved")
    except Exception as e:
        print(f"rank {rank}: {type(e).__name__}: {e}")
""")


def test_every_process_refuses_a_sharded_non_finite_weight_together(tmp_path):
    """Under FSDP (2 CPU processes, gloo) the NaN sits in rank 1's shard only: both processes
    raise the same TrainingFault (one all_reduce), so neither waits forever in a collective."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
                        "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # fmt: skip
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "run")], cwd=ROOT, text=True,
                              env=env | {"RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=120)[0] for p in procs]
    step1 = tmp_path / "run" / "checkpoints" / "step_1"
    for rank, out in enumerate(outs):
        expected = f"rank {rank}: TrainingFault: refusing to save checkpoint {step1}: the policy's weight 0.weight "
        assert expected in out, out[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()
