"""AWQ (Lin et al., 2023), as in the paper's reference code (mit-han-lab/llm-awq, `auto_scale` /
`auto_clip`), block by block:

 1. Capture every linear's inputs from one full-precision pass of the block.
 2. For each group of linears sharing an input, grid-search alpha in {0, 1/20, ..., 19/20}:
        s = mean_tokens |x|^alpha,  s /= sqrt(max(s) min(s))
    quantize W diag(s), run the inspected module with W diag(s) quantized / s, and keep the alpha
    with the lowest mean squared error of the module's output. Groups for a Llama block:
        input_layernorm -> qkv_proj          (inspect: self_attn)
        v rows of qkv   -> o_proj            (only when v and o have the same shape, i.e. no GQA)
        post_attention_layernorm -> gate_up  (inspect: mlp)
        up rows of gate_up -> down_proj      (inspect: down_proj)
 3. Fold 1/s into the preceding op (norm weight or the rows of the previous linear) and s into W.
 4. Search per (row, group) clipping ranges max|w| * (1 - i/20), i < 10, minimizing the error of
    x W^T on 512 sampled tokens (not for q/k rows: their errors are amplified by the softmax).
 5. Quantize with AWQ's min-max grid.
The next block's inputs come from this block's full-precision output, as in the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.quant.calibration import chunks, decoder_layers, embed, positions_for
from tokenmill.quant.grid import QuantizedWeight, fit_minmax_awq, quantize_groupwise


def awq_fake_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool = False) -> torch.Tensor:
    """AWQ's pseudo_quantize_tensor on w [out, in] with contiguous groups."""
    out, cols = w.shape
    gs = cols if group_size == -1 else group_size
    wg = w.float().reshape(-1, gs)
    p = fit_minmax_awq(wg, bits, sym)
    maxq = 2**bits - 1
    q = torch.clamp(torch.round(wg / p.scale[:, None]) + p.zero[:, None], 0, maxq)
    return ((q - p.zero[:, None]) * p.scale[:, None]).reshape(out, cols).to(w.dtype)


def awq_scale_candidates(x_mean: torch.Tensor, w_mean: torch.Tensor | None, n_grid: int = 20) -> list[torch.Tensor]:
    """The grid of per-input-channel scales [in] for alpha = i / n_grid (w_mean only for duo scaling)."""
    out = []
    for i in range(n_grid):
        ratio = i / n_grid
        if w_mean is None:
            s = x_mean.pow(ratio).clamp(min=1e-4)
        else:
            s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        s = torch.where(torch.isfinite(s), s, torch.ones_like(s))
        out.append(s)
    return out


@dataclass
class ScaleSearchResult:
    scales: torch.Tensor  # [in] the chosen s
    best_ratio: float
    losses: list[float]  # output MSE per grid point


def awq_search_scale(
    linears: list[Linear],
    inspect: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    bits: int,
    group_size: int,
    n_grid: int = 20,
    duo_scaling: bool = False,
    batch: int = 8,
) -> ScaleSearchResult:
    """x: the shared input of `linears`, [n, T, in]; `inspect(x_chunk)` runs the module whose output
    error is minimized (it must use the linears). Weights are restored before returning."""
    x_mean = x.abs().reshape(-1, x.shape[-1]).float().mean(0)  # [in]
    w_mean = None
    if duo_scaling:
        w = torch.cat([lin.weight.data for lin in linears]).float()
        gs = w.shape[1] if group_size == -1 else group_size
        wg = w.reshape(-1, gs).abs()
        w_mean = (wg / (wg.amax(dim=1, keepdim=True) + 1e-6)).reshape(w.shape).mean(0)
    originals = [lin.weight.data.clone() for lin in linears]
    with torch.no_grad():
        ref = [inspect(x[sl]) for sl in chunks(x.shape[0], batch)]
        losses: list[float] = []
        best = (float("inf"), -1.0, None)
        for i, s in enumerate(awq_scale_candidates(x_mean, w_mean, n_grid)):
            for lin, w0 in zip(linears, originals):
                lin.weight.data = awq_fake_quantize(w0 * s[None, :].to(w0.dtype), bits, group_size) / s[None, :].to(
                    w0.dtype
                )
            err = 0.0
            count = 0
            for sl, r in zip(chunks(x.shape[0], batch), ref):
                err += float((inspect(x[sl]).float() - r.float()).pow(2).sum())
                count += r.numel()
            loss = err / count
            losses.append(loss)
            if loss < best[0]:
                best = (loss, i / n_grid, s.clone())
        for lin, w0 in zip(linears, originals):
            lin.weight.data = w0
    assert best[2] is not None, "AWQ scale search produced no finite loss"
    return ScaleSearchResult(scales=best[2], best_ratio=best[1], losses=losses)


def awq_search_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    bits: int,
    group_size: int,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    n_sample_token: int = 512,
) -> torch.Tensor:
    """w [out, in], x [..., in] -> best max|w| per (row, group): [out, num_groups]."""
    out, cols = w.shape
    gs = cols if group_size == -1 else group_size
    x = x.reshape(-1, cols).float()
    step = max(1, x.shape[0] // n_sample_token)
    x = x[0::step].reshape(1, -1, cols // gs, gs)  # [1, n_tok, G, gs]
    best_all = []
    batch = 256 if out % 256 == 0 else 64
    for r0 in range(0, out, batch):
        wb = w[r0 : r0 + batch].float().reshape(-1, 1, cols // gs, gs)  # [b, 1, G, gs]
        org_max = wb.abs().amax(dim=-1, keepdim=True)  # [b, 1, G, 1]
        best_max = org_max.clone()
        min_err = torch.full_like(org_max, 1e9)
        org_out = (x * wb).sum(dim=-1)  # [b, n_tok, G]
        for i_s in range(int(max_shrink * n_grid)):
            max_val = org_max * (1 - i_s / n_grid)
            cur = torch.clamp(wb, -max_val, max_val)
            q = awq_fake_quantize(cur.reshape(-1, cols), bits, group_size).reshape(cur.shape)
            err = ((x * q).sum(dim=-1) - org_out).pow(2).mean(dim=1).view(min_err.shape)
            better = err < min_err
            min_err[better] = err[better]
            best_max[better] = max_val[better]
        best_all.append(best_max)
    return torch.cat(best_all).reshape(out, cols // gs)


def apply_clip(w: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    """Clamp w [out, in] to [-max, max] per (row, group); max_val [out, G]."""
    out, cols = w.shape
    g = max_val.shape[1]
    m = max_val[..., None].to(w.dtype)
    return torch.clamp(w.reshape(out, g, cols // g), -m, m).reshape(out, cols)


def fold_scales(prev: RMSNorm | tuple[Linear, slice], linears: list[Linear], s: torch.Tensor) -> None:
    """y = f(x) W^T  ==  (f(x) / s) (W diag(s))^T: divide the producer of x by s, scale W's columns."""
    if isinstance(prev, RMSNorm):
        prev.weight.data = prev.weight.data / s.to(prev.weight.dtype)
    else:
        lin, rows = prev
        lin.weight.data[rows] = lin.weight.data[rows] / s[:, None].to(lin.weight.dtype)
        if lin.bias is not None:
            lin.bias.data[rows] = lin.bias.data[rows] / s.to(lin.bias.dtype)
    for linear in linears:
        linear.weight.data = linear.weight.data * s[None, :].to(linear.weight.dtype)


def _capture_all_inputs(layer: nn.Module, h: torch.Tensor, batch: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One fp pass: the inputs of every Linear ([n, T, in] each) and the block output [n, T, hidden]."""
    feats: dict[str, list[torch.Tensor]] = {}
    names = {id(m): n for n, m in layer.named_modules() if isinstance(m, Linear)}
    handles = [
        m.register_forward_pre_hook(lambda mod, args: feats.setdefault(names[id(mod)], []).append(args[0]))
        for m in layer.modules()
        if isinstance(m, Linear)
    ]
    try:
        with torch.no_grad():
            outs = [layer(positions_for(h[sl]), h[sl]) for sl in chunks(h.shape[0], batch)]
    finally:
        for hd in handles:
            hd.remove()
    return {k: torch.cat(v) for k, v in feats.items()}, torch.cat(outs)


def awq_quantize_block(
    layer: nn.Module,
    h: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool = False,
    n_grid: int = 20,
    duo_scaling: bool = False,
    clip: bool = True,
    min_zero: int = 0,
    batch: int = 8,
) -> tuple[dict[str, QuantizedWeight], torch.Tensor, dict[str, float]]:
    """AWQ one Llama decoder layer in place (scales folded, weights clipped) given its inputs h [n, T, hidden].
    Returns (quantized weights by local name, the block's full-precision output, chosen alpha per group)."""
    attn, mlp = layer.self_attn, layer.mlp
    feats, out = _capture_all_inputs(layer, h, batch)
    pos = lambda x: positions_for(x)  # noqa: E731
    ratios: dict[str, float] = {}

    def search_and_fold(key: str, prev, linears: list[Linear], inspect, x_name: str) -> None:
        res = awq_search_scale(linears, inspect, feats[x_name], bits, group_size, n_grid, duo_scaling, batch)
        fold_scales(prev, linears, res.scales)
        feats[x_name] = feats[x_name] / res.scales.to(feats[x_name].dtype)
        ratios[key] = res.best_ratio

    search_and_fold("qkv", layer.input_layernorm, [attn.qkv_proj], lambda x: attn(pos(x), x), "self_attn.qkv_proj")
    v_rows = attn.qkv_proj.shard_rows(2)
    if attn.kv_size == attn.o_proj.in_features == attn.o_proj.out_features:
        search_and_fold("v_o", (attn.qkv_proj, v_rows), [attn.o_proj], attn.o_proj, "self_attn.o_proj")
    search_and_fold("gate_up", layer.post_attention_layernorm, [mlp.gate_up_proj], mlp, "mlp.gate_up_proj")
    up_rows = mlp.gate_up_proj.shard_rows(1)
    search_and_fold("up_down", (mlp.gate_up_proj, up_rows), [mlp.down_proj], mlp.down_proj, "mlp.down_proj")

    named = {
        "self_attn.qkv_proj": attn.qkv_proj,
        "self_attn.o_proj": attn.o_proj,
        "mlp.gate_up_proj": mlp.gate_up_proj,
        "mlp.down_proj": mlp.down_proj,
    }
    if clip:
        for name, lin in named.items():
            # NOTE: q/k rows are never clipped (reference: their error is amplified by the softmax).
            rows = v_rows if name == "self_attn.qkv_proj" else slice(0, lin.out_features)
            w = lin.weight.data[rows]
            max_val = awq_search_clip(w, feats[name], bits, group_size, n_grid)
            lin.weight.data[rows] = apply_clip(w, max_val)
    weights = {}
    for name, lin in named.items():
        qw = quantize_groupwise(lin.weight.data, bits, group_size, sym, fit="awq", min_zero=min_zero)
        weights[name] = qw
        lin.weight.data = qw.dequantize(lin.weight.dtype)
    return weights, out, ratios


def awq_quantize_layers(
    model: nn.Module, cfg, calib_ids: torch.Tensor, progress: bool = True
) -> dict[str, QuantizedWeight]:
    """AWQ every decoder layer (cfg: pipeline.QuantConfig). Leaves fake-quantized weights in the model."""
    h = embed(model, calib_ids, cfg.batch_size)
    weights: dict[str, QuantizedWeight] = {}
    layers = decoder_layers(model)
    for i, layer in enumerate(tqdm(layers, desc=f"awq w{cfg.bits}", disable=not progress, unit="layer")):
        w, h, _ = awq_quantize_block(
            layer,
            h,
            cfg.bits,
            cfg.group_size,
            cfg.sym,
            cfg.awq_n_grid,
            cfg.awq_duo_scaling,
            cfg.awq_clip,
            cfg.min_zero,
            cfg.batch_size,
        )
        weights.update({f"model.layers.{i}.{k}": v for k, v in w.items()})
    return weights
