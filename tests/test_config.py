"""Config loading: defaults, YAML, --set overrides, and errors that name the key or path."""

import subprocess
import sys
from pathlib import Path

import pytest

from config import ConfigError, load_config

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
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        load_config(path)


def test_train_cli_reports_unknown_key_without_traceback():
    out = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/tiny.yaml", "--set", "train.lrr=1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "unknown config key 'train.lrr'" in out.stderr
    assert "Traceback" not in out.stderr


def test_train_help_explains_flags():
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for flag in ("--config", "--set", "--resume"):
        assert flag in out.stdout
