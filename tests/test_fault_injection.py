"""The faults a long run meets, injected into one real multi-step run (train.py in a subprocess,
the micro world, the transformers engine, the retrieval server on 127.0.0.1):

1. the retrieval server is killed for 10 s mid-run and comes back on the same port: the run
   rides it out (the client retries until `retriever.timeout`);
2. one reward comes out NaN (a user's `module:function` reward, as a buggy judge would): the run
   stops before the update, with one line and a non-zero exit, and keeps its last checkpoints;
3. the newest checkpoint is then truncated: `--resume` says so, falls back to the previous one,
   and finishes with the same metrics as a run that met none of this.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, free_port, run_script, write_micro_config
from test_train_e2e import _close, _metric_rows

from trainer.checkpoint import verify_checkpoint

FAULTY_REWARD = '''
import os
from pathlib import Path

from agent.answers import exact_match, parsed


def em_unless_marked(record: dict, **_) -> dict:
    """EM; NaN once, for the first record scored after the test creates $NAN_MARKER."""
    em = exact_match(parsed(record).answer, record["golden_answers"])
    marker = Path(os.environ["NAN_MARKER"])
    if marker.exists():
        marker.unlink()
        return {"em": em, "reward": float("nan")}
    return {"em": em, "reward": em}
'''


def _serve(index: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "retriever.py", "serve", "--index", str(index), "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("the retrieval server did not start")


def _wait_for(path: Path, proc: subprocess.Popen, limit: float = 300) -> None:
    deadline = time.time() + limit
    while not path.exists():
        assert proc.poll() is None, f"the run ended before {path} appeared"
        assert time.time() < deadline, f"{path} did not appear in {limit} s"
        time.sleep(0.1)


@pytest.mark.slow
def test_retriever_outage_nan_reward_and_truncated_checkpoint_then_resume_matches(micro, tmp_path):
    _, cfg, _, world = micro
    index = world / "index-bm25"
    if not index.exists():  # the index the in-process search builds; the server serves the same one
        build = ["build", "--corpus", str(world / "corpus.jsonl"), "--method", "bm25", "--out", str(index)]
        subprocess.run([sys.executable, "retriever.py", *build], cwd=ROOT, check=True, capture_output=True)
    (tmp_path / "faulty_reward.py").write_text(FAULTY_REWARD)
    port = free_port()
    procs, configs, envs = {}, {}, {}
    server = _serve(index, port)
    try:
        for name in ("whole", "faulty"):
            configs[name] = write_micro_config(
                tmp_path / f"{name}.yaml", cfg.world.cache_dir, rollout={"engine": "hf"},
                retriever={"url": f"http://127.0.0.1:{port}", "timeout": 30},
                train={"steps": 5, "save_every": 1, "keep_checkpoints": 2, "threads": 1,
                       "reward": "faulty_reward:em_unless_marked", "run_dir": str(tmp_path / name), "name": name},
            )  # fmt: skip
            envs[name] = dict(os.environ, PYTHONPATH=str(tmp_path), NAN_MARKER=str(tmp_path / f"nan.{name}"))
        faulty = procs["faulty"] = subprocess.Popen(
            [sys.executable, "train.py", "--config", str(configs["faulty"])], cwd=ROOT, env=envs["faulty"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
        deadline = time.time() + 120
        while not list((tmp_path / "faulty").glob("faulty-*")):
            assert faulty.poll() is None and time.time() < deadline, faulty.stderr.read()[-3000:]
            time.sleep(0.1)
        run = next((tmp_path / "faulty").glob("faulty-*"))
        _wait_for(run / "checkpoints" / "step_1", faulty)
        os.killpg(server.pid, signal.SIGKILL)  # 1. the server goes away for 10 s, mid-run
        server.wait()
        time.sleep(10)
        server = _serve(index, port)
        _wait_for(run / "checkpoints" / "step_2", faulty)
        (tmp_path / "nan.faulty").touch()  # 2. the next reward scored is NaN
        _, err = faulty.communicate(timeout=600)
        assert faulty.returncode != 0 and "Traceback" not in err, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: step ") and "non-finite reward" in last and "--resume" in last, err[-3000:]
        stopped_at = int(last.split("error: step ")[1].split(":")[0])
        rows = _metric_rows(run)
        assert [r["step"] for r in rows] == list(range(1, stopped_at)), rows  # the NaN step logged nothing
        assert max(r["time"]["retrieve"] for r in rows) > 5, "the outage was not met"  # and was ridden out
        kept = sorted(p.name for p in (run / "checkpoints").iterdir())
        assert kept == [f"step_{stopped_at - 2}", f"step_{stopped_at - 1}"], kept  # nothing pruned by the fault

        newest = run / "checkpoints" / f"step_{stopped_at - 1}" / "model.safetensors"
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # 3. a torn write
        out = run_script(["train.py", "--resume", str(run)], timeout=600, env=envs["faulty"])
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
        said = out.stdout + out.stderr
        fallback = run / "checkpoints" / f"step_{stopped_at - 2}"
        (line,) = [x for x in said.splitlines() if "is broken" in x]
        assert line.startswith(f"checkpoint step_{stopped_at - 1} is broken (cannot read {newest}: the file is "
                               f"truncated"), line  # fmt: skip
        assert line.endswith(f"; resuming from {fallback.name}, step_{stopped_at - 1} is left in place"), line
        assert f"resumed from {fallback} at step {stopped_at - 2}" in said, said[-3000:]
        for ckpt in (run / "checkpoints").iterdir():  # the broken one was redone in place, then pruned or kept
            verify_checkpoint(ckpt)
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_4", "step_5"]

        # the reference, after: its own NaN marker is never written, and the server is up throughout
        whole = run_script(["train.py", "--config", str(configs["whole"])], timeout=600, env=envs["whole"])
        assert whole.returncode == 0, whole.stderr[-3000:]
        reference = _metric_rows(next((tmp_path / "whole").glob("whole-*")))
        resumed = _metric_rows(run)
        assert [r["step"] for r in resumed] == [r["step"] for r in reference] == [1, 2, 3, 4, 5]
        for mine, ref in zip(resumed, reference):
            _close(mine, ref)
        print(json.dumps({"stopped_at": stopped_at, "retrieve_s": [r["time"]["retrieve"] for r in rows]}))
    finally:
        for proc in (server, *procs.values()):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
