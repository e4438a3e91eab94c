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
from tokenmill.layers import cpp_ext, fused_ops
from tokenmill.layers.cpu_packed_linear import PackedBf16LinearMethod, packed_linear
from tokenmill.layers.linear import Linear, UnquantizedLinearMethod
from tokenmill.quant import cpu_int4

LinearFn = Callable[[torch.Tensor], torch.Tensor]

_STACK_SOURCE = r"""
// One decode step (one token, or up to 8 tokens on bf16/float32 weights: a small batch of decodes or
// a verification) through every layer, in C++: the loop of CpuDecodeLoop.__call__ without the Python
// between kernels. Per layer, 8 tensors then 4 linears of 3 tensors each:
//   in_norm, post_norm, k_cache, v_cache, (unused x4), then for qkv, o, gate_up, down: (a, b, c)
// with a linear's kind in `kinds` (0: float32 a = weight, GEMV for one row else at::linear, 1: bf16 a = weight,
// b = its VNNI-packed copy (fused_ops.pack_vnni) or empty, c = its oneDNN-prepacked copy, group = with b the
// fewest rows b serves, else the rows x outputs limit of the GEMV above one row,
// 2: int4 tinygemm a = qweight, b = scales_and_zeros, 3: int4 k64 (quant/cpu_int4.py), same tensors,
// 4: int8 per channel (quant/cpu_int4.py) a = qweight, b = scales [N], c = offsets [N] or empty) and its
// group size in `groups`.
static torch::Tensor stack_linear(int64_t kind, const torch::Tensor& x, const torch::Tensor& a,
                                  const torch::Tensor& b, const torch::Tensor& c, int64_t group, torch::Tensor y) {
    // y: a buffer [n, N] for the kernels that write into one (kinds 0, 1, 3, 4); the result is y
    // for those, a new tensor for the others.
    if (kind == 4) {
        TORCH_CHECK(int8_linear(y, x, a, b, c.numel() ? c10::optional<torch::Tensor>(c) : c10::nullopt),
                    "decode_stack: int8 kernel refused its shape");
        return y;
    }
    if (kind == 1) {
        // As fused_ops.linear_small chooses: with b (the VNNI-packed copy), the VNNI kernel from `group`
        // rows up (VNNI_MIN_ROWS); without it, the GEMV for one row, or up to 8 rows while rows x outputs
        // <= group (SMALL_LINEAR_MAX_OUTPUTS); else oneDNN with the prepacked weight c.
        if (b.numel() && x.size(0) >= group) {
            TORCH_CHECK(gemm_vnni_bf16(y, x, b, c10::nullopt), "decode_stack: VNNI kernel refused its shape");
            return y;
        }
        if (x.size(0) == 1 || x.size(0) * a.size(0) <= group) {
            TORCH_CHECK(gemv_bf16(y, x, a, c10::nullopt), "decode_stack: GEMV refused its shape");
            return y;
        }
        static auto packed_linear = c10::Dispatcher::singleton()
            .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                              c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
        c10::List<std::optional<at::Scalar>> scalars;
        scalars.push_back(std::nullopt);
        return packed_linear.call(x, c, std::nullopt, "none", scalars, std::nullopt);
    }
    if (kind == 2) return at::_weight_int4pack_mm_for_cpu(x, a, group, b);
    if (kind == 3) {
        TORCH_CHECK(int4_linear(y, x, a, b, c10::nullopt, group), "decode_stack: int4 kernel refused its shape");
        return y;
    }
    if (x.size(0) == 1 && x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat && gemv_f32(y, x, a)) return y;
    return at::linear(x, a);
}

// Output features of a linear's weight tensor `a` (kind 2's tinygemm packing has no such row count:
// it allocates its own output, so its buffer is never used).
static int64_t stack_out_features(int64_t kind, const torch::Tensor& a) { return kind == 2 ? 1 : a.size(0); }

torch::Tensor decode_stack(torch::Tensor h, torch::Tensor positions, torch::Tensor slots, torch::Tensor tables,
                           torch::Tensor seq_lens, torch::Tensor cos_sin, std::vector<torch::Tensor> t,
                           std::vector<int64_t> kinds, std::vector<int64_t> groups, torch::Tensor final_norm,
                           int64_t nh, int64_t nkv, int64_t d, double eps, double scale) {
    const int64_t n = h.size(0), q_size = nh * d, kv_size = nkv * d;
    const int64_t num_layers = kinds.size() / 4;
    // Buffers allocated once per step and reused by every layer (~300 small allocations fewer).
    const auto opts = h.options();
    auto x = at::empty_like(h);
    torch::Tensor sums[2] = {at::empty_like(h), at::empty_like(h)};   // the residual stream, alternating
    auto o = at::empty({n, nh, d}, opts);
    auto o_flat = o.view({n, q_size});
    auto qkv_buf = at::empty({n, stack_out_features(kinds[0], t[8])}, opts);
    auto h_attn = at::empty({n, stack_out_features(kinds[1], t[11])}, opts);
    auto gu_buf = at::empty({n, stack_out_features(kinds[2], t[14])}, opts);
    auto act = at::empty({n, std::max<int64_t>(gu_buf.size(1) / 2, 1)}, opts);
    auto h_mlp = at::empty({n, stack_out_features(kinds[3], t[17])}, opts);
    torch::Tensor res;
    int cur = 0;
    for (int64_t l = 0; l < num_layers; ++l) {
        const torch::Tensor* L = t.data() + l * 20;
        if (l == 0) { rms_norm(x, h, L[0], eps); res = h; }
        else { add_rms_norm(x, sums[cur], h, res, L[0], eps); res = sums[cur]; cur ^= 1; }
        auto qkv = stack_linear(kinds[4 * l], x, L[8], L[9], L[10], groups[4 * l], qkv_buf);
        rope_inplace(qkv, nh + nkv, d, cos_sin, positions);
        auto q = qkv.narrow(1, 0, q_size).view({n, nh, d});
        auto k = qkv.narrow(1, q_size, kv_size).view({n, nkv, d});
        auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, nkv, d});
        write_and_decode(o, q, k, v, slots, L[2], L[3], tables, seq_lens, scale);
        h = stack_linear(kinds[4 * l + 1], o_flat, L[11], L[12], L[13], groups[4 * l + 1], h_attn);
        add_rms_norm(x, sums[cur], h, res, L[1], eps);
        res = sums[cur];
        cur ^= 1;
        auto gu = stack_linear(kinds[4 * l + 2], x, L[14], L[15], L[16], groups[4 * l + 2], gu_buf);
        auto a = gu.size(1) / 2 == act.size(1) ? act : at::empty({n, gu.size(1) / 2}, opts);
        silu_mul(a, gu);
        h = stack_linear(kinds[4 * l + 3], a, L[17], L[18], L[19], groups[4 * l + 3], h_mlp);
    }
    auto out = at::empty_like(h);   // returned: a fresh tensor, never a buffer
    add_rms_norm(out, sums[cur], h, res, final_norm, eps);
    return out;
}
"""

_STACK_DECL = ("torch::Tensor decode_stack(torch::Tensor h, torch::Tensor positions, torch::Tensor slots, "
               "torch::Tensor tables, torch::Tensor seq_lens, torch::Tensor cos_sin, std::vector<torch::Tensor> t, "
               "std::vector<int64_t> kinds, std::vector<int64_t> groups, torch::Tensor final_norm, int64_t nh, "
               "int64_t nkv, int64_t d, double eps, double scale);")


def _stack_ext():
    """The C++ layer loop: one extension built from the fused-op and attention sources plus the loop."""
    return cpp_ext.load("tokenmill_decode_stack_v12", _STACK_DECL,
                        fused_ops._SOURCE + cpu_kernels._CPP_SOURCE + cpu_int4.SOURCE + _STACK_SOURCE, ["decode_stack"])


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
    """(kind, a, b, group, c) of qkv, o, gate_up, down for the C++ loop (see _STACK_SOURCE), None if unsupported."""


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
    if getattr(method, "layout", None) == "k64" and layer.scales_and_zeros.dtype == torch.bfloat16 and cpu_int4.available():
        return 3, layer.qweight, layer.scales_and_zeros, method.group_size, empty
    if getattr(method, "is_tinygemm", False) and layer.scales_and_zeros.dtype in (torch.bfloat16, torch.float16):
        return 2, layer.qweight, layer.scales_and_zeros, method.group_size, empty
    if _int8_serves(layer):
        offsets = layer.offsets
        return (4, layer.qweight, layer.scales.reshape(-1).contiguous(), 0,
                empty if offsets is None else offsets.reshape(-1).contiguous())
    return None


def _int8_serves(layer: Linear) -> bool:
    """Per-channel int8 weights our int8 GEMV takes at one bf16 row (quant/cpu_int4.int8_linear)."""
    from tokenmill.quant.kernels import Int8WeightOnlyMethod
    scales, offsets = getattr(layer, "scales", None), getattr(layer, "offsets", None)
    return (isinstance(layer.quant_method, Int8WeightOnlyMethod) and scales is not None and scales.shape[-1] == 1
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
    if getattr(method, "layout", None) == "k64":  # int4, our kernel (quant/cpu_int4.py)
        qweight, sz, gs = layer.qweight, layer.scales_and_zeros, method.group_size
        return _one_row_then_method(lambda x: cpu_int4.linear(x, qweight, sz, gs), layer)
    if getattr(method, "is_tinygemm", False):  # int4 (quant/kernels.py)
        op = torch.ops.aten._weight_int4pack_mm_for_cpu.default
        qweight, sz, gs = layer.qweight, layer.scales_and_zeros, method.group_size

        def int4(x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 1 and x.dtype == sz.dtype and x.dtype in (torch.bfloat16, torch.float16):
                return op(x, qweight, gs, sz)  # the kernel the method measures fastest at one row
            return method.apply(layer, x)
        return int4
    if _int8_serves(layer):  # int8 per channel: our GEMV at one row, as the C++ loop (kind 4) calls it
        qweight, scales, offsets = layer.qweight, layer.scales, layer.offsets
        return _one_row_then_method(lambda x: cpu_int4.int8_linear(x, qweight, scales, offsets), layer)
    if hasattr(method, "force_path"):  # grouped int8 and non-tinygemm int4: the method's own choice
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
        # does (bf16: fused_ops.linear_small's rule; float32: at::linear). Quantized methods choose
        # per shape by timing, so their multi-token steps stay in Python.
        self._stack_multi = self._stack is not None and all(k in (0, 1) for k in self._stack[1])

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        ext, attn = fused_ops._ext(), cpu_kernels._load()
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
            out.append(_Layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *fns,
                              cache[0], cache[1],
                              [_stack_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]))
        a0 = layers[0].self_attn
        eps = layers[0].input_layernorm.eps
    except AttributeError:  # not the Llama layout
        return None
    if a0.rotary.cos_sin.dtype != torch.float32:
        return None
    return CpuDecodeLoop(model, out, a0.rotary, (a0.num_heads, a0.num_kv_heads, a0.head_dim), eps, a0.scale)
