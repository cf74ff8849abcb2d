"""Each rank's own vLLM engine after an FSDP update and an in-memory sync, against the trainer.

    torchrun --nproc_per_node 2 tests/engine_sync.py CONFIG OUT_DIR [TENSOR_PARALLEL_SIZE]

Every rank: the policy sharded with FSDP2, an engine in this process (vLLM's external_launcher,
engine.make_engine(launcher=True); with tensor parallel size 2 both ranks share one), one AdamW
step on a loss that moves every weight, then the sync train.py runs (distributed.full_weights
with every_rank, one tensor at a time, into engine.load_weights). Each rank writes
OUT_DIR/rank<k>.json: the largest |log p_engine - log p_trainer| over a fixed sequence before the
sync (the engine still holds the old weights: large) and after it (tests/test_fsdp.py: within
numerics.logprob_atol, vLLM's kernels vs torch's).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data import ensure_policy  # noqa: E402
from trainer import distributed  # noqa: E402
from trainer.batching import token_logprobs  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.engine import load_policy, make_engine  # noqa: E402
from trainer.precision import resolve as resolve_precision  # noqa: E402

SEQUENCE = [5, 17, 42, 99, 7, 250, 3, 77, 18, 64, 130, 9, 300, 11, 45, 2]


def main() -> None:
    config, out = sys.argv[1], Path(sys.argv[2])
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    rank, world, _ = distributed.init()
    cfg = load_config(config, ["train.fsdp=true", f"rollout.tensor_parallel_size={tp}"])
    resolve_precision(cfg)  # this machine's bf16 / dtype for the `auto` keys
    policy = ensure_policy(cfg, out)
    engine = make_engine("vllm", policy, cfg.rollout, "float32", seed=0, launcher=True)
    torch.set_num_threads(1)
    model = distributed.shard(load_policy(policy), cfg)
    optimizer = distributed.make_optimizer(list(model.parameters()), 1e-2, 0.0)
    ids = torch.tensor([SEQUENCE])
    loss = -token_logprobs(model, ids, torch.ones_like(ids)).mean()  # ascend the sequence's likelihood
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        trainer = token_logprobs(model, ids, torch.ones_like(ids))[0].tolist()
    before = max(abs(a - b) for a, b in zip(engine.score(SEQUENCE), trainer))
    calls = []  # the retriever as a tensor-parallel group sees it: called on its first rank only
    shared = engine.share_tool(lambda queries: calls.append(queries) or [f"hits of {q}" for q in queries])
    tool = {"results": shared(["q1", "q2"]), "calls": len(calls)}
    t = time.perf_counter()
    engine.load_weights(distributed.full_weights(model, rank, every_rank=True))
    sync_s = time.perf_counter() - t
    after = max(abs(a - b) for a, b in zip(engine.score(SEQUENCE), trainer))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"before": before, "after": after, "sync_s": sync_s,
                                                      "world": world, "tp": tp, "tool": tool}))  # fmt: skip
    engine.close()
    distributed.close(world)


if __name__ == "__main__":
    main()
