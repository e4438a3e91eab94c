"""Integer quantization grids and the one in-memory form every method produces.

A `QuantizedWeight` is what RTN, GPTQ and AWQ all return, what the checkpoint formats pack and
unpack, and what the kernels repack. For a weight W [out, in]:

    W[o, i] ≈ (codes[o, i] - zeros[o, g]) * scales[o, g]      with g = g_idx[i]

    codes  [out, in]          uint8, 0 .. 2**bits - 1 (unsigned; a symmetric grid uses the middle zero)
    scales [out, num_groups]  float16 (the checkpoint formats store fp16, so the model uses exactly these)
    zeros  [out, num_groups]  uint8 integer zero points
    g_idx  [in]               int32 group of each input column; i // group_size unless act-order reordered it

Two ways to fit a group's (scale, zero), both from the papers' reference code:
  * `fit_minmax_gptq`: GPTQ's quantizer. The range always includes 0 (xmin <= 0 <= xmax);
    symmetric uses zero = (maxq + 1) / 2 and scale = 2 max|x| / maxq.
  * `fit_minmax_awq`: AWQ's pseudo-quantizer. Range is [min, max] of the group, scale clamped at 1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # [out, in] uint8
    scales: torch.Tensor  # [out, num_groups] float16
    zeros: torch.Tensor  # [out, num_groups] uint8
    g_idx: torch.Tensor  # [in] int32
    bits: int
    group_size: int
    """Columns per group; -1 means one group per output row (per channel)."""
    sym: bool

    def __post_init__(self) -> None:
        out, cols = self.codes.shape
        assert self.scales.shape == self.zeros.shape and self.scales.shape[0] == out, (self.scales.shape, out)
        assert self.g_idx.shape == (cols,)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def has_trivial_g_idx(self) -> bool:
        """True when column i belongs to group i // group_size (no act-order reordering)."""
        gs = self.group_size if self.group_size > 0 else self.in_features
        return torch.equal(self.g_idx.long(), torch.arange(self.in_features) // gs)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference: [out, in] weight in `dtype` (computed in float32)."""
        g = self.g_idx.long()
        s = self.scales.float()[:, g]
        z = self.zeros.float()[:, g]
        return ((self.codes.float() - z) * s).to(dtype)

    def rows(self, sl: slice) -> QuantizedWeight:
        """The quantized rows of one part of a packed layer (shares g_idx)."""
        return QuantizedWeight(
            self.codes[sl], self.scales[sl], self.zeros[sl], self.g_idx, self.bits, self.group_size, self.sym
        )


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack parts (q, k, v) into one packed layer; they must share bits, groups and g_idx."""
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.sym) != (first.bits, first.group_size, first.sym):
            raise ValueError("parts of a packed layer must share bits, group size and symmetry")
        if not torch.equal(p.g_idx, first.g_idx):
            raise ValueError(
                "parts of a packed layer have different g_idx (act-order per part); "
                "this engine packs q/k/v and gate/up and needs them to share one"
            )
    return QuantizedWeight(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.zeros for p in parts]),
        first.g_idx,
        first.bits,
        first.group_size,
        first.sym,
    )


def check_group_size(in_features: int, group_size: int, what: str = "layer") -> None:
    """An impossible group size is a clear error, not a silent per-channel fallback."""
    if group_size == -1:
        return
    if group_size <= 0:
        raise ValueError(f"group_size must be -1 (per channel) or a positive number, got {group_size}")
    if in_features % group_size:
        divisors = [g for g in (32, 64, 128, 256) if in_features % g == 0]
        hint = f"; try {', '.join(map(str, divisors))}" if divisors else "; use -1 (per channel)"
        raise ValueError(f"group_size {group_size} does not divide the input size {in_features} of {what}{hint}")


@dataclass
class GroupParams:
    scale: torch.Tensor  # [rows] float32 (already rounded through fp16)
    zero: torch.Tensor  # [rows] float32 holding integers


def _fp16_round(scale: torch.Tensor) -> torch.Tensor:
    # NOTE: the checkpoint formats store fp16 scales; fitting the codes against exactly those scales
    # keeps a saved model bit-identical to the in-memory one.
    return scale.to(torch.float16).float().clamp(min=torch.finfo(torch.float16).tiny)


def fit_minmax_gptq(w: torch.Tensor, bits: int, sym: bool, min_zero: int = 0) -> GroupParams:
    """GPTQ's `Quantizer.find_params(weight=True)` on w [rows, cols] -> one (scale, zero) per row.

    min_zero=1 keeps asymmetric zero points >= 1: GPTQ's v1 format stores zero - 1, which cannot
    hold -1 (only a group whose values are all >= 0 would need zero 0)."""
    maxq = 2**bits - 1
    w = w.float()
    xmin = w.min(dim=1).values.clamp(max=0)
    xmax = w.max(dim=1).values.clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    both0 = (xmin == 0) & (xmax == 0)
    xmin = torch.where(both0, -1.0, xmin)
    xmax = torch.where(both0, 1.0, xmax)
    scale = _fp16_round((xmax - xmin) / maxq)
    if sym:
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        zero = torch.round(-xmin / scale).clamp(min_zero, maxq)
    return GroupParams(scale, zero)


def fit_minmax_awq(w: torch.Tensor, bits: int, sym: bool, min_zero: int = 0) -> GroupParams:
    """AWQ's `pseudo_quantize_tensor` parameters on w [rows, cols] (the range is the group's own
    [min, max]). The symmetric variant is returned in unsigned form (zero = 2**(bits-1))."""
    maxq = 2**bits - 1
    w = w.float()
    if sym:
        max_abs = w.abs().amax(dim=1).clamp(min=1e-5)
        scale = _fp16_round(max_abs / (2 ** (bits - 1) - 1))
        zero = torch.full_like(scale, 2 ** (bits - 1))
        return GroupParams(scale, zero)
    max_val = w.amax(dim=1)
    min_val = w.amin(dim=1)
    scale = _fp16_round((max_val - min_val).clamp(min=1e-5) / maxq)
    zero = (-torch.round(min_val / scale)).clamp(min_zero, maxq)
    return GroupParams(scale, zero)


def quantize_codes(w: torch.Tensor, p: GroupParams, bits: int) -> torch.Tensor:
    """w [rows, cols] -> integer codes (float tensor) on the grid of p (one param per row)."""
    maxq = 2**bits - 1
    return torch.clamp(torch.round(w.float() / p.scale[:, None]) + p.zero[:, None], 0, maxq)


FITTERS = {"gptq": fit_minmax_gptq, "awq": fit_minmax_awq}


def quantize_groupwise(
    w: torch.Tensor, bits: int, group_size: int, sym: bool, fit: str = "gptq", min_zero: int = 0
) -> QuantizedWeight:
    """Round-to-nearest of w [out, in] with contiguous groups (RTN; also AWQ's last step)."""
    out, cols = w.shape
    check_group_size(cols, group_size)
    gs = cols if group_size == -1 else group_size
    ng = cols // gs
    wg = w.float().reshape(out, ng, gs).transpose(0, 1).reshape(ng * out, gs)  # group-major rows
    p = FITTERS[fit](wg, bits, sym, min_zero)
    codes = quantize_codes(wg, p, bits).reshape(ng, out, gs).transpose(0, 1).reshape(out, cols)
    return QuantizedWeight(
        codes=codes.to(torch.uint8),
        scales=p.scale.reshape(ng, out).t().to(torch.float16).contiguous(),
        zeros=p.zero.reshape(ng, out).t().to(torch.uint8).contiguous(),
        g_idx=(torch.arange(cols) // gs).to(torch.int32),
        bits=bits,
        group_size=group_size,
        sym=sym,
    )
