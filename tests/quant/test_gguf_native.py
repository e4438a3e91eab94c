"""GGUF blocks kept quantized, repacked into row groups (quant/gguf.py, csrc/gguf_layout.h).

Oracles: the `gguf` package's own dequantizer (an independent implementation of every block format) for the
weights, and a float64 emulation of the kernel's int8 activations for the products; the real default model's
logits against the same file dequantized at load. Every ISA level the host has runs, and the levels it lacks
are reported as skips that name the missing instruction set."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import isa_skip_reason
from tokenmill import native
from tokenmill.layers.linear import Linear
from tokenmill.quant import gguf as gq

TYPES = list(gq.GGML_TYPES.items())
LEVELS = ("generic", "avx2", "avx512", "avx512_bf16", "amx")

# Byte offsets of each format's float16 scales (d, and dmin / m where it has one).
_F16_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def _host_has_vnni() -> bool:
    return "avx512_vnni" in Path("/proc/cpuinfo").read_text()


def expected_kernel(level: str) -> str:
    """The integer kernel csrc/gguf_quant.cpp must choose at `level` on this host."""
    if level == "generic":
        return "none"
    if level == "avx2":
        return "avx2"
    return "avx512_vnni" if _host_has_vnni() else "avx2"


def random_blocks(ggml_type: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """[rows, row bytes] of valid blocks: random codes, scales and high bits, with sane float16 scales."""
    g = np.random.default_rng(seed)
    weights, nbytes = gq.BLOCKS[ggml_type]
    nblk = rows * cols // weights
    raw = g.integers(0, 256, size=(nblk, nbytes), dtype=np.uint8)
    for off in _F16_FIELDS[ggml_type]:
        scale = g.uniform(0.002, 0.02, size=nblk).astype(np.float16)
        raw[:, off : off + 2] = scale.view(np.uint8).reshape(nblk, 2)
    return torch.from_numpy(raw.reshape(rows, cols // weights * nbytes).copy())


def package_dequantize(ggml_type: int, blocks: torch.Tensor, cols: int) -> torch.Tensor:
    import gguf

    arr = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(blocks.shape[0], cols)


def emulate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: x rounded per 32 to int8 codes times max|x| / 127 (ties to even),
    then a product with the exact weights."""
    x = x.double()
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    # the kernel multiplies by float32(127 / amax), then rounds
    inv = torch.where(amax > 0, (127.0 / amax.float()).double(), torch.zeros_like(amax))
    q = torch.round((xb.float() * inv.float()).double())
    xq = (q * (amax.float() / 127.0).double()).reshape(m, k)
    return xq @ w.double().t()


KERNEL_LEVELS = {"avx2": "avx2", "avx512_vnni": "avx512"}
"""Each integer kernel -> the ISA level cap under which it is the one chosen."""


@contextlib.contextmanager
def using_kernel(name: str) -> Iterator[None]:
    """Caps the ISA level so that kernel `name` runs, and restores the cap after. Skips, naming the instruction set,
    where this host cannot run it."""
    detected = native.module().detected_isa()
    if name == "avx2" and LEVELS.index(detected) < LEVELS.index("avx2"):
        pytest.skip(isa_skip_reason("the GGUF avx2 kernel", "AVX2"))
    if name == "avx512_vnni" and (LEVELS.index(detected) < LEVELS.index("avx512") or not _host_has_vnni()):
        pytest.skip(isa_skip_reason("the GGUF avx512_vnni kernel", "AVX512-VNNI"))
    previous = native.module().set_max_isa(KERNEL_LEVELS[name])
    try:
        assert gq.kernel_name() == name
        yield
    finally:
        native.module().set_max_isa(previous)


def check_emulation(dtype: torch.dtype) -> None:
    """Every format against a float64 emulation of the kernel's arithmetic, and near the float product."""
    rows, cols = 48, 768
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(1)).to(dtype)
    for name, ggml_type in TYPES:
        blocks = random_blocks(ggml_type, rows, cols, seed=3 + ggml_type)
        w = package_dequantize(ggml_type, blocks, cols)
        y = gq.linear(x, [gq.GGUFPart.from_blocks(ggml_type, blocks)])
        assert y is not None and y.dtype == dtype
        ref = emulate(x.float(), w)
        scale = ref.abs().max().item()
        tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's own rounding
        assert (y.double() - ref).abs().max().item() <= tol * scale, name
        # and against the float product with the exact weights: the activations' rounding only
        exact = x.double() @ w.double().t()
        assert (y.double() - exact).abs().max().item() <= 0.03 * exact.abs().max().item(), name


def check_batch_invariance(dtype: torch.dtype) -> None:
    """Every row the same bits alone, in passes of any size, or in the whole batch."""
    cols = 1024
    x = torch.randn(37, cols, generator=torch.Generator().manual_seed(2)).to(dtype)
    for name, ggml_type in TYPES:
        part = gq.GGUFPart.from_blocks(ggml_type, random_blocks(ggml_type, 32, cols, seed=ggml_type))
        whole = gq.linear(x, [part])
        assert whole is not None
        for lo, hi in ((0, 1), (3, 5), (5, 8), (8, 13), (13, 37)):
            assert torch.equal(gq.linear(x[lo:hi], [part]), whole[lo:hi]), (name, lo, hi)


def check_mixed_parts() -> None:
    """Parts of different types fill their own columns, as each part alone."""
    cols = 512
    parts = [gq.GGUFPart.from_blocks(t, random_blocks(t, n, cols, seed=t)) for t, n in ((6, 16), (8, 32), (14, 48))]
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(3))
    y = gq.linear(x, parts)
    assert y is not None and y.shape == (3, 96)
    col = 0
    for p in parts:
        assert torch.equal(y[:, col : col + p.rows], gq.linear(x, [p]))
        col += p.rows


@pytest.mark.parametrize(("name", "ggml_type"), TYPES)
def test_dequantize_rows_equals_the_gguf_package(name, ggml_type):
    rows, cols = 32, 512
    blocks = random_blocks(ggml_type, rows, cols, seed=ggml_type)
    ref = package_dequantize(ggml_type, blocks, cols)
    part = gq.GGUFPart.from_blocks(ggml_type, blocks)
    assert torch.equal(part.dequantize(torch.float32), ref)
    picked = torch.tensor([21, 0, 5, 21])
    assert torch.equal(part.dequantize(torch.float32, picked), ref[picked])
    assert torch.equal(part.dequantize(torch.bfloat16), ref.bfloat16())


@pytest.mark.parametrize(("name", "ggml_type"), TYPES)
def test_packing_keeps_the_files_size(name, ggml_type):
    """A packed group holds its 16 rows' file bytes; Q4_K and Q5_K 4 more per row and block (a byte per 6-bit
    scale and minimum, where the file packs 16 of them in 12 bytes)."""
    cols = 512
    blocks = random_blocks(ggml_type, 32, cols, seed=ggml_type)
    extra = 4 * (cols // 256) * 32 if name in ("Q4_K", "Q5_K") else 0
    assert gq.GGUFPart.from_blocks(ggml_type, blocks).packed.numel() == blocks.numel() + extra


def test_q8_0_quantizer_writes_the_gguf_packages_blocks():
    """quantize_q8_0 (the block drafter's weights) writes the bytes the gguf package's reference quantizer writes,
    an all-zero block included; dequantized, every weight is within 0.6 of its block's step (half a step, plus
    the scale's float16 rounding, up to 2^-11 x 127 codes = 0.06 of a step)."""
    import gguf

    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(0))
    w[3, 32:64] = 0.0
    ref = torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0).view(np.uint8))
    assert torch.equal(gq.quantize_q8_0(w), ref.reshape(32, -1))
    back = gq.GGUFPart.from_dense_q8_0(w).dequantize(torch.float32)
    step = w.reshape(32, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert bool(((back - w).reshape(32, 3, 32).abs() <= 0.6 * step).all())
    assert torch.equal(back[3, 32:64], torch.zeros(32))


def test_packing_refuses_rows_not_in_groups_of_16():
    with pytest.raises(RuntimeError, match="N a multiple of 16"):
        gq.GGUFPart.from_blocks(2, random_blocks(2, 8, 64))


def test_each_level_chooses_its_kernel():
    detected = native.module().detected_isa()
    for level in LEVELS[: LEVELS.index(detected) + 1]:
        previous = native.module().set_max_isa(level)
        try:
            assert gq.kernel_name() == expected_kernel(level), level
        finally:
            native.module().set_max_isa(previous)


def test_no_integer_kernel_below_avx2():
    part = gq.GGUFPart.from_blocks(3, random_blocks(3, 16, 256))
    previous = native.module().set_max_isa("generic")
    try:
        assert gq.kernel_name() == "none"
        assert gq.linear(torch.randn(2, 256), [part]) is None
    finally:
        native.module().set_max_isa(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_kernel_matches_the_int8_activation_emulation(dtype):
    with using_kernel("avx2"):
        check_emulation(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_kernel_rows_are_the_same_bits_at_any_batch(dtype):
    with using_kernel("avx2"):
        check_batch_invariance(dtype)


def test_avx2_kernel_parts_of_mixed_types():
    with using_kernel("avx2"):
        check_mixed_parts()


def test_avx512_vnni_kernel():
    """The AVX512-VNNI kernel, every check above in one test (one skip, naming VNNI, on hosts without it)."""
    with using_kernel("avx512_vnni"):
        for dtype in (torch.float32, torch.bfloat16):
            check_emulation(dtype)
            check_batch_invariance(dtype)
        check_mixed_parts()


def test_kernel_refuses_bad_blocks():
    part = gq.GGUFPart.from_blocks(2, random_blocks(2, 16, 64))
    x = torch.randn(2, 96)  # 96 inputs: 3 blocks per row, the part has 2
    with pytest.raises(RuntimeError, match="not contiguous packed groups"):
        gq.linear(x, [part])


def test_linear_method_below_avx2_dequantizes():
    from tokenmill.layers.linear import Linear

    cols = 256
    blocks = random_blocks(3, 16, cols)
    with torch.device("meta"):
        layer = Linear(cols, 16)
    gq.install_gguf(layer, [gq.GGUFPart.from_blocks(3, blocks)])
    x = torch.randn(2, cols)
    previous = native.module().set_max_isa("generic")
    try:
        assert layer.kernel() is None  # the C++ layer loop is not offered a kernel it cannot run
        y = layer(x)
    finally:
        native.module().set_max_isa(previous)
    torch.testing.assert_close(y, x @ package_dequantize(3, blocks, cols).t())


# ------------------------------------------------------------------------------------ the real model

LOGIT_BOUND = 2.5
"""Max |logit difference| allowed between the default model run natively and the same file dequantized at load,
float32, over the prompt below (measured on an AVX-512 host: 1.34 at logits up to ~28; the int8 activations'
rounding, llama.cpp's own scheme)."""


@pytest.fixture(scope="module")
def real_native_and_dequantized(real_model_path):
    from tokenmill.models.loader import load_model

    native_model = load_model(str(real_model_path), dtype=torch.float32)
    dense_model = load_model(str(real_model_path), dtype=torch.float32, gguf_dequantize=True)
    return native_model, dense_model


def test_real_model_keeps_the_files_blocks(real_native_and_dequantized, real_model_path):
    from tokenmill.models.gguf_file import GGUFFile

    net = real_native_and_dequantized[0].model
    assert isinstance(net.model.embed_tokens, gq.GGUFEmbedding)
    assert net.model.embed_tokens.part.ggml_type == gq.GGML_TYPES["Q8_0"]  # the file's own table type
    methods = [m.quant_method for m in net.modules() if isinstance(m, Linear)]
    native_linears = [m for m in methods if isinstance(m, gq.GGUFLinearMethod)]
    assert len(native_linears) == 30 * 4 + 1  # every layer's qkv, o, gate_up, down, and the tied head
    quantized_bytes = sum(t.data.nbytes for t in GGUFFile(real_model_path).tensors if int(t.tensor_type) in gq.BLOCKS)
    held = sum(p.packed.numel() for m in native_linears for p in m.parts)
    assert held == quantized_bytes  # Q4_1 and Q8_0 pack into the file's bytes, nothing dequantized beside them
    assert not any(p.dtype.is_floating_point and p.numel() >= 576 * 576 for p in net.parameters())


def test_real_model_logits_near_the_dequantized_file(real_native_and_dequantized):
    native_model, dense_model = real_native_and_dequantized
    ids = torch.tensor(native_model.tokenizer.encode("The capital of France is Paris. The capital of Germany is"))
    pos = torch.arange(len(ids))
    with torch.no_grad():
        a = native_model.model.compute_logits(native_model.model(ids[None], pos[None])[0])
        b = dense_model.model.compute_logits(dense_model.model(ids[None], pos[None])[0])
    assert (a - b).abs().max().item() <= LOGIT_BOUND
    assert torch.equal(a.argmax(-1), b.argmax(-1))


INVARIANCE_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime, step by step, for a curious child who loves maths.",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish, French and German.",
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who",
]


def test_auto_dtype_is_bf16_and_greedy_is_batch_invariant(real_model_path):
    """--dtype auto picks bfloat16 for a GGUF file that runs natively, on the claim that its greedy output does not
    depend on what else is batched: checked here, on this CPU, with chunked prefill (16-token budget) and
    prefix-cache hits on the second pass."""
    if gq.kernel_name() == "none":
        pytest.skip(isa_skip_reason("the GGUF integer kernel", "AVX2"))
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=str(real_model_path), kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=16)
    assert llm.engine.config.model.torch_dtype == torch.bfloat16
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in INVARIANCE_PROMPTS]
    together = [o.outputs[0].token_ids for o in llm.generate(INVARIANCE_PROMPTS, params, use_tqdm=False)]
    assert together == alone
    llm.check_integrity()
