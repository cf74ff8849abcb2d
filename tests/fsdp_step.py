"""One `grpo.grpo_step` per case on a fixed batch, in one process or sharded over several.

    python tests/fsdp_step.py SPEC.json                                         # world 1, no FSDP
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \\
        --mixed_precision no --dynamo_backend no tests/fsdp_step.py SPEC.json    # 2 CPU processes, gloo

SPEC.json: {"model": dir, "records": json file, "pad_id": int, "out": dir, "cases": [{"name",
"overrides": [key=value, ..], "sharded_only": bool}, ..]}. For each case a fresh copy of the
model takes one grpo_step (optimizer from distributed.make_optimizer; the reference model only if
distributed.needs_reference), and rank 0 writes out/<name>.json (loss, grad norm, KL, clip
fraction, ...), out/<name>.safetensors (the updated full weights, via distributed.full_weights)
and out/<name>.grads.safetensors (the last mini-batch's gradients). The first case also writes
out/initial.safetensors before its step: the vLLM sync path on an untouched sharded model.
tests/test_fsdp.py compares the runs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from run_setup import sharded_policy_and_reference  # noqa: E402
from trainer import distributed  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.distributed import make_optimizer  # noqa: E402
from trainer.engine import load_policy  # noqa: E402
from trainer.grpo import grpo_step, memory_savers  # noqa: E402
from trainer.ppo import critic_optimizer, critic_step, critic_values, load_critic, load_sharded_critic  # noqa: E402
from trainer.precision import resolve as resolve_precision  # noqa: E402


def save_grads(model, path: Path, rank: int) -> None:
    """The gradients of the last mini-batch (still on the parameters after the step), gathered."""
    from safetensors.torch import save_file

    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[distributed.plain_name(name)] = g.detach().cpu().clone()
    if distributed.is_main(rank):
        save_file(grads, str(path))


def count_no_grad_tokens(model, ref) -> dict:
    """{"old": n, "ref": n}, filled as the step runs: the tokens (attention mask ones) this process
    forwards without gradients through the policy (pi_old) and through the reference."""
    counted = {"old": 0, "ref": 0}

    def counter(key):
        def hook(module, args, kwargs):
            if not torch.is_grad_enabled():
                counted[key] += int(kwargs["attention_mask"].sum())

        return hook

    model.register_forward_pre_hook(counter("old"), with_kwargs=True)
    if ref is not None:
        ref.register_forward_pre_hook(counter("ref"), with_kwargs=True)
    return counted


def run_case(case: dict, spec: dict, records: list[dict], rank: int, world: int, first: bool) -> dict:
    cfg = load_config(None, case["overrides"])
    resolve_precision(cfg)  # this machine's bf16 / dtype for the `auto` keys
    sharded = cfg.train.fsdp and world > 1
    needs_ref = distributed.needs_reference(cfg)
    if sharded:  # as train.py: built on the meta device, sharded, filled from rank 0's read
        model_dir = Path(spec["model"])
        model, ref = sharded_policy_and_reference(cfg, model_dir, model_dir if needs_ref else None, rank, world)
    else:
        model = memory_savers(load_policy(spec["model"]).eval(), cfg)
        ref = load_policy(spec["model"], cfg.model.dtype).eval().requires_grad_(False) if needs_ref else None
    out = Path(spec["out"])
    if first:
        distributed.save_full_state(model, out / "initial.safetensors", rank)
        # the sync for a bf16 engine: each shard cast before its gather
        bf16 = {n: t.cpu().clone() for n, t in distributed.full_weights(model, rank, dtype=torch.bfloat16)}
        if distributed.is_main(rank):
            save_file(bf16, str(out / "initial.bf16.safetensors"))
    optimizer = make_optimizer(model.parameters(), cfg.train.lr, cfg.train.weight_decay, cfg.train.optimizer)
    counted = count_no_grad_tokens(model, ref)
    t0 = time.time()
    phase = distributed.phase_offload(cfg, world)
    for step in range(case.get("steps", 1)):  # train.cpu_offload phase: to the host (the rollout), back (the update)
        if phase:
            distributed.offload_to_host([model, ref], [optimizer])
            distributed.load_to_device([model, ref], [optimizer], distributed.compute_device(model))
        stats = grpo_step(model, ref, records, optimizer, cfg, spec["pad_id"], step=step, rank=rank, world=world)
    if sharded and cfg.train.optimizer == "adamw8bit":  # the storage 8-bit AdamW steps is the model's own
        stepped = [s for group in optimizer.param_groups for s in group["params"]]
        stats["optimizer_steps_the_shards"] = all(s.data_ptr() == p.to_local().data_ptr()
                                                  for s, p in zip(stepped, model.parameters()))  # fmt: skip
    (out / f"{case['name']}.tokens.rank{rank}.json").write_text(json.dumps(counted))
    reference = None if ref is None else "sharded" if isinstance(ref, FSDPModule) else "plain"
    stats |= {"seconds": time.time() - t0, "world": world, "sharded": sharded, "reference": reference}
    distributed.save_full_state(model, out / f"{case['name']}.safetensors", rank)
    save_grads(model, out / f"{case['name']}.grads.safetensors", rank)
    if phase:  # every tensor of the state reached: moved to the meta device (its contents are lost)
        distributed.offload_to_host([model, ref], [optimizer], "meta")
        stats["meta"] = moved_to_meta(model, ref, optimizer)
    if distributed.is_main(rank):
        (out / f"{case['name']}.json").write_text(json.dumps(stats))
    return stats


def moved_to_meta(model, ref, optimizer) -> dict:
    """Counts of the state's tensors (local shards) on the meta device and elsewhere, and whether
    the optimizer still steps the model's own Parameter objects."""
    tensors = [t for m in (model, ref) for p in m.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    stepped = [q for group in optimizer.param_groups for q in group["params"]]
    return {"on_meta": sum(t.is_meta for t in local), "elsewhere": sum(not t.is_meta for t in local),
            "grads": sum(p.grad is not None for p in model.parameters()), "states": len(optimizer.state),
            "same_params": len(stepped) == len(list(model.parameters()))
            and all(a is b for a, b in zip(stepped, model.parameters()))}  # fmt: skip


def run_critic_case(case: dict, spec: dict, records: list[dict], rank: int, world: int) -> dict:
    """PPO's critic sharded under the case's flags (bf16, cpu_offload): the values of the batch,
    then one clipped value-loss step toward targets 1 above them (any targets: the step must run)."""
    cfg = load_config(None, case["overrides"])
    resolve_precision(cfg)  # this machine's bf16 / dtype for the `auto` keys
    if world > 1:  # as train.py: built on meta, sharded, filled from rank 0's read (issue 53)
        critic = load_sharded_critic(spec["model"], cfg, rank, world)
        distributed.save_full_state(critic, Path(spec["out"]) / f"{case['name']}.initial.safetensors", rank)
    else:
        critic = load_critic(spec["model"])
    optimizer = critic_optimizer(critic, cfg.train.critic_lr)
    values = critic_values(critic, records, cfg.train.micro_batch_tokens, spec["pad_id"])
    targets = [v + 1.0 for v in values]
    stats = critic_step(critic, optimizer, records, values, targets, cfg.train.value_clip, cfg.train.micro_batch_tokens,
                        spec["pad_id"], cfg.train.grad_clip, rank=rank, world=world)  # fmt: skip
    stats |= {"world": world, "sharded": world > 1, "value_dtype": str(values[0].dtype)}
    if distributed.is_main(rank):
        (Path(spec["out"]) / f"{case['name']}.json").write_text(json.dumps(stats))
    return stats


def main(spec_path: str) -> None:
    rank, world, _ = distributed.init()
    spec = json.loads(Path(spec_path).read_text())
    records = json.loads(Path(spec["records"]).read_text())
    for n, case in enumerate(spec["cases"]):
        if case.get("sharded_only") and world == 1:
            continue
        if case.get("critic"):
            stats = run_critic_case(case, spec, records, rank, world)
        else:
            stats = run_case(case, spec, records, rank, world, first=n == 0)
        if distributed.is_main(rank):
            print(f"{case['name']} world={world}: {json.dumps(stats)}", flush=True)
    distributed.close(world)


if __name__ == "__main__":
    main(sys.argv[1])
