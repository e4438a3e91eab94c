#!/usr/bin/env bash
# Builds llama.cpp's llama-server, the multi-slot peer of `tokenmill bench throughput --peers llamaserver`,
# and llama-quantize, which benchmarks/vs_llamacpp.py uses to write F16 and Q8_0 GGUFs of the model.
# It uses the llama.cpp sources vendored in the llama-cpp-python 0.3.36 sdist, so the server and the
# llamacpp peer (llama-cpp-python) run the same llama.cpp code.
#
#   scripts/build_llama_server.sh [DEST]    DEST default: ../shared/tools/llama-server (next to the repo)
#
# Needs cmake and a C++ compiler; takes a while on a small machine (it builds with 2 jobs).
# Run the result with LD_LIBRARY_PATH=DEST (its .so files sit beside it; the bench peer sets this).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$repo/../shared/tools/llama-server}"
py="$repo/.venv/bin/python"
version=0.3.36

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The sdist, never a wheel: the wheel has no llama-server in it.
"$py" -m pip download -q "llama-cpp-python==$version" --no-deps --no-binary :all: -d "$work"
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"

# No curl/OpenSSL (the server only listens on 127.0.0.1 and never downloads models); -march=native.
cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON
cmake --build "$src/build" --target llama-server llama-quantize -j2

mkdir -p "$dest"
cp -a "$src/build/bin/." "$dest/"   # -a keeps the libfoo.so -> libfoo.so.0 links
echo "llama-server installed in $(cd "$dest" && pwd)"
