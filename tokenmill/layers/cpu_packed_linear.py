"""bf16 linear layers on CPU with weights reordered for oneDNN once, at load.

Why: F.linear on bf16 CPU tensors goes through oneDNN, which reorders the weight into its
blocked layout on every call. For decode (a few rows) that reorder is most of the cost: measured
on the 2-core AVX512-BF16 reference machine, one 3072x576 layer at batch 1 took 0.32 ms plain vs
0.06 ms prepacked; a full decode step's 120 linears 39 ms vs 20 ms (1 thread). Outputs are
bitwise identical to F.linear for every batch size tested (1, 3, 64, 300), so this is a pure
speed change. Not used for float32 (there F.linear uses MKL, and oneDNN's fp32 results differ in
the last bits) nor for quantized layers (they have their own LinearMethod).
"""
from __future__ import annotations

import logging

import torch

from tokenmill.layers import fused_ops
from tokenmill.layers.linear import Linear, UnquantizedLinearMethod

logger = logging.getLogger("tokenmill")


def packed_linear_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bf16 weight -> oneDNN's blocked layout (an opaque tensor; keep the original too)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


_LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default if packed_linear_available() else None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] -> [..., out], same values as F.linear(x, weight, bias)."""
    return _LINEAR_POINTWISE(x.contiguous(), packed, bias, "none", [None], "")


class PackedBf16LinearMethod:
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        # Our kernels first: any row count on AMX (batch-invariant), a few rows elsewhere (decode: they
        # skip oneDNN's fixed cost); oneDNN for the rest.
        x2 = x.reshape(-1, x.shape[-1])
        y = fused_ops.linear_small(x2, layer.weight, layer.bias, layer.vnni_weight)
        if y is not None:
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return packed_linear(x, layer.packed_weight, layer.bias)


_PACKED = PackedBf16LinearMethod()


def prepack_bf16_linears(model: torch.nn.Module) -> int:
    """Switch every unquantized bf16 CPU Linear of `model` (and a tied LM head, via
    model.packed_lm_head) to prepacked weights. Call after all weights are loaded and final.
    Returns the number of layers packed (0 when oneDNN is unavailable)."""
    if not packed_linear_available():
        return 0
    n = 0
    try:
        for m in model.modules():
            if (isinstance(m, Linear) and type(m.quant_method) is UnquantizedLinearMethod
                    and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"):
                m.packed_weight = pack_weight(m.weight)
                m.vnni_weight = fused_ops.pack_vnni(m.weight)
                m.quant_method = _PACKED
                n += 1
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        table = getattr(embed, "weight", None)  # None when the table is quantized (quant/head.py)
        if getattr(model, "lm_head", 1) is None and table is not None and table.dtype == torch.bfloat16 \
                and table.device.type == "cpu":
            model.packed_lm_head = pack_weight(table)
            model.vnni_lm_head = fused_ops.pack_vnni(table)
    except RuntimeError as e:  # an unusual oneDNN build: keep F.linear everywhere
        logger.warning("prepacking bf16 linears failed (%s); using F.linear", e)
        for m in model.modules():
            if isinstance(m, Linear) and m.quant_method is _PACKED:
                m.quant_method = UnquantizedLinearMethod()
        model.packed_lm_head = model.vnni_lm_head = None
        return 0
    return n
