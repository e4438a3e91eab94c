"""Round-to-nearest: per-group min-max grid, no calibration. The baseline every method is compared to."""

from __future__ import annotations

import torch

from tokenmill.quant.grid import QuantizedWeight, quantize_groupwise


def rtn_quantize_weight(w: torch.Tensor, bits: int, group_size: int, sym: bool, min_zero: int = 0) -> QuantizedWeight:
    """w [out, in] -> its RTN quantization with GPTQ's grid (the grid of the GPTQ paper's RTN rows)."""
    return quantize_groupwise(w, bits, group_size, sym, fit="gptq", min_zero=min_zero)
