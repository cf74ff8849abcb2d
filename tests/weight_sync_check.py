"""An engine's weight sync against the trainer, on a fixed sequence; run as a script, through the
file channel into an engine in a process of its own.

    python tests/weight_sync_check.py CONFIG POLICY_DIR     # rollout.weight_sync: file (exit 0: ok)

A script, not a test body: pytest's process has imported bm25s / numba by the time the test runs,
and vLLM must start before them (engine.VLLMEngine refuses otherwise). tests/test_rollout_engines.py
calls `check_weight_sync` on its in-process engine and runs this file for the spawned one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from numerics import assert_close, logprob_atol  # noqa: E402

from trainer.batching import token_logprobs  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.engine import load_policy, load_tokenizer, make_engine  # noqa: E402
from trainer.precision import resolve as resolve_precision  # noqa: E402


def check_weight_sync(engine, policy: str | Path) -> None:
    """The engine scores a fixed sequence as the trainer does (logprob_atol: vLLM's kernels vs
    torch's on the same fp32 weights), no longer after an update (so the check can fail), and
    again after load_weights; then the start weights go back."""
    tok = load_tokenizer(policy)
    model = load_policy(policy)
    ids = tok.encode("Answer the question. Question: Where was Ka Bo born?\n<think> I need", add_special_tokens=False)
    x = torch.tensor([ids])
    attn = torch.ones_like(x)

    lp = logprob_atol(model.config.vocab_size)

    def trainer() -> list[float]:
        with torch.no_grad():
            return token_logprobs(model, x, attn)[0].tolist()

    assert_close(engine.score(ids), trainer(), rtol=0, atol=lp, what="engine vs trainer before the update")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    (-token_logprobs(model, x, attn).sum()).backward()
    opt.step()
    # before the sync: no match (an AdamW step of 1e-2 on every weight moves them by far more)
    assert max(abs(a - b) for a, b in zip(engine.score(ids), trainer())) > 10 * lp
    engine.load_weights(model.state_dict().items())
    assert_close(engine.score(ids), trainer(), rtol=0, atol=lp, what="engine vs trainer after the sync")
    engine.load_weights(load_policy(policy).state_dict().items())  # the start weights, for what follows


if __name__ == "__main__":
    cfg = load_config(sys.argv[1])
    resolve_precision(cfg)  # this machine's bf16 / dtype for the `auto` keys
    file_engine = make_engine("vllm", sys.argv[2], cfg.rollout, separate_process=True)
    try:
        check_weight_sync(file_engine, sys.argv[2])
    finally:
        file_engine.close()
    print("weight sync through the file: ok")
