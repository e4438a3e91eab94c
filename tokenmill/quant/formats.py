"""Checkpoint layouts of the ecosystem: GPTQ (AutoGPTQ / GPTQModel "gptq" v1) and AWQ GEMM (AutoAWQ).

Both store int32 words holding `32 / bits` codes each; they differ in the packed dimension.

GPTQ (any of 2, 3, 4, 8 bits) — one linear layer, W [out, in]:

    qweight [in * bits / 32, out]  int32   codes packed along the INPUT dim, as a little-endian
                                           bit stream: code r of a column starts at stream bit r * bits
                                           (3 bits: 32 codes fill 3 words, codes straddle words)
    qzeros  [num_groups, out * bits / 32]  int32   (zero - 1) packed along the OUTPUT dim ("v1")
    scales  [num_groups, out]              float16
    g_idx   [in]                           int32   group of each input column (act-order)

    word layout, 4 bits:  qweight[j, o] = sum_k code[8j + k, o] << 4k        k = 0..7

AWQ GEMM (4 bits only) — packed along the OUTPUT dim in an interleaved order:

    qweight [in, out / 8]          int32   word c of row i holds codes of columns 8c + ORDER[k] at bits 4k
    qzeros  [num_groups, out / 8]  int32   zero points (no offset), same interleave
    scales  [num_groups, out]      float16         ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
"""

from __future__ import annotations

import math

import torch

from tokenmill.quant.grid import QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GPTQ_BITS = (2, 3, 4, 8)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding 0 .. 2**32 - 1 -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_bitstream(values: torch.Tensor, bits: int) -> torch.Tensor:
    """values [R, C] (0 .. 2**bits - 1) -> int32 [R * bits / 32, C], packed down the rows."""
    rows, cols = values.shape
    if (rows * bits) % 32:
        raise ValueError(
            f"cannot pack {rows} rows of {bits}-bit codes into 32-bit words (need a multiple of "
            f"{32 // math.gcd(32, bits)} rows)"
        )
    v = values.to(torch.int64)
    bit = (v[:, None, :] >> torch.arange(bits)[None, :, None]) & 1  # [R, bits, C]
    bit = bit.reshape(rows * bits // 32, 32, cols)  # stream bit t -> word t // 32
    return _to_int32((bit << torch.arange(32)[None, :, None]).sum(1))


def unpack_bitstream(words: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """int32 [rows * bits / 32, C] -> int64 [rows, C]; the inverse of pack_bitstream."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    bit = (w[:, None, :] >> torch.arange(32)[None, :, None]) & 1  # [W, 32, C]
    bit = bit.reshape(rows, bits, -1)
    return (bit << torch.arange(bits)[None, :, None]).sum(1)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """values [R, C] 4-bit -> int32 [R, C / 8], interleaved along the columns."""
    rows, cols = values.shape
    if cols % 8:
        raise ValueError(f"AWQ packs 8 output columns per word; {cols} is not a multiple of 8")
    v = values.to(torch.int64).reshape(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)]
    return _to_int32((v << (4 * torch.arange(8))).sum(-1))


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] -> int64 [R, C]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    nib = (w[..., None] >> (4 * torch.arange(8))) & 15  # [R, C/8, 8] in packed order
    out = torch.empty_like(nib)
    out[..., list(AWQ_ORDER)] = nib
    return out.reshape(w.shape[0], -1)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(map(str, t.shape)) + "]"


def gptq_shape_problem(t: dict[str, torch.Tensor], bits: int, out: int, cols: int) -> str | None:
    """What is wrong with the shapes of one GPTQ layer's tensors for a weight [out, cols], or None."""
    want = {"qweight": (cols * bits // 32, out), "scales": (None, out), "qzeros": (None, out * bits // 32)}
    if (cols * bits) % 32 or (out * bits) % 32:
        return f"a [{out}, {cols}] weight cannot be packed in {bits}-bit GPTQ words"
    problem = _packed_shape_problem(t, want, f"a [{out}, {cols}] weight at {bits} bits")
    if problem:
        return problem
    g = t.get("g_idx")
    if g is not None and tuple(g.shape) != (cols,):
        return f"g_idx has shape {_shape(g)}, expected [{cols}]"
    return None


def awq_shape_problem(t: dict[str, torch.Tensor], out: int, cols: int) -> str | None:
    """What is wrong with the shapes of one AWQ GEMM layer's tensors for a weight [out, cols], or None."""
    want = {"qweight": (cols, out // 8), "scales": (None, out), "qzeros": (None, out // 8)}
    return _packed_shape_problem(t, want, f"a [{out}, {cols}] weight (AWQ GEMM, 4 bits)")


def _packed_shape_problem(t: dict[str, torch.Tensor], want: dict[str, tuple[int | None, int]], what: str) -> str | None:
    """Each tensor 2-D with the wanted (rows or None for any group count, width); qzeros and scales
    with the same group count."""
    for k, (rows, width) in want.items():
        v = t[k]
        if v.dim() != 2 or (rows is not None and v.shape[0] != rows) or v.shape[1] != width:
            shown = f"[{rows if rows is not None else 'groups'}, {width}]"
            return f"{k} has shape {_shape(v)}, expected {shown} for {what}"
    if t["qzeros"].shape[0] != t["scales"].shape[0]:
        return f"qzeros has {t['qzeros'].shape[0]} groups but scales has {t['scales'].shape[0]}"
    return None


# ------------------------------------------------------------------------------------ GPTQ


def to_gptq_tensors(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """One layer's QuantizedWeight -> {qweight, qzeros, scales, g_idx} in the GPTQ v1 layout."""
    if qw.bits not in GPTQ_BITS:
        raise ValueError(f"GPTQ format supports {GPTQ_BITS} bits, got {qw.bits}")
    if int(qw.zeros.min()) < 1:
        raise ValueError(
            "GPTQ v1 stores zero - 1 and cannot hold a zero point of 0; quantize with min_zero=1 for this format"
        )
    return {
        "qweight": pack_bitstream(qw.codes.t(), qw.bits),  # [in*bits/32, out]
        "qzeros": pack_bitstream(qw.zeros.to(torch.int64) - 1, qw.bits).t().contiguous(),  # [groups, out*bits/32]
        "scales": qw.scales.t().contiguous().to(torch.float16),  # [groups, out]
        "g_idx": qw.g_idx.to(torch.int32).clone(),
    }


def from_gptq_tensors(
    t: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool, checkpoint_format: str = "gptq"
) -> QuantizedWeight:
    """{qweight, qzeros, scales[, g_idx]} of one layer -> QuantizedWeight. checkpoint_format "gptq"
    (v1: zeros stored minus one) or "gptq_v2" (zeros stored as is)."""
    scales = t["scales"]  # [groups, out]
    num_groups, out = scales.shape
    cols = t["qweight"].shape[0] * 32 // bits
    codes = unpack_bitstream(t["qweight"], bits, cols).t()  # [out, in]
    zeros = unpack_bitstream(t["qzeros"].t().contiguous(), bits, out)  # [out, groups]
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    elif checkpoint_format != "gptq_v2":
        raise ValueError(f"unknown GPTQ checkpoint_format {checkpoint_format!r} (expected gptq or gptq_v2)")
    # NOTE: an AutoGPTQ v1 file may hold zero 2**bits (it wrote zero 0 as -1); 8-bit cannot keep 256.
    zeros = zeros.clamp(max=255)
    gs = cols if group_size == -1 else group_size
    g_idx = t.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(cols) // gs
    if int(g_idx.max()) >= num_groups:
        raise ValueError(f"g_idx refers to group {int(g_idx.max())} but scales has {num_groups} groups")
    return QuantizedWeight(
        codes=codes.to(torch.uint8).contiguous(),
        scales=scales.t().to(torch.float16).contiguous(),
        zeros=zeros.to(torch.uint8).contiguous(),
        g_idx=g_idx.to(torch.int32).contiguous(),
        bits=bits,
        group_size=group_size,
        sym=sym,
    )


# ------------------------------------------------------------------------------------- AWQ


def to_awq_tensors(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """One layer's QuantizedWeight -> {qweight, qzeros, scales} in AutoAWQ's GEMM layout."""
    if qw.bits != 4:
        raise ValueError(f"AWQ GEMM format is 4-bit only, got {qw.bits} bits (save it in GPTQ format instead)")
    if not qw.has_trivial_g_idx:
        raise ValueError("AWQ format has no g_idx: act-order weights cannot be stored in it")
    return {
        "qweight": pack_awq(qw.codes.t()),  # [in, out/8]
        "qzeros": pack_awq(qw.zeros.t()),  # [groups, out/8]
        "scales": qw.scales.t().contiguous().to(torch.float16),  # [groups, out]
    }


def from_awq_tensors(t: dict[str, torch.Tensor], group_size: int) -> QuantizedWeight:
    scales = t["scales"]  # [groups, out]
    codes = unpack_awq(t["qweight"]).t()  # [out, in]
    zeros = unpack_awq(t["qzeros"]).t()  # [out, groups]
    cols = codes.shape[1]
    gs = cols if group_size == -1 else group_size
    return QuantizedWeight(
        codes=codes.to(torch.uint8).contiguous(),
        scales=scales.t().to(torch.float16).contiguous(),
        zeros=zeros.to(torch.uint8).contiguous(),
        g_idx=(torch.arange(cols) // gs).to(torch.int32),
        bits=4,
        group_size=group_size,
        sym=False,
    )
