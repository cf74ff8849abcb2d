"""Train a search agent with GRPO: roll out, score, take a masked clipped step, sync vLLM.

    python train.py --config configs/tiny.yaml                 # the embedded tiny world, CPU
    python train.py --config configs/tiny.yaml --set train.steps=5 --set rollout.engine=hf
    python train.py --resume runs/tiny-20261122-010203         # continue a killed run

One step, top to bottom (each line is a function below):

  1. rollout   G trajectories per question with the current policy (rollout.py), searching
               the corpus mid-thought; records keep token ids, loss mask and sampling logprobs
  2. reward    r_i = EM(answer_i, golden) (Search-R1 §3.4), or any `train.reward` of rewards.py
  3. advantage A_i = (r_i - mean(r_group)) / (std(r_group) + eps)   (GRPO, DESIGN.md §4),
               the same A_i for every token of rollout i; a group with equal rewards has A = 0
  4. loss      per policy token t (loss_mask = 1; retrieved tokens never count):
                 rho_t = exp(log pi_theta - log pi_old)          pi_old = the engine's logprobs
                 pg_t  = -min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A)
                 kl_t  = exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]   (k3)
               loss = sum_t m_t (pg_t + beta kl_t) / sum_t m_t   over the whole batch
               (token-mean; micro-batches divide by the batch's token count, not their own)
               Options (config train.*): kl_estimator k1/k2/k3, kl_in_reward, adv_std
               group/batch/none, loss_agg (token-mean, seq-mean-token-mean, Dr.GRPO's
               seq-mean-token-sum-norm), clip_eps_high (clip-higher), dual_clip, entropy_coef.
  5. update    AdamW, gradient-norm clip
  6. sync      push the new weights into the vLLM engine (engine.load_weights)

Worked example of step 3: a group of 4 rewards [1, 0, 0, 1] has mean 0.5 and std 0.577, so
the advantages are [+0.866, -0.866, -0.866, +0.866].

The run directory `runs/<name>-<time>/` holds config.yaml (resolved), metrics.jsonl (one line
per step, plus eval lines), samples/step_<k>.jsonl (rollout records), checkpoints/step_<k>/
(safetensors + optimizer state) and eval_*.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from answers import exact_match
from config import Config, ConfigError, DataError, config_to_dict, load_config
from engine import load_policy, load_tokenizer, make_engine
from rewards import score
from rollout import rollout_batch
from sft import pad_batch, token_budget_batches, token_logprobs

# ---------------------------------------------------------------------------------------------
# The GRPO math (DESIGN.md §4). Pure functions on tensors, tested in tests/test_grpo.py.


def group_advantages(rewards: list[float], group_ids: list[str], eps: float = 1e-6, std: str = "group") -> list[float]:
    """GRPO: (r - mean of the group) / (std + eps); equal rewards give 0.

    std "group" (GRPO), "batch" (one std over the whole batch) or "none" (Dr.GRPO: r - mean).

    >>> [round(a, 3) for a in group_advantages([1, 0, 0, 1], ["q"] * 4)]
    [0.866, -0.866, -0.866, 0.866]
    >>> group_advantages([1, 0, 0, 1], ["q"] * 4, std="none")
    [0.5, -0.5, -0.5, 0.5]
    """
    groups: dict[str, list[float]] = {}
    for r, g in zip(rewards, group_ids):
        groups.setdefault(g, []).append(r)
    mean = {g: sum(rs) / len(rs) for g, rs in groups.items()}
    centred = [r - mean[g] for r, g in zip(rewards, group_ids)]
    if std == "none":
        return centred

    def unbiased_std(xs: list[float]) -> float:  # as torch.std
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1))

    if std == "batch":
        s = unbiased_std(list(rewards))
        return [c / (s + eps) for c in centred]
    sd = {g: unbiased_std(rs) for g, rs in groups.items()}
    return [c / (sd[g] + eps) for c, g in zip(centred, group_ids)]


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi (Schulman 2020; DESIGN §4):
    k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 ("low_var_kl") = exp(ref - logp) - (ref - logp) - 1,
    clamped to [-10, 10]. k1 is unbiased but noisy, k3 unbiased and >= 0, k2 biased but low-variance."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    return (torch.exp(-log_ratio) + log_ratio - 1).clamp(-10, 10)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return kl_estimate(logp, ref_logp, "k3")


def grpo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    ref_logp: torch.Tensor | None,
    clip_eps: float,
    kl_coef: float,
    clip_eps_high: float = 0.0,
    dual_clip: float = 0.0,
    kl_kind: str = "k3",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss (PPO-clip policy term + beta * KL), its KL part and whether it clipped.

    pg = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)); eps_high = eps_low unless given
    (DAPO's clip-higher). Dual-clip (c > 1, for A < 0 only) caps pg at -c A, so a huge ratio on a
    bad token cannot blow the loss up.
    """
    ratio = torch.exp(logp - old_logp)
    high = clip_eps_high or clip_eps
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_eps, 1 + high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip > 1:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    kl = kl_estimate(logp, ref_logp, kl_kind) if ref_logp is not None else torch.zeros_like(logp)
    return loss + kl_coef * kl, kl, (loss != unclipped).float()


def loss_weights(policy_tokens: list[int], mode: str, norm: int) -> list[float]:
    """Per-sequence weight w_i so that the loss is sum_i w_i sum_t m_it l_it (DESIGN §4):

      token-mean               w_i = 1 / sum_j n_j           (every policy token counts the same)
      seq-mean-token-mean      w_i = 1 / (N n_i)             (every rollout counts the same)
      seq-mean-token-sum-norm  w_i = 1 / (N norm)            (Dr.GRPO: no length bias)

    >>> loss_weights([1, 3], "seq-mean-token-mean", 0)
    [0.5, 0.16666666666666666]
    """
    n = len(policy_tokens)
    if mode == "seq-mean-token-mean":
        return [1.0 / (n * max(1, k)) for k in policy_tokens]
    if mode == "seq-mean-token-sum-norm":
        return [1.0 / (n * norm)] * n
    return [1.0 / max(1, sum(policy_tokens))] * n


def grpo_step(model, ref_model, records: list[dict], optimizer, cfg: Config, pad_id: int) -> dict:
    """One optimizer step on scored rollout records with their `advantage` set."""
    tcfg = cfg.train
    seqs, sampled, masks, olds = [], [], [], []
    for r in records:
        n = len(r["prompt_ids"])
        seqs.append(r["prompt_ids"] + r["response_ids"])
        sampled.append([0] * n + r["loss_mask"])  # tokens the engine sampled, with a logprob
        masks.append(sampled[-1] if tcfg.mask_retrieved else [0] * n + [1] * len(r["response_ids"]))
        olds.append([0.0] * n + r["logprobs"])
    n_tokens = sum(sum(m) for m in masks)  # the token-mean denominator for the whole batch
    weights = loss_weights([sum(m) for m in masks], tcfg.loss_agg, tcfg.loss_norm_tokens or cfg.rollout.max_model_len)
    kl_coef = 0.0 if tcfg.kl_in_reward else tcfg.kl_coef  # in the reward already (kl_penalties)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    totals = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "entropy": 0.0}
    for idx in token_budget_batches([len(s) for s in seqs], tcfg.micro_batch_tokens, random.Random(0)):
        ids, attn, mask = pad_batch([seqs[i] for i in idx], [masks[i] for i in idx], pad_id)
        was_sampled = _pad_float([sampled[i] for i in idx], ids.shape[1])[:, 1:]
        old = _pad_float([olds[i] for i in idx], ids.shape[1])[:, 1:]
        m = mask[:, 1:]  # position t-1 predicts token t
        w = torch.tensor([weights[i] for i in idx])[:, None]
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
        # Retrieved tokens were never sampled, so the engine has no logprob for them; in the
        # no-mask ablation they are trained on-policy: old = current (ratio 1, gradient of logp).
        old_logp = torch.where(was_sampled > 0, old, logp.detach())
        ref_logp = None
        if ref_model is not None and kl_coef > 0:
            with torch.no_grad():
                ref_logp = token_logprobs(ref_model, ids, attn)
        adv = torch.tensor([records[i]["advantage"] for i in idx])[:, None].expand_as(logp)
        tok_loss, kl, clipped = grpo_token_loss(
            logp, old_logp, adv, ref_logp, tcfg.clip_eps, kl_coef, tcfg.clip_eps_high, tcfg.dual_clip, tcfg.kl_estimator
        )
        with torch.set_grad_enabled(tcfg.entropy_coef > 0):
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        loss = ((tok_loss - tcfg.entropy_coef * entropy) * m * w).sum()
        loss.backward()
        with torch.no_grad():
            for key, value in (("loss", tok_loss), ("kl", kl), ("clip_frac", clipped), ("entropy", entropy)):
                totals[key] += float((value * m).sum() / n_tokens)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
    optimizer.step()
    model.eval()
    return totals | {"grad_norm": float(grad_norm), "policy_tokens": n_tokens}


def kl_penalties(ref_model, records: list[dict], cfg: Config, pad_id: int) -> list[float]:
    """sum_t m_t KL_t(pi_old || ref) per rollout, with pi_old the engine's sampling logprobs: what
    `kl_in_reward` subtracts from the reward (times kl_coef) before the advantages."""
    out = [0.0] * len(records)
    seqs = [r["prompt_ids"] + r["response_ids"] for r in records]
    masks = [[0] * len(r["prompt_ids"]) + r["loss_mask"] for r in records]
    for idx in token_budget_batches([len(s) for s in seqs], cfg.train.micro_batch_tokens, random.Random(0)):
        ids, attn, mask = pad_batch([seqs[i] for i in idx], [masks[i] for i in idx], pad_id)
        old = _pad_float([[0.0] * len(records[i]["prompt_ids"]) + records[i]["logprobs"] for i in idx], ids.shape[1])
        with torch.no_grad():
            ref = token_logprobs(ref_model, ids, attn)
        kl = kl_estimate(old[:, 1:], ref, cfg.train.kl_estimator) * mask[:, 1:]
        for row, i in enumerate(idx):
            out[i] = float(kl[row].sum())
    return out


def _pad_float(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width))
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


# ---------------------------------------------------------------------------------------------
# Data, retriever and run directory.


def ensure_policy(cfg: Config, run_dir: Path) -> Path:
    """The starting policy: `model.path` if given, else the tiny world's cached SFT policy.

    The tiny world is built in a child process: its teacher uses bm25s (numba), which must not
    be imported in a process that will start vLLM afterwards (DESIGN.md §6).
    """
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path has no model: {path / 'config.json'} not found")
        return path
    from world import world_dir

    policy = world_dir(cfg) / "policy"
    if not (policy / "DONE").exists():
        print(f"building the tiny world and SFT warm start in {policy.parent} (cached) ...", flush=True)
        subprocess.run(
            [sys.executable, str(Path(__file__).with_name("world.py")), "--config", str(run_dir / "config.yaml")],
            check=True,
        )
    return policy


def data_paths(cfg: Config) -> dict[str, Path]:
    """corpus/train/val/test files: the `data` section, or the tiny world's cache when empty."""
    from world import world_dir

    paths = {}
    for kind in ("corpus", "train", "val", "test"):
        given = getattr(cfg.data, kind)
        paths[kind] = Path(given) if given else world_dir(cfg) / f"{kind}.jsonl"
    for kind in ("corpus", "train", "val"):
        if not paths[kind].is_file():
            raise FileNotFoundError(f"{kind} file not found: {paths[kind]}")
    return paths


def load_questions(path: Path) -> list[dict]:
    """FlashRAG jsonl; an empty question is an error that names the line."""
    from world import read_jsonl

    questions = read_jsonl(path)
    for n, q in enumerate(questions, 1):
        if not str(q.get("question", "")).strip():
            raise DataError(f"{path}:{n}: empty question (id {q.get('id')!r})")
        if not q.get("golden_answers"):
            raise DataError(f"{path}:{n}: no golden_answers (id {q.get('id')!r})")
    if not questions:
        raise DataError(f"{path}: no questions")
    return questions


def make_search_fn(cfg: Config, corpus_path: Path, timings: dict):
    """Batched search tool: list of queries -> rendered hits, in process or over HTTP
    (retriever.open_search). Imports bm25s: call after vLLM has started."""
    from retriever import format_hits, open_search

    search = open_search(cfg.retriever, corpus_path)

    def search_fn(queries: list[str]) -> list[str]:
        t = time.time()
        out = [format_hits(h) for h in search(queries, cfg.retriever.topk)]
        timings["retrieve"] = timings.get("retrieve", 0.0) + time.time() - t
        return out

    return search_fn


def new_run_dir(cfg: Config) -> Path:
    run = Path(cfg.train.run_dir) / f"{cfg.train.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run.mkdir(parents=True, exist_ok=False)
    (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return run


def save_checkpoint(run: Path, step: int, model, tokenizer, optimizer, keep: int = 2) -> None:
    ckpt = run / "checkpoints" / f"step_{step}"
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save({"step": step, "optimizer": optimizer.state_dict()}, tmp / "trainer_state.pt")
    shutil.rmtree(ckpt, ignore_errors=True)
    tmp.rename(ckpt)  # a checkpoint directory exists only once it is complete
    for old in sorted(ckpt.parent.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[:-keep]:
        if not old.name.endswith(".tmp"):
            shutil.rmtree(old)


def latest_checkpoint(run: Path) -> Path | None:
    done = [p for p in (run / "checkpoints").glob("step_*") if not p.name.endswith(".tmp")]
    return max(done, key=lambda p: int(p.name.split("_")[1])) if done else None


def log(run: Path, row: dict) -> None:
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def batch_metrics(records: list[dict]) -> dict:
    """Batch means; EM and answered-rate whatever the reward, plus each numeric reward component
    as `reward/<name>` (the reward's own parts, rewards.py)."""
    n = len(records)
    row = {
        "reward": sum(r["reward"] for r in records) / n,
        "em": sum(exact_match(r["answer"], r["golden_answers"]) for r in records) / n,
        "format_ok": sum(r["finish"] == "answer" for r in records) / n,
        "response_len": sum(sum(r["loss_mask"]) for r in records) / n,
        "searches_per_question": sum(r["num_searches"] for r in records) / n,
    }
    for key, value in records[0]["reward_components"].items():
        if isinstance(value, (int, float)) and key != "reward":
            row[f"reward/{key}"] = sum(float(r["reward_components"].get(key, 0.0)) for r in records) / n
    return row


# ---------------------------------------------------------------------------------------------


def train(cfg: Config, run: Path, resume_from: Path | None = None) -> dict:
    from eval import evaluate

    torch.manual_seed(cfg.train.seed)
    torch.set_num_threads(cfg.train.threads)
    if cfg.data.corpus or cfg.data.train:
        data_paths(cfg)  # given files: fail on a bad path before building anything
    start_dir = resume_from or ensure_policy(cfg, run)
    paths = data_paths(cfg)
    train_q, val_q = load_questions(paths["train"]), load_questions(paths["val"])
    tokenizer = load_tokenizer(start_dir)
    engine = make_engine(cfg.rollout.engine, start_dir, cfg.rollout, seed=cfg.train.seed)  # before bm25s
    torch.set_num_threads(cfg.train.threads)  # vLLM drops torch to 1 thread "for serving"
    timings: dict[str, float] = {}
    search_fn = make_search_fn(cfg, paths["corpus"], timings)
    model = load_policy(start_dir).eval()
    ref = None
    if cfg.train.kl_coef > 0:  # the frozen reference is the starting policy (SFT), not a checkpoint
        ref = load_policy(ensure_policy(cfg, run) if resume_from else start_dir).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    step0 = 0
    if resume_from is not None:
        state = torch.load(resume_from / "trainer_state.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        step0 = state["step"]
        _truncate_metrics(run, step0)
        print(f"resumed from {resume_from} at step {step0}", flush=True)
    val_subset = val_q[: cfg.eval.max_questions] if cfg.eval.max_questions else val_q
    if step0 == 0 and cfg.train.eval_every > 0:
        ev = evaluate(engine, tokenizer, val_subset, search_fn, cfg)
        log(run, {"step": 0, "eval": ev})
        print(f"step 0 eval: {json.dumps(ev)}", flush=True)
    rng = random.Random(cfg.train.seed)
    order: list[int] = []
    for _ in range(step0):  # replay the question order so a resumed run sees the same batches
        order = _next_batch(order, len(train_q), cfg.train.questions_per_step, rng)[1]
    bar = tqdm(range(step0, cfg.train.steps), desc="grpo", initial=step0, total=cfg.train.steps)
    ev = {}
    for step in bar:
        timings.clear()
        batch_idx, order = _next_batch(order, len(train_q), cfg.train.questions_per_step, rng)
        questions = [train_q[i] for i in batch_idx]
        t0 = time.time()
        records = rollout_batch(
            engine, tokenizer, questions, cfg.train.group_size, search_fn, cfg.rollout,
            seed=cfg.train.seed * 100003 + step, group_prefix=cfg.data.name + ":",
        )  # fmt: skip
        t_generate = time.time() - t0 - timings.get("retrieve", 0.0)
        t0 = time.time()
        score(records, cfg.train.reward, cfg.train.reward_params)
        if cfg.train.kl_in_reward and ref is not None and cfg.train.kl_coef > 0:
            for r, kl in zip(records, kl_penalties(ref, records, cfg, tokenizer.pad_token_id)):
                r["kl_penalty"] = kl
                r["reward"] -= cfg.train.kl_coef * kl
        advantages = group_advantages(
            [r["reward"] for r in records], [r["group_id"] for r in records], cfg.train.adv_eps, cfg.train.adv_std
        )
        for r, a in zip(records, advantages):
            r["advantage"] = a
        t_reward = time.time() - t0
        t0 = time.time()
        stats = grpo_step(model, ref, records, optimizer, cfg, tokenizer.pad_token_id)
        t_train = time.time() - t0
        t0 = time.time()
        engine.load_weights(model.state_dict().items())
        t_sync = time.time() - t0
        gen_tokens = sum(sum(r["loss_mask"]) for r in records)
        row = {"step": step + 1} | batch_metrics(records) | stats | {
            "tokens_per_s": gen_tokens / max(t_generate, 1e-9),
            "time": {"generate": t_generate, "retrieve": timings.get("retrieve", 0.0),
                     "reward": t_reward, "train": t_train, "sync": t_sync},
        }  # fmt: skip
        _write_samples(run, step + 1, records[: cfg.train.samples_per_step])
        if cfg.train.eval_every > 0 and ((step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.steps):
            ev = evaluate(engine, tokenizer, val_subset, search_fn, cfg)
            row["eval"] = ev
        log(run, row)
        bar.set_postfix(reward=f"{row['reward']:.2f}", searches=f"{row['searches_per_question']:.2f}")
        if (cfg.train.save_every > 0 and (step + 1) % cfg.train.save_every == 0) or step + 1 == cfg.train.steps:
            save_checkpoint(run, step + 1, model, tokenizer, optimizer)
    return ev


def _next_batch(order: list[int], n: int, k: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """Take k question indices from a shuffled epoch order, starting a new epoch when short."""
    if len(order) < k:
        fresh = list(range(n))
        rng.shuffle(fresh)
        order = order + fresh
    return order[:k], order[k:]


def _truncate_metrics(run: Path, step: int) -> None:
    """Drop metric rows written after the checkpoint we resume from (they will be redone)."""
    path = run / "metrics.jsonl"
    if path.exists():
        rows = [line for line in path.read_text().splitlines() if line.strip()]
        kept = [line for line in rows if json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))


def _write_samples(run: Path, step: int, records: list[dict]) -> None:
    (run / "samples").mkdir(exist_ok=True)
    with open(run / "samples" / f"step_{step}.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="GRPO training of a search agent (see the module docstring for the step).",
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML config, e.g. configs/tiny.yaml (defaults if omitted)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override one config key, e.g. --set train.lr=1e-4 (repeatable; unknown keys are errors)",
    )  # fmt: skip
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    args = parser.parse_args(argv)
    try:
        if args.resume:
            run = Path(args.resume)
            cfg = load_config(run / "config.yaml", args.set)
            ckpt = latest_checkpoint(run)
            if ckpt is None:
                raise ConfigError(f"no checkpoint to resume in {run / 'checkpoints'}")
        else:
            cfg = load_config(args.config, args.set)
            run, ckpt = new_run_dir(cfg), None
    except (ConfigError, FileNotFoundError) as e:
        parser.error(str(e))
    print(f"run directory: {run}", flush=True)
    try:
        ev = train(cfg, run, ckpt)
    except (DataError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print(f"final eval: {json.dumps(ev)}")


if __name__ == "__main__":
    main()
