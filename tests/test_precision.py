"""`auto` precision: bf16 where this machine does it natively, fp32 elsewhere; an explicit value wins.

conftest.py sets TRAINER_NATIVE_BF16=0 for the suite; the detection tests here remove it."""

import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run_script

from trainer.config import ConfigError, load_config
from trainer.engine import make_engine
from trainer.plan import memory_plan
from trainer.precision import CPU_BF16_FLAGS, ENV_OVERRIDE, describe, native_bf16, resolve


def _cpuinfo_flags() -> set[str]:
    out = subprocess.run(["grep", "-m1", "^flags", "/proc/cpuinfo"], capture_output=True, text=True).stdout
    return set(out.split(":", 1)[1].split()) if ":" in out else set()


def test_detection_reads_this_cpu(monkeypatch):
    """On this machine (no GPU in CI) auto is bf16 exactly when /proc/cpuinfo lists AMX or
    AVX512-BF16; on the AMD EPYC (AVX2) machines of this project that is fp32."""
    monkeypatch.delenv(ENV_OVERRIDE)
    if torch.cuda.is_available():
        pytest.skip("a GPU decides by compute capability")
    expected = bool(_cpuinfo_flags() & set(CPU_BF16_FLAGS))
    native, why = native_bf16()
    assert native == expected and why.startswith("CPU ")
    cfg = resolve(load_config(ROOT / "configs/tiny.yaml"))
    assert (cfg.sft.bf16, cfg.train.bf16, cfg.model.dtype) == (expected, expected, "float32")
    assert describe(cfg).startswith(f"precision: {'bf16' if expected else 'fp32'} (CPU ")


def test_auto_follows_the_machine_and_an_explicit_value_wins(monkeypatch):
    for forced, expected in (("0", False), ("1", True)):
        monkeypatch.setenv(ENV_OVERRIDE, forced)
        cfg = resolve(load_config(ROOT / "configs/tiny.yaml"))
        assert cfg.sft.bf16 is expected and cfg.train.bf16 is expected
        assert cfg.model.dtype == "float32"  # on a CPU the engine's weights stay fp32 (trainer/precision.py)
        explicit = resolve(load_config(ROOT / "configs/tiny.yaml",
                               [f"sft.bf16={str(not expected).lower()}", f"train.bf16={str(not expected).lower()}",
                                "model.dtype=bfloat16"]))  # fmt: skip
        assert explicit.sft.bf16 is (not expected) and explicit.train.bf16 is (not expected)
        assert explicit.model.dtype == "bfloat16"


def test_bad_precision_values_name_the_key():
    for override, key in (("sft.bf16=maybe", "sft.bf16"), ("train.bf16=1", "train.bf16"),
                          ("model.dtype=fp8", "model.dtype")):  # fmt: skip
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(ROOT / "configs/tiny.yaml", [override])


def test_the_memory_plan_resolves_auto_for_its_gpus_not_for_this_machine():
    """--plan on a CPU laptop for an 8-GPU box: auto means bf16 weights, as the GPUs will run."""
    cfg = load_config(ROOT / "configs/search_r1_grpo_qwen2.5-3b-instruct.yaml", ["model.dtype=auto"])
    fp32 = load_config(ROOT / "configs/search_r1_grpo_qwen2.5-3b-instruct.yaml", ["model.dtype=float32"])
    auto_w, fp32_w = memory_plan(cfg)["vllm"]["weights"], memory_plan(fp32)["vllm"]["weights"]
    assert auto_w == pytest.approx(fp32_w / 2)  # float64 byte counts: exact up to ~1e-16


def test_train_prints_its_precision_before_loading_anything(tmp_path):
    """The one line at start: --plan loads no model, a config error stops before; here the line of a
    real start is read from a run that fails right after it (a model.path with no model)."""
    out = run_script(["train.py", "--config", "configs/tiny.yaml", "--set", f"model.path={tmp_path}", "--set",
                      f"train.run_dir={tmp_path / 'runs'}"], timeout=300)  # fmt: skip
    assert "precision: fp32 (TRAINER_NATIVE_BF16=0); sft.bf16=false train.bf16=false model.dtype=float32" in out.stdout
    assert out.returncode != 0 and "Traceback" not in out.stderr


def test_reading_a_config_needs_no_torch():
    """`import rewards` (a fork's reward file), the search server and load_config read a config
    without loading torch: the precision keys stay `auto` until a script resolves them."""
    code = ("import sys, rewards, retriever, search.server; from trainer.config import load_config; "
            "cfg = load_config('configs/tiny.yaml'); "
            "heavy = sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules); "
            "print(cfg.train.bf16, cfg.model.dtype, heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["auto", "auto", "[]"], out.stderr[-2000:]


def test_an_engine_refuses_an_unresolved_dtype():
    """vLLM would take `auto` as the checkpoint's own dtype: the engine refuses it in one line."""
    with pytest.raises(ConfigError, match="model.dtype is still 'auto'"):
        make_engine("hf", ROOT, load_config(None).rollout, load_config(None).model.dtype)
