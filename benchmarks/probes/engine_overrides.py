"""Which CPU kernel overrides vLLM CPU tolerates on this machine: greedy rollouts of a policy through
eval.py under each ATEN_CPU_CAPABILITY (and with MKL / oneDNN capped to match), and whether the
output still has the policy's format and finite log-probabilities.

    python benchmarks/probes/engine_overrides.py --config C.yaml [--caps none default avx2 avx512]

A policy trained on the tiny world writes well-formed rollouts (format near 1.0) on any numeric
path; garbage (format near 0, or NaN log-probabilities) means the engine does not tolerate the
setting. Each setting runs eval.py in a fresh process (fresh compile caches: TORCHINDUCTOR_CACHE_DIR
and VLLM_CACHE_ROOT under a temporary directory). Prints one table row per setting.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MATCHED = {"default": ("SSE4_2", "SSE41"), "avx2": ("AVX2", "AVX2"), "avx512": ("AVX512", "AVX512_CORE")}


def probe(config: str, cap: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor", "VLLM_CACHE_ROOT": f"{tmp}/vllm"}
        if cap != "none":
            mkl, onednn = MATCHED[cap]
            env |= {"ATEN_CPU_CAPABILITY": cap, "MKL_ENABLE_INSTRUCTIONS": mkl, "ONEDNN_MAX_CPU_ISA": onednn}
        out = Path(tmp) / "eval"
        done = subprocess.run([sys.executable, "eval.py", "--config", config, "--split", "val", "--out", str(out),
                               "--columns", "em", "format_ok", *extra], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=900)  # fmt: skip
        if done.returncode:
            return {"cap": cap, "error": (done.stderr.strip().splitlines() or ["?"])[-1][:150]}
        metrics = next(iter(next(iter(json.loads((out / "results.json").read_text()).values())).values()))
        records = [json.loads(x) for f in (out / "rollouts").glob("*.jsonl") for x in f.read_text().splitlines()]
        bad = sum(not math.isfinite(v) for r in records for v, m in zip(r["logprobs"], r["loss_mask"]) if m)
        return {"cap": cap, "n": int(metrics["n"]), "format_ok": metrics["format_ok"], "em": metrics["em"],
                "nonfinite_logprobs": bad}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a config whose starting policy is trained (tiny world)")
    parser.add_argument("--caps", nargs="+", default=["none", "default", "avx2", "avx512"],
                        choices=["none", *MATCHED], help="settings to try (none: no override)")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], help="eval.py --set overrides")
    args = parser.parse_args()
    extra = sum((["--set", s] for s in args.set), [])
    print("| ATEN_CPU_CAPABILITY (MKL, oneDNN matched) | questions | format | EM | non-finite logprobs |")
    print("|---|---|---|---|---|")
    for cap in args.caps:
        r = probe(args.config, cap, extra)
        if "error" in r:
            print(f"| {cap} | failed: {r['error']} | | | |", flush=True)
        else:
            row = (r["n"], f"{r['format_ok']:.2f}", f"{r['em']:.2f}", r["nonfinite_logprobs"])
            print(f"| {cap} | " + " | ".join(map(str, row)) + " |", flush=True)


if __name__ == "__main__":
    main()
