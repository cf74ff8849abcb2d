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


# ---------------------------------------------------------------------------------------------
# vLLM's settings per platform, the reload through Worker.reload_weights, the file sync.


def test_cpu_workarounds_stay_on_cpu_and_the_gpu_settings_are_explicit(monkeypatch):
    """vllm_setup.vllm_options is a function of the platform: CPU gets chunked prefill off and AOT
    compile off; a GPU gets neither, and the V2 runner, async scheduling and batch invariance set
    and named in the line printed at start. (The GPU branch is only computed here: no GPU.)"""
    from trainer.vllm_setup import vllm_options

    for key in ("VLLM_USE_AOT_COMPILE", "VLLM_USE_V2_MODEL_RUNNER", "VLLM_BATCH_INVARIANT"):
        monkeypatch.delenv(key, raising=False)
    env, kwargs, line = vllm_options(cpu=True)
    assert env == {"VLLM_USE_AOT_COMPILE": "0"} and kwargs == {"enable_chunked_prefill": False}
    env, kwargs, line = vllm_options(cpu=False)
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_BATCH_INVARIANT": "1"}
    assert kwargs == {"async_scheduling": True} and "enable_chunked_prefill" not in kwargs
    assert "V2 runner on" in line and "async scheduling" in line and "batch invariance on" in line
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")  # the user's choice wins, and the line says so
    assert "batch invariance off" in vllm_options(cpu=False)[2]


def test_the_sync_reloads_through_the_workers_reload_weights(vllm_engine, micro, monkeypatch):
    """collective_rpc("reload_weights"): vLLM's Worker.reload_weights (CPUWorker inherits it) runs
    the model runner's under set_current_vllm_config. A spy on that method (the real one still
    runs) sees every sync; fcae7e2 called model_runner.reload_weights directly, past it. Then the
    engine scores with the weights it was given: the model's own, so its logprobs are unchanged."""
    from vllm.v1.worker.gpu_worker import Worker

    from trainer.engine import load_policy

    calls, real = [], Worker.reload_weights

    def spy(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return real(self, *args, **kwargs)

    ids = [1, 5, 9, 13, 2]
    before = vllm_engine.score(ids)
    monkeypatch.setattr(Worker, "reload_weights", spy)
    vllm_engine.load_weights(load_policy(micro[2]).state_dict().items())
    assert calls == ["CPUWorker"]
    assert vllm_engine.score(ids) == pytest.approx(before, abs=1e-5)


@pytest.fixture
def small_shm(tmp_path):
    """A 4 MiB tmpfs standing in for Docker's small /dev/shm (ENOSPC from the kernel)."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "shm"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def test_the_file_sync_writes_one_tensor_at_a_time_and_checks_the_space_first(small_shm, monkeypatch):
    """vllm_setup.write_weight_files: one file per tensor, read back in order and equal; on a 4 MiB
    tmpfs a tensor that does not fit stops with one line naming the directory, before writing it
    (the margin is set to 0 here, the tmpfs being smaller than the real 64 MB margin)."""
    from trainer import vllm_setup

    monkeypatch.setattr(vllm_setup, "SHM_MARGIN", 0)
    small = [(f"w{i}", torch.full((64, 64), float(i))) for i in range(3)]  # 16 KB each
    paths = vllm_setup.write_weight_files(iter(small), small_shm)
    assert [p.name for p in paths] == ["000000.safetensors", "000001.safetensors", "000002.safetensors"]
    back = list(vllm_setup.read_weight_files(small_shm))
    assert [n for n, _ in back] == ["w0", "w1", "w2"] and all(torch.equal(a, b) for (_, a), (_, b) in zip(back, small))
    for p in paths:
        p.unlink()
    seen = []

    def stream():
        for i in range(3):
            seen.append(i)
            yield f"big{i}", torch.zeros(384, 1024)  # 1.5 MiB each: the third does not fit beside two

    with pytest.raises(OSError, match=rf"{small_shm}: \d+ MB free, big\d needs"):
        vllm_setup.write_weight_files(stream(), small_shm)
    assert seen == [0, 1, 2] and not (small_shm / "000002.safetensors").exists()
