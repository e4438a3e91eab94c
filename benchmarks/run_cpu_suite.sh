#!/usr/bin/env bash
# Every CPU figure in docs/benchmarks.md, one after another (never in parallel: they would
# measure each other). Results: bench_out/*.json, bench_out/serve/*.png, logs in bench_out/*.log.
#     bash benchmarks/run_cpu_suite.sh [threads]
set -uo pipefail
cd "$(dirname "$0")/.."
T="${1:-2}"
O=bench_out
mkdir -p "$O"
PY="${PYTHON:-.venv/bin/python}"
TM="$PY -m tokenmill.entrypoints.cli"
run() { local name=$1; shift; echo "== $name: $*"; "$@" > "$O/$name.log" 2>&1; echo "   exit $? ($(grep -c . "$O/$name.log") log lines)"; }

run engine_vs_hf       $PY benchmarks/engine_vs_hf.py --num-threads "$T" --output-json $O/engine_vs_hf.json
run roofline           $TM bench roofline --num-threads "$T" --dtype bfloat16 --output-json $O/roofline.json
run ablation           $TM bench ablation --num-threads "$T" --dtype bfloat16 --num-prompts 16 --max-output-len 64 \
                           --only batching,chunked_prefill,prefix_caching,speculation --output-json $O/ablation.json
run serve              $TM bench serve --launch-server --server-args "--max-num-seqs 16 --dtype bfloat16" --num-prompts 16 \
                           --max-output-len 32 --ignore-eos --request-rate 2,inf --max-concurrency 4,16 \
                           --goodput ttft:5000 tpot:500 --result-dir $O/serve
run ablation_quant     $TM bench ablation --num-threads "$T" --dtype bfloat16 --only quantization \
                           --output-json $O/ablation_quant.json
run engine_vs_hf_fp32  $PY benchmarks/engine_vs_hf.py --num-threads "$T" --dtype float32 --skip throughput \
                           --output-json $O/engine_vs_hf_fp32.json
