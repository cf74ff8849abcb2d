"""The 8-GPU box's path, read against vLLM 0.32 and FSDP2 (issue 53): what a CPU can show of it.

The entropy's gradient in chunks (batching._LogprobsEntropy): its values and gradients against a
float64 log_softmax, and its peak memory measured, beside trainer/plan.py's count of it."""

import ctypes
import math
import re
from pathlib import Path

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


def test_the_file_sync_writes_one_tensor_at_a_time_and_checks_the_space_first(small_disk, monkeypatch):
    """vllm_setup.write_weight_files: one file per tensor, read back in order and equal; on a 4 MiB
    tmpfs a tensor that does not fit stops with one line naming the directory, before writing it
    (the margin is set to 0 here, the tmpfs being smaller than the real 64 MB margin)."""
    from trainer import vllm_setup

    monkeypatch.setattr(vllm_setup, "SHM_MARGIN", 0)
    small = [(f"w{i}", torch.full((64, 64), float(i))) for i in range(3)]  # 16 KB each
    paths = vllm_setup.write_weight_files(iter(small), small_disk)
    assert [p.name for p in paths] == ["000000.safetensors", "000001.safetensors", "000002.safetensors"]
    back = list(vllm_setup.read_weight_files(small_disk))
    assert [n for n, _ in back] == ["w0", "w1", "w2"] and all(torch.equal(a, b) for (_, a), (_, b) in zip(back, small))
    for p in paths:
        p.unlink()
    seen = []

    def stream():
        for i in range(3):
            seen.append(i)
            yield f"big{i}", torch.zeros(384, 1024)  # 1.5 MiB each: the third does not fit beside two

    with pytest.raises(OSError, match=rf"{small_disk}: \d+ MB free, big\d needs"):
        vllm_setup.write_weight_files(stream(), small_disk)
    assert seen == [0, 1, 2] and not (small_disk / "000002.safetensors").exists()


# ---------------------------------------------------------------------------------------------
# --plan for the paper configs (docs/box.md's table), each term by hand.

ROOT = Path(__file__).resolve().parents[1]
PAPER = sorted((ROOT / "configs").glob("search_r1_*_qwen2.5-*.yaml"))
QWEN = {  # config.json of Qwen2.5-3B and -7B: hidden, layers, kv heads x 128, MLP, vocab, tied
    "3b": (2048, 36, 2 * 128, 11008, 151936, True),
    "7b": (3584, 28, 4 * 128, 18944, 152064, False),
}


def paper_plan_by_hand(algo: str, size: str, offload: bool | str) -> dict:
    """The plan of a Search-R1 paper config on 8 x 80 GB, written out term by term: bf16 weights,
    FSDP over 8, checkpointing, 8192-token micro-batches, entropy_coef > 0, sleep mode, vLLM 0.6,
    and retriever.url on this box: wiki-18's Flat index (21,015,324 x 768 fp32) over the 8 GPUs.
    The state (weights, gradients, AdamW, the reference, the critic) under train.cpu_offload:
    false, on the GPU throughout; phase, on the GPU for the update and in host RAM for the
    rollout; micro_batch, in host RAM throughout."""
    h, L, kv, i, V, tied = QWEN[size]
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    root = V * h * (1 if tied else 2) + h
    P = root + L * layer
    critic = P - (0 if tied else V * h) + h + 1
    e5 = ((30522 + 512 + 2) * 768 + 2 * 768 + 12 * (4 * (768 * 768 + 768) + 2 * 768 * 3072 + 3072 + 768 + 4 * 768)
          + 768 * 768 + 768)  # fmt: skip
    index = 21_015_324 * 768 * 4
    T = 8192
    gpu = {
        "retriever_served": index / 8 + 1536 * 2**20 + 0.5e9 + e5 * 2,
        "overhead": 2e9,
        "fsdp_gathered": (2 * root + 3 * layer) * 2,
        "activations": T * L * 2 * h + T * 2 * (4 * h + 2 * h + 2 * kv + 4 * i),
        "logits": T * V * 2 * 2 + 2 * 256 * V * 4,
    }
    state = {"policy_weights": P * 2 / 8, "policy_grads": P * 2 / 8, "policy_optimizer": P * 12 / 8,
             "reference_weights": P * 2 / 8, "critic_state": critic * 16 / 8 if algo == "ppo" else 0}  # fmt: skip
    host = {k: v if offload else 0 for k, v in state.items()}
    gpu |= {k: 0 if offload == "micro_batch" else v for k, v in state.items()}
    on_gpu_in_update = 0 if offload == "micro_batch" else sum(state.values())
    on_gpu_in_rollout = 0 if offload else sum(state.values())
    policy = gpu["fsdp_gathered"] + gpu["activations"] + gpu["logits"]
    critic_ws = (2 * (V * h + 2 * h + 1) + 3 * layer) * 2 + gpu["activations"] if algo == "ppo" else 0
    resident = gpu["retriever_served"] + gpu["overhead"]
    return {"P": P, "gpu": gpu, "host": host, "train_total": resident + on_gpu_in_update + max(policy, critic_ws),
            "train_budget": 80e9 - 2e9, "rollout_total": 0.6 * 80e9 + resident + on_gpu_in_rollout,
            "host_per_gpu": sum(host.values()), "host_per_node": 8 * sum(host.values()) + index}  # fmt: skip


# train.cpu_offload of each paper config, as docs/box.md gives the reasons: the state fits beside
# vLLM's share during the rollout (false) but for PPO 7B's (phase: on the host for the rollout)
CONFIGURED = {("grpo", "3b"): False, ("grpo", "7b"): False, ("ppo", "3b"): False, ("ppo", "7b"): "phase"}


@pytest.mark.parametrize("offload", ["configured", False, "phase", "micro_batch"])
@pytest.mark.parametrize("path", PAPER, ids=[p.stem for p in PAPER])
def test_the_paper_configs_plans_match_a_hand_computation(path, offload, tmp_path):
    """Each row of --plan for the four GRPO and four PPO configs, as configured and under each
    train.cpu_offload, against paper_plan_by_hand, in GB (1e9 B). The model, corpus and encoder are
    named by their directories as in the configs, in an empty directory: the plan's built-in
    tables, not files this machine may hold. As configured, each fits."""
    from trainer.config import load_config
    from trainer.plan import memory_plan

    algo, size = path.stem.split("_")[2], path.stem.split("-")[1]
    assert len(PAPER) == 8 and algo in ("grpo", "ppo") and size in QWEN
    model = f"Qwen2.5-{size[:-1]}B" + ("-Instruct" if "instruct" in path.stem else "")
    cfg = load_config(path, [f"model.path={tmp_path / model}", f"data.corpus={tmp_path / 'wiki-18.jsonl'}",
                             f"retriever.model={tmp_path / 'e5-base-v2'}"])  # fmt: skip
    if offload == "configured":
        assert cfg.train.cpu_offload == CONFIGURED[algo, size]
    else:
        cfg.train.cpu_offload = offload
    plan, hand = memory_plan(cfg), paper_plan_by_hand(algo, size, cfg.train.cpu_offload)
    assert plan["model"]["params"] == hand["P"]
    for key, value in hand["gpu"].items():
        assert plan["gpu"][key] == pytest.approx(value / 1e9), key
    for key, value in hand["host"].items():
        assert plan["host"][key] == pytest.approx(value / 1e9), key
    for key in ("train_total", "train_budget", "rollout_total", "host_per_gpu", "host_per_node"):
        assert plan[key] == pytest.approx(hand[key] / 1e9), key
    assert plan["fits"] == (hand["train_total"] <= hand["train_budget"] and hand["rollout_total"] <= 80e9)
    assert plan["fits"] or offload != "configured"
    if (algo, size) == ("ppo", "7b") and offload is False:
        assert not plan["fits"]  # the rollout: 91.7 of 80 GB


def test_the_box_docs_memory_table_is_the_plans(tmp_path):
    """docs/box.md's table of the paper configs (base; Instruct's plan is the same): its offload,
    training and rollout peaks and host rows are what --plan computes for the shipped configs."""
    from trainer.config import load_config
    from trainer.plan import memory_plan

    box = (ROOT / "docs" / "box.md").read_text()
    for (algo, size), offload in CONFIGURED.items():
        row = next(line for line in box.splitlines() if line.startswith(f"| {algo.upper()} {size.upper()} |"))
        cells = [c.strip().strip("*") for c in row.strip("|").split("|")]
        path = ROOT / "configs" / f"search_r1_{algo}_qwen2.5-{size}-base.yaml"
        cfg = load_config(path, [f"model.path={tmp_path / f'Qwen2.5-{size[:-1]}B'}",
                                 f"data.corpus={tmp_path / 'wiki-18.jsonl'}",
                                 f"retriever.model={tmp_path / 'e5-base-v2'}"])  # fmt: skip
        plan = memory_plan(cfg)
        assert cells[1] == str(offload).lower(), row
        assert cells[8] == f"{plan['train_total']:.2f}** / 78", row
        assert cells[9] == f"{plan['rollout_total']:.2f}** / 80", row
        assert cells[10] == f"{plan['host_per_gpu']:.2f}" and cells[11] == f"{plan['host_per_node']:.1f}", row


# ---------------------------------------------------------------------------------------------
# The recipe, as a user on the box reads it.


def _bash_block(text: str, first_line: str) -> list[str]:
    """The command lines (comments dropped, continuations joined) of the ```bash block holding
    `first_line`."""
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if first_line in b)
    lines = block.replace("\\\n", " ").splitlines()
    return [c.split("  #")[0].strip() for c in lines if c.strip() and not c.startswith("#")]


def test_the_box_recipe_installs_before_it_downloads_and_waits_for_the_server():
    """docs/box.md's Search-R1 recipe and the README's short form: the install (python3.11, the
    uninstall as a command) before the first `hf`; the driver and the disk said; after the server
    starts in the background, a wait on /health before anything uses it."""
    box = (ROOT / "docs" / "box.md").read_text()
    steps = _bash_block(box, "hf download")
    install = next(i for i, c in enumerate(steps) if "pip install -r requirements-gpu.txt" in c)
    assert steps[install].startswith("python3.11 -m venv")
    assert install < next(i for i, c in enumerate(steps) if c.startswith("hf "))
    assert any(c.startswith(".venv/bin/pip uninstall -y torchvision torchaudio torchcodec") for c in steps)
    assert "R580" in box and "~150 GB of disk" in box
    readme = (ROOT / "README.md").read_text()
    for lines in (steps, _bash_block(readme, "index-e5 --port 8000")):
        serve = next(i for i, c in enumerate(lines) if "retriever.py serve" in c)
        assert lines[serve].endswith("&") and "/health" in lines[serve + 1] and lines[serve + 1].startswith("until ")
        assert all("train.py" not in c for c in lines[: serve + 1])


def test_the_readmes_wait_for_the_server_waits(tmp_path):
    """The README's `until curl ... /health` line, run by bash as written (the port and the pause
    made small): it is still waiting while nothing answers, and returns once a server does."""
    import subprocess
    import sys
    import time

    from conftest import free_port

    readme = (ROOT / "README.md").read_text()
    wait = next(c for c in _bash_block(readme, "index-e5 --port 8000") if c.startswith("until "))
    port = free_port()
    wait = wait.replace("8000", str(port)).replace("sleep 10", "sleep 0.2")
    waiting = subprocess.Popen(["bash", "-c", wait])
    try:
        time.sleep(1.5)
        assert waiting.poll() is None  # nothing answers yet
        (tmp_path / "health").write_text("ok")
        server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                                  cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            assert waiting.wait(timeout=30) == 0
        finally:
            server.kill()
            server.wait()
    finally:
        waiting.kill()


def test_the_gpu_checks_for_the_next_gpu_are_there():
    """benchmarks/gpu_checks.py --box: the sync round trip, the update's peak beside the plan,
    offload against none (run on a GPU; here it imports and says what it runs)."""
    from conftest import run_script

    out = run_script(["benchmarks/gpu_checks.py", "--help"], timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--box" in out.stdout and all(c in out.stdout for c in ("sync", "update", "offload"))
