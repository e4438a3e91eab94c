"""Quantize a loaded model in place: RTN, GPTQ (sequential, layer by layer) or AWQ (block by block).

`quantize_model` returns the QuantizedWeight of every quantized linear layer (by module name) and
leaves the model running on the weight-only kernels, so the in-memory model is exactly the one
`save_quantized` writes and `load_model` reads back.

With `QuantConfig.lm_head` the LM head (for tied embeddings: the shared table) is quantized last,
after the decoder layers: GPTQ for the gptq and awq methods, with its Hessian taken from the final
hidden states (the final norm's outputs) of the already quantized model on the same calibration
windows; RTN for the rtn method. It is returned under the name "lm_head". For gptq those final
hidden states are the ones sequential GPTQ computes anyway (the last block's outputs, every layer
already quantized, then the final norm): no extra forward pass. AWQ's block outputs are full
precision, so for awq one forward pass of the quantized model over the windows computes them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm import tqdm

from tokenmill.layers.linear import Linear
from tokenmill.quant.calibration import capture_inputs, chunks, decoder_layers, embed, linears_in_call_order, run_layer
from tokenmill.quant.gptq import HessianAccumulator, gptq_quantize_weight
from tokenmill.quant.grid import QuantizedWeight, check_group_size
from tokenmill.quant.kernels import install_quantized
from tokenmill.quant.rtn import rtn_quantize_weight
from tokenmill.quant.save import SAVE_DTYPE, round_unquantized_params

if TYPE_CHECKING:
    from tokenmill.models.causal_lm import CausalLM  # the common base of every model class

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
    lm_head: bool = False
    """Also quantize the LM head / tied embedding table (same bits and group size): GPTQ on the final
    hidden states for gptq and awq, RTN for rtn. Saved in the GPTQ layout only."""

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
        if self.lm_head and self.resolved_format == "awq":
            raise ValueError(
                "a quantized LM head is saved in the GPTQ layout only: AutoAWQ's GEMM format has no "
                "quantized lm_head (AutoAWQ never writes one); add --format gptq to save the "
                "AWQ-quantized model with its quantized head in the GPTQ layout"
            )
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
    head_seconds: float = 0.0
    """Of `seconds`, the time spent on the LM head (final-hidden Hessian + GPTQ), 0 without lm_head."""


def quantizable_linears(model: nn.Module) -> dict[str, Linear]:
    """Every Linear inside the decoder layers (the LM head and embeddings stay unquantized)."""
    return {
        f"model.layers.{i}.{n}": m
        for i, layer in enumerate(decoder_layers(model))
        for n, m in layer.named_modules()
        if isinstance(m, Linear)
    }


def check_model_fits(model: nn.Module, cfg: QuantConfig) -> None:
    for name, lin in quantizable_linears(model).items():
        check_group_size(lin.in_features, cfg.group_size, name)
    if cfg.lm_head:
        check_group_size(model.config.hidden_size, cfg.group_size, "the LM head")


def quantize_model(
    model: nn.Module, cfg: QuantConfig, calib_ids: torch.Tensor | None = None, progress: bool = True
) -> QuantizeReport:
    """Quantize `model` in place. calib_ids [n, T] are needed by GPTQ and AWQ."""
    check_model_fits(model, cfg)
    t0 = time.perf_counter()
    losses: dict[str, float] = {}
    final_h: list[torch.Tensor] = []
    if cfg.method == "rtn":
        weights = {
            name: rtn_quantize_weight(lin.weight.data, cfg.bits, cfg.group_size, cfg.sym, cfg.min_zero)
            for name, lin in quantizable_linears(model).items()
        }
    else:
        if calib_ids is None:
            raise ValueError(f"{cfg.method} needs calibration data")
        if cfg.method == "gptq":
            weights = gptq_quantize_layers(
                model, cfg, calib_ids, losses, progress, final_hidden=final_h if cfg.lm_head else None
            )
        else:
            from tokenmill.quant.awq import awq_quantize_layers

            weights = awq_quantize_layers(model, cfg, calib_ids, progress)
    modules = dict(model.named_modules())
    for name, qw in weights.items():
        install_quantized(modules[name], qw)
    # NOTE: checkpoints keep embeddings / norms in fp16; rounding them here makes the in-memory
    # model the exact model that save_quantized writes and load_model reads back.
    round_unquantized_params(model, SAVE_DTYPE)
    head_seconds = 0.0
    if cfg.lm_head:
        t1 = time.perf_counter()
        weights["lm_head"] = quantize_head(model, cfg, calib_ids, progress, final_h[0] if final_h else None)
        final_h.clear()
        head_seconds = time.perf_counter() - t1
    return QuantizeReport(
        weights=weights, seconds=time.perf_counter() - t0, layer_losses=losses, head_seconds=head_seconds
    )


def head_weight(model: CausalLM) -> torch.Tensor:
    """The dense [vocab, hidden] LM head: the lm_head Linear's weight, or the tied embedding table."""
    head = model.lm_head
    w = model.model.embed_tokens.weight if head is None else head.weight
    if w is None:
        raise ValueError("the LM head is already quantized")
    return w.data


def final_hidden_hessian(
    model: nn.Module,
    calib_ids: torch.Tensor,
    batch_size: int = 8,
    progress: bool = False,
    last_block_out: torch.Tensor | None = None,
) -> HessianAccumulator:
    """H = 2 XᵀX / n of the LM head's input X: the final norm's outputs of `model` (as it is now,
    e.g. with its decoder layers quantized) on the windows calib_ids [n, T]. last_block_out
    [n, T, hidden]: the last decoder block's outputs on those windows when already computed (then
    only the final norm runs)."""
    acc = HessianAccumulator(model.config.hidden_size)
    bar = tqdm(
        total=calib_ids.shape[0],
        desc="lm_head hessian",
        disable=not progress or last_block_out is not None,
        unit="window",
    )
    with torch.no_grad():
        for sl in chunks(calib_ids.shape[0], batch_size):
            if last_block_out is not None:
                acc.add_batch(model.model.norm(last_block_out[sl]))
                continue
            ids = calib_ids[sl]
            pos = torch.arange(ids.shape[1]).expand(ids.shape)
            acc.add_batch(model.model(ids, pos))  # [b, T, hidden]
            bar.update(ids.shape[0])
    bar.close()
    return acc


def quantize_head(
    model: CausalLM,
    cfg: QuantConfig,
    calib_ids: torch.Tensor | None = None,
    progress: bool = False,
    last_block_out: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Quantize the LM head (tied: the shared table) of a model whose decoder is already quantized,
    install it (quant/head.py) and return it. GPTQ (for the gptq and awq methods) with H from the
    final hidden states on calib_ids (see final_hidden_hessian); RTN for the rtn method. A tied
    table is kept aside in fp16 for save_quantized, which writes it as model.embed_tokens.weight
    beside the quantized head."""
    from tokenmill.quant.head import install_head_weight

    w = head_weight(model)
    if cfg.method == "rtn":
        qw = rtn_quantize_weight(w.float(), cfg.bits, cfg.group_size, cfg.sym, cfg.min_zero)
    else:
        if calib_ids is None:
            raise ValueError(f"{cfg.method} with lm_head needs calibration data")
        acc = final_hidden_hessian(model, calib_ids, cfg.batch_size, progress, last_block_out)
        qw = gptq_quantize_weight(
            w,
            acc.H,
            cfg.bits,
            cfg.group_size,
            cfg.sym,
            cfg.desc_act,
            cfg.static_groups,
            cfg.block_size,
            cfg.damp_percent,
            cfg.min_zero,
        ).weight
    install_head_weight(model, qw, keep_table=True)
    return qw


def gptq_quantize_layers(
    model: nn.Module,
    cfg: QuantConfig,
    calib_ids: torch.Tensor,
    losses: dict[str, float] | None = None,
    progress: bool = True,
    final_hidden: list[torch.Tensor] | None = None,
) -> dict[str, QuantizedWeight]:
    """Sequential GPTQ: block by block, and inside a block linear by linear in call order; each
    linear's Hessian comes from inputs computed with every earlier linear already quantized
    (AutoGPTQ's true_sequential). Leaves fake-quantized (dequantized) weights in the model.
    final_hidden: receives the last block's outputs [n, T, hidden] (every layer quantized)."""
    layers = decoder_layers(model)
    h = embed(model, calib_ids, cfg.batch_size)  # [n, T, hidden]
    hidden = h.shape[-1]
    weights: dict[str, QuantizedWeight] = {}
    bar = tqdm(
        total=sum(len(linears_in_call_order(layer, hidden)) for layer in layers),
        desc=f"gptq w{cfg.bits}",
        disable=not progress,
        unit="linear",
    )
    for i, layer in enumerate(layers):
        for name, lin in linears_in_call_order(layer, hidden):
            acc = HessianAccumulator(lin.in_features)
            capture_inputs(layer, lin, h, acc.add_batch, cfg.batch_size)
            res = gptq_quantize_weight(
                lin.weight.data,
                acc.H,
                cfg.bits,
                cfg.group_size,
                cfg.sym,
                cfg.desc_act,
                cfg.static_groups,
                cfg.block_size,
                cfg.damp_percent,
                cfg.min_zero,
            )
            full = f"model.layers.{i}.{name}"
            weights[full] = res.weight
            if losses is not None:
                losses[full] = res.loss
            lin.weight.data = res.weight.dequantize(lin.weight.dtype)
            bar.set_postfix_str(f"layer {i} {name}")
            bar.update()
        h = run_layer(layer, h, cfg.batch_size)
    bar.close()
    if final_hidden is not None:
        final_hidden.append(h)
    return weights
