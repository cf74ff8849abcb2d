"""A run's inputs: the starting policy, the question and corpus files, the prompt-length check.

    paths = data_paths(cfg)            # corpus / train / val / test: `data.*`, or the tiny world's cache
    questions = load_questions(paths["train"])      # trainer/questions.py: checked line by line
    policy_dir = ensure_policy(cfg, run_dir)        # model.path, or the tiny world's SFT policy
    start = starting_policy(cfg)                    # the same directory, without building anything
    check_prompt_lengths(questions, tokenizer, cfg.rollout, paths["train"])  # prompts fit max_model_len

Used by train.py, eval.py and the benchmarks. Empty `data.*` and `model.path` mean the embedded
tiny world (docs/design.md §5), built once into `cache/` by `python -m tiny.sft`. Beside the entry
scripts, this is the one file that reaches into the classroom's `tiny/`, which is why it sits at
the top level and not in trainer/ (the ground floor imports nothing above it).
A bad question file is a DataError naming path:line, before any model loads (the prompt lengths:
once the tokenizer is loaded, still before any engine starts).
"""

from __future__ import annotations

import codecs
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import yaml

from agent import protocols
from rollout import prompt_ids
from tiny.warm_start import warm_start_dir
from tiny.world import ensure_world_data, world_data_dir, world_dir
from trainer.config import Config, DataError, RolloutConfig, config_to_dict
from trainer.questions import question_lines, unreadable

ROOT = Path(__file__).resolve().parent  # the repository, so `python -m tiny.sft` runs from any directory


def run_module(module: str, *args: str, what: str, log: Path) -> None:
    """`python -m module args` in a child process, in this directory, the repository importable.

    Its stdout and progress bars show as they come; its stderr is also kept in `log`. A child that
    fails is one DataError line: `what` failed, the child's own last error line, and the log. Its
    traceback stays in the log, off the screen: stderr is shown up to the traceback's first line.
    """
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    log.parent.mkdir(parents=True, exist_ok=True)
    decode = codecs.getincrementaldecoder("utf-8")("replace").decode
    held, showing, last = "", True, "\n"  # held: an end that may begin a traceback; last: last character shown
    with open(log, "wb") as kept:
        child = subprocess.Popen([sys.executable, "-m", module, *args], stderr=subprocess.PIPE,
                                 env=os.environ | {"PYTHONPATH": path})  # fmt: skip
        try:
            for chunk in iter(lambda: child.stderr.read1(1 << 16), b""):
                kept.write(chunk)
                kept.flush()
                if not showing:
                    continue
                text = held + decode(chunk)
                cut = text.find(TRACEBACK)
                showing = cut < 0
                if cut < 0:  # hold back the longest end that TRACEBACK starts with, until the next chunk
                    cut = len(text) - next((k for k in range(len(TRACEBACK) - 1, 0, -1)
                                            if text.endswith(TRACEBACK[:k])), 0)  # fmt: skip
                shown, held = text[:cut], text[cut:] if showing else ""
                sys.stderr.write(shown)
                sys.stderr.flush()
                last = shown[-1:] or last
            code = child.wait()
        except BaseException:  # Ctrl-C (the child got it too) or a failed write: no child left behind
            child.kill()
            child.wait()
            raise
    sys.stderr.write(held + ("\n" if (held[-1:] or last) != "\n" else ""))  # a bar cut short: end its line
    if code:
        lines = log.read_bytes().decode("utf-8", "replace").replace("\r", "\n").splitlines()
        last_error = next((x.strip() for x in reversed(lines) if x.strip()), "")
        status = f"exit status {code}" if code > 0 else f"killed by signal {-code}"
        raise DataError(f"{what} failed ({status}){': ' + last_error if last_error else ''}; full log: {log}")


TRACEBACK = "Traceback (most recent call last):"  # where a child's stderr stops being shown (run_module)


def starting_policy(cfg: Config) -> Path:
    """Where the run starts from: `model.path` (or its cached warm start), else the tiny world's
    SFT policy. Builds nothing (ensure_policy does)."""
    if cfg.model.path:
        return warm_start_dir(cfg) / "policy" if cfg.sft.warm_start else Path(cfg.model.path)
    return world_dir(cfg) / "policy"


def ensure_policy(cfg: Config, run_dir: Path) -> Path:
    """The starting policy: `model.path` if given (after its warm start with `sft.warm_start`),
    else the tiny world's cached SFT policy.

    Both warm starts are built in a child process: the teacher uses bm25s (numba), which must not
    be imported in a process that will start vLLM afterwards (docs/design.md §6).
    """
    policy = starting_policy(cfg)
    if cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        raise FileNotFoundError(f"model.path has no model: {Path(cfg.model.path) / 'config.json'} not found")
    if (cfg.model.path and not cfg.sft.warm_start) or (policy / "DONE").exists():
        return policy
    if cfg.model.path:
        print(f"warm start: fine-tuning {cfg.model.path} on the tiny world's teacher into {policy.parent} "
              "(cached) ...", flush=True)  # fmt: skip
        run_module("tiny.warm_start", "--config", str(run_dir / "config.yaml"), what="the warm start of model.path",
                   log=policy.parent / "build.log")  # fmt: skip
    else:
        print(f"building the tiny world and SFT warm start in {policy.parent} (cached) ...", flush=True)
        run_module("tiny.sft", "--config", str(run_dir / "config.yaml"), what="building the tiny world's SFT start",
                   log=policy.parent / "build.log")  # fmt: skip
    return policy


def cached_policy(cfg: Config) -> Path:
    """ensure_policy outside a run (benchmarks): the run directory it reads config.yaml from is a
    temporary one. The cached start: the tiny world's SFT, or model.path's warm start."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        return ensure_policy(cfg, Path(tmp))


def data_paths(cfg: Config) -> dict[str, Path]:
    """corpus/train/val/test files: the `data` section, or, where it is empty, the tiny world's.
    With the tiny policy they sit in its cache (world.world_dir); with a `model.path` of yours,
    in a cache keyed on the world alone (world.world_data_dir, written here on first use), so any
    model trains and evaluates on the tiny world with no `data.*` set."""
    tiny = world_dir(cfg)
    if cfg.model.path and not all(getattr(cfg.data, kind) for kind in ("corpus", "train", "val", "test")):
        tiny = ensure_world_data(cfg, world_data_dir(cfg))
    paths = {}
    for kind in ("corpus", "train", "val", "test"):
        given = getattr(cfg.data, kind)
        paths[kind] = Path(given) if given else tiny / f"{kind}.jsonl"
    for kind in ("corpus", "train", "val"):
        if not os.path.lexists(paths[kind]):
            raise FileNotFoundError(f"{kind} file not found: {paths[kind]}")
        if why := unreadable(paths[kind]):  # a directory or a broken link: said as such, not "not found"
            raise FileNotFoundError(f"{kind} file {paths[kind]} cannot be read: {why}")
    return paths


FIRST_TURN_ROOM = 8  # rollout.py ends a rollout with fewer tokens of room than this before it generates


def check_prompt_lengths(questions: list[dict], tokenizer, cfg: RolloutConfig, path: Path) -> None:
    """Every question's first prompt, built as rollout.py builds it (rollout.prompt_ids: template,
    chat template, protocol instructions), must leave the rollout room to generate: at most
    rollout.max_model_len - FIRST_TURN_ROOM tokens. A longer one is a DataError naming path:line
    (questions: load_questions(path), in its order); run it before any engine starts.

    Unchecked, such a question is never generated for (the rollout ends it at once, finish
    "length"), but its prompt still goes through every forward pass: a 1 MB question made a
    reference forward over a million tokens in one micro-batch. The bound is the rollout's own, not
    max_model_len - max_tokens_per_turn: a prompt with less room than a full turn still gets a
    shorter first turn, as later turns do.

    Cost: each question alone is tokenised in one batched call; the exact prompt only for a
    question within SLACK tokens of the bound (text tokenised whole differs from its parts
    tokenised apart only where they meet). 20,000 short questions take about a second; a 1 MB one,
    a few. No character count could stand in for this: how many characters a token covers depends
    on the tokenizer (its vocabulary and normalizer), so none bounds tokens for every tokenizer.
    """
    proto = protocols.get(cfg.protocol)
    limit = cfg.max_model_len - FIRST_TURN_ROOM
    most_bytes = limit * max_token_bytes(tokenizer) * NORMALIZED_SHRINK  # more cannot fit: refused untokenised
    # a UTF-8 character is at most 4 bytes: a question of fewer characters than most_bytes / 4 is never encoded
    huge = [i for i, q in enumerate(questions) if len(q["question"]) > most_bytes // 4
            and len(q["question"].encode("utf-8")) > most_bytes]  # fmt: skip
    if huge:
        i, more = huge[0], len(huge) - 1
        line = question_lines(Path(path))[i]
        raise DataError(f"{path}:{line}: question {questions[i]['id']!r} has {len(questions[i]['question'].encode())} "
                        f"bytes, more than rollout.max_model_len {cfg.max_model_len} tokens can hold with this "
                        f"tokenizer (at most {most_bytes} bytes)"
                        + (f" ({more} more question{'s' * (more > 1)} in the file too)" if more else ""))  # fmt: skip
    around = len(prompt_ids(tokenizer, "", cfg, proto))  # the prompt's tokens besides the question's
    alone = tokenizer([str(q["question"]).strip() for q in questions], add_special_tokens=False)["input_ids"]
    near = [i for i, ids in enumerate(alone) if around + len(ids) > limit - SLACK]
    exact = {i: len(prompt_ids(tokenizer, str(questions[i]["question"]), cfg, proto)) for i in near}
    over = [(i, n) for i, n in exact.items() if n > limit]
    if over:
        (i, n), more = over[0], len(over) - 1
        line = question_lines(Path(path))[i]
        raise DataError(f"{path}:{line}: question {questions[i]['id']!r} is {n} tokens as a prompt, over "
                        f"rollout.max_model_len {cfg.max_model_len} less the {FIRST_TURN_ROOM} a first turn needs"
                        + (f" ({more} more question{'s' * (more > 1)} in the file too)" if more else ""))  # fmt: skip


SLACK = 64  # tokens: where the exact prompt is built (check_prompt_lengths)
# How far a tokenizer's normalizer can shrink text before it is split: NFC composing 3 Hangul jamo
# (9 bytes) into one syllable (3 bytes) is the largest shrink of NFC / NFKC we know of; 4 leaves room.
NORMALIZED_SHRINK = 4


def max_token_bytes(tokenizer) -> int:
    """The most input bytes one token can stand for, bounded by its vocabulary: the longest token
    string in UTF-8. A byte-level BPE token (Qwen, GPT-2) writes each byte it covers as one
    character of 1-2 UTF-8 bytes; a SentencePiece piece writes its text ("▁" for a space, 3 bytes
    for 1) or a byte-fallback "<0xE3>" (6 for 1). So a question of more than
    limit x this x NORMALIZED_SHRINK bytes cannot fit in `limit` tokens, and is refused before
    tokenising it: tokenising a 50 MB line took 166-228 s and 13.3 GB (88e794b)."""
    return max(len(token.encode("utf-8")) for token in tokenizer.get_vocab())


def passage_lookup(corpus_path: Path) -> Callable[[str], str | None]:
    """id -> the passage's contents (None for an unknown id): what the rewards are given as
    `passage` (StepSearch's gold documents from metadata.gold_ids). The id map is read on the
    first call, one pass over the corpus holding every id and text: fine for the tiny world and a
    few million passages; for wiki-18 give the questions `metadata.support_docs` instead (then it
    is never called)."""
    texts: dict[str, str] = {}

    def passage(doc_id: str) -> str | None:
        if not texts:
            with open(corpus_path, encoding="utf-8-sig") as f:
                for line in f:
                    if line.strip():
                        doc = json.loads(line)
                        texts[str(doc["id"])] = str(doc["contents"])
        return texts.get(str(doc_id))

    return passage
