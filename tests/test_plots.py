"""eval.py curves: PNGs per family from a metrics.jsonl, only for the families that were logged."""

import json

from conftest import run_script


def test_curves_draw_each_logged_family(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 0, "eval": {"em": 0.1, "em_2hop": 0.05}}]
    for s in range(1, 9):
        rows.append({"step": s, "reward": s / 10, "reward/reliability": 0.5 + s / 20, "em": s / 10, "kl": 0.01 * s,
                     "entropy": 1.0, "lambda/reliability": 0.01 * 1.2**s, "constraint/reliability": 0.5 + s / 20,
                     "time": {"train": 1.0}})  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text("train:\n  constraints: [{name: reliability, stat: reward/reliability}]\n")
    out = run_script(["eval.py", "curves", str(run)])
    assert out.returncode == 0, out.stderr
    names = sorted(p.name for p in (run / "curves").iterdir())
    assert names == ["accuracy.png", "kl.png", "lagrangian.png", "reward.png"]  # no idk/length/searches logged
    png = (run / "curves" / "lagrangian.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_curves_of_a_directory_without_metrics_is_a_clear_error(tmp_path):
    out = run_script(["eval.py", "curves", str(tmp_path)])
    assert out.returncode != 0 and "metrics.jsonl not found" in out.stderr and "Traceback" not in out.stderr
