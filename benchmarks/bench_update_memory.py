"""Peak memory of one GRPO update with all its logprob passes: the reference's and pi_old's
(recomputed by the trainer) without gradients, then the policy's forward and backward.

    python benchmarks/bench_update_memory.py                  # SmolLM2-135M-Instruct, 8 x 512 tokens
    python benchmarks/bench_update_memory.py --seqs 8 --seq-len 1024 --reps 2

Model, batch and memory readings are benchmarks/bench_memory.py's (8 fake rollouts of 512
tokens: a 64-token prompt, policy runs of 96 tokens and masked retrieved runs of 64), fp32, one
micro-batch of 4,096 tokens (train.micro_batch_tokens 8192), gradient checkpointing (as the
paper configs; --no-grad-ckpt: without), train.kl_coef 0.001 with a frozen
reference (the policy's weights plus N(0, 1e-3) noise, so that KL and loss are not 0),
train.recompute_old_logprobs, AdamW. Each repetition runs in a fresh child process
with MALLOC_MMAP_THRESHOLD_=65536, so freed tensors leave the RSS and the peak follows the live
tensors. Printed per repetition: RSS after loading policy and reference, the peak during
grpo_step (VmHWM reset after loading) and its rise above it, and the step's loss, KL, entropy
and gradient norm to 9 digits.

To compare two versions of the trainer, run the same command in a worktree of the other
commit (`git worktree add /tmp/before REV`, copy this file into its benchmarks/): the losses
must agree, the peaks are the difference. Results: results/memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_memory import THREADS, current_rss, ensure_model, fake_records, load_average  # noqa: E402

GB = 1e9


def reset_peak() -> None:
    """Linux: the peak RSS (VmHWM) starts again from the RSS now (proc(5), clear_refs 5), so the
    peak read after the step is the step's, not the loading's."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_since_reset() -> int:
    """VmHWM, bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def child(n_seqs: int, seq_len: int, grad_ckpt: bool) -> dict:
    """In the fresh process: load policy and reference, one grpo_step, the readings."""
    from train import make_optimizer
    from trainer.config import Config
    from trainer.engine import load_policy
    from trainer.grpo import grpo_step, memory_savers

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    cfg = Config()
    cfg.train.kl_coef, cfg.train.recompute_old_logprobs, cfg.train.grad_checkpointing = 0.001, True, grad_ckpt
    model = memory_savers(load_policy(ensure_model()), cfg)
    ref = load_policy(ensure_model()).eval().requires_grad_(False)
    pad_id = model.config.pad_token_id or 0
    records = fake_records(n_seqs, seq_len, model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # page the weights in; the reference moved a little, so KL and loss are not 0
        for p in model.parameters():
            p.add_(0.0)
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
    optimizer = make_optimizer(model.parameters(), cfg.train.lr, cfg.train.weight_decay, cfg.train.optimizer)
    loaded = current_rss()
    reset_peak()
    t0 = time.perf_counter()
    stats = grpo_step(model, ref, records, optimizer, cfg, pad_id, step=0)
    return {"rss_loaded": loaded, "peak": peak_since_reset(), "seconds": time.perf_counter() - t0,
            **{k: stats[k] for k in ("loss", "kl", "entropy", "grad_norm")}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=8, help="rollouts in the batch")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per rollout")
    parser.add_argument("--reps", type=int, default=1, help="fresh processes, one update each")
    parser.add_argument("--no-grad-ckpt", action="store_true",
                        help="without gradient checkpointing (the paper configs turn it on)")  # fmt: skip
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.seqs, args.seq_len, not args.no_grad_ckpt)))
        return
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1]).stdout.strip()  # fmt: skip
    ckpt = "no gradient checkpointing" if args.no_grad_ckpt else "gradient checkpointing"
    print(f"commit {head} | {args.seqs} x {args.seq_len} tokens | {ckpt} | load {load_average()}")
    print(f"{'rep':>3} {'loaded GB':>9} {'peak GB':>8} {'peak-loaded':>11} {'s':>6} {'loss':>13} {'kl':>13} "
          f"{'entropy':>12} {'grad_norm':>12}")  # fmt: skip
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536"}
    for rep in range(args.reps):
        cmd = [sys.executable, __file__, "--child", "--seqs", str(args.seqs), "--seq-len", str(args.seq_len)]
        cmd += ["--no-grad-ckpt"] if args.no_grad_ckpt else []
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            sys.exit(f"child failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        r = json.loads(done.stdout.strip().splitlines()[-1])
        rise = (r["peak"] - r["rss_loaded"]) / GB
        print(f"{rep:>3} {r['rss_loaded'] / GB:>9.2f} {r['peak'] / GB:>8.2f} {rise:>11.2f} "
              f"{r['seconds']:>6.1f} {r['loss']:>13.9f} {r['kl']:>13.9f} {r['entropy']:>12.8f} "
              f"{r['grad_norm']:>12.8f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
