"""Real engines on a really built micro world: vLLM (CPU build) and transformers.

Covers: multi-turn rollouts that search, stop strings, batched retrieval, the loss mask and
logprob bookkeeping, the engine/bm25s start-up order, and weight sync into vLLM.
"""

import logging
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import ROOT
from numerics import assert_close, logprob_atol, model_vocab
from weight_sync_check import check_weight_sync

from rollout import STOP
from search.tools import make_search_fn
from trainer.engine import RELOAD_LOGGER, load_policy, load_tokenizer, make_engine, quiet_rotary_reload_warning

CPUS_BEFORE_VLLM = os.sched_getaffinity(0)  # at collection, before the session's vLLM engine starts


def check_record(r, tokenizer, max_turns):
    assert len(r["response_ids"]) == len(r["loss_mask"]) == len(r["logprobs"])
    assert r["num_searches"] <= max_turns  # Search-R1's max_turns: searches, then an answer-only turn
    for c in r["chunks"]:
        ids = r["response_ids"][c["start"] : c["end"]]
        mask = set(r["loss_mask"][c["start"] : c["end"]])
        if c["role"] == "policy":
            assert mask == {1}
            assert all(lp <= 0 for lp in r["logprobs"][c["start"] : c["end"]])
            # generation stopped AT a stop string, never past it
            for s in STOP:
                assert s not in c["text"] or c["text"].rstrip().endswith(s) and c["text"].count(s) == 1
        else:
            assert mask == {0} and c["text"].endswith("</information>\n")
            assert tokenizer.decode(ids) == c["text"]


@pytest.fixture(scope="module")
def setup(micro):
    path, cfg, policy, world = micro
    from data import data_paths
    from trainer.questions import load_questions

    tok = load_tokenizer(policy)
    calls = []
    inner = make_search_fn(cfg, data_paths(cfg)["corpus"], {})

    def search_fn(queries):
        calls.append(list(queries))
        return inner(queries)

    return cfg, tok, load_questions(data_paths(cfg)["val"])[:8], search_fn, calls


@pytest.mark.numeric
def test_vllm_rollouts_search_and_keep_bookkeeping(vllm_engine, setup, micro):
    from rollout import rollout_batch

    cfg, tok, questions, search_fn, calls = setup
    calls.clear()
    records = rollout_batch(vllm_engine, tok, questions, 4, search_fn, cfg.rollout, seed=1, group_prefix="tiny:")
    assert len(records) == 32
    for r in records:
        check_record(r, tok, cfg.rollout.max_turns)
    searched = sum(r["num_searches"] for r in records)
    assert searched >= 16, "the SFT'd micro policy should search"
    assert sum(r["finish"] == "answer" for r in records) >= 16
    # continuous (the default): one batched retriever call per engine step, holding the queries
    # of the trajectories that stopped in it; every query is asked once
    assert sum(len(c) for c in calls) == searched and len(calls) < searched
    # group ids: one per question, dataset-prefixed
    assert len({r["group_id"] for r in records}) == 8 and records[0]["group_id"].startswith("tiny:")
    # turn by turn: one batched call per turn, and the same records: per-request seeds make them
    # independent of the schedule
    calls.clear()
    turns = rollout_batch(vllm_engine, tok, questions, 4, search_fn, replace(cfg.rollout, continuous=False), seed=1,
                          group_prefix="tiny:")  # fmt: skip
    assert len(calls) <= cfg.rollout.max_turns and sum(len(c) for c in calls) == searched
    # the logprobs: the same engine and weights, but continuous decoding fills the KV cache token
    # by token in batches of other sizes, where turn by turn prefills each turn's prompt: another
    # batch shape for every matmul and for the log-softmax over the vocabulary
    lp = logprob_atol(model_vocab(micro[2]))
    for a, b in zip(records, turns):
        assert (a["response_ids"], a["loss_mask"], a["finish"]) == (b["response_ids"], b["loss_mask"], b["finish"])
        assert_close(b["logprobs"], a["logprobs"], rtol=0, atol=lp, what="turn-by-turn vs continuous logprobs")


@pytest.mark.numeric
def test_searches_beside_generation_give_the_same_records_whatever_their_latency(vllm_engine, setup, micro):
    """rollout.tool_workers: each tool call runs in a thread while the engine decodes the others.
    A search whose latency varies at random (0-40 ms, drawn from another seed each call) changes
    which trajectories share each engine step, never a record: the same tokens, masks and finishes
    as every call made in the engine's loop at 0 ms; the logprobs within the bound of another batch
    shape, as turn by turn against continuous above."""
    import random
    import threading
    import time

    from rollout import rollout_batch

    cfg, tok, questions, search_fn, _ = setup
    threads, delays = set(), random.Random()

    def slow_search(queries):
        threads.add(threading.current_thread().name.split("_")[0])
        time.sleep(delays.uniform(0, 0.04))
        return search_fn(queries)

    inline = rollout_batch(vllm_engine, tok, questions, 4, search_fn, replace(cfg.rollout, tool_workers=0), seed=3)
    beside = rollout_batch(vllm_engine, tok, questions, 4, slow_search, replace(cfg.rollout, tool_workers=4), seed=3)
    assert threads == {"tools"}, "every search ran in the pool, off the engine's loop"
    assert sum(r["num_searches"] for r in beside) >= 16
    lp = logprob_atol(model_vocab(micro[2]))
    for a, b in zip(inline, beside):
        assert (a["response_ids"], a["loss_mask"], a["finish"], a["tool_calls"]) == \
            (b["response_ids"], b["loss_mask"], b["finish"], b["tool_calls"])  # fmt: skip
        assert_close(b["logprobs"], a["logprobs"], rtol=0, atol=lp, what="searches beside vs in the loop")


def test_a_search_that_fails_beside_generation_is_raised_and_leaves_no_request(vllm_engine, setup):
    """A tool call's error (a RetrieverError after its retries) reaches the caller from the pool, and
    the engine is left with no request of the failed rollout: the next rollout runs as usual."""
    from rollout import rollout_batch

    cfg, tok, questions, search_fn, _ = setup

    def failing(queries):
        raise RuntimeError("retriever down")

    with pytest.raises(RuntimeError, match="retriever down"):
        rollout_batch(vllm_engine, tok, questions, 4, failing, cfg.rollout, seed=3)
    assert not vllm_engine.llm.llm_engine.has_unfinished_requests()
    assert len(rollout_batch(vllm_engine, tok, questions[:2], 2, search_fn, cfg.rollout, seed=3)) == 4


@pytest.mark.numeric
def test_vllm_and_hf_agree_greedily(vllm_engine, setup, micro):
    from rollout import rollout_batch

    cfg, tok, questions, search_fn, _ = setup
    hf = make_engine("hf", micro[2], cfg.rollout)
    a = rollout_batch(vllm_engine, tok, questions[:4], 1, search_fn, cfg.rollout, greedy=True)
    b = rollout_batch(hf, tok, questions[:4], 1, search_fn, cfg.rollout, greedy=True)
    same = sum(x["response_ids"] == y["response_ids"] for x, y in zip(a, b))
    assert same >= 3  # fp32 on both sides; a near-tie argmax may rarely flip
    lp = logprob_atol(model_vocab(micro[2]))  # vLLM's kernels vs torch's, the same fp32 weights
    for x, y in zip(a, b):
        if x["response_ids"] == y["response_ids"]:
            assert_close(x["logprobs"], y["logprobs"], rtol=0, atol=lp, what="vLLM vs transformers logprobs")


@pytest.mark.numeric
def test_stop_strings_of_one_token_stop_on_ids_and_cut_where_the_text_first_holds_one(vllm_engine, setup, micro):
    """Every stop string one token (the tiny world's tags): VLLMEngine stops on ids and vLLM decodes
    no text; the completion is cut where its text first holds a stop string, as vLLM's own stop
    strings cut it. "e" is one token and inside many others (" the"), so most completions need the
    cut; the same stop with a string no token spells beside it takes vLLM's string path."""
    cfg, tok, questions, _, _ = setup
    never = "\u00a7never\u00a7"
    assert vllm_engine._stop_ids(["e"]) is not None and vllm_engine._stop_ids(["e", never]) is None
    prompts = [tok.encode(q["question"]) for q in questions] * 4
    n = len(prompts)
    by_ids = vllm_engine.generate(prompts, [40] * n, 1.5, 1.0, ["e"], list(range(n)))
    by_text = vllm_engine.generate(prompts, [40] * n, 1.5, 1.0, ["e", never], list(range(n)))
    assert [(c.token_ids, c.finish_reason) for c in by_ids] == [(c.token_ids, c.finish_reason) for c in by_text]
    lp = logprob_atol(model_vocab(micro[2]))  # one engine, two batches: fp32 rounding only
    for a, b in zip(by_ids, by_text):
        assert_close(a.logprobs, b.logprobs, rtol=0, atol=lp, what="logprobs, stopped on ids vs on text")
    cut = [c for c in by_ids if c.token_ids and c.token_ids[-1] not in vllm_engine._stop_ids(["e"])
           and "e" in tok.decode(c.token_ids)]  # fmt: skip
    assert len(cut) >= n // 4, f"only {len(cut)} of {n} completions ended on an 'e' inside a longer token"


@pytest.mark.numeric
def test_weight_sync_makes_vllm_match_the_trainer(vllm_engine, micro):
    check_weight_sync(vllm_engine, micro[2])


@pytest.mark.slow
@pytest.mark.numeric
def test_file_weight_sync_to_an_engine_in_its_own_process(micro):
    """rollout.weight_sync: file, the fallback: vLLM's engine in a spawned process, the weights
    through a safetensors file that its workers load (engine.WeightFileReload, which they import
    by its module's name). In a fresh process: this one has imported numba by now."""
    done = subprocess.run([sys.executable, "tests/weight_sync_check.py", str(micro[0]), str(micro[2])], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "weight sync through the file: ok" in done.stdout


def test_weight_sync_no_longer_warns_about_the_rotary_cache(vllm_engine, micro, caplog):
    """vLLM warns "RotaryEmbedding: Failed to load weights" at every sync (a buffer no checkpoint
    holds, restored by vLLM); trainer/engine.py filters that one line. Without the filter it is there."""
    weights = list(load_policy(micro[2]).state_dict().items())
    reload_logger = logging.getLogger(RELOAD_LOGGER)
    reload_logger.removeFilter(quiet_rotary_reload_warning)
    try:
        caplog.clear()
        vllm_engine.load_weights(weights)
        unfiltered = caplog.text
    finally:
        reload_logger.addFilter(quiet_rotary_reload_warning)
    caplog.clear()
    vllm_engine.load_weights(weights)
    assert "RotaryEmbedding: Failed to load weights" in unfiltered
    assert "Failed to load weights" not in caplog.text


def test_the_trainer_keeps_its_threads_and_cpus_beside_vllm(vllm_engine):
    """vLLM CPU's worker, in this process, swaps torch.set_num_threads for a no-op for good
    (vllm/v1/worker/cpu_worker.py); trainer/engine.py gives the real one back, so train.threads
    holds beside the engine as beside transformers. And vLLM binds nothing here: the process
    keeps every CPU it started with (an in-process binding would leave the update fewer)."""
    import torch

    threads = torch.get_num_threads()
    other = 1 if threads > 1 else 2
    try:
        torch.set_num_threads(other)
        assert torch.get_num_threads() == other
    finally:
        torch.set_num_threads(threads)
    assert os.sched_getaffinity(0) == CPUS_BEFORE_VLLM


def test_engine_refuses_to_start_after_numba(micro):
    code = (
        "import sys; sys.path.insert(0, '.'); import numba; from trainer.config import RolloutConfig; "
        f"from trainer.engine import make_engine; make_engine('vllm', {str(micro[2])!r}, RolloutConfig())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode != 0
    assert "vLLM must be started before bm25s/numba" in out.stderr


def test_sleep_mode_is_refused_on_cpu_with_a_clear_error(micro):
    """vLLM's sleep mode exists on CUDA/ROCm only; on this CPU build the engine refuses the
    setting before starting (the GPU configs turn it on: a GPU path, not run here)."""
    from dataclasses import replace

    from trainer.config import ConfigError

    _, cfg, policy, _ = micro
    with pytest.raises(ConfigError, match="rollout.sleep_mode"):
        make_engine("vllm", policy, replace(cfg.rollout, sleep_mode=True))


def test_a_tokenizer_without_a_pad_token_pads_with_eos(micro, tmp_path):
    """SmolLM2's GGUF converted under transformers 5.17 names no pad token (seen on the lent H200:
    the transformers engine failed with "Could not infer dtype of NoneType", then the update in
    pad_batch). A tiny random Llama with the micro world's vocabulary and no pad token: load_tokenizer
    gives it EOS, and the transformers engine generates a padded batch."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    _, cfg, policy, _ = micro
    fast = PreTrainedTokenizerFast(tokenizer_file=str(policy / "tokenizer.json"), eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(fast), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path)  # fmt: skip
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token_id is None  # the case: transformers gives none
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id is not None
    engine = make_engine("hf", tmp_path, cfg.rollout)
    prompts = [tokenizer("Question: who?")["input_ids"], tokenizer("Q")["input_ids"]]  # two lengths: padding
    outs = engine.generate(prompts, max_tokens=[4, 4], temperature=1.0, top_p=1.0, stop=STOP, seeds=[0, 1])
    assert all(1 <= len(o.token_ids) <= 4 and len(o.logprobs) == len(o.token_ids) for o in outs)


def test_a_spawned_engine_gets_its_own_processs_gpu():
    """rollout.weight_sync: file spawns vLLM's engine core; CUDA_VISIBLE_DEVICES for it names the
    training process's own GPU (issue 33, item 8: before, 8 engines landed on GPU 0). A mock of
    nothing: the choice is a function of LOCAL_RANK and the launcher's CUDA_VISIBLE_DEVICES, which
    VLLMEngine sets around the spawn only where CUDA is there (no GPU here to land on)."""
    from trainer.engine import engine_gpu

    assert [engine_gpu(r, None, 8) for r in range(8)] == [str(r) for r in range(8)]
    assert [engine_gpu(r, "6, 7", 2) for r in range(2)] == ["6", "7"]  # a launcher's subset, spaces
