"""A flat decode loop for the Llama family on CPU: the same math as the modules, fewer Python hops.

Why: after the fused kernels (layers/fused_ops.py) a single-stream decode step of the default
model still spent ~95 us per layer in Python around the kernels (module calls, method dispatch,
shape checks, views), ~3 ms of a ~8-10 ms step: as much as all int4 matmuls together. This loop
calls the same kernels directly, with every per-layer decision (which linear kernel, which
buffers) taken once when it is built:

    h = embed(ids); res = None
    for each layer:
        x, res = norm(h)        or  add_norm(h, res)      (residual carried, as vLLM does)
        qkv = linear(x);  rope(qkv) in place
        write k, v to their slots and attend              (one C++ call)
        h = o_proj(attn)
        x, res = add_norm(h, res);  h = down(silu_and_mul(gate_up(x)))
    return final_norm(h + res)

`build` returns None (the runner keeps the module path) unless everything it needs is there:
fused and attention C++ kernels, float32/bfloat16 activations and KV cache, no biases on the
linears, no act-order column permutations. It serves steps where every request has at most a few
new tokens (decodes and speculative verification; the runner then provides per-token metadata). The oracle is the
module path: tests assert equal hidden states (tests/worker).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tokenmill.attention import cpu_kernels
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill import native
from tokenmill.layers import fused_ops
from tokenmill.layers.cpu_packed_linear import PackedBf16LinearMethod, packed_linear
from tokenmill.layers.linear import Linear, UnquantizedLinearMethod
from tokenmill.quant import cpu_int4
from tokenmill.quant.kernels import Int4WeightOnlyMethod, Int8WeightOnlyMethod

LinearFn = Callable[[torch.Tensor], torch.Tensor]

def _stack_ext():
    """torch.ops.tokenmill, whose decode_stack (csrc/decode_stack.cpp) is the C++ layer loop; None without
    the C++ kernels."""
    return native.ops()


@dataclass
class _Layer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: LinearFn
    o: LinearFn
    gate_up: LinearFn
    down: LinearFn
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    stack_linears: list[tuple[int, torch.Tensor, torch.Tensor, int, torch.Tensor] | None]
    few_rows_like_stack: bool
    """Every quantized linear's plan takes SMALL_LINEAR_MAX_ROWS rows on its kernel, as the C++ loop does."""
    """(kind, a, b, group, c) of qkv, o, gate_up, down for the C++ loop (csrc/decode_stack.cpp), None if unsupported."""


def _stack_linear(layer: Linear) -> tuple[int, torch.Tensor, torch.Tensor, int, torch.Tensor] | None:
    """The C++ loop's encoding (kind, a, b, group, c) of this layer's one-row kernel (the one
    `_linear_fn` calls at one row)."""
    method = layer.quant_method
    empty = torch.empty(0)
    if isinstance(method, PackedBf16LinearMethod) and layer.in_features % 32 == 0:
        if layer.vnni_weight is not None:
            return 1, layer.weight, layer.vnni_weight, fused_ops.VNNI_MIN_ROWS, layer.packed_weight
        return 1, layer.weight, empty, fused_ops.SMALL_LINEAR_MAX_OUTPUTS, layer.packed_weight
    if type(method) is UnquantizedLinearMethod and layer.weight.dtype == torch.float32:
        return 0, layer.weight, empty, 0, empty
    if isinstance(method, Int4WeightOnlyMethod) and method.layout == "k64" and layer.scales_and_zeros.dtype == torch.bfloat16 \
            and cpu_int4.available():
        return 3, layer.qweight, layer.scales_and_zeros, method.group_size, empty
    if isinstance(method, Int4WeightOnlyMethod) and method.is_tinygemm \
            and layer.scales_and_zeros.dtype in (torch.bfloat16, torch.float16):
        return 2, layer.qweight, layer.scales_and_zeros, method.group_size, empty
    if _int8_serves(layer):
        offsets = layer.offsets
        return (4, layer.qweight, layer.scales.reshape(-1).contiguous(), 0,
                empty if offsets is None else offsets.reshape(-1).contiguous())
    return None


def _few_rows_like_stack(layer: Linear) -> bool:
    """A step of up to SMALL_LINEAR_MAX_ROWS tokens takes the same kernel through `layer`'s method as the
    C++ loop's `stack_linear` (unquantized layers: fused_ops.linear_small's rule, shared by both)."""
    method = layer.quant_method
    if isinstance(method, (Int4WeightOnlyMethod, Int8WeightOnlyMethod)):
        return method.max_kernel_rows >= fused_ops.SMALL_LINEAR_MAX_ROWS
    return isinstance(method, PackedBf16LinearMethod) or layer.weight.dtype == torch.float32


def _int8_serves(layer: Linear) -> bool:
    """Per-channel int8 weights our int8 GEMV takes at one bf16 row (quant/cpu_int4.int8_linear)."""
    if not isinstance(layer.quant_method, Int8WeightOnlyMethod):
        return False
    scales, offsets = layer.scales, layer.offsets
    return (scales.shape[-1] == 1
            and scales.dtype == torch.bfloat16 and (offsets is None or offsets.dtype == torch.bfloat16)
            and layer.in_features % 64 == 0 and cpu_int4.available())


def _one_row_then_method(one_row: Callable[[torch.Tensor], torch.Tensor | None], layer: Linear) -> LinearFn:
    """`one_row` (our kernel, as the C++ loop calls it) for a single row when it serves the call,
    else the layer's quant method with its own per-shape choice."""
    method = layer.quant_method

    def fn(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            y = one_row(x)
            if y is not None:
                return y
        return method.apply(layer, x)
    return fn


def _linear_fn(layer: Linear) -> LinearFn | None:
    """A direct call for this layer's weights with the kernel its method would pick at one row."""
    if layer.bias is not None or getattr(layer, "col_perm", None) is not None:
        return None
    method = layer.quant_method
    if isinstance(method, PackedBf16LinearMethod):
        w, packed, vnni = layer.weight, layer.packed_weight, layer.vnni_weight

        def bf16(x: torch.Tensor) -> torch.Tensor:
            y = fused_ops.linear_small(x, w, None, vnni)
            return packed_linear(x, packed, None) if y is None else y
        return bf16
    if type(method) is UnquantizedLinearMethod:
        w = layer.weight

        def dense(x: torch.Tensor) -> torch.Tensor:
            y = fused_ops.linear_small(x, w, None) if x.shape[0] == 1 else None
            return F.linear(x, w) if y is None else y
        return dense
    if isinstance(method, Int4WeightOnlyMethod) and method.layout == "k64":  # int4, our kernel (quant/cpu_int4.py)
        qweight, sz, gs = layer.qweight, layer.scales_and_zeros, method.group_size
        return _one_row_then_method(lambda x: cpu_int4.linear(x, qweight, sz, gs), layer)
    if isinstance(method, Int4WeightOnlyMethod) and method.is_tinygemm:  # int4 (quant/kernels.py)
        op = torch.ops.aten._weight_int4pack_mm_for_cpu.default
        qweight, sz, gs = layer.qweight, layer.scales_and_zeros, method.group_size

        def int4(x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 1 and x.dtype == sz.dtype and x.dtype in (torch.bfloat16, torch.float16):
                return op(x, qweight, gs, sz)  # the kernel the method's plan takes at one row
            return method.apply(layer, x)
        return int4
    if _int8_serves(layer):  # int8 per channel: our GEMV at one row, as the C++ loop (kind 4) calls it
        qweight, scales, offsets = layer.qweight, layer.scales, layer.offsets
        return _one_row_then_method(lambda x: cpu_int4.int8_linear(x, qweight, scales, offsets), layer)
    if isinstance(method, (Int4WeightOnlyMethod, Int8WeightOnlyMethod)):  # grouped int8, plain int4: the method's plan
        return lambda x: method.apply(layer, x)
    return None


class CpuDecodeLoop:
    def __init__(self, model: torch.nn.Module, layers: list[_Layer], rotary, dims: tuple[int, int, int],
                 eps: float, scale: float) -> None:
        self.model = model
        self.layers = layers
        self.cos_sin = rotary.cos_sin
        self.num_heads, self.num_kv_heads, self.head_dim = dims
        self.eps = eps
        self.scale = scale
        self.final_norm = model.model.norm.weight
        self._stack = None
        if all(sl is not None for L in layers for sl in L.stack_linears) and _stack_ext() is not None:
            tensors, kinds, groups = [], [], []
            empty = torch.empty(0)
            for L in layers:
                tensors += [L.in_norm, L.post_norm, L.k_cache, L.v_cache] + [empty] * 4
                for kind, a, b, g, c in L.stack_linears:
                    tensors += [a, b, c]
                    kinds.append(kind)
                    groups.append(g)
            self._stack = (tensors, kinds, groups)
        # Above one token, only where the C++ loop picks each linear's kernel exactly as the Python loop
        # does: bf16 by fused_ops.linear_small's rule, float32 by at::linear, quantized layers when their
        # plans (quant/kernels.py) keep a few rows on the kernel the C++ loop calls.
        self._stack_multi = self._stack is not None and all(L.few_rows_like_stack for L in layers)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        ext = attn = native.ops()   # the fused ops and the attention kernels (csrc/)
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = nh * d, nkv * d
        n = input_ids.shape[0]
        eps, scale = self.eps, self.scale
        # One attention row per token: a request's k + 1 verification tokens attend causally, each
        # as a decode over its own prefix (all of the step's K/V are written before any is read).
        slots, tables, seq_lens = meta.slot_mapping, meta.token_block_tables, meta.token_seq_lens
        h = self.model.model.embed_tokens(input_ids)
        if self._stack is not None and (n == 1 or (n <= fused_ops.SMALL_LINEAR_MAX_ROWS and self._stack_multi)):
            # the whole layer loop in one C++ call: a single stream, or a few tokens on bf16/fp32 weights
            tensors, kinds, groups = self._stack
            return _stack_ext().decode_stack(h, positions, slots, tables, seq_lens, self.cos_sin, tensors, kinds,
                                             groups, self.final_norm, nh, nkv, d, eps, scale)
        res = None
        for L in self.layers:
            x = torch.empty_like(h)
            if res is None:
                ext.rms_norm(x, h, L.in_norm, eps)
                res = h
            else:
                s = torch.empty_like(h)
                ext.add_rms_norm(x, s, h, res, L.in_norm, eps)
                res = s
            qkv = L.qkv(x)
            ext.rope_inplace(qkv, nh + nkv, d, self.cos_sin, positions)
            q = qkv[:, :q_size].view(n, nh, d)
            k = qkv[:, q_size:q_size + kv_size].view(n, nkv, d)
            v = qkv[:, q_size + kv_size:].view(n, nkv, d)
            o = q.new_empty(n, nh, d)
            attn.write_and_decode(o, q, k, v, slots, L.k_cache, L.v_cache, tables, seq_lens, scale)
            h = L.o(o.view(n, q_size))
            x, s = torch.empty_like(h), torch.empty_like(h)
            ext.add_rms_norm(x, s, h, res, L.post_norm, eps)
            res = s
            gu = L.gate_up(x)
            a = gu.new_empty(n, gu.shape[1] // 2)
            ext.silu_mul(a, gu)
            h = L.down(a)
        x, s = torch.empty_like(h), torch.empty_like(h)
        ext.add_rms_norm(x, s, h, res, self.final_norm, eps)
        return x

    def serves(self, meta: AttentionMetadata, input_ids: torch.Tensor) -> bool:
        return meta.token_seq_lens is not None and meta.custom_mask is None


def build(model: torch.nn.Module, kv_caches: list[torch.Tensor]) -> CpuDecodeLoop | None:
    """The loop for `model` (a LlamaForCausalLM-shaped module) and its per-layer caches, or None."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not fused_ops.is_available() or not cpu_kernels.is_available():
        return None
    norm = getattr(inner, "norm", None)
    dtype = norm.weight.dtype if norm is not None else None
    if dtype not in (torch.float32, torch.bfloat16) or norm.weight.device.type != "cpu":
        return None
    out: list[_Layer] = []
    try:
        for layer, cache in zip(layers, kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            if cache.dtype != dtype or cache.shape[-1] != attn.head_dim:  # int8 KV: module path
                return None
            fns = [_linear_fn(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(f is None for f in fns):
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            out.append(_Layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *fns,
                              cache[0], cache[1], [_stack_linear(m) for m in linears],
                              all(_few_rows_like_stack(m) for m in linears)))
        a0 = layers[0].self_attn
        eps = layers[0].input_layernorm.eps
    except AttributeError:  # not the Llama layout
        return None
    if a0.rotary.cos_sin.dtype != torch.float32:
        return None
    return CpuDecodeLoop(model, out, a0.rotary, (a0.num_heads, a0.num_kv_heads, a0.head_dim), eps, a0.scale)
