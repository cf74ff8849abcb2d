"""Config loading: defaults, YAML, --set overrides, and errors that name the key or path."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest
from conftest import run_script

from trainer.config import ConfigError, TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 1\n  steps: 7\nrollout:\n  engine: hf\n")
    cfg = load_config(f, ["train.steps=9", "train.mask_retrieved=false"])
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 9
    assert cfg.train.mask_retrieved is False
    assert cfg.rollout.engine == "hf"


def test_unknown_key_names_the_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr_rate: 0.1\n")
    with pytest.raises(ConfigError, match="'train.lr_rate'"):
        load_config(f)
    with pytest.raises(ConfigError, match="'trian'"):
        load_config(None, ["trian.lr=1"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match="'train.steps'"):
        load_config(None, ["train.steps=many"])


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_every_shipped_config_loads():
    configs = sorted((ROOT / "configs").glob("**/*.yaml"))  # reproduction/ and experiments/ too
    assert configs
    for path in configs:
        load_config(path)


def test_train_cli_reports_unknown_key_without_traceback():
    out = run_script(["train.py", "--config", "configs/tiny.yaml", "--set", "train.lrr=1"], timeout=120)
    assert out.returncode == 2
    assert "unknown config key 'train.lrr'" in out.stderr
    assert "Traceback" not in out.stderr


def test_train_help_explains_flags():
    out = run_script(["train.py", "--help"], timeout=120)
    assert out.returncode == 0
    for flag in ("--config", "--set", "--resume"):
        assert flag in out.stdout


def test_grpo_refuses_a_one_rollout_group():
    """A one-rollout group has advantage 0 under GRPO: only the KL term would train. PPO (the
    critic is the baseline) and RFT (keeps rollouts by reward) may roll out once per question."""
    with pytest.raises(ConfigError, match=r"'train.group_size' must be >= 2 with train.algo grpo.*advantage 0"):
        load_config(None, ["train.group_size=1"])
    for algo in ("ppo", "rft"):
        assert load_config(None, ["train.group_size=1", f"train.algo={algo}"]).train.group_size == 1


@pytest.mark.parametrize("override", ["train.steps=true", "train.group_size=false", "train.lr=true",
                                      "hardware.gpu_memory_gb=true"])  # fmt: skip
def test_a_bool_is_not_a_number(override):
    """isinstance(True, int) is True in Python; `steps: true` is still a mistake, not 1 step."""
    with pytest.raises(ConfigError, match=f"'{override.split('=')[0]}' wants (int|float), got (True|False)"):
        load_config(None, [override])


@pytest.mark.parametrize("override", ["train.lr=.nan", "train.lr=nan", "train.kl_coef=.inf", "rollout.temperature=inf",
                                      "train.rft_accept=-.inf", "hardware.gpu_memory_gb=.nan"])  # fmt: skip
def test_every_float_must_be_finite(override):
    with pytest.raises(ConfigError, match=f"'{override.split('=')[0]}' must be a finite number"):
        load_config(None, [override])


@pytest.mark.parametrize("url", ["notaurl", "127.0.0.1:8000", "ftp://host/x", "http://"])
def test_retriever_url_must_be_an_http_url(url):
    """It was a 47-line CalledProcessError from the tiny world's SFT build, minutes in."""
    with pytest.raises(ConfigError, match="'retriever.url' must be an http"):
        load_config(None, [f"retriever.url={url}"])
    assert load_config(None, ["retriever.url=http://localhost:8000"]).retriever.url == "http://localhost:8000"


@pytest.mark.parametrize("override", ["train.dist_timeout=0", "train.dist_timeout=-5"])
def test_dist_timeout_must_be_positive(override):
    with pytest.raises(ConfigError, match="'train.dist_timeout' must be > 0"):
        load_config(None, [override])


@pytest.mark.parametrize(
    "override, allowed",
    [
        ("train.steps=-1", ">= 1"),  # exited 0 having trained nothing
        ("train.steps=0", ">= 1"),
        ("train.questions_per_step=0", ">= 1"),
        ("train.group_size=0", ">= 1"),
        ("rollout.max_turns=-1", ">= 0"),  # a rollout of no turns: no tokens to train on
        ("rollout.max_tokens_per_turn=0", ">= 1"),
        ("train.lr=0", "> 0"),
        ("train.lr=-1e-4", "> 0"),
        ("rollout.temperature=0", "> 0"),
        ("rollout.top_p=0", "in (0, 1]"),
        ("rollout.top_p=1.5", "in (0, 1]"),
        ("train.clip_eps=0", "> 0"),
        ("train.kl_coef=-0.1", ">= 0"),
        ("train.grad_clip=-1", "> 0"),
        ("rollout.gpu_memory_utilization=0", "in (0, 1]"),
        ("rollout.gpu_memory_utilization=1.2", "in (0, 1]"),
        ("train.epochs=0", ">= 1"),
        ("train.mini_batches=0", ">= 1"),
        ("train.micro_batch_tokens=0", ">= 1"),
        ("hardware.gpus=0", ">= 1"),  # divided by zero in train.py --plan
        ("hardware.gpu_memory_gb=0", "> 0"),
        ("world.n_people=0", ">= 1"),
        ("train.eval_every=-1", ">= 0"),
        ("train.save_every=-5", ">= 0"),
        ("train.threads=0", ">= 1"),
        ("train.gae_lambda=1.5", "in [0, 1]"),
        ("train.lora_dropout=1", "in [0, 1)"),
        ("world.misinfo_frac=-0.1", "in [0, 1]"),
        ("rollout.tensor_parallel_size=0", ">= 1"),
    ],
)
def test_out_of_range_values_name_the_key_and_the_range(override, allowed):
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError, match=re.escape(f"config key '{key}' must be {allowed}; got ")):
        load_config(None, [override])


def test_range_edges_are_accepted():
    cfg = load_config(None, ["rollout.top_p=1", "rollout.max_turns=0", "train.kl_coef=0", "train.save_every=0",
                             "train.warmup_frac=1", "train.lora_dropout=0", "train.dual_clip=3"])  # fmt: skip
    assert (cfg.rollout.top_p, cfg.rollout.max_turns, cfg.train.dual_clip) == (1.0, 0, 3.0)
    with pytest.raises(ConfigError, match="'train.dual_clip' must be 0 \\(off\\) or > 1"):
        load_config(None, ["train.dual_clip=0.5"])


def test_every_numeric_key_has_a_range():
    """Each int / float field of the config was looked at: it has a range, or is named as unbounded."""
    from trainer.config import RANGES, UNBOUNDED, Config

    numeric = set()
    for section in dataclasses.fields(Config):
        hints = typing.get_type_hints(type(getattr(Config(), section.name)))
        numeric |= {f"{section.name}.{name}" for name, kind in hints.items() if kind in (int, float, int | str)}
    assert numeric == set(RANGES) | set(UNBOUNDED)
    load_config(None)  # the defaults are in range


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 1\n lr2: x\n")  # line 3 is indented by one space
    with pytest.raises(ConfigError, match=re.escape(f"{f}:3:")) as e:
        load_config(f)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=re.escape("override 'train.lr=[1': not valid YAML")) as e:
        load_config(None, ["train.lr=[1"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "script, args, says",
    [
        ("train.py", ["--config", "BAD"], "BAD:3:"),
        ("train.py", ["--set", "train.lr=[1"], "override 'train.lr=[1'"),
        ("train.py", ["--set", "train.steps=-1"], "'train.steps' must be >= 1"),
        ("train.py", ["--plan", "--set", "hardware.gpus=0"], "'hardware.gpus' must be >= 1"),
        ("train.py", ["--plan", "--config", "BAD"], "BAD:3:"),
        ("eval.py", ["--set", "train.lr=.nan"], "'train.lr' must be a finite number"),
        ("eval.py", ["--config", "BAD"], "BAD:3:"),
    ],
)
def test_cli_reports_a_bad_config_in_one_line(tmp_path, script, args, says):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: 1\n lr2: x\n")
    args, says = [a.replace("BAD", str(bad)) for a in args], says.replace("BAD", str(bad))
    out = run_script([script, *args], timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    (line,) = [x for x in out.stderr.splitlines() if "error:" in x]
    assert says in line


@pytest.mark.parametrize("override", ["rollout.engine=hf", "rollout.weight_sync=file"])
def test_a_shared_engine_needs_vllm_in_the_training_process(override):
    with pytest.raises(ConfigError, match="config key 'rollout.tensor_parallel_size' > 1 shares a vLLM engine"):
        load_config(None, ["rollout.tensor_parallel_size=2", override])
    with pytest.raises(ConfigError, match="config key 'rollout.weight_sync' must be one of memory, file"):
        load_config(None, ["rollout.weight_sync=disk"])


def test_config_cli_lists_every_key_with_its_note_and_a_bad_file_is_one_line():
    """`python -m trainer.config --keys SECTION`: every field of the section, its value and the
    comment beside / above it in trainer/config.py; a missing file: one line, no traceback."""
    run = ["-m", "trainer.config"]
    keys = run_script(run + ["--keys", "train", "--set", "train.steps=3"])
    assert keys.returncode == 0, keys.stderr
    keys = keys.stdout.splitlines()
    assert [line.split(" = ")[0] for line in keys] == [f"train.{f.name}" for f in dataclasses.fields(TrainConfig)]
    assert "train.steps = 3" in keys
    note = next(line for line in keys if line.startswith("train.exact_grad_sum"))
    assert "float64" in note and "number of processes" in note  # the comment block above the field
    assert any(line.startswith("train.group_size = 8  rollouts per question") for line in keys)  # the comment beside
    bad = run_script(run + ["no/such.yaml"])
    assert bad.returncode != 0 and bad.stderr.strip() == "error: config file not found: no/such.yaml"
