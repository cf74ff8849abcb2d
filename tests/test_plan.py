"""trainer/plan.py: the per-GPU memory plan, checked against hand calculations (no model is loaded).

The plan is float64 arithmetic on integer byte counts: pytest.approx's default (rel 1e-6, abs
1e-12) is far above its rounding (~1e-16); an explicit abs= is a rounding of the rounded figure
quoted next to it (7.62e9, 3.94)."""

import json
import re
from pathlib import Path

import pytest
from conftest import run_script

from trainer.config import ConfigError, load_config
from trainer.plan import load_arch, memory_plan, param_count

ROOT = Path(__file__).resolve().parents[1]

# Qwen2.5-7B by hand, from its config.json: hidden 3584, 28 layers, 28 heads of 128, 4 kv heads,
# MLP 18944, vocab 152064, untied embeddings, biases on q, k, v.
H, L, KV, MLP, V = 3584, 28, 4 * 128, 18944, 152064
LAYER = (H * H + H) + 2 * (H * KV + KV) + H * H + 3 * H * MLP + 2 * H  # q, k, v, o, gate/up/down, 2 norms
ROOT_UNIT = 2 * V * H + H  # embeddings, lm_head, final norm
P7 = ROOT_UNIT + L * LAYER
GB = 1e9


def qwen7b(tmp_path, *overrides):
    """Qwen2.5-7B by name (a directory without config.json) on the default 8 x 80 GB."""
    (tmp_path / "Qwen2.5-7B-Instruct").mkdir(exist_ok=True)
    base = [f"model.path={tmp_path / 'Qwen2.5-7B-Instruct'}", "model.dtype=bfloat16", "train.fsdp=true",
            "train.bf16=true", "train.grad_checkpointing=true", "hardware.vllm_memory_fraction=0.5"]  # fmt: skip
    return load_config(None, base + list(overrides))


def test_qwen25_parameter_counts_from_the_table(tmp_path):
    assert LAYER == 233_057_792
    assert P7 == 7_615_616_512  # the model card's 7.61B
    cfg = qwen7b(tmp_path)
    arch = load_arch(cfg.model)
    assert (arch.source, arch.hidden, arch.layers, arch.kv_heads, arch.head_dim, arch.tied) == (
        "built-in table", 3584, 28, 4, 128, False)  # fmt: skip
    assert param_count(arch) == P7 == pytest.approx(7.62e9, abs=0.01e9)
    # 3B: hidden 2048, 36 layers, 16 heads, 2 kv heads (kv dim 256), MLP 11008, tied: 3.09B
    h, kv = 2048, 256
    p3 = 151936 * h + h + 36 * ((h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * 11008 + 2 * h)
    (tmp_path / "Qwen2.5-3B").mkdir()
    assert param_count(load_arch(load_config(None, [f"model.path={tmp_path / 'Qwen2.5-3B'}"]).model)) == p3
    assert p3 == 3_085_938_688


def test_qwen25_7b_on_8x80gb_matches_a_hand_calculation(tmp_path):
    plan = memory_plan(qwen7b(tmp_path))  # GRPO, bf16 weights, FSDP over 8, checkpointing, AdamW
    gpu = plan["gpu"]
    assert gpu["policy_weights"] == pytest.approx(P7 * 2 / 8 / GB)  # 1.90 GB
    assert gpu["policy_grads"] == pytest.approx(P7 * 2 / 8 / GB)
    assert gpu["policy_optimizer"] == pytest.approx(P7 * (4 + 4 + 4) / 8 / GB)  # master, m, v: 11.42 GB
    assert gpu["reference_weights"] == pytest.approx(P7 * 2 / 8 / GB)
    assert gpu["fsdp_gathered"] == pytest.approx((2 * ROOT_UNIT + 3 * LAYER) * 2 / GB)  # 5.76 GB
    per_layer = 2 * (6 * H + 2 * KV + 4 * MLP)  # bytes per token: 196,608
    assert gpu["activations"] == pytest.approx((8192 * L * 2 * H + 8192 * per_layer) / GB)  # 3.25 GB
    assert gpu["logits"] == pytest.approx((8192 * V * 2 * 2 + 2 * 256 * V * 4) / GB)  # bf16 logits, grad; 2 fp32 chunks
    resident = 3 * P7 * 2 / 8 / GB + P7 * 12 / 8 / GB + 2.0  # weights, grads, reference, optimizer, allowance
    assert plan["train_total"] == pytest.approx(resident + (2 * ROOT_UNIT + 3 * LAYER) * 2 / GB + gpu["activations"]
                                                + gpu["logits"])  # fmt: skip
    assert plan["train_budget"] == 40.0 and plan["train_fits"]
    v = plan["vllm"]
    assert v["weights"] == pytest.approx(P7 * 2 / GB)  # 15.23 GB, a full bf16 copy
    assert v["kv_bytes_per_token"] == 2 * L * 4 * 128 * 2 == 57_344
    assert v["kv_tokens"] == int((40e9 - P7 * 2) // 57_344)
    assert v["rollout_tokens"] == 16 * 8 * 1024 // 8  # config defaults: 16 questions x 8 x 1024 / 8 engines
    assert plan["fits"] and not plan["advice"]


def test_tensor_parallel_engines_hold_a_share_of_the_weights_and_kv(tmp_path):
    """rollout.tensor_parallel_size 2 on 8 GPUs: 4 engines, each GPU half a copy of the weights
    and half of each token's KV, each engine a quarter of the rollout batch."""
    one = memory_plan(qwen7b(tmp_path))["vllm"]
    two = memory_plan(qwen7b(tmp_path, "rollout.tensor_parallel_size=2"))["vllm"]
    assert two["weights"] == pytest.approx(one["weights"] / 2) and two["engines"] == 4 and one["engines"] == 8
    assert two["kv_bytes_per_token"] == one["kv_bytes_per_token"] / 2
    assert two["rollout_tokens"] == 2 * one["rollout_tokens"]


def test_ppo_with_offload_moves_state_to_host_and_adds_a_critic(tmp_path):
    plan = memory_plan(qwen7b(tmp_path, "train.algo=ppo", "train.cpu_offload=true"))
    critic = P7 - V * H + H + 1  # no lm_head, a value head h -> 1
    assert plan["model"]["critic_params"] == critic
    for key in ("policy_weights", "policy_grads", "policy_optimizer", "reference_weights", "critic_state"):
        assert plan["gpu"][key] == 0.0
    assert plan["host"]["critic_state"] == pytest.approx(critic * (2 + 2 + 12) / 8 / GB)
    assert plan["host_per_gpu"] == pytest.approx((P7 * (2 + 2 + 12 + 2) + critic * 16) / 8 / GB)
    # the critic steps after the policy: the larger working set counts, not both
    assert plan["train_total"] == pytest.approx(2.0 + plan["policy_working_set"])
    assert plan["gpu"]["critic_working_set"] < plan["policy_working_set"]


def test_phase_offload_keeps_the_state_on_the_gpu_for_the_update_and_on_the_host_for_the_rollout(tmp_path):
    """train.cpu_offload phase (issue 53, finding 3): the training peak counts the state as no
    offload does, the rollout peak does not (it is on the host then), and the host holds what
    micro_batch puts there. true, as older configs say, is micro_batch; anything else is refused
    naming the key."""
    args = ("train.algo=ppo", "hardware.vllm_memory_fraction=0.6", "rollout.sleep_mode=true")
    none, phase, micro = (memory_plan(qwen7b(tmp_path, *args, f"train.cpu_offload={m}"))
                          for m in ("false", "phase", "micro_batch"))  # fmt: skip
    critic = P7 - V * H + H + 1
    state = (P7 * (2 + 2 + 12 + 2) + critic * 16) / 8 / GB  # policy, AdamW, reference, critic
    assert phase["train_total"] == pytest.approx(none["train_total"])
    assert phase["train_total"] == pytest.approx(micro["train_total"] + state)
    assert phase["rollout_total"] == pytest.approx(micro["rollout_total"])
    assert none["rollout_total"] == pytest.approx(phase["rollout_total"] + state)
    assert phase["host_per_gpu"] == pytest.approx(micro["host_per_gpu"]) == pytest.approx(state)
    assert none["host_per_gpu"] == 0.0
    assert phase["gpu"]["critic_state"] == phase["host"]["critic_state"] == pytest.approx(critic * 16 / 8 / GB)
    assert not none["rollout_fits"] and phase["fits"]  # vLLM's 48 GB beside 31 GB of state: over 80
    assert any("--set train.cpu_offload=phase" in line and ": fits" in line for line in none["advice"])
    assert load_config(None, ["train.cpu_offload=true"]).train.cpu_offload == "micro_batch"
    with pytest.raises(ConfigError, match="'train.cpu_offload' must be false, phase or micro_batch"):
        load_config(None, ["train.cpu_offload=sometimes"])


def test_grad_checkpointing_lowers_activations(tmp_path):
    on = memory_plan(qwen7b(tmp_path))
    off = memory_plan(qwen7b(tmp_path, "train.grad_checkpointing=false"))
    assert off["gpu"]["activations"] == pytest.approx(8192 * L * 2 * (6 * H + 2 * KV + 4 * MLP) / GB)  # 45.1 GB
    assert on["gpu"]["activations"] < off["gpu"]["activations"] / 10
    assert not off["train_fits"] and "grad_checkpointing=true" in off["advice"][0]


def test_adamw8bit_lowers_optimizer_memory_by_the_expected_factor(tmp_path):
    for dtype, master in (("bfloat16", 4), ("float32", 0)):
        full = memory_plan(qwen7b(tmp_path, f"model.dtype={dtype}"))["gpu"]["policy_optimizer"]
        small = memory_plan(qwen7b(tmp_path, f"model.dtype={dtype}", "train.optimizer=adamw8bit"))["gpu"]
        # m and v drop from 4 bytes to 1 (+ one fp32 absmax per 256 values each); the master copy stays
        assert small["policy_optimizer"] / full == pytest.approx((master + 2 + 8 / 256) / (master + 8))
    assert (master + 8) / (master + 2 + 8 / 256) == pytest.approx(3.94, abs=0.01)  # fp32 weights: ~4x


def test_no_kl_means_no_reference_model(tmp_path):
    assert memory_plan(qwen7b(tmp_path, "train.kl_coef=0"))["gpu"]["reference_weights"] == 0.0


def test_config_json_is_read_instead_of_the_table(tmp_path):
    d = tmp_path / "Qwen2.5-7B"  # a name the table knows: config.json must still win
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000, "tie_word_embeddings": True,
    }))  # fmt: skip
    arch = load_arch(load_config(None, [f"model.path={d}"]).model)
    assert arch.source == str(d / "config.json") and (arch.hidden, arch.kv_heads, arch.head_dim) == (64, 2, 16)
    layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert param_count(arch) == 1000 * 64 + 64 + 2 * layer


def test_unknown_model_without_config_json_names_the_path(tmp_path):
    cfg = load_config(None, [f"model.path={tmp_path / 'my-own-model'}"])
    with pytest.raises(ConfigError, match="my-own-model"):
        memory_plan(cfg)


def test_tiny_world_policy_is_planned_from_config_model():
    plan = memory_plan(load_config(ROOT / "configs" / "tiny.yaml"))
    assert plan["model"]["source"] == "config.model" and plan["fits"]


def test_cli_prints_a_verdict():
    config = "configs/search_r1_ppo_qwen2.5-7b-base.yaml"
    out = run_script(["-m", "trainer.plan", "--config", config], timeout=60)  # fmt: skip
    assert out.returncode in (0, 1), out.stderr
    assert "=> fits" in out.stdout or "=> does not fit" in out.stdout
    assert "Qwen2.5-7B" in out.stdout and "KV cache" in out.stdout
    bad = run_script(["-m", "trainer.plan", "--set", "model.path=models/nonexistent-model"], timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "models/nonexistent-model" in bad.stderr


@pytest.mark.parametrize("override, says", [
    ("hardware.gpus=0", "'hardware.gpus' must be >= 1"),
    ("hardware.gpu_memory_gb=-80", "'hardware.gpu_memory_gb' must be > 0"),
    ("train.micro_batch_tokens=0", "'train.micro_batch_tokens' must be >= 1"),
])  # fmt: skip
def test_cli_refuses_out_of_range_hardware_in_one_line(override, says):
    """hardware.gpus 0 divided by zero in the plan (a traceback); now the config refuses it."""
    for cmd in (["-m", "trainer.plan"], ["train.py", "--plan"]):
        out = run_script([*cmd, "--set", override], timeout=60)  # fmt: skip
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        (line,) = [x for x in out.stderr.splitlines() if "error:" in x]
        assert says in line


@pytest.mark.parametrize("text, says", [('{"hidden_size": 64,\n "vocab_size": }', "config.json:2: not valid JSON"),
                                        ("[1, 2]", "must hold a JSON object"),
                                        ('{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 0, '
                                         '"intermediate_size": 128, "vocab_size": 1000}',
                                         "'num_attention_heads' must be a positive integer; got 0")])  # fmt: skip
def test_a_broken_config_json_names_the_file(tmp_path, text, says):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(says)) as e:
        load_arch(load_config(None, [f"model.path={tmp_path}"]).model)
    assert str(tmp_path / "config.json") in str(e.value)


def test_one_gpu_keeps_everything_on_the_gpu_whatever_cpu_offload_says(tmp_path):
    """One GPU is one process, which train.py runs without FSDP: cpu_offload moves nothing there
    (issue 33, item 9: the plan put the 3B state in host RAM and said it fits on one GPU)."""
    one = memory_plan(qwen7b(tmp_path, "hardware.gpus=1", "train.cpu_offload=true"))
    assert one["host"]["policy_weights"] == one["host"]["policy_optimizer"] == 0.0
    assert one["gpu"]["policy_optimizer"] > 0
    eight = memory_plan(qwen7b(tmp_path, "train.cpu_offload=true"))
    assert eight["gpu"]["policy_optimizer"] == 0.0 and eight["host"]["policy_optimizer"] > 0
    assert not one["train_fits"]  # 7B's fp32 state alone is over 80 GB


def test_offloaded_optimizer_gets_the_process_share_of_the_host_cores():
    """Issue 33, item 10: under cpu_offload on GPUs AdamW steps the fp32 master weights on the host,
    so each of 8 processes on a 96-core host takes 12 threads, not train.threads' 2; without a GPU
    (these tests, where the processes share 2 cores) or without offload, train.threads stands."""
    from trainer.distributed import trainer_threads

    assert trainer_threads(2, cpu_offload=True, cuda=True, cpus=96, local_world_size=8) == 12
    assert trainer_threads(2, cpu_offload=True, cuda=False, cpus=96, local_world_size=8) == 2
    assert trainer_threads(2, cpu_offload=False, cuda=True, cpus=96, local_world_size=8) == 2
    assert trainer_threads(16, cpu_offload=True, cuda=True, cpus=96, local_world_size=8) == 16


def test_the_retriever_is_counted_per_gpu_and_per_host(tmp_path):
    """In process with a dense index: its query encoder on every GPU (fp16 weights, counted from
    its config.json and checked against the loaded model), the index once per host (file-backed
    mmap: the page cache's one copy), from its files when built, else n_docs x dim x 4 B for Flat.
    A retriever.url on this box counts on its GPUs; another host's costs this machine nothing."""
    import faiss
    import numpy as np
    from transformers import AutoModel

    from search.index import default_encoder_path, import_index

    minilm = default_encoder_path()
    n_params = sum(p.numel() for p in AutoModel.from_pretrained(minilm).parameters())
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f"passage {i}"}) + "\n" for i in range(1000)))
    dense = ["retriever.method=dense", f"data.corpus={corpus}"]
    bm25 = memory_plan(qwen7b(tmp_path))
    estimated = memory_plan(qwen7b(tmp_path, *dense))  # <corpus dir>/index-dense, not built yet
    r = estimated["retriever"]
    assert r["encoder_bytes"] == n_params * 2 == 22_713_216 * 2 and not r["served"]
    assert estimated["gpu"]["retriever_encoder"] == pytest.approx(n_params * 2 / GB)
    assert estimated["train_total"] == pytest.approx(bm25["train_total"] + n_params * 2 / GB)  # beside training
    assert r["index_bytes"] == 1000 * 384 * 4 and "Flat not built yet: 1,000 passages x 384 x 4 B" in r["index_how"]
    assert estimated["host_per_node"] == pytest.approx(bm25["host_per_node"] + 1000 * 384 * 4 / GB)  # once, not x 8
    index = faiss.IndexFlatIP(384)
    index.add(np.ones((1000, 384), np.float32))
    faiss.write_index(index, str(tmp_path / "bare.index"))
    built = import_index(tmp_path / "bare.index", corpus, tmp_path / "index-dense", minilm, "minilm")
    r = memory_plan(qwen7b(tmp_path, *dense))["retriever"]
    files = (built / "faiss.index").stat().st_size + (built / "spans.npy").stat().st_size
    assert r["index_bytes"] == files and f"files of {built}" in r["index_how"]
    # served on this box (issue 53): the Flat index sharded over the GPUs (all 8, or
    # hardware.retriever_gpus), faiss's 1.5 GiB scratch and a context on each, the encoder on GPU 0
    scratch = 1536 * 2**20 + 0.5e9
    for gpus, keys in ((8, []), (2, ["hardware.retriever_gpus=2"])):
        served = memory_plan(qwen7b(tmp_path, *dense, "retriever.url=http://127.0.0.1:8000", *keys))
        assert served["gpu"]["retriever_encoder"] == 0.0
        assert served["gpu"]["retriever_served"] == pytest.approx((files / gpus + scratch + n_params * 2) / GB)
        assert served["train_total"] == pytest.approx(bm25["train_total"] + served["gpu"]["retriever_served"])
    elsewhere = memory_plan(qwen7b(tmp_path, *dense, "retriever.url=http://10.0.0.7:8000"))
    assert elsewhere["gpu"]["retriever_served"] == 0.0 and elsewhere["retriever"]["index_bytes"] == 0.0
    assert elsewhere["train_total"] == pytest.approx(bm25["train_total"])
    out = run_script(["-m", "trainer.plan", "--set", "retriever.url=http://10.0.0.7:8000",
                      "--set", "retriever.method=dense"], timeout=60)  # fmt: skip
    assert "served by another host" in out.stdout, out.stderr
