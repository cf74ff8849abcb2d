"""A judge that hangs, rate-limits or fails in part, met by the real client, the real rewards and
train.py (issue "Nothing silent", case 1: a dead judge stalled a step for hours and trained on
zeros; a 429 was taken as a permanent refusal).

The judges are stand-in servers on 127.0.0.1: one that answers each POST as the test says (and
counts how many requests it holds at once), and a listening socket that never answers.
"""

import contextlib
import http.server
import json
import select
import socket
import threading
import time

import pytest
from conftest import run_script, write_micro_config

from agent.judge import make_judge, retry_after
from rewards import compute

ONE = b'{"choices": [{"text": "1"}]}'


class StandIn(http.server.BaseHTTPRequestHandler):
    """Reads a POST's prompt, counts it (time, requests in flight), lets server.respond answer."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        srv = self.server
        with srv.lock:
            srv.times.append(time.monotonic())
            srv.in_flight += 1
            srv.most = max(srv.most, srv.in_flight)
        try:
            srv.respond(self, body.get("prompt", ""))
        except OSError:  # the client gave up: fine
            pass
        finally:
            with srv.lock:
                srv.in_flight -= 1

    def log_message(self, *args):
        pass


def reply(h: StandIn, status: int = 200, body: bytes = ONE, headers: tuple = ()) -> None:
    h.send_response(status)
    for name, value in headers:
        h.send_header(name, value)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


@contextlib.contextmanager
def stand_in(respond):
    """A judge on 127.0.0.1 answering every POST with respond(handler, prompt); yields the server
    (.url its /v1 URL, .times the requests' arrival, .most the most requests held at once)."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    srv.daemon_threads, srv.respond, srv.lock = True, respond, threading.Lock()
    srv.times, srv.in_flight, srv.most = [], 0, 0
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


@contextlib.contextmanager
def hanging():
    """A judge that accepts connections (the kernel's backlog) and never answers: every request
    times out. Yields (its /v1 URL, the listening socket: readable once a request has come)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        yield f"http://127.0.0.1:{silent.getsockname()[1]}/v1", silent


def webfilter_records(n: int) -> list[dict]:
    """n rollouts that each ask the judge two things: is the answer right (z), did the site: query help (c)."""
    return [{"response": f"<think> find P{i}</think><search> site:tinypedia.org P{i} born </search>"
                         f"<information>Doc 1(Title: P{i}) P{i} was born in C{i}.</information>"
                         f"<think> So P{i} was born in C{i}.</think><answer> C{i} </answer>",
             "golden_answers": [f"C{i}"], "question": f"Where was P{i} born?", "group_id": f"q{i}"}
            for i in range(n)]  # fmt: skip


def test_retry_after_reads_seconds_and_dates():
    assert retry_after("2") == 2.0 and retry_after(" 0.5 ") == 0.5 and retry_after("-3") == 0.0
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past: now
    soon = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 28 <= retry_after(soon) <= 30
    assert retry_after(None) is None and retry_after("soon") is None and retry_after("nan") is None


def test_a_rate_limit_is_waited_out_as_the_server_asks():
    """429 then 200: the verdict is the 200's, asked again after Retry-After (1 s), not after the
    client's own 0.01 s backoff; before, the 429 was a permanent refusal scored 0."""

    def respond(h, prompt):
        if len(h.server.times) == 1:
            reply(h, 429, b'{"error": "rate limited"}', (("Retry-After", "1"),))
        else:
            reply(h)

    with stand_in(respond) as srv:
        judge = make_judge(srv.url, "judge", timeout=10, backoff=0.01, on_failure="zero")
        assert judge.verdicts(["x"]) == [1.0] and judge.failures == 0
        assert len(srv.times) == 2 and 1.0 <= srv.times[1] - srv.times[0] < 2.0


def test_a_rate_limit_past_the_timeout_fails_at_once_and_other_4xx_stay_permanent():
    with stand_in(lambda h, p: reply(h, 429, b"slow down", (("Retry-After", "30"),))) as srv:
        judge = make_judge(srv.url, "judge", timeout=2, on_failure="zero")
        t = time.monotonic()
        assert judge.verdicts(["x"]) == [0.0] and judge.failures == 1
        assert time.monotonic() - t < 1.0  # no 30 s wait inside a 2 s budget, and no waiting it out either
        assert judge.last_failure.startswith("unreachable: 1 attempt(s) in the 2 s timeout, last error HTTP 429")
    with stand_in(lambda h, p: reply(h, 400, b'{"error": "bad request"}')) as srv:
        judge = make_judge(srv.url, "judge", timeout=5, backoff=0.01, on_failure="zero")
        assert judge.verdicts(["x"]) == [0.0] and len(srv.times) == 1  # not retried
        assert judge.last_failure.startswith("refused: HTTP 400")


def test_a_steps_verdicts_go_to_the_judge_at_once():
    """16 rollouts (8 questions, 2 alike each) ask 32 verdicts, 16 distinct; a judge taking 0.4 s
    a request served them 8 at a time, each distinct prompt once, with no cache (the memo of
    asked_at_once). Before: one at a time, 32 requests, 12.8 s."""
    d = 0.4
    with stand_in(lambda h, p: (time.sleep(d), reply(h))) as srv:
        judge = make_judge(srv.url, "judge", timeout=30, concurrency=8)
        records = [dict(r) for r in webfilter_records(8) for _ in range(2)]
        t = time.monotonic()
        out = compute(records, "webfilter", judge=judge)
        took = time.monotonic() - t
    assert srv.most > 1, "the judge was asked one prompt at a time"
    assert took < 16 * d / 2, f"{took:.1f} s for 16 distinct prompts at {d} s each"
    assert all(o["components"]["z"] == o["components"]["c"] == 1.0 for o in out)
    assert len(srv.times) == judge.calls == judge.asked == 16  # each distinct prompt once; the real pass asks nothing
    print(json.dumps({"records": len(records), "seconds": round(took, 2), "most_in_flight": srv.most}))


def test_a_hanging_judge_costs_one_timeout_not_one_per_prompt(capsys):
    """12 rollouts, 24 prompts, a judge that never answers and a 1 s timeout: the first wave of 8
    times out, the other 16 fail at once. Before: 24 s, one prompt after the other."""
    with hanging() as (url, _):
        judge = make_judge(url, "judge", timeout=1.0, concurrency=8, on_failure="zero")
        t = time.monotonic()
        out = compute(webfilter_records(12), "webfilter", judge=judge)
        took = time.monotonic() - t
    assert took < 2 * 1.0, f"{took:.1f} s against a dead judge with a 1 s timeout"
    assert judge.failures == judge.asked == 24 and all(o["components"]["z"] == 0.0 for o in out)
    assert judge.last_failure == "unreachable: 1 attempt(s) in the 1 s timeout, last error TimeoutError: timed out"
    said = capsys.readouterr().out
    assert "judge failure (zero): skipped: the judge is down (no reply to any prompt in the 1 s timeout)" in said


def _train_config(micro, tmp_path, name: str, **train):
    return write_micro_config(
        tmp_path / f"{name}.yaml", micro[1].world.cache_dir,
        train={"steps": 1, "save_every": 0, "reward": "webfilter", "judge_model": "judge", "name": name,
               "run_dir": str(tmp_path / "runs")} | train,
    )  # fmt: skip


@pytest.mark.slow
def test_a_dead_judge_stops_the_run_within_two_timeouts(micro, tmp_path):
    """train.py with WebFilter's reward and a judge that never answers (8 s timeout): from the
    first verdict asked to the exit, under 2 timeouts, one line naming the judge, the rate, the key
    and the cause, no metrics row (the step trained nothing). The line comes one timeout after the
    first verdict asked; the exit ~3.5 s later (vLLM's engine shutting down, as at any run's end).
    Before: 8 s a verdict, one after the other, every verdict 0, and the run trained on."""
    timeout = 8.0
    with hanging() as (url, silent):
        cfg_path = _train_config(micro, tmp_path, "dead", judge=url, judge_timeout=timeout, steps=2)
        done = {}

        def run():
            done["out"] = run_script(["train.py", "--config", str(cfg_path)], timeout=400)
            done["at"] = time.monotonic()

        runner = threading.Thread(target=run)
        runner.start()
        asked = select.select([silent], [], [], 400)[0]  # readable: a connection is waiting, the reward stage began
        asked_at = time.monotonic()
        runner.join(400)
    out = done["out"]
    assert asked, "the judge was never asked"
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert lines == [out.stderr.strip().splitlines()[-1]], out.stderr[-3000:]
    assert lines[0].startswith(f"error: step 1: judge {url}: "), lines
    assert "verdicts failed (100%), more than train.judge_max_failure_rate 0.5" in lines[0], lines
    assert "Last failure: unreachable: 1 attempt(s) in the 8 s timeout, last error TimeoutError" in lines[0], lines
    took = done["at"] - asked_at
    assert took < 2 * timeout, f"{took:.1f} s from the first verdict asked to the exit"
    run = next((tmp_path / "runs").glob("dead-*"))
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip()
    print(json.dumps({"judge_timeout": timeout, "first_verdict_to_exit_s": round(took, 2)}))


@pytest.mark.slow
def test_a_partly_failing_judge_is_logged_each_step_and_at_validation(micro, tmp_path):
    """A judge that refuses every "did the operators help" prompt and answers the others: the run
    trains (under train.judge_max_failure_rate 0.9), and metrics.jsonl has the judge's failures
    and rate in the step row and in both validation rows."""

    def respond(h, prompt):
        if "search operators" in prompt:  # WebFilter's c
            reply(h, 400, b'{"error": "no"}')
        else:
            reply(h)

    with stand_in(respond) as srv:
        cfg_path = _train_config(micro, tmp_path, "partly", judge=srv.url, judge_max_failure_rate=0.9, eval_every=1)
        out = run_script(["train.py", "--config", str(cfg_path), "--set", "eval.max_questions=4"], timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    run = next((tmp_path / "runs").glob("partly-*"))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    step = next(r for r in rows if r["step"] == 1)
    for where, row in (("step 1", step), ("validation at step 0", rows[0]["eval"]), ("at step 1", step["eval"])):
        failed, asked = row["judge/failures"], row["judge/verdicts"]
        assert 0 < failed < asked, (where, row)
        assert row["judge/failure_rate"] == failed / asked, (where, row)
