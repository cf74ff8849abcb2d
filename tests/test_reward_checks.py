"""The reward is checked before any work, and checked again as it is scored (issue 34):

- `train.reward` parses strictly: a NaN or infinite weight, a trailing '+', a weight with no
  name, ... is one ConfigError naming the key and the bad part (it once ran, NaN, and exited 0);
- rewards.check_reward (train.py calls it right after the config loads): an unknown reward or a
  misspelt `train.reward_params` key is an error naming the key and what exists (it was a
  traceback after vLLM started, or silently ignored: every reward takes `**_`);
- a reward that comes out NaN or infinite when scored stops the step (TrainingFault) naming the
  reward, how many rollouts and one group; it never reaches the advantages;
- the tiny world's cache keys do not depend on where the retriever is served (retriever.url).
"""

import math
import time
from pathlib import Path

import pytest
from conftest import run_script

from rewards import check_reward, compute, parse_spec, score
from trainer.config import ConfigError, TrainingFault, load_config

ROOT = Path(__file__).resolve().parents[1]
GOOD = "<think> x </think><answer> Velor </answer>"


def records(n: int = 4) -> list[dict]:
    return [{"response": GOOD, "golden_answers": ["Velor"], "group_id": f"g{i // 2}"} for i in range(n)]


# ------------------------------------------------------------------------ the spec (train.reward)


@pytest.mark.parametrize("spec, bad_part", [
    ("nan*em", "'nan'"), ("inf*em", "'inf'"), ("0.5*em + -inf*format", "'inf'"), ("0.5*em+", "empty term"),
    ("0.5*em + + format", "empty term"), ("+", "empty term"), ("0.5*", "no reward name"), ("*em", "no weight"),
    ("2*3*em", "'*' twice"), ("0.5 em", "'0.5 em'"), ("0.5", "'0.5'"), ("x*em", "'x'"), ("em + em", "twice"),
    ("", "empty"), ("bogus", "unknown reward 'bogus'"), ("serch_r1_em", "did you mean 'search_r1_em'"),
    ("no_such_module:fn", "cannot load reward"), ("math:pi", "not a function"),
])  # fmt: skip
def test_a_malformed_or_non_finite_spec_is_one_line_naming_train_reward_and_the_bad_part(spec, bad_part):
    with pytest.raises(ConfigError) as e:
        parse_spec(spec)
    msg = str(e.value)
    assert "'train.reward'" in msg and bad_part in msg and "\n" not in msg, msg


def test_well_formed_specs_keep_their_meaning():
    assert parse_spec("deliberative") == [(1.0, "deliberative")]
    assert parse_spec(" 0.9*em + 0.1 * think_answer ") == [(0.9, "em"), (0.1, "think_answer")]
    assert parse_spec("em - 1e-3*format") == [(1.0, "em"), (-0.001, "format")]  # an exponent's '-' is no operator
    assert parse_spec("-0.5*idk + f1") == [(-0.5, "idk"), (1.0, "f1")]
    assert parse_spec("json:dumps") == [(1.0, "json:dumps")]  # module:function, loaded


# ----------------------------------------------------- check_reward: names, params, constraints


@pytest.mark.parametrize("spec, params, says", [
    ("deliberative", {"zetaa": 5}, ["'train.reward_params'", "'zetaa'", "'deliberative'", "did you mean 'zeta'",
                                    "acc_metric, coin, lam, zeta"]),
    ("0.5*em + 0.5*webfilter", {"alfa": 0.3}, ["'alfa'", "no reward of 'em', 'webfilter'", "alpha, beta"]),
    ("em", {"lam": 0.1}, ["'lam'", "reward 'em' does not take", "no parameters"]),
    ("bapo", {"stage": "plateu"}, ["'train.reward_params.stage'", "exploration, plateau", "'plateu'"]),
    ("deliberative", {"acc_metric": "F1"}, ["acc_metric", "em, f1, judge"]),
    ("deliberative", {"zeta": "5"}, ["'train.reward_params.zeta'", "finite number"]),
    ("deliberative", {"lam": math.nan}, ["'train.reward_params.lam'", "finite number"]),
    ("bapo", {"sample_level": 1}, ["sample_level", "true or false"]),
    ("em", {"judge": "x"}, ["'judge'", "train.judge_url"]),
    ("nan*em", {}, ["'train.reward'", "'nan'"]),
])  # fmt: skip
def test_check_reward_names_the_misspelt_key_the_rewards_and_what_they_take(spec, params, says):
    with pytest.raises(ConfigError) as e:
        check_reward(spec, params)
    msg = str(e.value)
    assert all(s in msg for s in says) and "\n" not in msg, msg


def test_check_reward_checks_the_constraints_lambda_param_and_allows_the_trainers_keys():
    lam = [{"name": "reliability", "stat": "reward/reliability", "param": "lam"}]
    check_reward("deliberative", {"zeta": 5, "acc_metric": "em"}, lam)
    with pytest.raises(ConfigError, match=r"'train.constraints\[0\].param' \(reliability\) is 'lam'.*'em'"):
        check_reward("em", {}, lam)
    with pytest.raises(ConfigError, match="did you mean 'lam'"):
        check_reward("deliberative", {}, [{"name": "r", "param": "lamda"}])
    check_reward("bapo", {"stage": "exploration", "idk_ratio": 0.1, "alpha": 0.05, "correct": "reward"})


def test_a_reward_taking_named_kwargs_may_take_any_key(tmp_path, monkeypatch):
    """`**_` swallows keys meant for other rewards; `**kwargs` uses keys it does not name."""
    (tmp_path / "fwd_reward.py").write_text(
        "from rewards import deliberative\n\n"
        "def forwards(record, **kwargs):\n    return deliberative(record, **kwargs)\n\n"
        "def swallows(record, limit: int = 3, **_):\n    return {'reward': 0.0}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    check_reward("fwd_reward:forwards", {"zeta": 5, "anything": 1})
    check_reward("fwd_reward:swallows", {"limit": 2})
    with pytest.raises(ConfigError, match="'limt'.*did you mean 'limit'"):
        check_reward("fwd_reward:swallows", {"limt": 2})


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT) for p in (ROOT / "configs").glob("**/*.yaml")), ids=str)
def test_every_shipped_config_passes_check_reward(path):
    t = load_config(ROOT / path).train
    check_reward(t.reward, t.reward_params, t.constraints)


def test_the_readme_fork_recipe_reward_passes_and_a_misspelt_param_of_it_does_not(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    code = readme.split("<!-- fork-recipe -->")[1].split("<!-- /fork-recipe -->")[0].split("```python")[1]
    (tmp_path / "my_reward.py").write_text(code.split("```")[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    check_reward("my_reward:short_em", {"max_words": 2})  # the README's --set train.reward_params.max_words=2
    with pytest.raises(ConfigError, match="'max_word'.*did you mean 'max_words'"):
        check_reward("my_reward:short_em", {"max_word": 2})


# ------------------------------------------------------------------ scoring: non-finite rewards


NAN_REWARD = '''
import math
import subprocess
import sys
import time


def nan_for_g1(record: dict, **_) -> dict:
    return {"reward": math.nan if record["group_id"] == "g1" else 1.0}


def inf_component(record: dict, **_) -> dict:
    return {"ratio": math.inf, "reward": 0.5}


def not_a_number(record: dict, **_) -> dict:
    return {"reward": None}
'''


def test_a_non_finite_reward_stops_scoring_naming_the_reward_the_count_and_a_group(tmp_path, monkeypatch):
    (tmp_path / "nan_reward.py").write_text(NAN_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    rs = records()
    with pytest.raises(TrainingFault) as e:
        score(rs, "nan_reward:nan_for_g1")
    msg = str(e.value)
    assert "non-finite reward" in msg and "'nan_reward:nan_for_g1'" in msg and "2 of 4" in msg, msg
    assert "'g1'" in msg and "\n" not in msg, msg
    assert not any("reward" in r for r in rs)  # nothing attached: nothing reaches the advantages
    with pytest.raises(TrainingFault, match="'nan_reward:nan_for_g1'.*2 of 4"):  # inside a weighted sum too
        compute(records(), "0.5*em + 0.5*nan_reward:nan_for_g1")
    with pytest.raises(TrainingFault, match="component 'ratio' of 'nan_reward:inf_component': inf for 4 of 4"):
        compute(records(), "nan_reward:inf_component")
    with pytest.raises(TrainingFault, match="non-numeric reward from 'nan_reward:not_a_number'"):
        compute(records(), "nan_reward:not_a_number")
    with pytest.raises(TrainingFault, match="non-finite reward from '1e308\\*em \\+ 1e308\\*format'"):
        compute(records(), "1e308*em + 1e308*format")  # finite weights and rewards, an infinite sum


# ----------------------------------------------------- the tiny world's cache key and retriever.url


def test_the_tiny_world_and_warm_start_keys_do_not_depend_on_where_the_retriever_is_served(tmp_path):
    from tiny.warm_start import warm_start_dir
    from tiny.world import world_key

    def key(*overrides: str) -> str:
        return world_key(load_config(ROOT / "configs/tiny.yaml", ["sft.bf16=true", *overrides]))

    # the same index served on another port, or named localhost, is the same data: the same world,
    # so a run resumes after its server moved, and a fresh run reuses the SFT start built in process
    served = key("retriever.url=http://127.0.0.1:8000")
    assert served == key("retriever.url=http://localhost:9999") == key() == "2ab02866ae47"
    dense = key("retriever.method=dense")
    assert dense == key("retriever.method=dense", "retriever.url=http://localhost:9999") == "0300fa0577bc"  # as before
    assert key("retriever.method=hybrid", "retriever.index_factory=HNSW32") == "00ba673c89f1"  # unchanged keys
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"0")

    def warm(*overrides: str) -> Path:
        return warm_start_dir(load_config(ROOT / "configs/tiny.yaml", [f"model.path={model}", *overrides]))

    assert warm("retriever.url=http://127.0.0.1:8000") == warm("retriever.url=http://localhost:9999") == warm()


@pytest.mark.parametrize("overrides, says", [
    (["train.reward=deliberative", "train.reward_params.zetaa=5"], "did you mean 'zeta'"),
])  # fmt: skip
def test_train_py_refuses_a_bad_reward_before_any_engine_starts(tmp_path, overrides, says):
    """The whole path: `train.py` exits 2 with one line, before the world, a model or vLLM (it was
    a traceback 25 s in, after vLLM had started, or for a misspelt key nothing at all)."""
    args = [x for kv in overrides for x in ("--set", kv)] + ["--set", f"train.run_dir={tmp_path}"]
    t = time.monotonic()
    out = run_script(["train.py", "--config", "configs/tiny.yaml", *args], timeout=120)  # fmt: skip
    assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "train.reward" in out.stderr.strip().splitlines()[-1]
    assert not list(tmp_path.iterdir())  # no run directory: nothing was started
    assert time.monotonic() - t < 60  # imports only (~5-10 s on 2 cores), never a model or an engine
