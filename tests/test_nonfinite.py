"""A non-finite loss or gradient stops the update before the optimizer touches the weights
(issue: one NaN reward turned all 50 weight tensors NaN in one step, and the run went on).

A real tiny transformers policy, a real rollout record (scripted completions, as in
test_masking.py), the real grpo_step with AdamW."""

import math

import pytest
import torch
from test_masking import roll, setup

from trainer.config import TrainingFault
from trainer.grpo import grpo_step


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("advantage", [math.nan, math.inf])
def test_non_finite_advantage_stops_the_step_and_leaves_the_weights(tmp_path, advantage):
    tok, cfg, model, engine = setup(tmp_path)
    record = roll(tok, cfg, engine, "P was born in the city of C.") | {"advantage": advantage}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = _weights(model)
    with pytest.raises(TrainingFault, match=r"non-finite (loss|gradient norm).*weights unchanged"):
        grpo_step(model, None, [record], opt, cfg, tok.pad_token_id)
    after = _weights(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit for bit: no step was taken, nothing written
    assert not opt.state  # AdamW never ran: no moments were made from NaN gradients
    assert all(p.grad is None for p in model.parameters())  # and the NaN gradients are dropped
    # the same record with a finite advantage steps as usual: the check does not block training
    grpo_step(model, None, [record | {"advantage": 1.0}], opt, cfg, tok.pad_token_id)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_non_finite_weight_is_named(tmp_path):
    tok, cfg, model, engine = setup(tmp_path)
    record = roll(tok, cfg, engine, "P was born in the city of C.") | {"advantage": 1.0}
    name, weight = next((n, p) for n, p in model.named_parameters() if n.endswith("mlp.up_proj.weight"))
    with torch.no_grad():
        weight[0, 0] = math.nan
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(TrainingFault, match=f"the weight {name} is already non-finite"):
        grpo_step(model, None, [record], opt, cfg, tok.pad_token_id)
    assert not opt.state


def test_non_finite_engine_logprobs_are_named_as_the_engines(tmp_path):
    """A real rollout record whose engine log-probabilities hold a NaN (what vLLM CPU gave under an
    ATEN_CPU_CAPABILITY it does not tolerate) stops the step naming the engine, before any reward
    or loss; a NaN on a tool token (logprob 0.0 by construction there) would not be the engine's."""
    from trainer.faults import check_engine_logprobs

    tok, cfg, model, engine = setup(tmp_path)
    record = roll(tok, cfg, engine, "P was born in the city of C.")
    check_engine_logprobs([record], "hf", 1)  # a finite record passes
    first = record["loss_mask"].index(1)
    record["logprobs"][first] = math.nan
    with pytest.raises(TrainingFault, match=r"step 4: the rollout engine \(hf\) returned non-finite log-probabilities "
                                            r"for 1 of \d+ generated tokens: the engine's numerics"):  # fmt: skip
        check_engine_logprobs([record], "hf", 4)
