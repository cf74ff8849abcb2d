"""Floating-point bounds for the tests: named tolerances, each derived from what it allows for, and
the checks that use them.

    assert_close(actual, expected, rtol=..., atol=..., what="...")   # |a - b| <= atol + rtol |b|
    assert_equal_bits(actual, expected, what="...")                   # bit-equal, where the code says so
    assert_stats_close(a, b, lp, vocab, what)   # a training step's statistics, logprobs lp apart

Every relative bound has an absolute floor: two numbers that are 0 up to rounding (a KL of a
policy against itself, a whitened mean) have no meaningful relative error. Derive a bound from its
reason (how many roundings, of what size, in what precision), never from one machine's observed
error: another CPU runs other kernels (ATEN_CPU_CAPABILITY, oneDNN's blocking, vLLM's own ops).

NUMERIC_MARGINS=FILE appends one JSON line per check, {"test", "what", "max_err", "bound",
"ratio"}, ratio = max over the elements of |a - b| / (atol + rtol |b|): 1.0 is at the bound, 0 is
exact. benchmarks/cpu_kernels.py runs `pytest -m numeric` under each ATEN_CPU_CAPABILITY with it and
reports the tightest bounds.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping

import numpy as np

EPS32 = 2.0**-23  # 1.19e-7: fp32's machine epsilon; one rounding is within EPS32 / 2 of its result
EPS64 = 2.0**-52  # 2.2e-16: float64's (Python floats)


def sum_rtol(n: int, eps: float = EPS32) -> float:
    """The same sum of n terms added in another order (another blocking, SIMD width, thread or
    process split): each order is within (n - 1) eps/2 sum|x_i| of the exact sum (Higham, Accuracy
    and Stability of Numerical Algorithms, 2nd ed., §4.2), so two orders differ by at most
    (n - 1) eps sum|x_i|. Relative to sum|x_i|, not to the sum: where terms cancel, pass
    rtol=0 and atol=sum_rtol(n) * sum|x_i|."""
    return max(n - 1, 1) * eps


def ops_rtol(k: int, eps: float = EPS32) -> float:
    """k elementwise ops (+, *, /, exp, log, sqrt) evaluated in another order or precision: each
    rounds its result once, within eps/2 (exp and log: within an ulp, eps), and passes its inputs'
    relative error through with a factor ~1, so two evaluations differ by at most k eps relative to
    the largest intermediate."""
    return k * eps


# fp32 hand-worked formulas: a loss, KL, advantage or ratio of a few terms computed by torch in fp32
# against the same formula in Python float64. Up to 8 roundings on the path (ops_rtol(8)); the
# floor is the same bound at the size of the terms that cancel (|x| ~ 1 in these tests).
FP32_FORMULA = ops_rtol(8)  # 9.5e-7

# Logits of the models the tests run stay within |z| < LOGIT_MAX: the micro policy's (SFT'd, 768
# logits) peak near 16, random-init tiny models' near 1. A property of the weights, not of the CPU.
LOGIT_MAX = 32.0


def logit_atol(logit_max: float = LOGIT_MAX) -> float:
    """|z_a - z_b| for logits of the same fp32 weights (or weights one rounding apart, as merged
    LoRA) run by another kernel or batch shape (vLLM vs transformers, a KV cache filled by decoding
    vs one prefill, packed vs padded rows, another process's micro-batches, another
    ATEN_CPU_CAPABILITY). Each logit is the head's output, rounded at |z| <= logit_max. Taken as 2
    roundings per side, 4 eps logit_max: the final RMSNorm rescales what the upstream sums' order
    did to the hidden state down to its own rounding, and the head's sum is rounded at |z|. (The
    head's worst case, sum_rtol(hidden) sum_k |h_k w_k|, is ~100x more; blocked kernels' rounding
    errors cancel like a random walk instead of adding up.)"""
    return ops_rtol(4) * logit_max


def logprob_atol(vocab: int, logit_max: float = LOGIT_MAX) -> float:
    """|log p_a - log p_b| under another kernel or batch shape, as logit_atol. log p = z_t - m -
    log sum_j exp(z_j - m): the sum of `vocab` positive terms in another order moves by at most
    sum_rtol(vocab) of itself, which the log makes an absolute error; z_t - m moves as the logits
    do (logit_atol). The micro policy (768 logits): 9.1e-5 + 1.5e-5 = 1.07e-4."""
    return sum_rtol(vocab) + logit_atol(logit_max)


def model_vocab(model_dir) -> int:
    """The width of a saved model's logits (config.json's vocab_size), which may exceed its
    tokenizer's (the micro policy pads 700 tokens to 768)."""
    from pathlib import Path

    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def _as_array(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, any dtype (bf16 too)
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _test_id() -> str:
    test = os.environ.get("PYTEST_CURRENT_TEST", "")
    return test.rsplit(" (", 1)[0] if test.endswith(")") else test


def _record(what: str, max_err: float, bound: float, ratio: float) -> None:
    path = os.environ.get("NUMERIC_MARGINS")
    if not path:
        return
    line = json.dumps({"test": _test_id(), "what": what, "max_err": max_err, "bound": bound, "ratio": ratio})
    with open(path, "a") as f:  # one write per line: processes append side by side
        f.write(line + "\n")


def assert_close(actual, expected, *, rtol: float, atol, what: str) -> None:
    """|actual - expected| <= atol + rtol |expected| elementwise (floats, lists, numpy arrays,
    torch tensors; shapes must match; atol a number or one per element). One failure message:
    `what`, the largest error, the bound and the worst element (the largest error / bound)."""
    a, b = _as_array(actual), _as_array(expected)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != expected {b.shape}"
    floor = np.broadcast_to(_as_array(atol), a.shape)
    if a.size == 0:
        _record(what, 0.0, 0.0, 0.0)
        return
    with np.errstate(invalid="ignore", divide="ignore"):
        err = np.where(a == b, 0.0, np.abs(a - b))  # inf == inf: no error
        bound = floor + rtol * np.abs(b)
        ratio = np.where(err == 0, 0.0, err / bound)
    ratio = np.where(np.isnan(ratio), np.inf, ratio)  # a NaN on either side fails
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(ratio)), ratio.shape))
    max_err, r = float(np.nanmax(np.where(np.isnan(err), np.inf, err))), float(ratio[worst])
    _record(what, max_err, float(bound[worst]), r)
    where = f" at {worst if a.ndim > 1 else worst[0]}" if a.ndim else ""
    assert r <= 1.0, (f"{what}: |actual - expected| up to {max_err:.3g}; worst{where}: {float(a[worst])!r} vs "
                      f"{float(b[worst])!r}, error {float(err[worst]):.3g} > bound {float(bound[worst]):.3g} "
                      f"(atol {float(floor[worst]):.3g} + rtol {rtol:.3g} |expected|; {r:.3g}x the bound)")  # fmt: skip


def assert_equal_bits(actual, expected, *, what: str) -> None:
    """Bit-equal (same dtype, shape and values; torch.equal), for results the code guarantees
    exactly; a Mapping (a state dict) compares key by key. Say at the test what makes it exact.
    Records ratio 0 (equal) or inf."""
    if isinstance(expected, Mapping):
        assert set(actual) == set(expected), f"{what}: keys differ: {sorted(set(actual) ^ set(expected))[:5]}"
        diff = [k for k in expected if not _equal(actual[k], expected[k])]
        max_err = max((_max_err(actual[k], expected[k]) for k in diff), default=0.0)
        _record(what, max_err, 0.0, math.inf if diff else 0.0)
        assert not diff, (f"{what}: not bit-equal in {len(diff)} of {len(expected)}: {diff[:5]} "
                          f"(max |a - b| {max_err:.3g})")  # fmt: skip
        return
    same = _equal(actual, expected)
    max_err = 0.0 if same else _max_err(actual, expected)
    _record(what, max_err, 0.0, 0.0 if same else math.inf)
    assert same, f"{what}: not bit-equal (max |a - b| {max_err:.3g}; dtypes and shapes must match too)"


def _equal(a, b) -> bool:
    if hasattr(a, "detach") and hasattr(b, "detach"):
        import torch

        return a.dtype == b.dtype and torch.equal(a, b)
    return bool(np.array_equal(_as_array(a), _as_array(b)))


def _max_err(a, b) -> float:
    x, y = _as_array(a), _as_array(b)
    return float(np.max(np.abs(x - y))) if x.shape == y.shape and x.size else math.inf


def assert_stats_close(a: dict, b: dict, lp: float, vocab: int, what: str, a_max=1.5, rho_w=2.5) -> None:
    """A step's statistics from 2 runs whose per-token logprobs differ by up to `lp` (another
    batch shape) and whose float64 token sums come in another order (negligible: ~1e-16).
    - loss: token-weighted terms -A rho w, |A| <= a_max (1.5 in groups of 4 with 0/1 rewards),
      rho w <= rho_w (2.5 for the fake records' noisy engine logprobs; 1.2, the clip, on policy);
      rho and w each move relatively by <= 2 lp (a new and an old logprob): <= a_max rho_w 4 lp.
      The KL and entropy terms, scaled by their small coefficients, stay within that;
    - grad_norm: per-token gradient terms move relatively like the loss's (rho, w, and the
      softmax's p by lp): 4 lp, and the 2 processes' partial sums add once more (EPS32);
    - kl = mean k3(d), d = logp - ref: d moves by <= 2 lp, k3' = 1 - e^-d <= |d| with
      mean|d| <= sqrt(2 kl); and fp32 k3 = exp(-d) + d - 1 cancels terms of size 1 (3 roundings);
    - entropy H = -sum p log p: logprobs moved by eps_j move it by sum p_j eps_j (log p_j + 1), at
      most lp (H + 1); its own fp32 sum of V positive terms in another order adds sum_rtol(V) H;
    - clip_frac: a ratio within 2 lp of a clip edge may fall either side: one token, 1/n."""
    n = a["policy_tokens"]
    assert a["policy_tokens"] == b["policy_tokens"], what  # a count
    assert_close(a["loss"], b["loss"], rtol=0, atol=a_max * rho_w * 4 * lp, what=f"{what}: loss")
    assert_close(a["grad_norm"], b["grad_norm"], rtol=4 * lp + EPS32, atol=EPS32, what=f"{what}: grad_norm")
    kl_atol = 2 * lp * math.sqrt(2 * max(a["kl"], b["kl"], 0.0)) + ops_rtol(3)
    assert_close(a["kl"], b["kl"], rtol=0, atol=kl_atol, what=f"{what}: kl")
    assert_close(a["entropy"], b["entropy"], rtol=lp + sum_rtol(vocab), atol=lp, what=f"{what}: entropy")
    if "clip_frac" in a:
        assert_close(a["clip_frac"], b["clip_frac"], rtol=0, atol=1 / n, what=f"{what}: clip_frac")
