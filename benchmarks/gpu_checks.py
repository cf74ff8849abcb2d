"""What only a GPU shows of the box's training flags: FSDP2 with bf16 mixed precision and
`cpu_offload` on CUDA, under each process-group backend, in one process on one GPU.

    python benchmarks/gpu_checks.py              # both backends, one child process each (~1 min)
    python benchmarks/gpu_checks.py --cpu        # the same checks on a CPU over gloo (a smoke run)

The paper configs (configs/search_r1_*.yaml) train with `train.bf16`, `train.cpu_offload` and
`train.grad_checkpointing`. For each backend, "nccl" (what trainer/distributed.init opened
before) and "cpu:gloo,cuda:nccl" (what it opens now, as verl does), a child opens a world-1
group on GPU 0 and, on a micro Qwen2 made here, runs:
1. policy: `distributed.shard`, one backward of the token logprobs, `distributed.clip_grad_norm`
   (the all-reduce of the offloaded gradients' norms: CPU tensors), one AdamW step;
2. critic: `distributed.shard_critic`, `ppo.critic_values` and one `ppo.critic_step` (the value
   head's float32 unit and the inputs' device under offload).
Each line says ok with what it measured, or the error's first line. One process cannot show what
needs several (a reduce-scatter across GPUs); CI runs those paths on CPU processes over gloo.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from trainer import distributed  # noqa: E402
from trainer.batching import token_logprobs  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.engine import load_policy  # noqa: E402
from trainer.grpo import memory_savers  # noqa: E402
from trainer.ppo import critic_optimizer, critic_step, critic_values, load_critic  # noqa: E402
from trainer.precision import resolve as resolve_precision  # noqa: E402

BACKENDS = ["nccl", "cpu:gloo,cuda:nccl"]
FLAGS = ["train.fsdp=true", "train.bf16=true", "train.cpu_offload=true", "train.grad_checkpointing=true",
         "train.algo=ppo", "train.micro_batch_tokens=64"]  # fmt: skip
VOCAB = 256


def micro_model(directory: Path) -> Path:
    """A 2-layer Qwen2 (the paper configs' family), random weights, saved as a policy directory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=VOCAB, tie_word_embeddings=True, pad_token_id=0)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def policy_check(cfg, model_dir: Path) -> str:
    model = distributed.shard(memory_savers(load_policy(model_dir), cfg), cfg)
    optimizer = distributed.make_optimizer(model.parameters(), 1e-4, 0.0)
    ids = torch.randint(1, VOCAB, (2, 32), device=distributed.compute_device(model))
    logp = token_logprobs(model, ids, torch.ones_like(ids))
    (-logp.mean()).backward()
    norm = distributed.clip_grad_norm(model, 1.0, exact=False, world=1)
    optimizer.step()
    grad = next(model.parameters()).grad
    return f"logprob dtype {logp.dtype}, grad norm {norm:.3g}, gradients on {grad.device}"


def critic_check(cfg, model_dir: Path) -> str:
    critic = distributed.shard_critic(load_critic(model_dir), cfg)
    optimizer = critic_optimizer(critic, 1e-5)
    gen = torch.Generator().manual_seed(0)
    records = [{"prompt_ids": torch.randint(1, VOCAB, (8,), generator=gen).tolist(),
                "response_ids": torch.randint(1, VOCAB, (n,), generator=gen).tolist(), "loss_mask": [1] * n}
               for n in (12, 20, 30)]  # fmt: skip
    values = critic_values(critic, records, 64, 0)
    stats = critic_step(critic, optimizer, records, values, [v + 1.0 for v in values], 0.5, 64, 0, 1.0)
    return f"values {values[0].dtype} on {values[0].device}, value loss {stats['value_loss']:.3g}"


def child(backend: str, port: int) -> None:
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0) if gpu else None)  # fmt: skip
    cfg = load_config(None, FLAGS)
    resolve_precision(cfg)  # this machine's bf16 / dtype for the `auto` keys
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = micro_model(Path(tmp) / "policy")
        for name, check in (("policy", policy_check), ("critic", critic_check)):
            try:
                result = "ok: " + check(cfg, model_dir)
            except Exception as e:  # the finding: what the backend does with these flags
                result = f"error: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
            print(f"{backend:<20} {name:<7} {result}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=BACKENDS + ["gloo"], help="run one backend in this process (the child)")
    parser.add_argument("--port", type=int, default=0, help="the child's rendezvous port")
    parser.add_argument("--cpu", action="store_true", help="allow a run without CUDA: gloo on the CPU (a smoke run)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        sys.exit("gpu_checks: no CUDA GPU here (torch.cuda.is_available() is False); --cpu runs a smoke run")
    if args.backend:
        return child(args.backend, args.port)
    gpu = torch.cuda.is_available()
    print(f"flags: {' '.join(FLAGS)} | {torch.cuda.get_device_name(0) if gpu else 'CPU'}, torch {torch.__version__}",
          flush=True)  # fmt: skip
    for backend in BACKENDS if gpu else ["gloo"]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, __file__, "--backend", backend, "--port", str(port), "--cpu"],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        print(proc.stdout, end="", flush=True)
        if proc.returncode != 0:
            print(f"{backend:<20} exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}", flush=True)


if __name__ == "__main__":
    main()
