"""The C++ kernels (tokenmill._C, csrc/): present, current, dispatched on this CPU's real features, and
loud when missing. Each op is called directly (torch.ops.tokenmill.*) against its PyTorch reference at
every instruction-set level this CPU supports, so a dispatcher that falls back cannot pass for a kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill import native
from tokenmill.layers import fused_ops

# Every op csrc/ops.cpp registers, with the arguments its schema declares as written in place.
EXPECTED_OPS = {
    "rms_norm": {"out"},
    "add_rms_norm": {"out", "sum"},
    "rope_inplace": {"qk"},
    "silu_mul": {"out"},
    "rms_norm_unit_offset": {"out"},
    "head_rms_norm_inplace": {"qk"},
    "gelu_tanh_mul": {"out"},
    "linear_bf16_small": {"y"},
    "linear_bf16_avx2": {"y"},
    "linear_bf16_vnni": {"y"},
    "linear_f32_small": {"y"},
    "linear_bf16_amx": {"y"},
    "paged_decode": {"out"},
    "write_and_decode": {"out", "k_cache", "v_cache"},
    "paged_prefill": {"out"},
    "int4_linear": {"y"},
    "int8_linear": {"y"},
    "gguf_linear": {"y"},
    "gguf_pack": set(),
    "gguf_dequantize_rows": {"out"},
    "dense_linear": set(),
    "argmax_rows": set(),
    "stream_read": set(),
}


def cpuinfo_isa() -> str:
    """The level /proc/cpuinfo's flags allow: an oracle independent of the kernels' own detection."""
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        if "avx512_bf16" not in flags:
            return "avx512"
        return "amx" if {"amx_tile", "amx_bf16"} <= flags else "avx512_bf16"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "generic"


def test_kernels_are_built_and_current():
    """Fails (never skips) when tokenmill._C is missing, does not load, or is older than csrc/."""
    assert native.module() is not None, "tokenmill._C is not usable: run `bash scripts/install.sh`"
    from tokenmill.native_source import source_hash

    assert native.module().source_hash == source_hash(native.CSRC)


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs Linux's /proc/cpuinfo")
def test_detected_isa_is_what_the_cpu_has():
    assert native.module().detected_isa() == cpuinfo_isa()


def test_every_op_is_registered_with_its_schema():
    for name, written in EXPECTED_OPS.items():
        schema = getattr(torch.ops.tokenmill, name).default._schema
        mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert mutated == written, name
    # the C++ layer loop's class (csrc/decode_stack.h)
    stack = torch.classes.tokenmill.DecodeStack(1, 1, 2, 1e-6, 1.0, [torch.zeros(4, 2)], torch.ones(2), 0, False)
    assert stack.num_layers() == 0
    for method in ("add_layer", "add_linear", "add_gguf_linear", "forward"):
        assert hasattr(stack, method), method


def test_no_cpp_source_left_in_python():
    """The C++ lives in csrc/ only: no translation unit inside a Python string."""
    root = Path(native.__file__).resolve().parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "#include <" not in text and "load_inline" not in text, path


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )


def test_required_kernels_fail_loudly_when_disabled():
    probe = (
        "from tokenmill.layers import fused_ops; import torch; "
        "fused_ops.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-5)"
    )
    loud = _run_python(probe, TOKENMILL_REQUIRE_KERNELS="1", TOKENMILL_NO_CPP_KERNELS="1")
    assert loud.returncode != 0 and "KernelsUnavailable" in loud.stderr
    quiet = _run_python(probe, TOKENMILL_REQUIRE_KERNELS="0", TOKENMILL_NO_CPP_KERNELS="1")
    assert quiet.returncode == 0, quiet.stderr  # the PyTorch path, with a warning


def test_stale_build_is_refused_when_required(tmp_path, monkeypatch):
    (tmp_path / "kernel.cpp").write_text("// a source the build never saw\n")
    monkeypatch.setattr(native, "CSRC", tmp_path)
    monkeypatch.setenv(native.REQUIRE_ENV, "1")
    native.module.cache_clear()
    try:
        with pytest.raises(native.KernelsUnavailable, match="other sources"):
            native.module()
    finally:
        monkeypatch.undo()
        native.module.cache_clear()
    assert native.module() is not None


def test_unknown_isa_name_is_an_error():
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        native.module().set_max_isa("avx9000")


# ------------------------------------------------------------------- each op at each level this CPU has


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_ops_match_references(each_isa, dtype):
    ops = torch.ops.tokenmill
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 200, generator=g) * 3).to(dtype)  # 200: a multiple of 16 plus a tail
    r = torch.randn(5, 200, generator=g).to(dtype)
    w = (torch.rand(200, generator=g) + 0.5).to(dtype)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-5)
    torch.testing.assert_close(out.float(), fused_ops.rms_norm_ref(x, w, 1e-5).float(), **tol)
    out, s = torch.empty_like(x), torch.empty_like(x)
    ops.add_rms_norm(out, s, x, r, w, 1e-5)
    ref_out, ref_s = fused_ops.add_rms_norm_ref(x, r, w, 1e-5)
    assert torch.equal(s, ref_s)
    torch.testing.assert_close(out.float(), ref_out.float(), **tol)
    gu = torch.randn(5, 2 * 200, generator=g).to(dtype)
    act = x.new_empty(5, 200)
    ops.silu_mul(act, gu)
    torch.testing.assert_close(act.float(), fused_ops.silu_and_mul_ref(gu).float(), **tol)
    logits = torch.randn(7, 1000, generator=g)
    logits[3, 17] = float("nan")
    logits[5, 999] = logits[5].max() + 1
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(-1))
    buf = torch.rand(64 * 1000, generator=g)
    assert ops.stream_read(buf) == pytest.approx(buf.double().sum().item(), rel=1e-5)


def test_few_row_linears_serve_exactly_where_the_cpu_allows(each_isa):
    ops = torch.ops.tokenmill
    g = torch.Generator().manual_seed(1)
    w = torch.randn(128, 256, generator=g).bfloat16()
    x = torch.randn(3, 256, generator=g).bfloat16()
    ref = x.float() @ w.float().T
    y = x.new_empty(3, 128)
    bf16 = each_isa in ("avx512_bf16", "amx")
    served = ops.linear_bf16_small(y, x, w, None)
    assert served == (each_isa != "generic")  # AVX-512 BF16's GEMV, else the AVX2 kernel
    if served:
        torch.testing.assert_close(y.float(), ref, atol=0.05, rtol=0.02)
    vnni = w.reshape(2, 64, 128, 2).permute(0, 2, 1, 3).contiguous()
    y = x.new_empty(3, 128)
    served = ops.linear_bf16_vnni(y, x, vnni, None)
    assert served == bf16
    if served:
        torch.testing.assert_close(y.float(), ref, atol=0.05, rtol=0.02)
    y = x.new_empty(3, 128)
    served = ops.linear_bf16_amx(y, x, vnni, None)
    assert served == (each_isa == "amx")
    if served:
        torch.testing.assert_close(y.float(), ref, atol=0.05, rtol=0.02)
    xf, wf = x.float()[:1], w.float()
    y = xf.new_empty(1, 128)
    served = ops.linear_f32_small(y, xf, wf)
    assert served == (each_isa != "generic")
    if served:
        torch.testing.assert_close(y, xf @ wf.T, atol=1e-4, rtol=1e-5)


def test_amx_linear_gives_a_row_the_same_bits_whatever_the_row_count(each_isa):
    """The batch invariance of bf16 on AMX CPUs: row i of a 70-row call equals row i of every smaller call
    (1, 2, 5, 16, 17, 33 rows: full and ragged 16-row blocks), bit for bit, bias included."""
    ops = torch.ops.tokenmill
    g = torch.Generator().manual_seed(2)
    w = torch.randn(192, 576, generator=g).bfloat16()
    b = torch.randn(192, generator=g).bfloat16()
    vnni = fused_ops.pack_vnni(w)
    x = torch.randn(70, 576, generator=g).bfloat16()
    if vnni is None:  # no AVX512-BF16 at this level: no packed copy, so the AMX kernel has nothing to read
        assert each_isa in ("generic", "avx2", "avx512")
        return
    full = x.new_empty(70, 192)
    if each_isa != "amx":  # below the amx level the kernel declines every call
        assert not ops.linear_bf16_amx(full, x, vnni, b)
        return
    assert ops.linear_bf16_amx(full, x, vnni, b)
    ref = x.double() @ w.double().T + b.double()
    assert torch.all((full.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-2)
    for m in (1, 2, 5, 16, 17, 33):
        y = x.new_empty(m, 192)
        assert ops.linear_bf16_amx(y, x[:m].contiguous(), vnni, b)
        assert torch.equal(y, full[:m]), m


def test_avx2_linear_gives_a_row_the_same_bits_whatever_the_row_count(each_isa):
    """The batch invariance of bf16 on AVX2 CPUs (no oneDNN bf16 there): row i of a 70-row call equals row i
    of every smaller call (1, 2, 3, 4, 5, 9, 33 rows: each tile shape and its remainders), bias included, and
    the few-row entry point (linear_bf16_small) gives the same bits as the any-row one."""
    ops = torch.ops.tokenmill
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 576, generator=g).bfloat16()  # 200 outputs: the 4- and 2-wide tiles leave tails
    b = torch.randn(200, generator=g).bfloat16()
    x = torch.randn(70, 576, generator=g).bfloat16()
    full = x.new_empty(70, 200)
    served = ops.linear_bf16_avx2(full, x, w, b)
    assert served == (each_isa != "generic")
    if not served:
        return
    ref = x.double() @ w.double().T + b.double()
    assert torch.all((full.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-2)
    for m in (1, 2, 3, 4, 5, 9, 33):
        y = x.new_empty(m, 200)
        assert ops.linear_bf16_avx2(y, x[:m].contiguous(), w, b)
        assert torch.equal(y, full[:m]), m
        if m <= 8 and each_isa == "avx2":
            small = x.new_empty(m, 200)
            assert ops.linear_bf16_small(small, x[:m].contiguous(), w, b)
            assert torch.equal(small, full[:m]), m
    assert not ops.linear_bf16_avx2(x.new_empty(2, 200), x[:2, :100].contiguous(), w[:, :100].contiguous(), b)  # K % 16


def test_prompt_attention_is_per_token_exactly_where_the_linears_are_invariant(each_isa):
    """ModelConfig.batch_invariant unset: per-token prompt attention for float32, and for bf16 only where the
    linears are invariant: the dense rule's bf16 linears on AMX or AVX2 without AVX-512 (the default GGUF file
    dequantized), and a GGUF file run in its blocks on any level with an integer kernel; explicit settings win."""
    from tokenmill.config import ModelConfig

    assert native.bf16_linears_batch_invariant() == (each_isa in ("amx", "avx2"))
    dense = ModelConfig(dtype="bfloat16", gguf_dequantize=True)
    assert dense.attends_prompts_per_token == (each_isa in ("amx", "avx2"))
    assert ModelConfig(dtype="bfloat16").runs_gguf_natively == (each_isa != "generic")
    assert ModelConfig(dtype="bfloat16").attends_prompts_per_token == (each_isa != "generic")
    assert ModelConfig(dtype="float32").attends_prompts_per_token
    for dtype in ("bfloat16", "float32"):
        assert ModelConfig(dtype=dtype, batch_invariant=True).attends_prompts_per_token
        assert not ModelConfig(dtype=dtype, batch_invariant=False).attends_prompts_per_token
