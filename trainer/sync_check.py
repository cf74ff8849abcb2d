"""After each weight sync: the engine is shown to serve the trainer's weights, by scoring one fixed
probe sequence with both and comparing the logprobs (issue 52; in verl #7495 a sync that failed
looked like staleness). A failed or partial sync stops the run in one line.

    expected = trainer_probe_logprobs(model, probe, dtype)   # before the sync (the model may go to the host)
    engine.load_weights(...)
    check_sync(engine, probe, expected, bound, step, world)   # TrainingFault past the bound
"""

from __future__ import annotations

import torch

from trainer.batching import token_logprobs
from trainer.config import Config, TrainingFault
from trainer.distributed import all_reduce, compute_device

PROBE_TOKENS = 48  # a few dozen tokens: one short forward on each side
LOGIT_MAX = 32.0  # |logit| of the policies run here (tests/numerics.py LOGIT_MAX says why)


def probe_ids(record: dict) -> list[int]:
    """The probe: the first PROBE_TOKENS of a record's prompt + response (the step's first record,
    the same on every rank: records are gathered), fixed by the run's seed."""
    return (list(record["prompt_ids"]) + list(record["response_ids"]))[:PROBE_TOKENS]


def probe_dtypes(model, cfg: Config, world: int) -> list[str]:
    """The dtypes the two sides compute the probe in: the engine's (model.dtype), the trainer's
    parameters', and bf16 where several processes shard the policy under train.bf16 (FSDP's
    MixedPrecisionPolicy computes every forward in bf16, autocast or not; one process's probe
    forward runs without autocast, in the parameters' dtype). Measured on the micro world, 2
    processes under bf16 against the fp32 engine: 0.036 nats apart with equal weights."""
    dtypes = [cfg.model.dtype, str(next(model.parameters()).dtype).removeprefix("torch.")]
    return dtypes + (["bfloat16"] if cfg.train.bf16 is True and world > 1 else [])


def sync_bound(dtypes: list[str], vocab: int) -> float:
    """The largest |log p_engine - log p_trainer| that the same weights may show under another
    kernel, in the least precise dtype of the two sides. fp32: tests/numerics.logprob_atol's
    derivation, the vocabulary's sum of exp in another order ((vocab - 1) eps of the log's
    argument) plus 4 roundings of a logit at |z| <= LOGIT_MAX (micro policy: 1.1e-4). bf16 / fp16:
    the logits themselves are rounded at eps |z| in every layer's output, and the two sides' kernels
    round them apart, so only the logit term is kept, at the low dtype's eps: 4 eps LOGIT_MAX (bf16:
    1.0 nats, fp16: 0.125); a sum bound over the vocabulary would exceed any corruption. So in
    bf16 a dropped or garbled tensor is caught, a one-step-stale sync (a small lr) may not be."""
    eps = max(torch.finfo(getattr(torch, d)).eps for d in dtypes)
    if eps <= torch.finfo(torch.float32).eps:
        return (vocab - 1) * eps + 4 * eps * LOGIT_MAX
    return 4 * eps * LOGIT_MAX


@torch.no_grad()
def trainer_probe_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) by the trainer's model, in its own dtype, no autocast. Under FSDP
    every rank calls it with the same ids: the forward gathers the shards together."""
    x = torch.tensor([ids], device=compute_device(model))
    return token_logprobs(model, x, torch.ones_like(x))[0].float().cpu()


def check_sync(engine, ids: list[int], expected: torch.Tensor, bound: float, step: int, world: int) -> float:
    """Scores ids with the engine (each rank its own) and raises a TrainingFault, on every rank
    alike (the largest difference over the ranks), when it is more than bound from expected.
    Returns the largest difference."""
    got = torch.tensor(engine.score(ids), dtype=torch.float32)
    diff = (got - expected).abs().max() if len(got) == len(expected) else torch.tensor(float("inf"))
    worst = float(all_reduce(torch.nan_to_num(diff, nan=float("inf")).double().reshape(1), world, "max"))
    if not worst <= bound:
        raise TrainingFault(f"step {step}: weight check after the sync: the engine's logprobs on the probe differ "
                            f"from the trainer's by up to {worst:.3g} (bound {bound:.3g}): the engine is not serving "
                            "the trainer's weights (a failed weight sync?); train.sync_check_every=0 turns the check "
                            "off")  # fmt: skip
    return worst
