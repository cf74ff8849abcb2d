"""bench_trl.py's two sides and its inputs: TRL installed into bench_cache and imported, a
GRPOTrainer holding only what _compute_loss reads, the fixed seed-0 models and records (Fixture),
our loss and TRL's on one batch, and the table of checks (row, section, table).

bench_trl.py's docstring says what each side computes and how the rows compare; its checks and
main use what is here.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TARGET = ROOT / "benchmarks" / "bench_cache" / "trl_pkgs"
TRL_VERSION = "1.16.0"  # needs transformers >= 4.56.2 (its METADATA); 5.19.0 here
PINNED = [f"trl=={TRL_VERSION}", "datasets==5.2.0", "pandas==3.1.1", "pyarrow==26.0.1", "xxhash==4.1.0",
          "multiprocess==0.70.19", "python-dateutil==4.0.0", "tzdata==2026.6", "pytz==2026.6",
          "six==1.17.0"]  # fmt: skip

import torch  # noqa: E402
import transformers  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from trainer.batching import pad_batch  # noqa: E402
from trainer.config import Config  # noqa: E402
from trainer.grpo import group_advantages, grpo_step, grpo_token_loss, loss_weights, sequence_tensors  # noqa: E402

V, P, G, Q, MAXC, PAD = 64, 6, 4, 5, 32, 0
EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.04
MODES = [("token-mean", "dapo"), ("token-mean", "bnpo"), ("seq-mean-token-mean", "grpo"),
         ("seq-mean-token-sum-norm", "dr_grpo")]  # fmt: skip
ROWS: list[tuple] = []


# ---------------------------------------------------------------------------------------------
# TRL: install into the cache, import, and a GRPOTrainer with only what _compute_loss reads.


def import_trl():
    if not (TARGET / f"trl-{TRL_VERSION}.dist-info").is_dir():
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(TARGET), *PINNED]
        print("installing TRL for this check only (not into the venv):\n  " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    sys.path.append(str(TARGET))  # last: never shadows the venv's torch / transformers
    warnings.filterwarnings("ignore", message=".*vLLM versions.*")
    trl = importlib.import_module("trl")
    assert trl.__version__ == TRL_VERSION, (trl.__version__, trl.__file__)
    return trl, importlib.import_module("trl.trainer.grpo_trainer"), importlib.import_module("trl.trainer.utils")


def trl_snippet(fn, first: str, last: str) -> str:
    """The statements of `fn` from the line starting with `first` to the one starting with `last`."""
    lines = inspect.getsource(fn).splitlines()
    starts = [k for k, s in enumerate(lines) if s.strip().startswith(first)]
    if not starts:
        sys.exit(f"marker {first!r} not found in {fn.__qualname__}: TRL's code changed, update the benchmark")
    ends = [k for k in range(starts[0], len(lines)) if lines[k].strip().startswith(last)]
    if not ends:
        sys.exit(f"marker {last!r} not found in {fn.__qualname__}: TRL's code changed, update the benchmark")
    return textwrap.dedent("\n".join(lines[starts[0] : ends[0] + 1]))


def make_trainer(gt, model, loss_type="dapo", beta=BETA, bias_kl=False, scale_rewards="group", accum=1):
    args = gt.GRPOConfig(
        output_dir=tempfile.gettempdir(), use_cpu=True, report_to="none", loss_type=loss_type, beta=beta,
        epsilon=EPS_LOW, epsilon_high=EPS_HIGH, use_bias_correction_kl=bias_kl, scale_rewards=scale_rewards,
        max_completion_length=MAXC, num_generations=G, per_device_train_batch_size=G * Q,
        gradient_accumulation_steps=accum,
    )  # fmt: skip
    t = object.__new__(gt.GRPOTrainer)
    # a real (single-process CPU) Accelerator, made after the config: TrainingArguments resets accelerate's state
    t.args, t.model, t.accelerator = args, model, Accelerator(cpu=True, mixed_precision="no")
    # As GRPOTrainer.__init__ sets them from args (grpo_trainer.py, "Training arguments" onwards)
    t.max_completion_length, t.num_generations, t.temperature = args.max_completion_length, G, args.temperature
    t.use_vllm, t.vllm_importance_sampling_correction = args.use_vllm, args.vllm_importance_sampling_correction
    t.loss_type, t.multi_objective_aggregation = args.loss_type, args.multi_objective_aggregation
    t.aux_loss_enabled = False  # not a mixture-of-experts model
    t.scale_rewards, t.importance_sampling_level = args.scale_rewards, args.importance_sampling_level
    t.off_policy_mask_threshold, t.top_entropy_quantile = args.off_policy_mask_threshold, args.top_entropy_quantile
    t.entropy_coef, t.use_adaptive_entropy = args.entropy_coef, args.use_adaptive_entropy
    t._entropy_bonus_enabled = t.entropy_coef != 0.0 or t.use_adaptive_entropy
    t.epsilon_low = args.epsilon
    t.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    t.beta = args.beta
    t.reward_weights = torch.ones(1)  # one reward function
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.current_gradient_accumulation_steps = accum  # set by transformers.Trainer's training loop
    return t


# ---------------------------------------------------------------------------------------------
# Fixed inputs.


def tiny_models():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False, initializer_range=0.2)  # fmt: skip
    cfg._attn_implementation = "eager"
    policy = transformers.Qwen2ForCausalLM(cfg).eval()
    ref = copy.deepcopy(policy)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return policy, ref


def make_records(rng: torch.Generator) -> list[dict]:
    rewards = [[1, 0, 0, 1], [0.5, 0.25, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0], [0.1, 0.7, 0.35, 0.9]]
    records = []
    for q in range(Q):
        prompt = torch.randint(1, V, (P,), generator=rng).tolist()
        for g in range(G):
            n = int(torch.randint(8, 29, (1,), generator=rng))
            mask = [1] * n
            if torch.rand(1, generator=rng) < 0.7:  # a retrieved block: tokens the policy never sampled
                start = int(torch.randint(2, n - 4, (1,), generator=rng))
                hole = int(torch.randint(3, 7, (1,), generator=rng))
                mask[start : start + hole] = [0] * len(mask[start : start + hole])
            records.append({"prompt_ids": prompt, "response_ids": torch.randint(1, V, (n,), generator=rng).tolist(),
                            "loss_mask": mask, "group_id": f"q{q}", "reward": float(rewards[q][g])})  # fmt: skip
    return records


def full_logp(model, ids, attn):
    """grpo_step's lines: logits[:, :-1] -> log_softmax -> gather (no float32 cast: float64 here)."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    logp_all = torch.log_softmax(logits, -1)
    return logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)


def padded(rows, width, dtype=torch.float64):
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Ours and TRL's on one batch.


def ours_fns(model, batch, mode, beta, ref=None, norm=MAXC):
    """Loss and gradients, float64, with train.py's functions as _policy_update combines them."""
    seqs = batch["seqs"]
    ids, attn, _ = pad_batch([s["ids"] for s in seqs], [[0] for _ in seqs], PAD)
    width = ids.shape[1] - 1
    m = padded([s["loss_mask"] for s in seqs], width)
    sampled = padded([s["sampled"] for s in seqs], width)
    old = padded([s["engine_logp"] for s in seqs], width)
    adv = padded([s["adv"] for s in seqs], width)
    w = torch.tensor(loss_weights([int(s["loss_mask"].sum()) for s in seqs], mode, norm), dtype=torch.float64)[:, None]
    ref = (batch["ref_full"] if ref is None else ref) if beta > 0 else None
    model.zero_grad(set_to_none=True)
    logp = full_logp(model, ids, attn)
    old_logp = torch.where(sampled > 0, old, logp.detach())
    tok_loss, kl, clipped = grpo_token_loss(logp, old_logp, adv, ref, EPS_LOW, beta, EPS_HIGH, 0.0, "k3")
    loss = (tok_loss * m * w).sum()
    loss.backward()
    return {"loss": float(loss.detach()), "grad": grads(model), "kl_mean": float((kl * m).sum() / m.sum()),
            "scale": float((tok_loss.detach().abs() * m * w).sum())}  # fmt: skip


def ours_grpo_step(model32, ref32, records, mode, beta) -> dict:
    cfg = Config()
    t = cfg.train
    t.loss_agg, t.loss_norm_tokens, t.clip_eps, t.clip_eps_high, t.kl_coef = mode, MAXC, EPS_LOW, EPS_HIGH, beta
    t.kl_estimator, t.kl_in_reward, t.dual_clip, t.entropy_coef, t.mask_retrieved = "k3", False, 0.0, 0.0, True
    t.micro_batch_tokens, t.grad_clip, t.epochs, t.mini_batches = 120, 1e30, 1, 1
    stats = grpo_step(model32, ref32 if beta > 0 else None, records, torch.optim.SGD(model32.parameters(), lr=0.0),
                      cfg, PAD)  # fmt: skip
    return stats | {"grad": grads(model32)}


def plain_logps(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **_):
    """Stands in for GRPOTrainer._get_per_token_logps_and_entropies in the float64 rows: the same
    per-token logprobs as ours (TRL's fused LM head accumulates in float32, see the fused rows)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1][:, -logits_to_keep:]
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, input_ids[:, -logits_to_keep:, None]).squeeze(-1)
    return logp, (-(logp_all.exp() * logp_all).sum(-1) if compute_entropy else None), None


def trl_run(trainer, model, inputs, splits=None, fused: bool = False) -> dict:
    """_compute_loss per micro-batch (TRL slices the padded generation batch), backward, sum."""
    if not fused:
        trainer._get_per_token_logps_and_entropies = plain_logps  # instance attribute shadows the method
    splits = splits or [list(range(inputs["completion_ids"].shape[0]))]
    model.zero_grad(set_to_none=True)
    model.train()  # TRL reads model.training for the train/eval branch
    total = 0.0
    for idx in splits:
        sub = {k: (v[idx] if k != "num_items_in_batch" else v) for k, v in inputs.items()}
        loss = trainer._compute_loss(model, sub)
        loss.backward()
        total += float(loss.detach())
    model.eval()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    return {"loss": total, "grad": grads(model), "metrics": metrics}


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])


# ---------------------------------------------------------------------------------------------
# Table.


def row(check: str, pair: str, ours, theirs, tol: float, why: str = "", scale: float = 0.0) -> None:
    """rel = max|ours - TRL| / max|TRL|; for a loss, / max(|TRL|, `scale` = sum_i w_i sum_t m_t |l_t|): a loss
    is a sum of terms of both signs and can be far smaller than they are."""
    ours, theirs = torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(theirs, dtype=torch.float64)
    err = float((ours - theirs).abs().max())
    rel = err / max(float(theirs.abs().max()), scale, 1e-300)
    if why:
        status = "DIFF" if rel > tol else "FAIL (no difference: the convention probe broke)"
    else:
        status = "PASS" if rel <= tol else "FAIL"
    ROWS.append((check, pair, err, rel, tol, status, why))


def section(title: str) -> None:
    ROWS.append(title)


def table() -> str:
    head = f"{'check':<36} {'ours <-> TRL':<35} {'max|d|':>9} {'rel':>9} {'tol':>6}  status"
    lines = [head, "-" * len(head)]
    notes: list[str] = []
    for r in ROWS:
        if isinstance(r, str):
            lines.append(f"-- {r}")
            continue
        check, pair, err, rel, tol, status, why = r
        if why and why not in notes:
            notes.append(why)
        mark = f" [{notes.index(why) + 1}]" if why else ""
        lines.append(f"{check:<36} {pair:<35} {err:9.2e} {rel:9.2e} {tol:6.0e}  {status}{mark}")
    lines += [""] + [textwrap.fill(f"[{k + 1}] {n}", 100, subsequent_indent="    ") for k, n in enumerate(notes)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


@dataclass
class Fixture:
    """The fixed inputs every section reads: models, records, TRL's tensors, our batch."""

    gt: object  # trl.trainer.grpo_trainer
    tu: object  # trl.trainer.utils
    policy32: torch.nn.Module
    ref32: torch.nn.Module
    policy: torch.nn.Module  # float64, with TRL's fused head added
    records: list[dict]
    inputs: dict  # TRL's padded completion tensors
    batch: dict  # ours: sequence tensors and the reference's full logprobs
    ids: torch.Tensor
    attn: torch.Tensor
    cur: torch.Tensor  # the policy's float64 logprobs, every position
    ref_full: torch.Tensor
    C: int  # the longest response

    @property
    def cur_c(self) -> torch.Tensor:  # the logprobs at the completion positions
        return self.cur[:, P - 1 : P - 1 + self.C]

    @property
    def on(self) -> torch.Tensor:  # policy tokens (completion and not retrieved)
        return (self.inputs["completion_mask"] * self.inputs["tool_mask"]) > 0


def build_fixture(gt, tu) -> Fixture:
    """Seed-0 models and records; old logprobs = current + N(0, 0.3), float32 as an engine gives them."""
    policy32, ref32 = tiny_models()
    policy, ref = copy.deepcopy(policy32).double(), copy.deepcopy(ref32).double()
    tu.add_fused_lm_head(policy, outputs=("log_probs", "entropy"))  # as GRPOTrainer.__init__ does
    tu.add_fused_lm_head(ref)
    rng = torch.Generator().manual_seed(0)
    records = make_records(rng)
    rewards = [r["reward"] for r in records]
    adv = group_advantages(rewards, [r["group_id"] for r in records])
    for r, a in zip(records, adv):
        r["advantage"] = float(torch.tensor(a, dtype=torch.float32))  # grpo_step holds it in float32
        r["logprobs"] = [0.0] * len(r["response_ids"])  # set below from the current policy
    seqs0 = sequence_tensors(records)
    ids, attn, _ = pad_batch([s["ids"] for s in seqs0], [[0] for _ in seqs0], PAD)
    with torch.no_grad():
        cur = full_logp(policy, ids, attn)
        ref_full = full_logp(ref, ids, attn)
    noise = 0.3 * torch.randn(cur.shape, generator=rng, dtype=torch.float64)
    for i, r in enumerate(records):  # old = current + noise, float32 as an engine returns it; 0.0 on holes
        n = len(r["response_ids"])
        r["logprobs"] = [float(torch.tensor(float(cur[i, P - 1 + j] + noise[i, j]), dtype=torch.float32))
                         if r["loss_mask"][j] else 0.0 for j in range(n)]  # fmt: skip
    C = max(len(r["response_ids"]) for r in records)
    comp_mask = padded([[1] * len(r["response_ids"]) for r in records], C)
    inputs = {
        "prompt_ids": torch.tensor([r["prompt_ids"] for r in records]),
        "prompt_mask": torch.ones((len(records), P), dtype=torch.long),
        "completion_ids": padded([r["response_ids"] for r in records], C, torch.long),
        "completion_mask": comp_mask.long(),
        "tool_mask": padded([r["loss_mask"] for r in records], C, torch.long) + (1 - comp_mask.long()),
        "advantages": torch.tensor([r["advantage"] for r in records], dtype=torch.float64),
        "old_per_token_logps": padded([r["logprobs"] for r in records], C),
        "ref_per_token_logps": ref_full[:, P - 1 : P - 1 + C].clone(),
    }
    inputs["num_items_in_batch"] = (inputs["completion_mask"] * inputs["tool_mask"]).double().sum()
    batch = {"seqs": sequence_tensors(records), "ref_full": ref_full}
    return Fixture(gt, tu, policy32, ref32, policy, records, inputs, batch, ids, attn, cur, ref_full, C)
