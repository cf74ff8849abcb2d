"""The box's configurations rehearsed on CPU: each paper config with its own train.* and rollout.*
flags, only sizes shrunk, in 2 processes (`accelerate launch --multi_gpu`, gloo) for 2 steps,
then a resume for a third.

    python benchmarks/dress_rehearsal.py                                   # every paper config
    python benchmarks/dress_rehearsal.py --configs search_r1_ppo_qwen2.5-7b-base bapo

What is overridden (sizes only), printed for each config:
- model.path: the micro tiny world's policy (Qwen2ForCausalLM, the paper configs' architecture
  family, 0.4M parameters), with a ChatML template added for the configs that use one;
  model.dtype float32 (vLLM CPU on a CPU without native bf16 computes bf16 in fp32 anyway);
- data.*: the micro world's corpus and questions; retriever: BM25 in process (no e5 model here);
- rollout lengths and vLLM's share of host RAM; train.questions_per_step, group_size (at most 4),
  micro_batch_tokens, steps, eval and save cadence, warm-up;
- rollout.enforce_eager: vLLM without torch.compile (CPU Inductor is not the box's CUDA graphs, and
  compiling took ~10 s per rank per launch).
Skipped flags, named with the reason: rollout.sleep_mode (vLLM offers it on CUDA/ROCm only),
NCCL (CPU processes use gloo). Every other train.* and rollout.* flag of the config runs as
written: bf16 mixed precision, cpu_offload, gradient checkpointing, 8-bit AdamW, the reference,
PPO's critic, epochs and mini-batches, the reward and its parameters.

A config passes when both launches exit 0, the first writes steps 1-2 and a checkpoint, and the
resume continues to step 3. Each takes ~2-4 min on 2 cores (the micro world is built once,
~1.5 min, in bench_cache/dress/).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import free_port  # noqa: E402  (tests/conftest.py: a free TCP port for the rendezvous)

from tiny.world import world_dir  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.precision import resolve as resolve_precision  # noqa: E402

PAPER_CONFIGS = [p.stem for p in sorted((ROOT / "configs").glob("search_r1_*.yaml"))] + [
    "deliberative_searcher", "bapo", "bapo_rft", "webfilter", "veritas"]  # fmt: skip
WORK = ROOT / "benchmarks" / "bench_cache" / "dress"
MICRO_WORLD = {
    "world": {"n_people": 300, "n_cities": 30, "n_countries": 6, "n_val": 20, "n_test": 20,
              "cache_dir": str(WORK / "cache")},
    "model": {"hidden_size": 128, "num_heads": 2, "num_layers": 2, "intermediate_size": 256, "vocab_size": 700},
    "sft": {"steps": 250, "batch_tokens": 2048, "lr": 3.0e-3, "warmup_steps": 20},
}  # fmt: skip
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
SKIPPED = {"rollout.sleep_mode": "vLLM's sleep mode is CUDA/ROCm only (the CPU engine refuses it)",
           "NCCL": "CPU processes use gloo; trainer/distributed.init opens cpu:gloo,cuda:nccl on GPUs"}  # fmt: skip


def micro_world() -> tuple[Path, Path]:
    """(world dir, policy dir with a ChatML template): built once by tiny.sft."""
    WORK.mkdir(parents=True, exist_ok=True)
    config = WORK / "micro.yaml"
    config.write_text(yaml.safe_dump(MICRO_WORLD))
    subprocess.run([sys.executable, "-m", "tiny.sft", "--config", str(config)], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    world = world_dir(load_config(config))
    return world, chat_policy(world, WORK)


def chat_policy(world: Path, work: Path) -> Path:
    """A copy of the world's policy with a ChatML template (for the configs that use one)."""
    chat = work / "policy-chat"
    if not (chat / "DONE").is_file():
        shutil.rmtree(chat, ignore_errors=True)
        shutil.copytree(world / "policy", chat)
        tok = json.loads((chat / "tokenizer_config.json").read_text())
        (chat / "tokenizer_config.json").write_text(json.dumps(tok | {"chat_template": CHATML}))
        (chat / "DONE").write_text("ok\n")
    return chat


def size_overrides(name: str, world: Path, policy: Path) -> list[str]:
    """The sizes this rehearsal shrinks; every other key stays the config's."""
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    resolve_precision(cfg)  # this machine's bf16 / dtype for the `auto` keys
    sets = [f"model.path={policy}", "model.dtype=float32",
            f"data.corpus={world / 'corpus.jsonl'}", f"data.train={world / 'train.jsonl'}",
            f"data.val={world / 'val.jsonl'}", f"data.test={world / 'test.jsonl'}",
            "retriever.method=bm25", "retriever.model=", "retriever.encoder_family=", "retriever.index=",
            "retriever.url=",
            "rollout.max_tokens_per_turn=24", "rollout.max_obs_tokens=64", "rollout.max_model_len=512",
            "rollout.gpu_memory_utilization=0.05", "rollout.sleep_mode=false",
            "rollout.enforce_eager=true",  # CPU Inductor is not the box's CUDA graphs; ~10 s of compiling per rank
            "train.questions_per_step=4", f"train.group_size={min(cfg.train.group_size, 4)}",
            "train.micro_batch_tokens=256", "train.steps=2", "train.save_every=1", "train.eval_every=2",
            "train.warmup_frac=0", "eval.max_questions=8", "hardware.gpus=2"]  # fmt: skip
    if cfg.train.judge and cfg.train.judge != "rule":
        sets.append("train.judge=rule")  # no judge model here: the rule judge behind the same interface
    return sets


def launch(args: list[str]) -> tuple[int, str, float]:
    """train.py `args` under a 2-process `accelerate launch` (CPU processes, gloo): (exit, log tail, s)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), "train.py", *args]  # fmt: skip
    t0 = time.time()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})  # fmt: skip
    said = [x for x in done.stderr.splitlines() if "error:" in x]  # a rank's one line, above the launcher's traceback
    return done.returncode, done.stdout[-3000:] + "\n".join(said[:5] + [done.stderr[-3000:]]), time.time() - t0


def rehearse(name: str, world: Path, chat: Path, work: Path = WORK) -> dict:
    """Config `name`: 2 steps in 2 processes, then a resume for a third; runs go under work/runs."""
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    resolve_precision(cfg)  # this machine's bf16 / dtype for the `auto` keys
    policy = chat if cfg.rollout.chat_template else world / "policy"
    sets = size_overrides(name, world, policy)
    flags = {k: getattr(cfg.train, k) for k in ("algo", "bf16", "cpu_offload", "grad_checkpointing", "optimizer",
                                                 "kl_coef", "epochs", "mini_batches", "reward")}  # fmt: skip
    print(f"\n{name}: its flags {flags}, rollout.tensor_parallel_size {cfg.rollout.tensor_parallel_size}")
    print(f"  sizes overridden: {' '.join(sets)}")
    print(f"  skipped: {'; '.join(f'{k} ({v})' for k, v in SKIPPED.items())}")
    run_dir = work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    rc, log, seconds = launch(["--config", f"configs/{name}.yaml",
                               *sum((["--set", s] for s in [*sets, f"train.run_dir={run_dir}"]), [])])  # fmt: skip
    result = {"config": name, "first": rc, "seconds": round(seconds)}
    if rc == 0:  # the run's own config.yaml, its newest checkpoint (step 2), one step more
        run = next(run_dir.iterdir())
        rc2, log, seconds2 = launch(["--resume", str(run), "--set", "train.steps=3"])
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] if rc2 == 0 else []
        steps = [r["step"] for r in rows if "time" in r]
        result |= {"resume": rc2, "steps": steps, "seconds": round(seconds + seconds2)}
    if result.get("resume") != 0:
        print("  " + log.replace("\n", "\n  ")[-2500:])
    print(f"  -> {result}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=PAPER_CONFIGS, choices=PAPER_CONFIGS, metavar="NAME",
                        help=f"paper configs to rehearse (default: all: {' '.join(PAPER_CONFIGS)})")  # fmt: skip
    args = parser.parse_args()
    world, chat = micro_world()
    results = [rehearse(name, world, chat) for name in args.configs]
    print(f"\n{'config':<40} {'first':>5} {'resume':>6} {'steps':>10} {'s':>5}")
    for r in results:
        print(f"{r['config']:<40} {r['first']:>5} {str(r.get('resume', '-')):>6} {str(r.get('steps', '-')):>10} "
              f"{r['seconds']:>5}")  # fmt: skip
    if any(r.get("resume") != 0 for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
