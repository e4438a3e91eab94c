"""The roofline's bound arithmetic (bench/roofline.py decode_bound, fraction_of_bound), called directly: the
AVX2 case of issue 47, where a bound taken from torch's bf16 matmul (~0 FLOP/s there) claimed 1.16 tok/s
for a 71 tok/s decode and printed measured / bound = 61.3."""

from __future__ import annotations

import pytest

from tokenmill.bench.roofline import MAX_FRACTION, RooflineError, decode_bound, fraction_of_bound

# SmolLM2-135M (the default model), whose shapes fix the bytes a bf16 decode step reads.
LAYERS, HIDDEN, INTERMEDIATE, KV_WIDTH, VOCAB = 30, 576, 1536, 3 * 64, 49152


def bf16_weight_bytes() -> int:
    """Every parameter once, 2 bytes each (tied head: the embedding table is read whole every step).
    Per layer: q, o 576 x 576; k, v 576 x 192; gate, up, down 576 x 1536 (3,538,944); two norms; plus the
    final norm and the 49,152 x 576 table: 134,515,008 parameters = 269,030,016 bytes (256.6 MiB)."""
    per_layer = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_WIDTH + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN
    return 2 * (LAYERS * per_layer + HIDDEN + VOCAB * HIDDEN)


WEIGHT_BYTES = bf16_weight_bytes()
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_WIDTH * 2  # K and V, every layer, 3 heads x 64, 2 bytes: 23,040
FLOPS_PER_TOKEN = WEIGHT_BYTES  # 2 FLOPs per parameter, 2 bytes per parameter
CONTEXT = 32 + 128 // 2  # the roofline's defaults: mean context of a 32-token prompt and 128 new tokens
AVX2_READ = 32.7e9  # bytes/s measured on the AVX2 host
TORCH_BF16_MATMUL = 0.31e9  # FLOP/s: "0.00 TFLOP/s", the rate that gave the 1.16 tok/s bound


def test_smollm2_step_bytes():
    assert WEIGHT_BYTES == 269_030_016 and KV_BYTES_PER_TOKEN == 23_040


def test_avx2_batch_1_is_bandwidth_bound_whatever_the_compute_rate():
    assert TORCH_BF16_MATMUL / FLOPS_PER_TOKEN == pytest.approx(1.16, abs=0.01)  # the old, wrong bound
    b = decode_bound(AVX2_READ, WEIGHT_BYTES, KV_BYTES_PER_TOKEN, 1, CONTEXT, FLOPS_PER_TOKEN, TORCH_BF16_MATMUL)
    assert b.binding == "memory" and b.compute_tok_s is None
    # 32.7e9 / (269,030,016 + 96 x 23,040) = 120.6 tok/s
    assert b.tok_s == b.memory_tok_s == pytest.approx(120.6, abs=0.1)
    assert fraction_of_bound(71.0, b.tok_s) == pytest.approx(0.589, abs=0.002)


def test_above_batch_1_the_engines_linear_rate_may_bind():
    # 64 rows at the AVX2 kernel's 72 GFLOP/s: 72e9 / 269.0e6 = 267.6 tok/s, far under the memory bound
    b = decode_bound(AVX2_READ, WEIGHT_BYTES, KV_BYTES_PER_TOKEN, 64, 512, FLOPS_PER_TOKEN, 72e9)
    assert b.binding == "compute" and b.tok_s == b.compute_tok_s == pytest.approx(267.6, abs=0.1)
    # 64 x 32.7e9 / (269,030,016 + 64 x 512 x 23,040)
    assert b.memory_tok_s == pytest.approx(64 * 32.7e9 / (WEIGHT_BYTES + 64 * 512 * 23_040))
    # not measured: the memory bound alone
    assert decode_bound(AVX2_READ, WEIGHT_BYTES, KV_BYTES_PER_TOKEN, 64, 512).binding == "memory"
    with pytest.raises(ValueError, match="FLOP/s must be > 0"):
        decode_bound(AVX2_READ, WEIGHT_BYTES, KV_BYTES_PER_TOKEN, 4, 512, FLOPS_PER_TOKEN, 0.0)


def test_a_measured_rate_above_the_bound_raises():
    with pytest.raises(RooflineError, match="the bound is wrong"):
        fraction_of_bound(71.0, 1.16)  # the 61.3
    assert fraction_of_bound(104.0, 100.0) == pytest.approx(1.04)  # timing noise within MAX_FRACTION
    with pytest.raises(RooflineError):
        fraction_of_bound(100.0 * MAX_FRACTION + 0.1, 100.0)
    assert issubclass(RooflineError, ValueError)  # the CLI prints a ValueError as one line, exit code 2
