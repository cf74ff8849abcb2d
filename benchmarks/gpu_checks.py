"""What only a GPU shows of the box's training flags: FSDP2 with bf16 mixed precision and
`cpu_offload` on CUDA, under each process-group backend, in one process on one GPU.

    python benchmarks/gpu_checks.py              # both backends, one child process each (~1 min)
    python benchmarks/gpu_checks.py --cpu        # the same checks on a CPU over gloo (a smoke run)
    python benchmarks/gpu_checks.py --box        # issue 53's checks for the next lent GPU (~5 min on an H200)
    python benchmarks/gpu_checks.py --box --cpu  # the same at toy sizes on a CPU (a smoke run)

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

--box (docs/box.md, "Memory on the box"), each in a child process of its own, on random weights of
the size named (no download), one process with FSDP2 over a world of 1:
1. sync: one AdamW step on the policy, then the sync the trainer runs (distributed.full_weights in
   bf16 into engine.load_weights): the engine's logprobs of a fixed sequence against the
   trainer's, before (large: the old weights) and after (bf16 kernels apart). vLLM when it is
   installed for this GPU, else the transformers engine (--engine to choose).
2. update: the peak GPU memory (torch.cuda.max_memory_allocated) of one update at Qwen2.5-3B's
   sizes (fp32 master weights, bf16 compute, checkpointing, the entropy's gradient, 8192 tokens,
   AdamW) beside trainer/plan.py's prediction for the same settings on one GPU, less its 2 GB
   allowance (a context and fragmentation, which max_memory_allocated does not see).
3. offload: the seconds and the peak of one update with train.cpu_offload micro_batch (FSDP2's
   CPUOffloadPolicy: a host round trip each micro-batch), phase (the update on the GPU, plus the
   seconds of the state's two moves a step: distributed.offload_to_host, load_to_device) and
   false, at Qwen2.5-0.5B's sizes.
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
from trainer.batching import autocast, logprobs_and_entropy, token_logprobs  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.engine import load_policy, make_engine  # noqa: E402
from trainer.grpo import memory_savers  # noqa: E402
from trainer.plan import OVERHEAD_GB, QWEN25, memory_plan  # noqa: E402
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


# --box: issue 53's checks ------------------------------------------------------------------

SEQUENCE = [5, 17, 42, 99, 7, 250, 3, 77, 18, 64, 130, 9, 300, 11, 45, 2]
BOX_CHECKS = ["sync", "update", "offload"]
TOY = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, tied=True)  # --cpu sizes


def qwen_dir(directory: Path, arch: dict, save: bool) -> Path:
    """A Qwen2 policy directory with `arch`'s sizes (plan.QWEN25's keys): its config.json (what
    --plan reads), and random weights when `save` (the sync needs a checkpoint to start from)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=arch["hidden"], num_hidden_layers=arch["layers"],
                         num_attention_heads=arch["heads"], num_key_value_heads=arch["kv_heads"],
                         intermediate_size=arch["intermediate"], vocab_size=arch["vocab"],
                         tie_word_embeddings=arch["tied"], pad_token_id=0)  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    if save:  # with a word-level tokenizer "t0 t1 ...": the engines load one, and score ids only
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(directory)
        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(arch["vocab"])}, unk_token="t1"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", pad_token="t0").save_pretrained(directory)
    return directory


def box_cfg(model_dir: Path, extra: list[str]):
    cfg = load_config(None, [f"model.path={model_dir}", "model.dtype=float32", "train.fsdp=true", "train.bf16=true",
                             "train.grad_checkpointing=true", "train.entropy_coef=0.001", "train.kl_coef=0",
                             "hardware.gpus=1", *extra])  # fmt: skip
    resolve_precision(cfg)
    return cfg


def one_update(model, optimizer, tokens: int, vocab: int, bf16: bool) -> None:
    """One micro-batch of `tokens` and an AdamW step: the forward, the log-probs and the entropy
    with its gradient (batching.logprobs_and_entropy, as grpo's update), the backward."""
    device = distributed.compute_device(model)
    ids = torch.randint(1, vocab, (1, tokens), device=device)
    with autocast(bf16):
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1]
    lp, ent = logprobs_and_entropy(logits, ids[:, 1:], entropy_grad=True)
    del logits
    (-(lp.mean()) - 0.001 * ent.mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def sync_check(tmp: Path, gpu: bool, engine_kind: str) -> str:
    arch = QWEN25["0.5"] if gpu else TOY
    model_dir = qwen_dir(tmp / "policy", arch, save=True)
    cfg = box_cfg(model_dir, [])
    engine = make_engine(engine_kind, model_dir, cfg.rollout, "bfloat16" if gpu else "float32")
    model = distributed.shard(load_policy(model_dir), cfg)
    optimizer = distributed.make_optimizer(model.parameters(), 1e-3, 0.0)
    one_update(model, optimizer, 64, arch["vocab"], cfg.train.bf16)
    ids = torch.tensor([[t % arch["vocab"] for t in SEQUENCE]], device=distributed.compute_device(model))
    with torch.no_grad(), autocast(cfg.train.bf16):
        trainer = token_logprobs(model, ids, torch.ones_like(ids))[0].float().tolist()
    before = max(abs(a - b) for a, b in zip(engine.score(ids[0].tolist()), trainer))
    engine.load_weights(distributed.full_weights(model, 0, every_rank=True,
                                                 dtype=torch.bfloat16 if gpu else None))  # fmt: skip
    after = max(abs(a - b) for a, b in zip(engine.score(ids[0].tolist()), trainer))
    return f"{engine_kind} engine: max |logp engine - logp trainer| before the sync {before:.3g}, after {after:.3g}"


def update_check(tmp: Path, gpu: bool, size: str, offload: bool | str) -> tuple[float, float, float, float]:
    """(seconds of the second update, peak GB, the plan's GB less its allowance, seconds of the
    state's move to the host and back before it under offload phase, else 0)."""
    import time

    arch = QWEN25[size] if gpu else TOY
    tokens = 8192 if gpu else 256
    model_dir = qwen_dir(tmp / f"plan-{size}", arch, save=False)
    cfg = box_cfg(model_dir, [f"train.micro_batch_tokens={tokens}", f"train.cpu_offload={str(offload).lower()}",
                              "hardware.gpus=1"])  # fmt: skip
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("cuda" if gpu else "cpu"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    model = distributed.shard(memory_savers(model, cfg), cfg)
    optimizer = distributed.make_optimizer(model.parameters(), 1e-6, 0.0)
    one_update(model, optimizer, tokens, arch["vocab"], cfg.train.bf16)  # AdamW's state exists from here
    moves = 0.0
    if offload == "phase":  # what train.py does around each rollout
        t = time.perf_counter()
        distributed.offload_to_host([model], [optimizer])
        distributed.load_to_device([model], [optimizer], distributed.compute_device(model))
        if gpu:
            torch.cuda.synchronize()
        moves = time.perf_counter() - t
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    one_update(model, optimizer, tokens, arch["vocab"], cfg.train.bf16)
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() / 1e9 if gpu else float("nan")
    # one process: the plan counts no FSDP offload (it needs 2+ GPUs), so its figure is offload's "none"
    return seconds, peak, memory_plan(cfg)["train_total"] - OVERHEAD_GB, moves


def box_child(check: str, port: int, engine_kind: str) -> None:
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0) if gpu else None)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if check == "sync":
                result = sync_check(Path(tmp), gpu, engine_kind)
            elif check == "update":
                seconds, peak, plan, _ = update_check(Path(tmp), gpu, "3", offload=False)
                sizes = "Qwen2.5-3B sizes, 8192 tokens" if gpu else "toy sizes (--cpu), 256 tokens"
                result = f"{sizes}: peak {peak:.2f} GB allocated, plan {plan:.2f} GB"
                result += f" ({seconds:.1f} s)"
            else:
                modes = (False, "phase", "micro_batch")
                runs = [(off, *update_check(Path(tmp), gpu, "0.5", offload=off)) for off in modes]
                result = ", ".join(f"cpu_offload {str(o).lower()}: {t:.2f} s" + (f" + {m:.2f} s moving" if m else "")
                                   + f", peak {p:.2f} GB" for o, t, p, _, m in runs)  # fmt: skip
            result = "ok: " + result
        except Exception as e:  # the finding: what this machine does with the box's path
            result = f"error: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    print(f"box {check:<8} {result}", flush=True)
    dist.destroy_process_group()


def default_engine() -> str:
    """vLLM when its build here runs on this GPU, else the transformers engine."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "hf"
    return "vllm" if torch.cuda.is_available() and not current_platform.is_cpu() else "hf"


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
    parser.add_argument("--box", action="store_true", help="issue 53's checks: sync round trip, update peak, offload")
    parser.add_argument("--check", choices=BOX_CHECKS, help="run one --box check in this process (the child)")
    parser.add_argument("--engine", choices=["vllm", "hf"], help="the sync engine (default: vllm where it runs)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        sys.exit("gpu_checks: no CUDA GPU here (torch.cuda.is_available() is False); --cpu runs a smoke run")
    if args.backend:
        return child(args.backend, args.port)
    if args.check:
        return box_child(args.check, args.port, args.engine or default_engine())
    if args.box:
        for check in BOX_CHECKS:
            extra = ["--engine", args.engine] if args.engine else []
            proc = subprocess.run([sys.executable, __file__, "--check", check, "--port", str(free_port()), "--cpu",
                                   *extra], capture_output=True, text=True, timeout=900)  # fmt: skip
            print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("box ")), flush=True)
            if proc.returncode != 0:
                print(f"box {check:<8} exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    gpu = torch.cuda.is_available()
    print(f"flags: {' '.join(FLAGS)} | {torch.cuda.get_device_name(0) if gpu else 'CPU'}, torch {torch.__version__}",
          flush=True)  # fmt: skip
    for backend in BACKENDS if gpu else ["gloo"]:
        proc = subprocess.run([sys.executable, __file__, "--backend", backend, "--port", str(free_port()), "--cpu"],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        print(proc.stdout, end="", flush=True)
        if proc.returncode != 0:
            print(f"{backend:<20} exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
