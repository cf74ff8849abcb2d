"""GRPO math against the formulas of DESIGN.md §4, worked by hand."""

import math

import pytest
import torch

from train import group_advantages, grpo_token_loss, k3_kl


def test_group_advantages_by_hand():
    adv = group_advantages([1, 0, 0, 1, 0.5, 0.5], ["a"] * 4 + ["b"] * 2)
    std = math.sqrt((4 * 0.25) / 3)  # unbiased std of [1, 0, 0, 1]
    assert adv[:4] == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    assert adv[4:] == [0.0, 0.0]  # equal rewards: no signal


def test_k3_matches_formula_and_is_clamped():
    logp = torch.tensor([-1.0, -2.0, -0.5, -30.0])
    ref = torch.tensor([-1.0, -1.5, -0.7, -1.0])
    d = ref - logp
    expected = (torch.exp(d) - d - 1).clamp(-10, 10)
    assert torch.allclose(k3_kl(logp, ref), expected)
    assert k3_kl(logp, ref)[0] == 0 and k3_kl(logp, ref)[3] == 10


def test_clip_by_hand():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5]))  # ratios
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, _, clipped = grpo_token_loss(logp, old, adv, None, 0.2, 0.0)
    # A>0: min(1.5, 1.2) = 1.2 ; min(0.5, 0.8) = 0.5 ; A<0: min(-1.5, -1.2) = -1.5 ; min(-0.5,-0.8) = -0.8
    assert loss.tolist() == pytest.approx([-1.2, -0.5, 1.5, 0.8])
    assert clipped.tolist() == [1.0, 0.0, 0.0, 1.0]
