"""FSDP parity: one GRPO step sharded over 2 CPU processes (gloo) equals the 1-process step.

The issue's acceptance item: on the same fixed batch, loss, gradient norm and updated weights
of a 2-process `accelerate launch` with FSDP match a single-process step (fp32; the bounds, from
tests/numerics.py, allow for the other micro-batch shapes and summation orders of 2 processes).
A tiny Qwen2 (tied embeddings, like the tiny world's policy) and a fixed batch
of fake rollouts of varied lengths: a small micro_batch_tokens gives each process several
micro-batches, and a different number on each (train.py pads with zero-weight repeats).
One launch runs every case (each process spends ~9 s CPU importing torch and transformers).
Last, the README's several-machine check: a PPO run with vLLM launched as 2 machines on loopback
equals a 1-process run. train.py under a 2-process launch against 1 process, and every rank's
engine after an in-memory sync: test_fsdp_runs.py.

    .venv/bin/python -m pytest -q -s tests/test_fsdp.py      # -s prints the run times
"""

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from numerics import (  # noqa: E402
    EPS32,
    EPS64,
    assert_close,
    assert_equal_bits,
    assert_stats_close,
    logprob_atol,
    model_vocab,
    ops_rtol,
    sum_rtol,
)

BASE = ["train.fsdp=true", "train.micro_batch_tokens=64", "train.lr=1e-4", "train.grad_clip=0.5"]
CASES = [
    # pi_old recomputed (2 updates), KL to a sharded reference, IS correction, checkpointing
    {"name": "kl_two_minibatches", "overrides": BASE + [
        "train.kl_coef=0.05", "train.mini_batches=2", "train.is_correction=2.0",
        "train.entropy_coef=0.01", "train.grad_checkpointing=true"]},
    # one update against the engine's (noisy) logprobs: ratios != 1, some tokens clip; no reference
    {"name": "engine_old_no_ref", "overrides": BASE + ["train.kl_coef=0", "train.loss_agg=seq-mean-token-mean"]},
    # 8-bit AdamW (bitsandbytes) on each process's shard of the parameters
    {"name": "adamw8bit", "overrides": BASE + ["train.kl_coef=0", "train.optimizer=adamw8bit"]},
    # kl_two_minibatches with float64 gradient sums over one cut of the micro-batches: bit for bit
    {"name": "exact", "overrides": BASE + [
        "train.kl_coef=0.05", "train.mini_batches=2", "train.is_correction=2.0",
        "train.entropy_coef=0.01", "train.grad_checkpointing=true", "train.exact_grad_sum=true"]},
    # no parity claimed, only that a sharded step runs: bf16 mixed precision, CPU offload
    {"name": "bf16", "sharded_only": True, "overrides": BASE + [
        "train.bf16=true", "train.kl_coef=0.05", "train.mini_batches=2"]},
    {"name": "cpu_offload", "sharded_only": True, "overrides": BASE + [
        "train.cpu_offload=true", "train.kl_coef=0.05", "train.grad_checkpointing=true"]},
    # two steps with train.cpu_offload phase (the state to the host and back before each update)
    # against two without: bit for bit (issue 53, finding 3)
    {"name": "phase_offload", "sharded_only": True, "steps": 2, "overrides": BASE + [
        "train.cpu_offload=phase", "train.kl_coef=0.05"]},
    {"name": "no_offload_two_steps", "sharded_only": True, "steps": 2, "overrides": BASE + [
        "train.cpu_offload=false", "train.kl_coef=0.05"]},
    # PPO's critic under the paper configs' flags: bf16 policy and cpu_offload (issue 33, item 5:
    # "mat1 and mat2 must have the same dtype" at the value head)
    {"name": "critic_bf16_offload", "sharded_only": True, "critic": True, "overrides": BASE + [
        "train.algo=ppo", "train.bf16=true", "train.cpu_offload=true", "train.grad_checkpointing=true"]},
]  # fmt: skip
PARITY = [c["name"] for c in CASES if not c.get("sharded_only")]
N_RECORDS = 12
VOCAB = 128
# The 2 processes pack the sequences into other micro-batches: another batch shape for every
# logprob. The random-init model's logits stay below 4 (~1.3 here; checked in `build`).
LP = logprob_atol(VOCAB, logit_max=4.0)


def build(tmp: Path) -> dict:
    """Model dir, records file and the spec both runs read."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.batching import token_logprobs
    from trainer.grpo import group_advantages

    torch.manual_seed(0)
    # intermediate_size 127: the MLP's gate and up projections shard 64 + 63 rows over 2 processes,
    # FSDP2's padded uneven shards (issue 33, item 11: 8-bit AdamW must step the model's storage)
    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=127, vocab_size=VOCAB, tie_word_embeddings=True, pad_token_id=0)  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # a trained model's biases are not 0; at 0 the weight check below is vacuous
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    model.save_pretrained(tmp / "model")
    rng = random.Random(0)
    records = []
    for i in range(N_RECORDS):
        # even records long, odd ones short: with 64-token micro-batches process 0 (even
        # indices) runs one micro-batch per sequence, process 1 packs several
        n_prompt, n_resp = rng.randint(4, 10), (rng.randint(36, 50) if i % 2 == 0 else rng.randint(6, 12))
        ids = [rng.randrange(1, 128) for _ in range(n_prompt + n_resp)]
        mask = [1] * n_resp
        if n_resp > 20:  # a retrieved run in the middle: not sampled, no loss
            start = rng.randint(5, n_resp - 12)
            mask[start : start + 8] = [0] * 8
        with torch.no_grad():
            logp = token_logprobs(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
            assert model(input_ids=torch.tensor([ids])).logits.abs().max() < 4.0  # LP's logit_max
        # the engine's logprobs: the model's own plus noise, so ratios != 1 and some clip
        engine = [float(lp) + rng.gauss(0, 0.3) if m else 0.0 for lp, m in zip(logp[n_prompt - 1 :], mask)]
        records.append({"prompt_ids": ids[:n_prompt], "response_ids": ids[n_prompt:], "loss_mask": mask,
                        "logprobs": engine, "group_id": f"q{i // 4}", "reward": float(rng.random() < 0.5)})  # fmt: skip
    for r, a in zip(records, group_advantages([r["reward"] for r in records], [r["group_id"] for r in records])):
        r["advantage"] = a
    (tmp / "records.json").write_text(json.dumps(records))
    spec = {"model": str(tmp / "model"), "records": str(tmp / "records.json"), "pad_id": 0, "cases": CASES}
    return spec


def launch(spec_path: Path, world: int) -> subprocess.Popen:
    """tests/fsdp_step.py: world 1 is plain python; world 2 is `accelerate launch`, whose
    --multi_gpu is its torchrun launcher, which with no GPU starts CPU processes (gloo); `--cpu`
    would start only one."""
    from conftest import free_port

    cmd = [sys.executable, str(ROOT / "tests" / "fsdp_step.py"), str(spec_path)]
    if world > 1:
        cmd[1:1] = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(world),
                    "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                    "--main_process_port", str(free_port())]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}  # one thread per process
    # own session: on failure the launcher and its workers are stopped together (killpg)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def write_spec(spec: dict, out: Path) -> Path:
    out.mkdir()
    (out / "spec.json").write_text(json.dumps(spec | {"out": str(out)}))
    return out / "spec.json"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(single-process out dir, 2-process out dir, model dir). The world-1 run of the same script
    runs beside the 2-process launch, in a fresh process of its own with one thread as each rank
    has: the test's process may have loaded vLLM, which changes torch's CPU kernels, and how many
    threads split a matmul changes its sum (the exact case compares bits)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    spec = build(tmp)
    t0 = time.time()
    procs = [launch(write_spec(spec, tmp / "fsdp"), world=2), launch(write_spec(spec, tmp / "single"), world=1)]
    try:
        logs = [proc.communicate(timeout=300)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:  # a hung collective
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-6000:]
    print(f"\nworld-1 run and 2-process FSDP launch together: {time.time() - t0:.1f} s")
    return tmp / "single", tmp / "fsdp", tmp / "model"


@pytest.mark.numeric
@pytest.mark.parametrize("case", PARITY)
def test_fsdp_step_matches_single_process(runs, case):
    """Loss, gradient norm, every updated weight and every gradient: 2-process FSDP = 1 process."""
    from safetensors.torch import load_file

    single, fsdp, model_dir = runs
    s, f = (json.loads((d / f"{case}.json").read_text()) for d in (single, fsdp))
    assert (s["world"], s["sharded"], f["world"], f["sharded"]) == (1, False, 2, True)
    assert f["reference"] == ("sharded" if case in ("kl_two_minibatches", "exact") else None)  # not without KL
    assert_stats_close(f, s, LP, VOCAB, case)
    # The gradients of the last mini-batch, element by element, against the largest one (Adam's
    # first step hides a wrong gradient scale; this does not). Each element sums per-token terms
    # that move relatively like grad_norm's (4 LP), over tokens whose micro-batches differ.
    gs, gf = (load_file(str(d / f"{case}.grads.safetensors")) for d in (single, fsdp))
    assert gs.keys() == gf.keys()
    g_max = max(float(g.abs().max()) for g in gs.values())
    g_atol = (4 * LP + EPS32) * g_max
    for name in gs:
        assert_close(gf[name], gs[name], rtol=0, atol=g_atol, what=f"{case}: grad {name}")
    # Updated weights. Adam's first step is lr g / (|g| + 1e-8) per element (m^ = g, v^ = g^2), so
    # a gradient moved by a changes it by at most lr a 1e-8 / (|g| - a + 1e-8)^2, capped at 2 lr:
    # ~0 where |g| >> a, up to 2 lr where g is rounding noise. That bound needs the step's own
    # gradient: engine_old_no_ref takes one step on the gradients saved. The others take two (the
    # first one's gradients are not saved) or quantise Adam's state to 8 bits (adamw8bit: a
    # gradient at a quantisation edge moves its step by a level): 2 lr per step, which still
    # catches a wrong gather (an error of the size of the weights). The exact case is bit for bit
    # (the next test).
    lr = 1e-4  # BASE
    w0 = load_file(str(model_dir / "model.safetensors"))
    ws, wf = load_file(str(single / f"{case}.safetensors")), load_file(str(fsdp / f"{case}.safetensors"))
    assert ws.keys() == wf.keys()
    for name in ws:
        if case == "engine_old_no_ref":
            g = gs[name if name in gs else "model.embed_tokens.weight"]  # lm_head.weight: tied
            slack = g_atol * 1e-8 / ((g.abs() - g_atol).clamp(min=0) + 1e-8) ** 2
            atol = lr * slack.clamp(max=2) + ops_rtol(8) * (lr + ws[name].abs())  # + fp32 Adam's roundings
        else:
            atol = 2 * lr * (2 if case in ("kl_two_minibatches", "exact") else 1)
        assert_close(wf[name], ws[name], rtol=0, atol=atol, what=f"{case}: {name}")
    moved = max(float((ws[n] - w0[n]).abs().max()) for n in w0)
    assert moved > 5e-5  # the step did change the weights: the comparison is not vacuous
    if case == "adamw8bit":
        # 8-bit AdamW steps plain tensors sharing each shard's storage (distributed.make_optimizer):
        # had FSDP moved an (uneven) shard to new storage, that weight would not move at all, which
        # the 2 lr bound above would pass. Adam's first step moves every weight with a gradient by
        # ~lr (lr g / |g|), more than lr / 2 wherever |g| is above rounding.
        assert f["optimizer_steps_the_shards"]
        for name in w0:  # (the tied lm_head is the embedding)
            assert float((wf[name] - w0[name]).abs().max()) > lr / 2, f"adamw8bit: {name} did not move"


@pytest.mark.numeric
def test_exact_grad_sum_makes_the_step_independent_of_the_number_of_processes(runs):
    """train.exact_grad_sum: the same step as kl_two_minibatches gives the 1-process gradients
    and weights bit for bit under 2 processes; without it the reduction order shows in the last
    bits. What makes it exact (trainer/batching.py): the mini-batch is cut into the same
    micro-batches whatever the number of processes (balanced_micro_batches), so each micro-batch's
    gradient is the same fp32 computation on the same rows (one thread per process, as the world-1
    run); `accumulating` sums them in float64 (FSDP reduce-scatters in float64) and rounds to
    float32 once. Two float64 orders differ by ~1e-16 relative, far below float32's half-ulp
    (6e-8): the rounding only differs if a sum lands within that of a rounding tie (~1e-9 per
    element). clip_grad_norm sums the squares in float64 too."""
    from safetensors.torch import load_file

    single, fsdp, _ = runs
    for suffix in ("safetensors", "grads.safetensors"):
        s, f = (load_file(str(d / f"exact.{suffix}")) for d in (single, fsdp))
        assert_equal_bits(f, s, what=f"exact: {suffix}")
        s, f = (load_file(str(d / f"kl_two_minibatches.{suffix}")) for d in (single, fsdp))
        assert not all(torch.equal(s[name], f[name]) for name in s), suffix  # fp32 sums: the order shows
    s, f = (json.loads((d / "exact.json").read_text()) for d in (single, fsdp))
    # the gradient clip (at 0.5) acted, on the same norm: float64 sums of the same n squares (exact
    # in float64) in another order (per shard, then all-reduced), sum_rtol(n, EPS64), which the
    # square root halves; its own rounding adds an eps
    n = sum(g.numel() for g in load_file(str(single / "exact.grads.safetensors")).values())
    assert_close(f["grad_norm"], s["grad_norm"], rtol=sum_rtol(n, EPS64) / 2 + EPS64, atol=EPS64,
                 what="exact: grad_norm")  # fmt: skip
    assert s["grad_norm"] > 0.5


def test_cases_exercise_the_hard_paths(runs):
    single, _, _ = runs
    engine_old = json.loads((single / "engine_old_no_ref.json").read_text())
    kl = json.loads((single / "kl_two_minibatches.json").read_text())
    assert 0 < engine_old["clip_frac"] < 1 and engine_old["grad_norm"] > 0.5  # PPO clip and gradient clip
    assert kl["kl"] > 0
    # uneven micro-batch counts across the 2 processes in the single mini-batch case
    from trainer.batching import token_budget_batches

    records = json.loads((single.parent / "records.json").read_text())
    lengths = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in records]
    counts = [len(token_budget_batches(lengths[rank::2], 64, random.Random(0))) for rank in range(2)]
    assert counts[0] != counts[1] and min(counts) > 1, counts


@pytest.mark.numeric
def test_full_weights_equal_single_process_state_dict(runs):
    """The vLLM sync path: gathered weights of the sharded model = the plain model's state dict."""
    from safetensors.torch import load_file

    from trainer.engine import load_policy

    _, fsdp, model_dir = runs
    gathered = load_file(str(fsdp / "initial.safetensors"))
    state = load_policy(model_dir).state_dict()
    assert sorted(gathered) == sorted(state)  # the same names: no FSDP prefixes
    # exact: sharding and gathering copy the bits; no arithmetic touches them
    assert_equal_bits(gathered, state, what="gathered initial weights")
    # gathered in bf16 (each shard cast first, for a bf16 engine): the fp32 gather's own cast,
    # bit for bit (round to nearest even, element by element)
    half = load_file(str(fsdp / "initial.bf16.safetensors"))
    assert {t.dtype for t in half.values()} == {torch.bfloat16}
    assert_equal_bits(half, {n: t.to(torch.bfloat16) for n, t in gathered.items()}, what="bf16 gather")


def test_each_process_forwards_about_half_of_the_no_grad_tokens(runs):
    """The reference's and pi_old's logprobs: each of 2 processes forwards its share of the batch
    (batching.no_grad_runs), not all of it (issue 33: at most ~55% of the 1-process tokens).
    kl_two_minibatches computes both; exact deals whole micro-batches of the 1-process cut."""
    single, fsdp, _ = runs
    for case in ("kl_two_minibatches", "exact"):
        one = json.loads((single / f"{case}.tokens.rank0.json").read_text())
        assert one["old"] > 0 and one["ref"] > 0
        for rank in range(2):
            mine = json.loads((fsdp / f"{case}.tokens.rank{rank}.json").read_text())
            for key in ("old", "ref"):
                assert mine[key] <= 0.55 * one[key], (case, rank, key, mine[key], one[key])


@pytest.mark.parametrize("case", ["bf16", "cpu_offload"])
def test_sharded_step_runs(runs, case):
    _, fsdp, _ = runs
    stats = json.loads((fsdp / f"{case}.json").read_text())
    assert stats["sharded"] and math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])


def test_sharded_critic_runs_under_bf16_and_offload(runs):
    """The value head stays float32 in a unit of its own (distributed.shard_critic) while the
    backbone computes in bf16, and the critic's inputs go to the compute device, not to its
    offloaded parameters' (ppo.critic_values / critic_step)."""
    _, fsdp, model_dir = runs
    stats = json.loads((fsdp / "critic_bf16_offload.json").read_text())
    assert stats["sharded"] and stats["value_dtype"] == "torch.float32"
    assert math.isfinite(stats["value_loss"]) and stats["critic_grad_norm"] > 0
    # loaded sharded (ppo.load_sharded_critic: meta build, rank 0's read; issue 53), it is the
    # critic load_critic reads whole: the same bits, the zero head included
    from safetensors.torch import load_file

    from trainer.ppo import load_critic

    sharded = load_file(str(fsdp / "critic_bf16_offload.initial.safetensors"))
    whole = load_critic(model_dir).state_dict()
    assert sorted(sharded) == sorted(whole)
    for name, tensor in whole.items():
        assert_equal_bits(sharded[name], tensor, what=name)


def test_phase_offload_trains_bit_for_bit_as_no_offload(runs):
    """train.cpu_offload phase (issue 53, finding 3): two sharded steps, the policy, its gradients,
    AdamW's moments and the sharded reference moved to the host and back before each (what
    train.py does around a rollout), end on the bits of two steps without. On CPU "the host" is
    the same memory, but every move is a copy into new storage (distributed._moved), so an FSDP
    shard or an optimizer moment left pointing at the old storage would show here. Then the state
    moved to the meta device: every parameter's, gradient's and moment's local shard arrives, and
    the optimizer still holds the model's own Parameter objects."""
    from safetensors.torch import load_file

    _, fsdp, _ = runs
    for what in ("", ".grads"):
        phase = load_file(str(fsdp / f"phase_offload{what}.safetensors"))
        none = load_file(str(fsdp / f"no_offload_two_steps{what}.safetensors"))
        assert sorted(phase) == sorted(none)
        for name, tensor in none.items():
            assert_equal_bits(phase[name], tensor, what=name + what)
    initial = load_file(str(fsdp / "initial.safetensors"))
    assert any(not torch.equal(initial[n], t) for n, t in none.items() if n in initial)  # the steps moved weights
    stats = json.loads((fsdp / "phase_offload.json").read_text())
    none_stats = json.loads((fsdp / "no_offload_two_steps.json").read_text())
    assert stats["loss"] == none_stats["loss"] and stats["grad_norm"] == none_stats["grad_norm"]
    meta = stats["meta"]
    assert meta["elsewhere"] == 0 and meta["on_meta"] > 0 and meta["same_params"], meta
    assert meta["grads"] > 0 and meta["states"] > 0, meta  # gradients and AdamW's moments were there to move


def test_offload_moves_every_tensor_and_keeps_the_parameters():
    """distributed.offload_to_host / load_to_device on one process's state (no FSDP here; the
    sharded case is test_phase_offload_trains_bit_for_bit_as_no_offload): a model with
    gradients and AdamW's moments, and a frozen second model (a reference). With no GPU the host
    is the only device with contents, so the round trip is host to host, each move a copy into
    new storage: the same bits come back, the optimizer's Parameter objects are the model's. The
    meta device (contents dropped) stands in for the GPU to show that every tensor moves."""
    from trainer.distributed import load_to_device, offload_to_host

    torch.manual_seed(0)
    model, ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)), torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    params = list(model.parameters())

    def tensors():
        state = [v for st in optimizer.state.values() for k, v in st.items() if k != "step"]
        return [*params, *(q.grad for q in params), *state, *ref.parameters()]

    before = [t.clone() for t in tensors()]
    pointers = [t.data_ptr() for t in tensors()]
    offload_to_host([model, ref], [optimizer])
    load_to_device([model, ref], [optimizer], "cpu")
    assert all(a is b for a, b in zip(optimizer.param_groups[0]["params"], model.parameters()))
    assert all(q is p for q, p in zip(model.parameters(), params))
    assert len(tensors()) == len(before) == 2 * 4 + 2 * 4 + 2
    for old, new, ptr in zip(before, tensors(), pointers):
        assert_equal_bits(new, old, what="round trip")
        assert new.data_ptr() != ptr  # a copy, not the same storage
    offload_to_host([model, ref], [optimizer], "meta")
    assert all(t.is_meta for t in tensors()) and all(q is p for q, p in zip(model.parameters(), params))
    assert all(st["step"].device.type == "cpu" for st in optimizer.state.values())  # AdamW keeps its count here


def launch_machines(args: list[str], logs: Path, machines: int = 2) -> list[subprocess.Popen]:
    """train.py as `machines` machines of one process each, all on 127.0.0.1: what the README's
    several-node command runs on each host (`--num_machines N --machine_rank R --main_process_ip
    HOST`). Their output goes to logs/machine<R>.log."""
    from conftest import free_port

    port, procs = str(free_port()), []
    for r in range(machines):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(machines),
               "--num_machines", str(machines), "--machine_rank", str(r), "--main_process_ip", "127.0.0.1",
               "--main_process_port", port, "--mixed_precision", "no", "--dynamo_backend", "no", "train.py",
               *args]  # fmt: skip
        with open(logs / f"machine{r}.log", "w") as out:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT))
    return procs


@pytest.mark.slow
@pytest.mark.numeric
def test_two_machines_on_loopback_with_vllm_match_one_process(micro, tmp_path):
    """PPO with rollout.engine: vllm, launched as 2 machines of one process each on 127.0.0.1
    (issue 33: several machines): each rank owns a vLLM engine in its own process (vLLM's
    external_launcher), rolls out half of each step's questions and loads the full weights from
    memory after each update; policy AND critic are sharded. Per machine: the run's
    processes.json shows machines 0 and 1 with one process each, so each engine takes the whole
    KV share of its host (one machine of 2 processes: test_dress_rehearsal.py); the run directory,
    metrics, samples and full weights are written once, the optimizer shards by each rank. With
    train.exact_grad_sum (float64 gradient sums over one cut of the micro-batches; 256 tokens
    give each rank 4-6 real micro-batches a step) the 2-process run equals a 1-process run: the
    same rollout records at steps 1-3 (token ids and loss masks identical, logprobs within 1e-6;
    steps 2-3 sample from the synced engines, so this holds only if every rank's engine holds
    the 1-process weights), the same rewards, losses and statistics, the same weights after step
    3. (A 2-process PPO run resumed, sharded critic and all: test_dress_rehearsal.py.)

    What is exact and what is not: each rank's engine samples its half of the questions in a
    batch of its own, and vLLM does not promise the same logprobs under another batch shape
    (logprob_atol). Where they do come out bit-equal (measured: on AVX2 they did), exact_grad_sum
    makes everything downstream bit-equal too, and the test says so; without exact_grad_sum the
    logprobs of steps 2-3 then differ by up to 4.5e-6 and this test fails. Where they do not, the
    updates differ as a pi_old moved by logprob_atol moves them."""
    from conftest import ROOT, write_micro_config

    cfgs = {}
    for name, fsdp in (("one", False), ("two", True)):
        cfgs[name] = write_micro_config(
            tmp_path / f"{name}.yaml", micro[1].world.cache_dir, rollout={"engine": "vllm"},
            train={"algo": "ppo", "steps": 3, "eval_every": 0, "save_every": 2, "threads": 1, "kl_coef": 0.01,
                   "critic_lr": 1e-3, "fsdp": fsdp, "run_dir": str(tmp_path / name), "name": name,
                   "samples_per_step": 64, "exact_grad_sum": True, "micro_batch_tokens": 256},
        )  # fmt: skip

    one = subprocess.Popen([sys.executable, "train.py", "--config", str(cfgs["one"])], cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    for r, machine in enumerate(launch_machines(["--config", str(cfgs["two"])], tmp_path)):
        assert machine.wait(timeout=900) == 0, (tmp_path / f"machine{r}.log").read_text()[-3000:]
    (run_two,) = (tmp_path / "two").iterdir()  # one run directory, made by rank 0
    runs = {"one": next((tmp_path / "one").glob("one-*")), "two": run_two}
    ckpt = runs["two"] / "checkpoints" / "step_2"
    assert {"critic_optimizer.rank0.pt", "critic_optimizer.rank1.pt", "critic"} <= {p.name for p in ckpt.iterdir()}
    host_ram = psutil.virtual_memory().total
    kv = int(micro[1].rollout.gpu_memory_utilization * host_ram)  # engine.cpu_kv_cache_size: one engine per host
    layout = json.loads((run_two / "processes.json").read_text())
    assert [(p["rank"], p["machine"], p["local_rank"], p["local_world_size"]) for p in layout] == [(0, 0, 0, 1),
                                                                                                   (1, 1, 0, 1)]
    assert [p["engine_kv_cache_bytes"] for p in layout] == [kv] * 2 and layout[0]["retriever"] == "in process"
    assert one.wait(timeout=900) == 0, one.stderr.read()[-3000:]
    rows = {n: [json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()] for n, r in runs.items()}
    assert [r["step"] for r in rows["two"]] == [1, 2, 3] == [r["step"] for r in rows["one"]]
    vocab = model_vocab(micro[2])
    lp, same_logprobs = logprob_atol(vocab), True
    for step in (1, 2, 3):
        lines = {n: (r / "samples" / f"step_{step}.jsonl").read_text().splitlines() for n, r in runs.items()}
        samples = {n: [json.loads(line) for line in ls] for n, ls in lines.items()}
        assert len(samples["one"]) == len(samples["two"]) == 16, step  # every record: 4 questions x 4
        for a, b in zip(samples["one"], samples["two"]):
            assert (a["group_id"], a["response_ids"], a["loss_mask"]) == (b["group_id"], b["response_ids"],
                                                                           b["loss_mask"]), step  # fmt: skip
            assert_close(b["logprobs"], a["logprobs"], rtol=0, atol=lp, what=f"step {step} engine logprobs")
            same_logprobs &= a["logprobs"] == b["logprobs"]
            assert a["reward"] == b["reward"], step
    assert_same_updates(runs, rows, micro[2], same_logprobs, lp, vocab)


def assert_same_updates(runs: dict, rows: dict, start_dir, same_logprobs: bool, lp: float, vocab: int) -> None:
    """The loopback test's runs ("one", "two") after step 3: the logged statistics, the policy's
    and the critic's weights; bit-equal where the engines' logprobs were, else within what a pi_old
    moved by `lp` allows. And the run moved: the critic learned, the policy took its steps."""
    from safetensors.torch import load_file

    start = load_file(str(start_dir / "model.safetensors"))
    weights = {n: load_file(str(r / "checkpoints" / "step_3" / "model.safetensors")) for n, r in runs.items()}
    assert weights["one"].keys() <= weights["two"].keys()  # the sharded save also writes the tied lm_head
    two = {key: weights["two"][key] for key in weights["one"]}
    critic = {n: {name: load_file(str(r / "checkpoints" / "step_3" / "critic" / name))
                  for name in ("model.safetensors", "value_head.safetensors")} for n, r in runs.items()}  # fmt: skip
    print(f"engine logprobs of 2 machines vs 1 process: {'bit-equal' if same_logprobs else 'within logprob_atol'}")
    if same_logprobs:
        # The same rollouts: exact_grad_sum makes each update the 1-process one bit for bit (see
        # test_exact_grad_sum_makes_the_step_independent_of_the_number_of_processes). The logged
        # statistics are float64 sums over <= 4096 tokens per rank, added across the 2 ranks in
        # another order: sum_rtol(4096, EPS64) ~ 9e-13 of their terms' size (~1; the policy loss
        # cancels terms ~1 down to ~1e-5..1e-8, hence the absolute floor).
        tol = {"rtol": sum_rtol(4096, EPS64), "atol": sum_rtol(4096, EPS64)}
        for a, b in zip(rows["one"], rows["two"]):
            for key in ("loss", "grad_norm", "value_loss", "critic_grad_norm", "value_mean", "kl", "entropy"):
                assert_close(b[key], a[key], **tol, what=f"step {a['step']}: {key}")
        assert_equal_bits(two, weights["one"], what="policy weights after step 3")
        for name in critic["one"]:
            assert_equal_bits(critic["two"][name], critic["one"][name], what=f"critic {name} after step 3")
    else:
        # pi_old (the engine's logprobs) moved by up to lp: the loss terms and gradients move as in
        # assert_stats_close; the critic's values and losses, fitted to the same rewards, by a
        # relative lp per step through the advantages' whitening (3 steps); Adam's steps by up to
        # 2 lr each (see test_fsdp_step_matches_single_process; lr and critic_lr are 1e-3 here).
        for a, b in zip(rows["one"], rows["two"]):
            assert_stats_close(b, a, lp, vocab, f"step {a['step']}", a_max=5, rho_w=1.2)  # whitened A
            for key in ("value_loss", "critic_grad_norm", "value_mean"):
                assert_close(b[key], a[key], rtol=3 * 4 * lp, atol=3 * lp, what=f"step {a['step']}: {key}")
        for key, w in weights["one"].items():
            assert_close(two[key], w, rtol=0, atol=3 * 2 * 1e-6, what=f"policy {key} after step 3")
        for name in critic["one"]:
            for key, w in critic["one"][name].items():
                assert_close(critic["two"][name][key], w, rtol=0, atol=3 * 2 * 1e-3, what=f"critic {key}")
    assert rows["two"][2]["value_mean"] != 0  # the critic learned (zero-init head) and was restored
    moved = max((w - start[key]).abs().max().item() for key, w in weights["one"].items())
    assert moved > 0  # the policy took its steps: the weights comparison is not vacuous
