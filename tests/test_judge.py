"""A real judge over HTTP: vLLM's OpenAI-compatible server (CPU build) on 127.0.0.1 serving the
micro policy, and the same model in process with transformers.

The tiny policy is no judge of anything; what is tested is the client: verdicts constrained to
0/1, the cache, retries through a server restart in the middle of a batch, timeouts counted as
failures, the failure policy, and the two backends agreeing on the same model. Malformed and
trickled replies come from a small hand-written server on 127.0.0.1.
"""

import contextlib
import http.server
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import pytest
from conftest import RawReply, free_port

from agent.judge import JudgeError, make_judge, parse_verdict
from rewards import compute

INFOS = [f"Doc {i}(Title: P{i}) P{i} was born in the city of C{i}." for i in range(12)]
THINKS = ["So P was born in C.", "I will search again.", "The passage says nothing.", "C it is."]


def start(policy, port, log_path=None):
    """A real vLLM OpenAI server on 127.0.0.1:port, its output kept in log_path (a temp file by
    default): a start-up failure raises with the log's tail, so its cause is seen, not guessed."""
    # The KV cache in bytes, as trainer/engine.py passes it: vLLM CPU's own reading of a share
    # (--gpu-memory-utilization) takes the NUMA node's free memory minus the process's RSS, and
    # refused to start here with "less than requested memory for kv (-0.1/0.64 GiB)".
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(policy), "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "512", "--kv-cache-memory-bytes", str(256 * 2**20),
           "--dtype", "float32", "--served-model-name", "judge",
           "--enforce-eager"]  # fmt: skip  # no torch.compile: each start ~6 s shorter (of ~50; rollout.enforce_eager)
    log_path = log_path or tempfile.NamedTemporaryFile(prefix="vllm-judge-", suffix=".log", delete=False).name
    with open(log_path, "ab") as log:
        # VLLM_USE_AOT_COMPILE=0 as trainer/engine.py sets it: the restart test's second start reuses the compile cache
        env = os.environ | {"VLLM_USE_AOT_COMPILE": "0"}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    proc.log_path = log_path
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            if proc.poll() is not None:
                tail = "".join(open(log_path, errors="replace").readlines()[-40:])
                raise RuntimeError(f"vLLM server exited during start-up (exit {proc.returncode}); "
                                   f"the end of {log_path}:\n{tail}") from None  # fmt: skip
            time.sleep(1)
    stop(proc)
    raise RuntimeError(f"vLLM server did not start in 10 minutes; see {log_path}")


def stop(proc):
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def server(micro):
    for attempt in range(3):  # free_port() then bind is a race: another process may take the port between
        port = free_port()
        try:
            proc = start(micro[2], port)
            break
        except RuntimeError as e:
            if "Address already in use" not in str(e) or attempt == 2:
                raise
    state = {"proc": proc, "port": port, "policy": micro[2], "mixed": mixed_prompts(micro[2])}
    yield state
    stop(state["proc"])


def prompts(judge):
    return [judge.prompt("info_think", info=i, think=t) for i in INFOS for t in THINKS[:2]]


def mixed_prompts(policy, n: int = 6) -> list[str]:
    """Prompts on which the micro model clearly prefers "1" and prompts on which it clearly prefers
    "0" (n of each), picked from a pool by its own next-token logits. A micro model judges
    nothing, and which way it leans differs from build to build; this keeps the agreement and
    determinism checks comparing mixed answers, not a constant."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rng = random.Random(0)
    pool = [f"Verdict: {b}\n" * k + "Verdict:" for b in (0, 1) for k in (1, 3, 6)]
    pool += [f"{d} " * k for d in "01" for k in range(1, 9)] + [d * k for d in "01" for k in range(2, 9)]
    pool += ["".join(rng.choice("01 abcdeVelor.\n") for _ in range(rng.randint(3, 40))) for _ in range(1500)]
    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    one, zero = tok.encode("1", add_special_tokens=False)[0], tok.encode("0", add_special_tokens=False)[0]
    ids = [tok(p)["input_ids"] for p in pool]
    margins = [0.0] * len(pool)
    with torch.inference_mode():  # prompts of one length in one batch: no padding, ~1 s, not ~13 s one by one
        for length in {len(x) for x in ids}:
            rows = [i for i, x in enumerate(ids) if len(x) == length]
            logits = model(torch.tensor([ids[i] for i in rows])).logits[:, -1]
            for i, margin in zip(rows, (logits[:, one] - logits[:, zero]).tolist()):
                margins[i] = margin
    order = sorted(range(len(pool)), key=lambda i: margins[i])
    low, high = order[:n], order[-n:]
    # 0.2 logits: far above what another kernel moves a logit by (numerics.logprob_atol: ~1e-4 for
    # this model), so both engines pick the same side; a fresh CI build once topped out at 0.46 on
    # a 300-prompt pool
    assert margins[high[-1]] > 0.2 and margins[low[0]] < -0.2, "the micro model never clearly prefers 1 or 0"
    return [pool[i] for i in low if margins[i] < -0.2] + [pool[i] for i in high if margins[i] > 0.2]


def test_parse_verdict():
    assert [parse_verdict(t) for t in ["1", " Yes.", "0\n", "no way", "maybe", ""]] == [1.0, 1.0, 0.0, 0.0, None, None]


def test_http_judge_scores_a_batch_and_caches(server, tmp_path):
    url = f"http://127.0.0.1:{server['port']}/v1"
    judge = make_judge(url, "judge", cache_path=str(tmp_path / "judge.sqlite"), concurrency=4)
    ps = prompts(judge) + server["mixed"]
    first = judge.verdicts(ps)
    n = len(first)
    assert set(first) == {0.0, 1.0} and judge.failures == 0 and judge.calls == n
    again = judge.verdicts(ps)
    assert again == first and judge.calls == n and judge.cache_hits == n  # all from the cache
    fresh = make_judge(url, "judge", concurrency=1)
    assert fresh.verdicts(ps) == first  # greedy and constrained: deterministic


def test_http_judge_survives_a_server_restart_mid_batch(server):
    url = f"http://127.0.0.1:{server['port']}/v1"
    ps = prompts(make_judge(url, "judge")) + server["mixed"]
    reference = make_judge(url, "judge").verdicts(ps)
    # the timeout bounds the whole call, retries included: room for vLLM to restart
    judge = make_judge(url, "judge", concurrency=2, retries=14, backoff=1.0, timeout=600)

    def restart():
        while judge.calls < 4:
            time.sleep(0.01)
        stop(server["proc"])
        server["proc"] = start(server["policy"], server["port"], server["proc"].log_path)

    t = threading.Thread(target=restart)
    t.start()
    got = judge.verdicts(ps)
    t.join()
    assert judge.retried > 0 and judge.failures == 0  # the restart was felt, and ridden out
    assert got == reference


def test_timeouts_are_counted_failures_and_the_policy_decides(capsys):
    # a server that accepts connections (its backlog) and never answers: every read times out.
    # (A 1 ms timeout on the real server was not enough: on CI it once answered two of six in time.)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        judge = make_judge(url, "judge", timeout=0.2, retries=1, backoff=0.01, on_failure="zero", concurrency=2)
        got = judge.verdicts(prompts(judge)[:6])
        assert got == [0.0] * 6 and judge.failures == 6
        # the 0.2 s timeout bounds the whole call: the first attempt uses it all, no retry is left
        assert "judge failure (zero): unreachable: 1 attempt(s) in the 0.2 s timeout" in capsys.readouterr().out
        strict = make_judge(url, "judge", timeout=0.2, retries=0, on_failure="error")
        with pytest.raises(JudgeError, match="unreachable"):
            strict.verdicts(prompts(strict)[:1])
    dead = make_judge(f"http://127.0.0.1:{free_port()}/v1", "judge", retries=1, backoff=0.01, on_failure="error")
    with pytest.raises(JudgeError, match="ConnectionRefusedError"):
        dead.verdicts(["x"])


@contextlib.contextmanager
def raw_server(respond):
    """A judge stand-in on 127.0.0.1 answering every POST with respond(handler); yields its /v1 URL."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RawReply)
    srv.daemon_threads, srv.respond, srv.stopping = True, respond, threading.Event()
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    finally:
        srv.stopping.set()
        srv.shutdown()
        srv.server_close()


def canned(body: bytes, length: int = -1):
    """A 200 reply with `body`; `length` other than len(body) declares more than is sent (cut short)."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
    return lambda h: h.wfile.write(head % (len(body) if length < 0 else length) + body)


def trickle(where: str):
    """Headers or body one byte every 0.25 s, for at most 10 s: each read is quick, the call is not."""

    def respond(h):
        if where == "body":
            h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        else:
            h.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        for _ in range(40):
            if h.server.stopping.is_set():
                return
            h.wfile.write(b"a")
            h.wfile.flush()
            time.sleep(0.25)

    return respond


MALFORMED = {  # name: (api, reply)
    "text null": ("completions", canned(b'{"choices": [{"text": null}]}')),
    "content null": ("chat", canned(b'{"choices": [{"message": {"content": null}}]}')),
    "cut short": ("completions", canned(b'{"choices": [{"text": "1"', length=100)),  # IncompleteRead
    "not UTF-8": ("completions", canned(b'{"choices": [{"text": "\xff1"}]}')),
    "nested 100k deep": ("completions", canned(b"[" * 100_000 + b"]" * 100_000)),
    "HTML": ("completions", canned(b"<html><body>502 Bad Gateway</body></html>")),
    "no choices": ("completions", canned(b'{"choices": []}')),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_replies_go_through_the_failure_policy(name, capsys):
    """Never a raw TypeError / IncompleteRead / RecursionError: training (on_failure "zero") must
    score 0 and go on; on_failure "error" raises JudgeError."""
    api, respond = MALFORMED[name]
    with raw_server(respond) as url:
        lenient = make_judge(url, "judge", api=api, timeout=5, retries=1, backoff=0.01, on_failure="zero")
        assert lenient.verdicts(["x"]) == [0.0] and lenient.failures == 1
        strict = make_judge(url, "judge", api=api, timeout=5, retries=1, backoff=0.01, on_failure="error")
        with pytest.raises(JudgeError):
            strict.verdicts(["x"])
    assert "judge failure (zero)" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["headers", "body"])
def test_the_timeout_bounds_the_whole_call_against_a_trickling_server(where, capsys):
    with raw_server(trickle(where)) as url:
        judge = make_judge(url, "judge", timeout=1.0, retries=3, backoff=0.05, on_failure="zero")
        t = time.monotonic()
        assert judge.verdicts(["x"]) == [0.0] and judge.failures == 1
        assert time.monotonic() - t < 2.0  # 1 s timeout + slack, retries included (was ~10 s: per read)
    assert "unreachable: 1 attempt(s) in the 1 s timeout, last error TimeoutError" in capsys.readouterr().out


def test_in_process_judge_agrees_with_the_server_on_the_same_model(server, micro):
    url = f"http://127.0.0.1:{server['port']}/v1"
    http = make_judge(url, "judge")
    local = make_judge(model=str(micro[2]), hf=True)
    ps = prompts(http) + server["mixed"]
    verdicts = http.verdicts(ps)
    assert set(verdicts) == {0.0, 1.0} and local.verdicts(ps) == verdicts


def test_rewards_use_the_judge(server):
    judge = make_judge(f"http://127.0.0.1:{server['port']}/v1", "judge")
    text = (f"<think> find it</think><search> P1 born</search><information>{INFOS[1]}</information>"
            "<think> So P1 was born in C1.</think><answer> C1 </answer>")  # fmt: skip
    rec = {"response": text, "golden_answers": ["C1"], "question": "Where was P1 born?"}
    out = compute([dict(rec)], "veritas", judge=judge)[0]
    assert out["components"]["judged"] == 1.0 and out["components"]["info_think"] in (0.0, 1.0)
    expected = 0.9 + 0.05 * out["components"]["info_think"] + 0.02
    assert out["reward"] == pytest.approx(expected)  # float64, a few terms: equal up to ~1e-16
    web = compute([dict(rec)], "webfilter", judge=judge)[0]["components"]
    assert web["judged"] == 1.0 and web["z"] in (0.0, 1.0) and web["c"] in (0.0, 1.0)


def test_eval_metrics_judge_accuracy_over_http(server):
    """metrics.compute_metrics with the real HTTP judge (eval.py --judge-url): judge_acc is the
    judge's verdict per answer, an IDK answer is never sent and never correct."""
    from report.metrics import compute_metrics
    from rewards import answer_verdict

    judge = make_judge(f"http://127.0.0.1:{server['port']}/v1", "judge")
    texts = ["<think> x</think><answer> C1 </answer>", "<think> x</think><answer> C7 </answer>",
             "<think> x</think><answer> I don't know </answer>"]  # fmt: skip
    records = [{"response_text": t, "golden_answers": ["C1"], "question": "Where was P1 born?"} for t in texts]
    m = compute_metrics(records, judge=judge)
    verdicts = [answer_verdict(dict(r), judge) for r in records[:2]]
    assert m["judge_acc"] == pytest.approx(sum(verdicts) / 3) and m["acc"] == m["judge_acc"]  # a float64 mean
