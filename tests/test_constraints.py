"""Lagrangian constraints (trainer/constraints.py): the dual update worked by hand, warm-up, fixed
lambda, both directions, bad specs, and the state a checkpoint carries.

lambda and the rewards are Python floats (float64) from a few exps and products: pytest.approx's
default (rel 1e-6, abs 1e-12) is far above their rounding (~1e-16)."""

import math

import pytest

from trainer.config import ConfigError
from trainer.constraints import (
    apply_to_rewards,
    batch_statistic,
    current_lambda,
    dual_update,
    parse_constraints,
    restore,
    reward_params,
    state,
    step,
    switch_on,
)

RELIABILITY = {"name": "rel", "stat": "reward/reliability", "param": "lam"}


def _records(values: list[float], key: str = "reliability") -> list[dict]:
    return [{"reward": 1.0, "reward_components": {key: v}} for v in values]


def test_paper_defaults_and_the_multiplicative_update_by_hand():
    (c,) = parse_constraints([RELIABILITY])
    assert (c.lambda0, c.eta, c.threshold, c.warmup_frac) == (0.01, 0.1, 0.9, 0.25)
    switch_on([c], step=0, total_steps=100)
    assert current_lambda(c) == 0.0  # warm-up: the reliability term is off
    dual_update(c, 0.2)
    assert c.lam == 0.0 and c.last_value == 0.2  # and lambda does not move
    switch_on([c], step=25, total_steps=100)
    assert current_lambda(c) == 0.01  # initialised to lambda0 when it comes on (§3.2)
    dual_update(c, 0.5)  # U = 0.5 < a = 0.9: lambda * exp(0.1 * 0.4)
    # float64, the same exp and product as the update: a few roundings (~1e-16), well inside 1e-12
    assert c.lam == pytest.approx(0.01 * math.exp(0.04), rel=1e-12, abs=1e-15)
    dual_update(c, 1.0)  # U = 1.0 > a: shrinks by exp(-0.01)
    assert c.lam == pytest.approx(0.01 * math.exp(0.04) * math.exp(-0.01), rel=1e-12, abs=1e-15)


def test_lambda_rises_while_violated_and_falls_once_met():
    (c,) = parse_constraints([RELIABILITY | {"warmup_frac": 0.0}])
    switch_on([c], 0, 10)
    history = [current_lambda(c)]
    for u in [0.3] * 10 + [0.99] * 10:
        history.append(dual_update(c, u))
    assert all(b > a for a, b in zip(history[:10], history[1:11]))
    assert all(b < a for a, b in zip(history[10:20], history[11:21]))


def test_lambda_max_bounds_the_dual_variable_and_it_still_falls_once_met():
    bounded, free = parse_constraints([RELIABILITY | {"warmup_frac": 0, "lambda0": 0.5, "eta": 0.5, "lambda_max": 0.8},
                                       RELIABILITY | {"warmup_frac": 0, "lambda0": 0.5, "eta": 0.5}])  # fmt: skip
    switch_on([bounded, free], 0, 10)
    for _ in range(20):  # U = 0.5 < a: x1.22 a step, past 0.9 (where eq. 6 pays a wrong answer) by step 3
        dual_update(bounded, 0.5), dual_update(free, 0.5)
    assert bounded.lam == 0.8 and free.lam == pytest.approx(0.5 * math.exp(0.5 * 0.4 * 20))
    assert reward_params([bounded], {}) == {"lam": 0.8}
    assert dual_update(bounded, 1.0) == pytest.approx(0.8 * math.exp(-0.05))  # met: it shrinks from the bound


def test_upper_bound_direction_flips_the_sign():
    (c,) = parse_constraints([{"name": "len", "stat": "reward/length", "threshold": 100, "direction": "<=",
                               "warmup_frac": 0, "eta": 0.01}])  # fmt: skip
    switch_on([c], 0, 10)
    assert dual_update(c, 150) == pytest.approx(0.01 * math.exp(0.5))  # U above the cap: lambda grows
    assert dual_update(c, 50) == pytest.approx(0.01 * math.exp(0.5) * math.exp(-0.5))


def test_fixed_lambda_ablation_never_moves():
    (c,) = parse_constraints([RELIABILITY | {"fixed_lambda": 0.1}])
    switch_on([c], 10, 20)
    for u in (0.0, 1.0, 0.3):
        assert dual_update(c, u) == 0.1
    assert reward_params([c], {"zeta": 5}) == {"zeta": 5, "lam": 0.1}


def test_additive_form_for_a_reward_without_a_lambda_parameter():
    (c,) = parse_constraints([{"name": "src", "stat": "reward/src", "threshold": 0.5, "warmup_frac": 0}])
    switch_on([c], 0, 10)
    c.lam = 2.0
    records = _records([1.0, 0.0], key="src")
    apply_to_rewards([c], records)
    assert [r["reward"] for r in records] == [1.0 + 2.0 * 0.5, 1.0 - 2.0 * 0.5]
    assert batch_statistic("reward/src", records) == 0.5
    assert batch_statistic("reward", records) == 1.0


def test_a_constraint_on_the_reward_measures_u_before_its_own_term_and_logs_the_lambda_used():
    # issue 23.1: U on stat "reward" is the batch mean of the rewards as scored; measured after
    # the term it would be U + lambda (U - a) (here 0.25 + 2 (0.25 - 0.9) = -1.05)
    (c,) = parse_constraints([{"name": "r", "stat": "reward", "threshold": 0.9, "eta": 0.1, "warmup_frac": 0}])
    switch_on([c], 0, 10)
    c.lam = 2.0
    records = [{"reward": x, "reward_components": {}} for x in (1.0, 0.0, 0.0, 0.0)]
    row = step([c], records)
    assert row == {"lambda/r": 2.0, "constraint/r": 0.25}  # issue 23.9: the lambda these rewards used
    assert c.lam == pytest.approx(2.0 * math.exp(0.1 * (0.9 - 0.25)))  # the next step's
    assert [r["reward"] for r in records] == pytest.approx([1 + 2 * 0.1, -1.8, -1.8, -1.8])


def test_param_constraints_do_not_touch_rewards():
    (c,) = parse_constraints([RELIABILITY | {"warmup_frac": 0}])
    switch_on([c], 0, 10)
    records = _records([0.0, 1.0])
    apply_to_rewards([c], records)
    assert [r["reward"] for r in records] == [1.0, 1.0]


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"name": "a", "stat": "reward/x", "treshold": 0.9}, "unknown key 'treshold'"),
        ({"stat": "reward/x"}, "'name' is required"),
        ({"name": "a", "stat": "reward/x", "direction": ">"}, "direction must be"),
        ({"name": "a", "stat": "reward/x", "measure": "test"}, "measure must be"),
        ({"name": "a", "stat": "reward/x", "lambda0": 0}, "lambda0 must be > 0"),
        ({"name": "a", "stat": "reward/x", "lambda0": 0.5, "lambda_max": 0.1}, r"lambda_max \(0.1\) must be >="),
        ("reliability >= 0.9", "must be a mapping"),
    ],
)
def test_bad_constraint_specs_name_the_problem(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_constraints([spec])


def test_state_round_trip_restores_lambda_and_phase():
    (c,) = parse_constraints([RELIABILITY])
    switch_on([c], 50, 100)
    dual_update(c, 0.1)
    saved = state([c])
    (fresh,) = parse_constraints([RELIABILITY])
    restore([fresh], saved)
    assert (fresh.lam, fresh.active, fresh.last_value) == (c.lam, True, 0.1)
