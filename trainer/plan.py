"""Per-GPU memory plan of a training run, computed from the architecture alone (no model loaded).

    python train.py --plan --config configs/search_r1_ppo_qwen2.5-7b-base.yaml
    python train.py --plan --config configs/search_r1_grpo_qwen2.5-3b-base.yaml --set train.micro_batch_tokens=16384
    python train.py --config X --plan        # the same table (train.py calls print_plan)

Exit status: 0 it fits, 1 it does not, 2 the config or the model cannot be read.

The architecture comes from `<model.path>/config.json` if there is one, else from a built-in
table of the Qwen2.5 family matched on the directory name (`models/Qwen2.5-7B-Instruct`), else
(empty path) from `config.model` (the tiny world's policy). GB = 1e9 bytes. Per GPU, with
P parameters, L layers, hidden h, q_dim = heads*head_dim, kv_dim = kv_heads*head_dim, MLP
width i, vocab V, N = hardware.gpus, S = N under train.fsdp else 1, T = train.micro_batch_tokens:

  P          = V*h*(1 if tied else 2) + L*(2*h*q_dim + 2*h*kv_dim + q_dim + 2*kv_dim + 3*h*i + 2*h) + h
  weights    = P * b / S            b = 2 for model.dtype bfloat16/float16, else 4
  gradients  = P * b / S            (same dtype as the parameters)
  optimizer  = P * o / S            AdamW: o = 4 + 4 (m, v fp32) + 4 (fp32 master copy if b = 2)
                                    adamw8bit: o = 1 + 1 (m, v) + 2*4/256 (block-wise absmax) + master
             weights + gradients + AdamW = 16 B per parameter whether b is 2 or 4 (fp32 weights
             need no master copy). train.cpu_offload micro_batch: these three live in host RAM
             (reported); phase: on the GPU during the update, in host RAM during the rollout
  reference  = P * b / S            only when train.kl_coef > 0; offloaded with the rest
  critic     = P - (V*h if untied else 0) + h + 1 parameters (the backbone without lm_head, a
               value head), weights + gradients + AdamW like the policy (train.algo ppo)
  gathered   = (2*root + 3*layer) * a    under FSDP (trainer/distributed.py: FSDP2, one unit per decoder
               layer plus the root; gathered in the compute dtype, a below): the root unit
               (embeddings, untied lm_head) stays unsharded, with its gradients, through forward
               and backward; one layer computes, one is prefetched, one holds full gradients
               before reduce-scatter
  activations (Korthikanti et al. 2022, §4.1, counted for Qwen2's GQA attention and SwiGLU MLP;
               flash/SDPA attention, so no 5*a*s^2 term; no dropout), with a = 2 B under
               train.bf16 (else b) per element, per token and layer:
                 per_layer = a * (4*h + 2*q_dim + 2*kv_dim + 4*i)
                 (two residual inputs and two RMSNorm outputs; q, k, v; attention output;
                 gate, up, silu(gate) and their product). For GPT (q_dim = kv_dim = h, i = 4h,
                 GeLU so two MLP tensors, not four) this is Korthikanti's 34*s*b*h less dropout.
               no checkpointing:  T * L * per_layer
               checkpointing:     T * L * a * h  (each layer's input)  +  T * per_layer  (the
                                  one layer being recomputed in the backward pass)
  exact sums = P * 8                train.exact_grad_sum: float64 gradient sums, unsharded on every
                                    GPU through the step (the critic's too, in its working set)
  logits     = T*V*a + T*V*a + 2*C*V*4   the logits, their gradient, and two float32 [C, V] slices of
               batching._LogprobsEntropy (C = 256 positions; log-probs and entropy with its
               gradient, chunked: tests/test_box.py measures this peak at a small vocabulary)
  overhead   = 2 GB                 our allowance: CUDA context, NCCL buffers, fragmentation
  retriever encoder = E * 2         in process (no retriever.url) with method dense or hybrid: each
                                    process's query encoder on its GPU in fp16 (search/index.py
                                    load_encoder), E its parameters from its config.json (BERT:
                                    (V + positions + types + 2) * h + L * (4 h^2 + 2 h i + 9 h + i)
                                    + h^2 + h); weights only
  retriever served  retriever.url on this box (127.0.0.1, localhost): index / G (G =
                    hardware.retriever_gpus, 0: all N; faiss-gpu's Flat in fp32) + 1.5 GiB faiss
                    scratch + 0.5 GB context on each, + E * 2 (the encoder) on GPU 0, the row's
                    GPU; resident through training and rollouts. Another host's URL: 0 here
  retriever index   per host, not per GPU: its files are mmap'd, file-backed (faiss IO_FLAG_MMAP_IFC,
                    bm25s mmap), so the page cache holds one copy whatever the number of processes:
                    the size of the built index's files, else for a Flat index not yet built
                    n_docs * dim * 4 B (n_docs estimated from the corpus's first 8 MB of lines)

  training peak = overhead + resident state (the rows above the working sets)
                  + max(policy working set, critic working set)   (the critic steps after
                  the policy, so their gathered units and activations are never live together)
  fits when the peak <= (1 - hardware.vllm_memory_fraction) * hardware.gpu_memory_gb, or with
  rollout.sleep_mode (level 2: vLLM frees weights and KV cache) <= gpu_memory_gb - 2 GB (what vLLM
  asleep keeps: our allowance); then also the rollout peak, vllm_memory_fraction * gpu_memory_gb
  + the resident rows (under cpu_offload phase or micro_batch none but the retriever and the 2 GB),
  <= gpu_memory_gb. cpu_offload phase: the training peak counts the state on the GPU (as false),
  the rollout peak does not (it is on the host then); its host rows are what the rollout holds there.
  Host RAM of vLLM asleep at level 2: 0 (level 1 kept P * b / R there)

  vLLM (colocated: one engine per GPU, or per group of R = rollout.tensor_parallel_size GPUs,
  each rolling out its share of the questions): weights = P * b / R on every GPU;
  KV cache = vllm_memory_fraction * gpu_memory_gb - weights (vLLM's own activations and CUDA
  graphs, ~1-2 GB, come out of this too); KV bytes per token per GPU = 2 * L * kv_heads *
  head_dim * b / R; an engine's share of the rollout batch is up to questions_per_step *
  group_size * rollout.max_model_len / (N / R) tokens (every trajectory at full length); more
  than fit means vLLM runs it in waves.

Worked example: configs/search_r1_ppo_qwen2.5-7b-base.yaml, Qwen2.5-7B (h 3584, L 28, 28 heads,
4 kv heads, head_dim 128, i 18944, V 152064, untied) on 8 x 80 GB, bf16, FSDP, CPU offload per
phase, checkpointing, AdamW, T = 8192, vLLM share 0.6:
  P = 2*152064*3584 + 28*233,057,792 + 3584 = 7,615,616,512
  state per GPU (host RAM in the rollout, the GPU in the update): weights, gradients
             7.616e9*2/8 = 1.90 GB each, optimizer 7.616e9*12/8 = 11.42, reference 1.90, critic
             7.071e9*16/8 = 14.14: 31.3 GB (250 GB of host RAM for the box, 314.8 with the index)
  gathered   (2*1.090e9 + 3*2.331e8) * 2 = 5.76 GB
  activations 8192*28*2*3584 + 8192*196,608 = 1.64 + 1.61 = 3.25 GB (45.1 GB without checkpointing)
  logits     8192*152064*2*2 + 2*256*152064*4 = 4.98 + 0.31 = 5.29 GB
  retriever  served on this box: 21,015,324*768*4/8 + 1.61 + 0.5 + 1.095e8*2 = 8.07 + 2.11 + 0.22 = 10.40 GB
  peak       2 + 10.40 + 31.28 + (5.76 + 3.25 + 5.29) = 57.98 GB of 80 - 2 = 78 (sleep mode): fits;
             rollout 0.6*80 + 10.40 + 2 = 60.40 of 80 (the state on the host): fits; with no
             offload 91.68 does not, with micro_batch the update is 26.71
  vLLM       weights 15.23 GB, KV cache 48 - 15.23 = 32.77 GB at 57,344 B per token = 571,441
             tokens; PPO's batch needs 512*1*4096/8 = 262,144 per GPU (GRPO's, 5 per question,
             1,310,720: ~2.3 waves if every trajectory ran to 4096 tokens)
"""

from __future__ import annotations

import argparse
import copy
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainer import precision
from trainer.batching import ENTROPY_CHUNK_TOKENS
from trainer.config import Config, ConfigError, ModelConfig, load_config
from trainer.overlap import overlap_on
from trainer.plan_retriever import read_config_json, retriever_plan, sci

GB = 1e9
OVERHEAD_GB = 2.0  # our allowance for the CUDA context, NCCL buffers and allocator fragmentation
# What vLLM keeps on a GPU asleep at level 2 (weights and KV cache freed): its CUDA graphs' pool and
# its own context. Our allowance, not measured: no GPU with vLLM has been lent to this project.
VLLM_ASLEEP_GB = 2.0
HALF = ("bfloat16", "float16")  # 2-byte model.dtype values

# Qwen2.5 architectures, from the official config.json files (huggingface.co/Qwen/Qwen2.5-<size>);
# base and Instruct share them. Parameter counts by the formula above: 0.494e9, 1.544e9,
# 3.086e9, 7.616e9, 14.770e9 (the model cards say 0.49B, 1.54B, 3.09B, 7.61B, 14.7B).
QWEN25 = {
    "0.5": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936, tied=True),
    "1.5": dict(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936, tied=True),
    "3": dict(hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008, vocab=151936, tied=True),
    "7": dict(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab=152064, tied=False),
    "14": dict(hidden=5120, layers=48, heads=40, kv_heads=8, intermediate=13824, vocab=152064, tied=False),
}
QWEN25_NAME = re.compile(r"^qwen2\.5-(\d+(?:\.\d+)?)b(?:-instruct)?$", re.I)


@dataclass
class Arch:
    """What the memory plan needs to know about a decoder-only (Qwen2-style) model."""

    name: str
    source: str  # where the numbers came from: a config.json path, "built-in table", "config.model"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    head_dim: int = 0  # 0: hidden // heads
    qkv_bias: bool = True  # Qwen2 has biases on q, k, v (not on o)

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden // self.heads


# ---------------------------------------------------------------------------------------------
# Architecture and parameter counts.


def load_arch(model: ModelConfig) -> Arch:
    """The architecture of `model.path`: its config.json, else the Qwen2.5 table, else an error."""
    if not model.path:  # the tiny world's policy, built by tiny/sft.py from these numbers
        return Arch("tiny world policy", "config.model", model.hidden_size, model.num_layers, model.num_heads,
                    model.num_heads, model.intermediate_size, model.vocab_size, tied=True)  # fmt: skip
    path = Path(model.path)
    cfg_file = path / "config.json"
    if cfg_file.is_file():
        c = read_config_json(cfg_file, "the model")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                    "num_key_value_heads", "head_dim"):  # fmt: skip
            value = c.get(key)
            derived = key in ("num_key_value_heads", "head_dim") and not value  # 0 / null: from the others
            if key in c and not derived and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                # a 0 divides by zero (head_dim = hidden // heads), a string fails deep in the plan
                raise ConfigError(f"{cfg_file}: {key!r} must be a positive integer; got {value!r}")
        try:
            return Arch(
                name=path.name,
                source=str(cfg_file),
                hidden=c["hidden_size"],
                layers=c["num_hidden_layers"],
                heads=c["num_attention_heads"],
                kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
                intermediate=c["intermediate_size"],
                vocab=c["vocab_size"],
                tied=bool(c.get("tie_word_embeddings", False)),  # transformers' default
                head_dim=c.get("head_dim") or 0,
                qkv_bias=c.get("model_type", "qwen2") == "qwen2" or bool(c.get("attention_bias", False)),
            )
        except KeyError as e:
            raise ConfigError(f"{cfg_file} has no {e.args[0]!r}; cannot size the model") from None
    m = QWEN25_NAME.match(path.name)
    if m and m.group(1) in QWEN25:
        return Arch(name=f"Qwen2.5-{m.group(1)}B", source="built-in table", **QWEN25[m.group(1)])
    sizes = ", ".join(f"Qwen2.5-{s}B" for s in QWEN25)
    raise ConfigError(f"cannot size model.path '{model.path}': there is no {cfg_file}, and the directory "
                      f"name is none of the built-in {sizes} (optionally -Instruct)")  # fmt: skip


def layer_params(a: Arch) -> int:
    """One decoder layer: q, k, v (with biases), o; gate, up, down; two RMSNorm weights."""
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    attn = a.hidden * q + 2 * a.hidden * kv + q * a.hidden + (q + 2 * kv if a.qkv_bias else 0)
    return attn + 3 * a.hidden * a.intermediate + 2 * a.hidden


def root_params(a: Arch) -> int:
    """What FSDP leaves in the root unit: the embeddings, an untied lm_head, the final norm."""
    return a.vocab * a.hidden * (1 if a.tied else 2) + a.hidden


def param_count(a: Arch) -> int:
    return root_params(a) + a.layers * layer_params(a)


def critic_param_count(a: Arch) -> int:
    """The critic: the same backbone without the lm_head, plus a value head (h -> 1, with bias)."""
    return param_count(a) - (0 if a.tied else a.vocab * a.hidden) + a.hidden + 1


def activation_bytes_per_token_layer(a: Arch, elem: int) -> int:
    """Saved tensors of one layer, per token (Korthikanti et al. 2022 counted for Qwen2)."""
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    return elem * (4 * a.hidden + 2 * q + 2 * kv + 4 * a.intermediate)


def logits_bytes(tokens: int, vocab: int, elem: int, chunk: int = ENTROPY_CHUNK_TOKENS) -> tuple[float, float]:
    """(the logits, the peak of batching.logprobs_and_entropy beyond them), bytes: the [T, V]
    logits in the compute dtype; then their gradient (same dtype) and two float32 [chunk, V]
    slices (_LogprobsEntropy's forward: log p and its exp; backward: log p and p), with or
    without the entropy's gradient. tests/test_box.py measures the second term."""
    return float(tokens * vocab * elem), float(tokens * vocab * elem + 2 * min(chunk, tokens) * vocab * 4)


def optimizer_bytes_per_param(kind: str, param_bytes: int) -> float:
    master = 4 if param_bytes < 4 else 0  # an fp32 copy to apply small updates to 16-bit weights
    if kind == "adamw8bit":
        return master + 2 + 2 * 4 / 256  # m, v in 1 byte each, one fp32 absmax per 256-value block each
    return master + 8  # m, v in fp32


# ---------------------------------------------------------------------------------------------
# The plan.


def planned(cfg: Config) -> Config:
    """A copy of cfg whose `auto` precision keys are resolved as on the GPUs of the plan (native
    bf16), not as on the machine that prints it."""
    cfg = copy.deepcopy(cfg)
    precision.resolve(cfg, native=True, gpu=True)
    return cfg


def memory_plan(cfg: Config, with_advice: bool = True) -> dict:
    """Per-GPU memory in GB (and host RAM per GPU process), row by row, and whether it fits.

    Returns {"model", "rows", "gpu", "host", "vllm", "train_total", "train_budget", "train_fits",
    "vllm_fits", "fits", "advice", ...}; `gpu` and `host` map each row's key to its GB.
    """
    cfg = planned(cfg)
    a, t, hw = load_arch(cfg.model), cfg.train, cfg.hardware
    n, n_critic = param_count(a), critic_param_count(a)
    b = 2 if cfg.model.dtype in HALF else 4  # bytes per parameter (and per gradient)
    e = 2 if t.bf16 else b  # bytes per activation element, and per gathered parameter (bf16 compute)
    T = t.micro_batch_tokens
    rows, gpu, host = [], {}, {}

    # cpu_offload is FSDP's: one process (one GPU) runs without FSDP (train.py shards only when
    # world > 1), so nothing is offloaded there, whatever the config says
    mode = t.cpu_offload if t.fsdp and hw.gpus > 1 else False

    def add(key: str, label: str, nbytes: float, how: str, resident: bool = False) -> None:
        """Resident state moves to host RAM under cpu_offload micro_batch, and between phases
        under phase (on the GPU for the update, on the host for the rollout); working sets stay."""
        gpu[key], host[key] = nbytes / GB, 0.0
        if resident and mode:
            host[key] = nbytes / GB
            gpu[key] = 0.0 if mode == "micro_batch" else gpu[key]
        rows.append((label, gpu[key], host[key] if resident else None, how))

    ret = add_resident(add, cfg, n, n_critic, b)  # resident through the whole step
    for key in ("reference_weights", "critic_state"):  # a model the run does not use weighs nothing
        gpu.setdefault(key, 0.0)
        host.setdefault(key, 0.0)
    resident = sum(gpu.values())

    # The working set of the model being stepped: FSDP's unsharded units, activations, logits.
    per_layer = activation_bytes_per_token_layer(a, e)
    full = T * a.layers * per_layer
    ckpt = T * a.layers * e * a.hidden + T * per_layer
    gathered = (2 * root_params(a) + 3 * layer_params(a)) * e if t.fsdp else 0
    how = f"(2 x root {sci(root_params(a))} + 3 x layer {sci(layer_params(a))}) x {e} B" if t.fsdp else "no fsdp"
    add("fsdp_gathered", "policy: fsdp gathered units", gathered, how)
    if t.grad_checkpointing:
        add("activations", "policy: activations (checkpointed)", ckpt,
            f"{T} tok x ({a.layers} x {e * a.hidden} + {per_layer}) B")  # fmt: skip
    else:
        add("activations", "policy: activations", full, f"{T} tok x {a.layers} layers x {per_layer} B")
    logits, entropy = logits_bytes(T, a.vocab, e)
    c = min(ENTROPY_CHUNK_TOKENS, T)
    add("logits", "policy: logits, grad, 2 fp32 chunks", logits + entropy,
        f"{T} tok x {a.vocab} x {e} B x 2 + 2 x {c} x {a.vocab} x 4 B")  # fmt: skip
    sums = 8 if t.exact_grad_sum else 0  # float64 bytes per parameter, unsharded until the step's last backward
    add("exact_sums", "policy: float64 gradient sums", n * sums, f"{sci(n)} x 8 B" if sums else "exact_grad_sum off")
    policy_ws = gpu["fsdp_gathered"] + gpu["activations"] + gpu["logits"] + gpu["exact_sums"]
    gpu["critic_working_set"] = 0.0
    if t.algo == "ppo":  # the critic steps after the policy: only the larger working set counts
        critic_root = a.vocab * a.hidden + 2 * a.hidden + 1  # embeddings, final norm, value head
        nbytes = ((2 * critic_root + 3 * layer_params(a)) * e if t.fsdp else 0) + gpu["activations"] * GB
        nbytes += n_critic * sums
        add("critic_working_set", "critic: gathered + activations", nbytes, "after the policy's; the larger counts")
    total = resident + max(policy_ws, gpu["critic_working_set"])
    # rollout.sleep_mode: vLLM sleeps at level 2 while the trainer steps, and frees its whole share
    # but VLLM_ASLEEP_GB; without it its share stays reserved through the update
    sleep = cfg.rollout.sleep_mode
    budget = hw.gpu_memory_gb - VLLM_ASLEEP_GB if sleep else (1 - hw.vllm_memory_fraction) * hw.gpu_memory_gb
    # during the rollout vLLM's share sits beside what the trainer keeps on the GPU (its resident
    # state: none under cpu_offload, phase or micro_batch), the served retriever and the allowance
    on_host_in_rollout = sum(host.values()) if mode == "phase" else 0.0
    rollout_total = hw.vllm_memory_fraction * hw.gpu_memory_gb + resident - on_host_in_rollout
    overlap = overlap_on(t)
    if overlap:  # step k+1's rollout beside step k's update, on the same GPU: both peaks at once
        rollout_total = hw.vllm_memory_fraction * hw.gpu_memory_gb + total
    host["vllm_asleep"] = 0.0  # level 2 drops the weights (the sync rewrites them); level 1 kept P*b/R here
    if sleep:
        level1 = n * b / cfg.rollout.tensor_parallel_size / GB
        rows.append(("vLLM asleep (level 2)", None, 0.0, f"weights, KV freed (level 1 kept {level1:.2f} GB here)"))

    vllm = vllm_plan(cfg, a, n, b)
    plan = {
        "model": {"name": a.name, "source": a.source, "params": n, "critic_params": n_critic, "arch": a},
        "rows": rows,
        "gpu": gpu,
        "host": host,
        "vllm": vllm,
        "policy_working_set": policy_ws,
        "activations_full": full / GB,
        "activations_checkpointed": ckpt / GB,
        "train_total": total,
        "train_budget": budget,
        "train_fits": total <= budget,
        "sleep": sleep,
        "offload": mode,
        "overlap": overlap,
        "rollout_total": rollout_total,
        "rollout_fits": rollout_total <= hw.gpu_memory_gb,
        "vllm_fits": vllm["kv_cache"] > 0,
        "host_per_gpu": sum(host.values()),
        "retriever": ret,
        "host_per_node": sum(host.values()) * hw.gpus + ret["index_bytes"] / GB,  # the index once per host
    }
    plan["fits"] = plan["train_fits"] and plan["vllm_fits"] and plan["rollout_fits"]
    plan["advice"] = advice(cfg, plan) if with_advice else []
    return plan


def add_resident(add: Callable, cfg: Config, n: int, n_critic: int, b: int) -> dict:
    """memory_plan's rows resident through the whole step, each through `add`: the policy's weights,
    gradients and optimizer, the reference and the critic when the run has them, the retriever's
    query encoder and our overhead allowance. Returns the retriever's plan (retriever_plan)."""
    t, hw = cfg.train, cfg.hardware
    shards = hw.gpus if t.fsdp else 1
    by = f"/ {shards}" if t.fsdp else "(no fsdp)"
    opt, opt_critic = optimizer_bytes_per_param(t.optimizer, b), optimizer_bytes_per_param("adamw", b)
    add("policy_weights", "policy weights", n * b / shards, f"{sci(n)} x {b} B {by}", True)
    add("policy_grads", "policy gradients", n * b / shards, f"{sci(n)} x {b} B {by}", True)
    add("policy_optimizer", f"policy optimizer ({t.optimizer})", n * opt / shards, f"{sci(n)} x {opt:.4g} B {by}", True)
    if t.kl_coef > 0:
        add("reference_weights", "reference weights", n * b / shards, f"{sci(n)} x {b} B {by}", True)
    if t.algo == "ppo":
        how = f"{sci(n_critic)} x ({b} + {b} + {opt_critic:g}) B {by}"
        add("critic_state", "critic weights + grads + adamw", n_critic * (2 * b + opt_critic) / shards, how, True)
    ret = retriever_plan(cfg)
    add("retriever_encoder", "retriever: query encoder", ret["encoder_bytes"], ret["encoder_how"])
    add("retriever_served", "retriever: served, GPU 0", ret["served_gpu_bytes"], ret["served_how"])
    add("overhead", "cuda context, nccl, fragmentation", OVERHEAD_GB * GB, "our allowance")
    return ret


def vllm_plan(cfg: Config, a: Arch, n: int, b: int) -> dict:
    """vLLM: one engine per GPU (per tensor-parallel group of tp GPUs, each holding 1/tp of the
    weights and of each token's KV); the rest of its share is KV cache, in GB and in tokens, and
    how many waves of KV a step's rollouts fill."""
    t, hw = cfg.train, cfg.hardware
    tp = cfg.rollout.tensor_parallel_size
    kv_per_token = 2 * a.layers * a.kv_heads * a.head_dim * b / tp
    vllm = {"weights": n * b / tp / GB, "budget": hw.vllm_memory_fraction * hw.gpu_memory_gb, "tp": tp}
    vllm["kv_cache"] = vllm["budget"] - vllm["weights"]
    vllm["kv_bytes_per_token"] = kv_per_token
    vllm["kv_tokens"] = max(0, int(vllm["kv_cache"] * GB // kv_per_token))
    engines = max(1, hw.gpus // tp)
    vllm["engines"] = engines
    vllm["rollout_tokens"] = math.ceil(t.questions_per_step * t.group_size * cfg.rollout.max_model_len / engines)
    vllm["waves"] = vllm["rollout_tokens"] / vllm["kv_tokens"] if vllm["kv_tokens"] else math.inf
    return vllm


def advice(cfg: Config, plan: dict) -> list[str]:
    """Ways to make a plan fit, each one line with the peak it leads to.

    First the switches, cheapest first and one on top of the other until the run fits: no
    exact_grad_sum (a test setting), gradient checkpointing (about a third more compute), FSDP,
    8-bit AdamW, CPU offload (the slowest).
    Then, on its own, the largest micro-batch that fits as configured.
    """
    t, out = cfg.train, []
    if not plan["train_fits"]:
        chain, trial = [], copy.deepcopy(cfg)
        for key, value in [("exact_grad_sum", False), ("grad_checkpointing", True), ("fsdp", True),
                           ("optimizer", "adamw8bit"), ("cpu_offload", "micro_batch")]:  # fmt: skip
            if getattr(trial.train, key) == value or (key in ("fsdp", "cpu_offload") and cfg.hardware.gpus == 1):
                continue
            setattr(trial.train, key, value)
            p = memory_plan(trial, with_advice=False)
            chain.append(f"--set train.{key}={str(value).lower()} ({p['train_total']:.1f} GB)")
            if p["train_fits"]:
                break
        if chain:
            out.append(" + ".join(chain) + (": fits" if p["train_fits"] else ": still does not fit"))
        # the working set grows linearly with the micro-batch: solve peak(T) = budget for T
        resident = plan["train_total"] - max(plan["policy_working_set"], plan["gpu"]["critic_working_set"])
        per_token = (plan["gpu"]["activations"] + plan["gpu"]["logits"]) / t.micro_batch_tokens
        room = plan["train_budget"] - resident - plan["gpu"]["fsdp_gathered"]
        if room / per_token >= 1:
            out.append(f"--set train.micro_batch_tokens={int(room / per_token)} alone (activations and logits "
                       "scale with it)")  # fmt: skip
    if plan["train_fits"] and not plan["rollout_fits"] and not plan["offload"] and cfg.hardware.gpus > 1 and t.fsdp:
        trial = copy.deepcopy(cfg)
        trial.train.cpu_offload = "phase"
        p = memory_plan(trial, with_advice=False)
        verdict = "fits" if p["rollout_fits"] else "still does not fit"
        out.append(f"--set train.cpu_offload=phase (rollout {p['rollout_total']:.1f} GB, the state on the host): "
                   f"{verdict}")  # fmt: skip
    if not plan["vllm_fits"]:
        out.append("raise hardware.vllm_memory_fraction (and rollout.gpu_memory_utilization): the vLLM weights "
                   "alone exceed its share")  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# The table.


def format_plan(cfg: Config, plan: dict) -> str:
    """The plan as an aligned table, one row per component, each with its formula."""
    cfg = planned(cfg)
    t, hw, a, v = cfg.train, cfg.hardware, plan["model"]["arch"], plan["vllm"]
    b = 2 if cfg.model.dtype in HALF else 4
    switches = [
        t.algo,
        f"{8 * b}-bit params",
        f"{16 if t.bf16 else 8 * b}-bit activations",
        f"fsdp over {hw.gpus}" if t.fsdp else "no fsdp",
        (f"cpu offload per {t.cpu_offload.replace('_', '-')}" if hw.gpus > 1 and t.fsdp
         else "cpu offload off (one process: no FSDP, nothing to offload)")
        if t.cpu_offload
        else "no offload",
        "grad checkpointing" if t.grad_checkpointing else "no checkpointing",
        t.optimizer,
        f"kl {t.kl_coef:g}",
        f"micro-batch {t.micro_batch_tokens} tokens",
    ] + ([f"overlap one-step-off: each of the {hw.gpus} GPUs trains (its FSDP rank) and rolls out (its own "
          "engine process) at once"] if plan["overlap"] else [])  # fmt: skip
    lines = [
        f"Memory plan: {cfg.model.path or 'config.model'} = {a.name} ({a.source}), {sci(plan['model']['params'])} "
        f"parameters",
        f"hidden {a.hidden}, {a.layers} layers, {a.heads} heads ({a.kv_heads} kv, head_dim "
        f"{a.head_dim}), intermediate {a.intermediate}, vocab {a.vocab}, {'tied' if a.tied else 'untied'}",
        f"{hw.gpus} x {hw.gpu_memory_gb:g} GB GPUs (GB = 1e9 B): {', '.join(switches)}",
        "",
        f"{'per GPU':<36}{'GPU GB':>8}{'host GB':>9}   how",
    ]

    def row(label: str, on_gpu: float | None, on_host: float | None, how: str) -> None:
        g, h = ("" if x is None else f"{x:.2f}" for x in (on_gpu, on_host))
        lines.append(f"{label:<36}{g:>8}{h:>9}   {how}")

    for r in plan["rows"]:
        row(*r)
    lines.append("-" * 100)
    verdict = "fits" if plan["train_fits"] else "does not fit"
    share = (
        f"vLLM asleep (level 2) keeps {VLLM_ASLEEP_GB:g}"
        if plan["sleep"]
        else f"1 - {hw.vllm_memory_fraction:g} for vLLM"
    )
    how = f"of {plan['train_budget']:.2f} GB ({share}): {verdict}"
    row("training peak", plan["train_total"], plan["host_per_gpu"], how)
    verdict = "fits" if plan["rollout_fits"] else "does not fit"
    vllm_share = f"vLLM {hw.vllm_memory_fraction:g} x {hw.gpu_memory_gb:g}"
    resident = "the resident rows" + (" on the GPU (the state is on the host)" if plan["offload"] == "phase" else "")
    if plan["overlap"]:
        resident = "the training peak (train.overlap: the engine rolls out beside the update)"
    how = f"{vllm_share} + {resident}, of {hw.gpu_memory_gb:g}: {verdict}"
    row("rollout peak", plan["rollout_total"], None, how)
    ret = plan["retriever"]
    index = " + the retriever index once" if ret["index_bytes"] else ""
    row("", None, plan["host_per_node"], f"host GB for all {hw.gpus} GPUs{index}")
    row("retriever index (per host)", None, ret["index_bytes"] / GB, ret["index_how"])
    copy = "a full copy" if v["tp"] == 1 else f"1/{v['tp']} of a copy"
    params = sci(plan["model"]["params"])
    row(f"vLLM weights (tensor parallel {v['tp']})", v["weights"], None, f"{params} x {b} B, {copy}")
    verdict = "fits" if plan["vllm_fits"] else "does not fit"
    row("vLLM KV cache", v["kv_cache"], None, f"{v['budget']:.2f} - {v['weights']:.2f}: {verdict}")
    waves = f": ~{v['waves']:.1f} waves at full length" if v["waves"] > 1 else ""
    lines += [
        f"KV cache: {v['kv_bytes_per_token']:,.0f} B per token per GPU (2 x {a.layers} x {a.kv_heads} x {a.head_dim} "
        f"x {b} B / {v['tp']}), {v['kv_tokens']:,} tokens fit; each of the {v['engines']} engines rolls out up to "
        f"{v['rollout_tokens']:,} ({t.questions_per_step} x {t.group_size} x {cfg.rollout.max_model_len} / "
        f"{v['engines']}){waves}",
        f"=> {'fits' if plan['fits'] else 'does not fit'}",
    ]
    lines += ["advice: " + line for line in plan["advice"]]
    return "\n".join(lines)


def print_plan(cfg: Config) -> bool:
    """Print the memory plan of `cfg`; return whether training and vLLM fit on each GPU."""
    plan = memory_plan(cfg)
    print(format_plan(cfg, plan))
    return plan["fits"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML config of the run (model.path, hardware.*, train.*, rollout.*)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set hardware.gpus=4 --set train.optimizer=adamw8bit",
    )
    args = ap.parse_args(argv)
    try:
        return 0 if print_plan(load_config(args.config, args.set)) else 1
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
