"""Quantize a loaded model in place: RTN, GPTQ (sequential, layer by layer) or AWQ (block by block).

`quantize_model` returns the QuantizedWeight of every quantized linear layer (by module name) and
leaves the model running on the weight-only kernels, so the in-memory model is exactly the one
`save_quantized` writes and `load_model` reads back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from tokenmill.layers.linear import Linear
from tokenmill.quant.calibration import capture_inputs, decoder_layers, embed, linears_in_call_order, run_layer
from tokenmill.quant.gptq import HessianAccumulator, gptq_quantize_weight
from tokenmill.quant.grid import QuantizedWeight, check_group_size
from tokenmill.quant.kernels import install_quantized
from tokenmill.quant.rtn import rtn_quantize_weight
from tokenmill.quant.save import SAVE_DTYPE, round_unquantized_params

METHODS = ("rtn", "gptq", "awq")


@dataclass(frozen=True)
class QuantConfig:
    method: str = "gptq"
    """Algorithm: rtn, gptq or awq."""
    bits: int = 4
    """Bits per weight: 2, 3, 4 or 8."""
    group_size: int = 64
    """Input columns sharing one scale/zero; -1 for one per output channel."""
    sym: bool = False
    """Symmetric grid (zero point in the middle) instead of asymmetric min-max."""
    desc_act: bool = False
    """GPTQ act-order: quantize columns by decreasing Hessian diagonal."""
    static_groups: bool = False
    """GPTQ: fit all group grids up front on the original weights (keeps act-order kernel-friendly)."""
    damp_percent: float = 0.01
    """GPTQ dampening, as a fraction of the mean Hessian diagonal."""
    block_size: int = 128
    """GPTQ columns per lazy-update block."""
    format: str = "auto"
    """Checkpoint format: gptq, awq or auto (awq for 4-bit AWQ, gptq otherwise)."""
    awq_n_grid: int = 20
    """AWQ: grid points of the scale exponent alpha in [0, 1)."""
    awq_duo_scaling: bool = False
    """AWQ: AutoAWQ's s = mean|x|^a / mean|w|^(1-a) instead of the paper's s = mean|x|^a."""
    awq_clip: bool = True
    """AWQ: search per-group clipping ranges after scaling."""
    batch_size: int = 8
    """Calibration windows per forward batch."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.bits not in (2, 3, 4, 8):
            raise ValueError(f"bits must be 2, 3, 4 or 8, got {self.bits}")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size must be -1 or positive, got {self.group_size}")
        if self.format not in ("auto", "gptq", "awq"):
            raise ValueError(f"format must be auto, gptq or awq, got {self.format!r}")
        if self.resolved_format == "awq" and (self.bits != 4 or self.desc_act):
            raise ValueError("the AWQ GEMM format holds 4-bit weights without act-order; use --format gptq")
        if not 0 <= self.damp_percent < 1:
            raise ValueError(f"damp_percent must be in [0, 1), got {self.damp_percent}")

    @property
    def resolved_format(self) -> str:
        if self.format != "auto":
            return self.format
        return "awq" if self.method == "awq" and self.bits == 4 else "gptq"

    @property
    def min_zero(self) -> int:
        """GPTQ v1 stores zero - 1, so its zero points start at 1."""
        return 1 if self.resolved_format == "gptq" else 0


@dataclass
class QuantizeReport:
    weights: dict[str, QuantizedWeight]
    """Module name (e.g. model.layers.0.self_attn.qkv_proj) -> its quantized weight."""
    seconds: float
    layer_losses: dict[str, float]
    """GPTQ's own error estimate per layer (empty for RTN / AWQ)."""


def quantizable_linears(model: nn.Module) -> dict[str, Linear]:
    """Every Linear inside the decoder layers (the LM head and embeddings stay unquantized)."""
    return {f"model.layers.{i}.{n}": m for i, layer in enumerate(decoder_layers(model))
            for n, m in layer.named_modules() if isinstance(m, Linear)}


def check_model_fits(model: nn.Module, cfg: QuantConfig) -> None:
    for name, lin in quantizable_linears(model).items():
        check_group_size(lin.in_features, cfg.group_size, name)


def quantize_model(model: nn.Module, cfg: QuantConfig, calib_ids: torch.Tensor | None = None,
                   progress: bool = True) -> QuantizeReport:
    """Quantize `model` in place. calib_ids [n, T] are needed by GPTQ and AWQ."""
    check_model_fits(model, cfg)
    t0 = time.perf_counter()
    losses: dict[str, float] = {}
    if cfg.method == "rtn":
        weights = {name: rtn_quantize_weight(lin.weight.data, cfg.bits, cfg.group_size, cfg.sym, cfg.min_zero)
                   for name, lin in quantizable_linears(model).items()}
    else:
        if calib_ids is None:
            raise ValueError(f"{cfg.method} needs calibration data")
        if cfg.method == "gptq":
            weights = gptq_quantize_layers(model, cfg, calib_ids, losses, progress)
        else:
            from tokenmill.quant.awq import awq_quantize_layers
            weights = awq_quantize_layers(model, cfg, calib_ids, progress)
    modules = dict(model.named_modules())
    for name, qw in weights.items():
        install_quantized(modules[name], qw)
    # NOTE: checkpoints keep embeddings / norms in fp16; rounding them here makes the in-memory
    # model the exact model that save_quantized writes and load_model reads back.
    round_unquantized_params(model, SAVE_DTYPE)
    return QuantizeReport(weights=weights, seconds=time.perf_counter() - t0, layer_losses=losses)


def gptq_quantize_layers(model: nn.Module, cfg: QuantConfig, calib_ids: torch.Tensor,
                         losses: dict[str, float] | None = None, progress: bool = True) -> dict[str, QuantizedWeight]:
    """Sequential GPTQ: block by block, and inside a block linear by linear in call order; each
    linear's Hessian comes from inputs computed with every earlier linear already quantized
    (AutoGPTQ's true_sequential). Leaves fake-quantized (dequantized) weights in the model."""
    layers = decoder_layers(model)
    h = embed(model, calib_ids, cfg.batch_size)                                  # [n, T, hidden]
    hidden = h.shape[-1]
    weights: dict[str, QuantizedWeight] = {}
    bar = tqdm(total=sum(len(linears_in_call_order(l, hidden)) for l in layers), desc=f"gptq w{cfg.bits}",
               disable=not progress, unit="linear")
    for i, layer in enumerate(layers):
        for name, lin in linears_in_call_order(layer, hidden):
            acc = HessianAccumulator(lin.in_features)
            capture_inputs(layer, lin, h, acc.add_batch, cfg.batch_size)
            res = gptq_quantize_weight(lin.weight.data, acc.H, cfg.bits, cfg.group_size, cfg.sym, cfg.desc_act,
                                       cfg.static_groups, cfg.block_size, cfg.damp_percent, cfg.min_zero)
            full = f"model.layers.{i}.{name}"
            weights[full] = res.weight
            if losses is not None:
                losses[full] = res.loss
            lin.weight.data = res.weight.dequantize(lin.weight.dtype)
            bar.set_postfix_str(f"layer {i} {name}")
            bar.update()
        h = run_layer(layer, h, cfg.batch_size)
    bar.close()
    return weights
