"""The `train.reward` key: its grammar, and the check of it and of `train.reward_params` before a run.

A config names one reward of rewards.REWARDS ("deliberative"), a weighted sum of them
("0.9*em + 0.1*think_answer", "em - 1e-3*format"), or a reward kept outside this repo
("my_module:my_reward", README "Fork a reward"). `parse_spec` turns that into (weight, name)
terms and refuses, in one ConfigError naming the key, what would silently go wrong: a NaN or
infinite weight (a run once trained on NaN and exited 0), a malformed sum ("0.5*em +"), a name
given twice or unknown (with "did you mean"). `check_reward` adds what only the rewards'
signatures can tell: every `train.reward_params` key must be a parameter of some reward of the
spec (each reward takes `**_`, so a misspelt key would otherwise be ignored), a word parameter
one of its words, a number a finite number, and each Lagrangian constraint's `param` taken.

rewards.py binds its table (rewards.parse_spec, rewards.check_reward); train.py calls the
check right after the config loads, before any engine starts.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import re
from collections.abc import Callable

from trainer.config import ConfigError

# The "module:function" rewards of specs parsed so far (rewards.REWARDS stays the repo's own table).
LOADED: dict[str, Callable] = {}
# What the trainer gives every reward as keyword arguments besides train.reward_params (rewards.py's
# contract): not parameters a config sets.
GIVEN = ("judge", "passage", "answer_logprob")


def reward_fn(name: str, table: dict[str, Callable]) -> Callable:
    """The function of a reward name of a parsed spec: a table entry or a loaded module:function."""
    return table[name] if name in table else LOADED[name]


def _label(key: str, sub: str = "") -> str:
    """How an error names a setting: config key 'train.reward_params.zeta', or `--set zeta` (CLI)."""
    if key.startswith("--"):
        return f"{key} {sub}".strip()
    return f"config key '{key}{'.' + sub if sub else ''}'"


# A term of a spec: an optional weight and "*", then a table name or "module:function"; terms are
# joined by "+" or "-" (not the "-" of an exponent: "1e-3*em" is one term).
_NAME = re.compile(r"[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?")
_OPERATOR = re.compile(r"(?<![\d.][eE])([+-])")


def parse_spec(spec: str, table: dict[str, Callable], key: str = "train.reward") -> list[tuple[float, str]]:
    """'deliberative' -> [(1, 'deliberative')]; '0.9*em + 0.1*think_answer' -> two terms.

    A weight that is not a finite number ('nan*em'), a malformed sum ('0.5*em +', '0.5*',
    '2*3*em', '0.5 em'), a name given twice or an unknown name is a ConfigError naming `key`
    and the bad part. A "module:function" name is imported here (it must be importable, e.g.
    from PYTHONPATH) and kept in LOADED.

    >>> table = {"em": len, "format": len, "think_answer": len}
    >>> parse_spec("0.9*em + 0.1 * think_answer", table)
    [(0.9, 'em'), (0.1, 'think_answer')]
    >>> parse_spec("em - 1e-3*format", table)
    [(1.0, 'em'), (-0.001, 'format')]
    """

    def bad(what: str, grammar: bool = True) -> ConfigError:
        form = " (a reward name, a weighted sum such as '0.9*em + 0.1*think_answer', or 'module:function')"
        return ConfigError(f"{_label(key)} is {spec!r}: {what}{form if grammar else ''}")

    if not isinstance(spec, str) or not spec.strip():
        raise bad("empty")
    pieces = _OPERATOR.split(spec)  # [term, op, term, op, term, ...]
    signed = [("+", pieces[0]), *zip(pieces[1::2], pieces[2::2])]
    terms: list[tuple[float, str]] = []
    carry = 1.0  # a sign before a sign: "-0.1*em" at the start, "em + -0.1*format"
    for n, (op, part) in enumerate(signed):
        part, sign = part.strip(), carry * (-1.0 if op == "-" else 1.0)
        following = signed[n + 1][0] if n + 1 < len(signed) else ""
        if not part and (following == "-" or (n == 0 and following == "+")):
            carry = sign
            continue
        carry = 1.0
        if not part:
            raise bad("an empty term (a '+' or '-' with nothing on one side)")
        if part.count("*") > 1:
            raise bad(f"'*' twice in term {part!r}")
        weight, star, name = part.rpartition("*")
        weight, name = weight.strip(), name.strip()
        if star and not weight:
            raise bad(f"term {part!r} has '*' but no weight")
        if star and not name:
            raise bad(f"weight {weight!r} has no reward name after its '*'")
        try:
            w = float(weight) if star else 1.0
        except ValueError:
            raise bad(f"weight {weight!r} of term {part!r} is not a number") from None
        if not math.isfinite(w):
            raise bad(f"weight {weight!r} of term {part!r} is not a finite number")
        if not _NAME.fullmatch(name):
            try:
                float(name)
            except ValueError:
                raise bad(f"{name!r} is not a reward name (a weight is joined to its name by '*')") from None
            raise bad(f"weight {name!r} has no reward name (write it as {name}*<reward>)")
        if ":" in name and name not in LOADED:  # "my_module:my_reward", a reward kept outside this repo
            module, _, fn = name.partition(":")
            try:
                loaded = getattr(importlib.import_module(module), fn)
            except (ImportError, AttributeError) as e:
                raise bad(f"cannot load reward {name!r}: {e}", grammar=False) from None
            if not callable(loaded):
                raise bad(f"reward {name!r} is not a function", grammar=False)
            LOADED[name] = loaded
        if name not in table and name not in LOADED:
            close = difflib.get_close_matches(name, table, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise bad(f"unknown reward {name!r}; {hint}known: {', '.join(table)}", grammar=False)
        if name in (t for _, t in terms):
            raise bad(f"reward {name!r} appears twice (write one term with the summed weight)", grammar=False)
        terms.append((sign * w, name))
    return terms


# Parameters whose value is one of a few words: a misspelt word would silently mean the default.
PARAM_CHOICES = {"acc_metric": ("em", "f1", "judge"), "f1_unit": ("char", "word"), "correct": ("em", "reward"),
                 "stage": ("exploration", "plateau")}  # fmt: skip


def reward_keywords(fn) -> dict[str, inspect.Parameter] | None:
    """The parameters a reward takes from train.reward_params: every named one after the record
    (or group), except `judge` (the trainer passes it). None when it also takes `**kwargs` by a
    real name: it uses keys it does not name, so any key may be meant for it (`**_` only
    swallows the keys meant for other rewards)."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    if any(p.kind is p.VAR_KEYWORD and p.name != "_" for p in params):
        return None
    return {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in GIVEN}


def check_signature(name: str, fn: Callable, given: set[str]) -> None:
    """A reward must take the record (or a group's list) first, and every keyword argument it will
    be given (`given`: GIVEN, every train.reward_params key, the constraints' lambdas, BAPO's
    modulator inputs), so end in `**_`; and a parameter without a default must be one of them.
    Else a ConfigError of one line, before any engine starts: unchecked, the first step's scoring
    died with a TypeError after the engine and the first rollouts.

    >>> def mine(record, penalty=0.1): ...
    >>> check_signature("m:mine", mine, {"judge", "penalty"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    trainer.config.ConfigError: reward 'm:mine' cannot take the keyword argument 'judge' ... **_)
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return
    head = "reward " + repr(name)
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD,
                                           params[0].VAR_POSITIONAL):  # fmt: skip
        raise ConfigError(f"{head} must take the rollout record (a group reward: the group's list) as its first "
                          f"argument, as def {getattr(fn, '__name__', 'reward')}(record, ..., **_)")  # fmt: skip
    rest = params[1:]
    if not any(p.kind is p.VAR_KEYWORD for p in rest):
        named = {p.name for p in rest if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        missing = sorted(given - named)
        if missing:
            s = "s" * (len(missing) > 1)
            raise ConfigError(f"{head} cannot take the keyword argument{s} {', '.join(repr(m) for m in missing)} "
                              f"that every reward is given (rewards.py, the reward contract): end its signature with "
                              f"**_, as def {getattr(fn, '__name__', 'reward')}(record, ..., **_)")  # fmt: skip
    required = [p.name for p in rest if p.default is p.empty and p.name not in given
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]  # fmt: skip
    if required:
        raise ConfigError(f"{head} needs {', '.join(repr(r) for r in required)}, which nothing gives it: set "
                          f"train.reward_params.{required[0]} or give the parameter a default")  # fmt: skip


def check_reward(spec: str, params: dict, table: dict[str, Callable], constraints: list = (),
                 keys: tuple[str, str] = ("train.reward", "train.reward_params")) -> None:  # fmt: skip
    """Check `train.reward` and `train.reward_params` before any work (train.py's main): the spec
    parses and every name resolves (parse_spec), every key of params is a parameter of some
    reward of the spec (a misspelt key names itself, the rewards and the keys they take), a word
    parameter is one of its words (PARAM_CHOICES), and a number parameter is a finite number.
    `constraints` (train.constraints mappings): each one's `param`, which the trainer fills with
    lambda, must be taken by the reward too. Raises ConfigError naming the key.

    >>> def reliable(record, lam=0.0, zeta=5, acc_metric="em", judge=None, **_): ...
    >>> table = {"reliable": reliable}
    >>> check_reward("reliable", {"zeta": 5, "acc_metric": "em"}, table, [{"name": "r", "param": "lam"}])
    >>> check_reward("reliable", {"zetaa": 5}, table)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    trainer.config.ConfigError: ... 'zetaa', which reward 'reliable' does not take (did you mean 'zeta'?); ...
    """
    names = [name for _, name in parse_spec(spec, table, keys[0])]
    if not isinstance(params, dict):
        raise ConfigError(f"{_label(keys[1])} must be a mapping of name: value, got {params!r}")
    given = set(GIVEN) | set(params) | {c["param"] for c in constraints if isinstance(c, dict) and c.get("param")}
    if "bapo" in names:  # the modulator's inputs, which train.py adds at each step (BAPO §4.2)
        given |= {"stage", "idk_ratio"}
    for name in names:
        check_signature(name, reward_fn(name, table), given)
    taken: dict[str, tuple[inspect.Parameter, str]] = {}  # key -> (parameter, the reward that takes it)
    for name in names:
        keywords = reward_keywords(reward_fn(name, table))
        if keywords is None:  # takes **kwargs: it may use any key
            return
        taken = {k: (p, name) for k, p in keywords.items()} | taken
    rewards = ", ".join(repr(n) for n in names)
    said = f"reward {rewards} does not take" if len(names) == 1 else f"no reward of {rewards} takes"
    wanted = [(key, f"{_label(keys[1])} has {key!r}") for key in params]
    wanted += [(c["param"], f"config key 'train.constraints[{i}].param' ({c.get('name', '?')}) is {c['param']!r}")
               for i, c in enumerate(constraints) if isinstance(c, dict) and c.get("param")]  # fmt: skip
    for key, where in wanted:
        if key not in taken:
            close = difflib.get_close_matches(str(key), taken, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            they = "it takes" if len(names) == 1 else "they take"
            known = f"{they}: {', '.join(sorted(taken))}" if taken else f"{they} no parameters"
            if key == "judge":
                known = "the judge comes from train.judge_url / judge_model"
            raise ConfigError(f"{where}, which {said}{hint}; {known}")
    for key, value in params.items():
        default, owner = taken[key][0].default, taken[key][1]
        if key in PARAM_CHOICES and ":" not in owner and value not in PARAM_CHOICES[key]:
            raise ConfigError(f"{_label(keys[1], key)} must be one of {', '.join(PARAM_CHOICES[key])}; "
                              f"got {value!r}")  # fmt: skip
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{_label(keys[1], key)} must be a finite number; got {value!r}")
        elif isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"{_label(keys[1], key)} must be true or false; got {value!r}")


def judge_note(spec: str, params: dict, table: dict[str, Callable], judge: str) -> str:
    """One line for a run without a judge (`judge`: train.judge, "") whose reward has terms that ask
    one (their function's `without_judge(params)` says what they score instead); "" otherwise.
    train.py prints it once, at the start: a researcher who forgot train.judge trains on another
    reward than the paper's, and would otherwise see it only in a `judged: 0` component.

    >>> def webfilter(record, **_): ...
    >>> webfilter.without_judge = lambda params: "z is EM"
    >>> judge_note("0.5*webfilter", {}, {"webfilter": webfilter}, "")  # doctest: +ELLIPSIS
    "note: config key 'train.judge' is empty, so reward 'webfilter' (z is EM) scores without a judge; ..."
    """
    if judge:
        return ""
    terms = [(name, getattr(reward_fn(name, table), "without_judge", None)) for w, name in parse_spec(spec, table) if w]
    said = [f"{name!r} ({why})" for name, without in terms if without and (why := without(params))]
    if not said:
        return ""
    s = "s" * (len(said) > 1)
    return (f"note: config key 'train.judge' is empty, so reward{s} {', '.join(said)} score{'' if s else 's'} "
            "without a judge; set train.judge (rule: the tiny world's rule judge; or an OpenAI-compatible URL with "
            "train.judge_model) to score as the paper does")

