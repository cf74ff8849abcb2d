"""The 8-GPU box's path, read against vLLM 0.32 and FSDP2 (issue 53): what a CPU can show of it.

The entropy's gradient in chunks (batching._LogprobsEntropy): its values and gradients against a
float64 log_softmax, and its peak memory measured, beside trainer/plan.py's count of it."""

import ctypes
import math

import pytest
import torch
from numerics import FP32_FORMULA, assert_close, logprob_atol

from trainer.batching import logprobs_and_entropy
from trainer.plan import logits_bytes


def _reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple:
    """The unchunked computation in float64: torch's log_softmax, its gather, -sum p log p."""
    logp = torch.log_softmax(logits.double(), -1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 256])
def test_chunked_entropy_values_and_gradients_equal_the_unchunked_ones(chunk):
    """Against float64, so the whole difference is the fp32 path's. Log-probs: logprob_atol (a sum
    of V terms in another order, |z| < 4). Entropy: V terms p log p, each log p within it (sum p =
    1): twice it. Gradients of sum(w1 lp + w2 H): w1 (onehot - p) + w2 (-p (log p + H)): p within
    FP32_FORMULA of itself, log p and H within their bounds, |p (log p + H)| <= 1 + log V, so
    |w| (FP32_FORMULA (2 + log V) + 3 logprob_atol) bounds an entry."""
    torch.manual_seed(0)
    vocab = 50
    base = (torch.randn(3, 8, vocab) * 1.3).clamp(-4, 4)
    logits = base[:, :-1].clone().requires_grad_(True)  # a [:, :-1] view's shape, as the trainer's
    targets = torch.randint(0, vocab, (3, 7))
    w1, w2 = torch.randn(3, 7), torch.randn(3, 7)
    lp, ent = logprobs_and_entropy(logits, targets, entropy_grad=True, chunk=chunk)
    ((lp * w1).sum() + (ent * w2).sum()).backward()
    ref_lp, ref_ent = _reference(logits.detach().double().requires_grad_(True), targets)
    x = logits.detach().double().requires_grad_(True)
    r_lp, r_ent = _reference(x, targets)
    ((r_lp * w1.double()).sum() + (r_ent * w2.double()).sum()).backward()
    atol = logprob_atol(vocab, logit_max=4.0)
    assert_close(lp.double(), ref_lp, rtol=0, atol=atol, what="logprobs")
    assert_close(ent.double(), ref_ent, rtol=0, atol=2 * atol, what="entropy")
    w = max(w1.abs().max(), w2.abs().max()).item()
    grad_atol = w * (FP32_FORMULA * (2 + math.log(vocab)) + 3 * atol)
    assert_close(logits.grad.double(), x.grad, rtol=0, atol=grad_atol, what="gradients")
    assert torch.equal(logits.detach(), base[:, :-1])  # fp32 logits are not changed in place
    # without entropy_grad: the same logprob gradient, no gradient through the entropy
    logits.grad = None
    lp2, ent2 = logprobs_and_entropy(logits, targets, entropy_grad=False, chunk=chunk)
    assert not ent2.requires_grad and torch.equal(ent2, ent.detach())


def _rss_peak_reset() -> int:
    """Return the resident set now (bytes) and restart the peak (VmHWM) from it: Linux's
    /proc/self/clear_refs "5". glibc is told to map every block of 1 MB or more on its own
    (mallopt M_MMAP_THRESHOLD, which also stops its threshold from growing after a free), so a
    freed tensor leaves the resident set at once, and its free memory is handed back first
    (malloc_trim), so pages freed earlier are not counted as in use."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_entropy_peak_memory_is_the_plans_count():
    """The peak resident memory of logprobs_and_entropy(entropy_grad=True) forward and backward,
    beyond its inputs, against plan.logits_bytes. Measured as the kernel's peak resident set
    (VmHWM, reset before), not torch's allocator statistics, which CPU tensors have none of:
    torch's CPU allocator is plain malloc and frees at once, and tensors of >= 32 MB are mmap'd
    pages, resident once written, unmapped when freed (_rss_peak_reset). 2 x 2048 positions of a
    4096 vocabulary in fp32: the logits are 67 MB, their gradient 67 MB, two [1024, 4096] slices
    16.8 MB each. A page is resident once written, and the gradient is written a chunk at a time,
    so the measured peak may be one slice below the plan's (a GPU allocator reserves the whole
    gradient at once, as the plan counts); the allowance above, 8 MB, is the small [B, T] vectors
    and the interpreter's own pages. The unchunked torch path (fcae7e2) held ~4-5 x 67 MB here:
    log_softmax, exp, product, their backward."""
    torch.manual_seed(0)
    B, T, V, chunk = 2, 2048, 4096, 1024
    logits = torch.randn(B, T, V).requires_grad_(True)
    targets = torch.randint(0, V, (B, T))
    w = torch.randn(B, T)
    torch.set_num_threads(1)  # no per-thread scratch in the measurement
    base = _rss_peak_reset()
    lp, ent = logprobs_and_entropy(logits, targets, entropy_grad=True, chunk=chunk)
    ((lp * w).sum() + (ent * w).sum()).backward()
    extra = _status("VmHWM") - base
    _, planned = logits_bytes(B * T, V, 4, chunk)
    assert planned == B * T * V * 4 + 2 * chunk * V * 4
    assert planned - chunk * V * 4 - 2e6 <= extra <= planned + 8e6, (extra / 1e6, planned / 1e6)
