"""tests/numerics.py itself: the bound, its absolute floor, the failure message and the margin lines
that benchmarks/cpu_kernels.py reads."""

import json

import numpy as np
import pytest
import torch
from numerics import EPS32, assert_close, assert_equal_bits, logprob_atol, sum_rtol


def test_a_relative_bound_has_its_floor_and_fails_naming_what(monkeypatch):
    monkeypatch.delenv("NUMERIC_MARGINS", raising=False)  # its failures on purpose are no margins
    assert_close(0.0, -8.5e-11, rtol=1e-5, atol=1e-9, what="kl")  # both 0 up to rounding: the floor holds
    assert_close(torch.tensor([1.0, 2.0]), np.array([1.0, 2.0 + 1e-6]), rtol=1e-6, atol=0.0, what="x")
    with pytest.raises(AssertionError, match=r"grad: .*up to 0\.5.*worst at \(1, 0\).*> bound 0\.1"):
        assert_close([[1.0], [2.5]], [[1.0], [2.0]], rtol=0.0, atol=0.1, what="grad")
    with pytest.raises(AssertionError, match="nan"):
        assert_close(float("nan"), 1.0, rtol=1.0, atol=1.0, what="nan")
    with pytest.raises(AssertionError, match="shape"):
        assert_close([1.0, 2.0], [1.0], rtol=0.0, atol=1.0, what="shape")
    assert_close([1.0, 2.0], [1.5, 2.0], rtol=0.0, atol=[0.5, 0.0], what="one floor per element")


def test_margins_are_recorded_one_json_line_per_check(monkeypatch, tmp_path):
    path = tmp_path / "margins.jsonl"
    monkeypatch.setenv("NUMERIC_MARGINS", str(path))
    assert_close([1.0, 3.0], [1.0, 2.0], rtol=0.5, atol=0.5, what="half")  # |3 - 2| = 1 of a bound 1.5
    assert_equal_bits({"w": torch.ones(3)}, {"w": torch.ones(3)}, what="state")
    with pytest.raises(AssertionError, match="not bit-equal"):
        assert_equal_bits(torch.ones(2), torch.tensor([1.0, 1.0 + EPS32]), what="bits")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["what"] for r in rows] == ["half", "state", "bits"]
    assert rows[0]["test"].endswith("test_numerics.py::test_margins_are_recorded_one_json_line_per_check")
    # float64, one division: approx's default (rel 1e-6, abs 1e-12)
    assert (rows[0]["max_err"], rows[0]["bound"], rows[0]["ratio"]) == pytest.approx((1.0, 1.5, 2 / 3))
    assert rows[1]["ratio"] == 0.0 and rows[2]["ratio"] == float("inf") and rows[2]["bound"] == 0.0
    assert set(rows[0]) == {"test", "what", "max_err", "bound", "ratio"}


def test_named_tolerances_follow_their_formulas():
    assert sum_rtol(1) == sum_rtol(2) == EPS32 and sum_rtol(700) == 699 * EPS32
    assert logprob_atol(768) == pytest.approx(1.07e-4, abs=5e-7)  # 9.1e-5 + 1.5e-5, to the 3 digits quoted
