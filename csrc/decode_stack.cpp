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
#include "decode_stack.h"

#include "attention.h"
#include "fused_ops.h"
#include "quant.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace tokenmill {

static at::Tensor stack_linear(int64_t kind, const at::Tensor& x, const at::Tensor& a,
                                  const at::Tensor& b, const at::Tensor& c, int64_t group, at::Tensor y) {
    // y: a buffer [n, N] for the kernels that write into one (kinds 0, 1, 3, 4); the result is y
    // for those, a new tensor for the others.
    if (kind == 4) {
        TORCH_CHECK(int8_linear(y, x, a, b, c.numel() ? std::optional<at::Tensor>(c) : std::nullopt),
                    "decode_stack: int8 kernel refused its shape");
        return y;
    }
    if (kind == 1) {
        // As fused_ops.linear_small chooses: with b (the VNNI-packed copy), the AMX kernel where the CPU
        // has it, else the VNNI kernel from `group`
        // rows up (VNNI_MIN_ROWS); without it, the GEMV for one row, or up to 8 rows while rows x outputs
        // <= group (SMALL_LINEAR_MAX_OUTPUTS); else oneDNN with the prepacked weight c.
        if (b.numel() && cpu_has_amx()) {   // every row count on AMX, as fused_ops.linear_small
            TORCH_CHECK(linear_bf16_amx(y, x, b, std::nullopt), "decode_stack: AMX kernel refused its shape");
            return y;
        }
        if (b.numel() && x.size(0) >= group) {
            TORCH_CHECK(linear_bf16_vnni(y, x, b, std::nullopt), "decode_stack: VNNI kernel refused its shape");
            return y;
        }
        if (x.size(0) == 1 || x.size(0) * a.size(0) <= group) {
            TORCH_CHECK(linear_bf16_small(y, x, a, std::nullopt), "decode_stack: GEMV refused its shape");
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
        TORCH_CHECK(int4_linear(y, x, a, b, std::nullopt, group), "decode_stack: int4 kernel refused its shape");
        return y;
    }
    if (x.size(0) == 1 && x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat && linear_f32_small(y, x, a)) return y;
    return at::linear(x, a);
}

// Output features of a linear's weight tensor `a` (kind 2's tinygemm packing has no such row count:
// it allocates its own output, so its buffer is never used).
static int64_t stack_out_features(int64_t kind, const at::Tensor& a) { return kind == 2 ? 1 : a.size(0); }

at::Tensor decode_stack(at::Tensor h, const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& tables,
                        const at::Tensor& seq_lens, const at::Tensor& cos_sin, at::TensorList t, c10::IntArrayRef kinds,
                        c10::IntArrayRef groups, const at::Tensor& final_norm, int64_t nh, int64_t nkv, int64_t d,
                        double eps, double scale) {
    const int64_t n = h.size(0), q_size = nh * d, kv_size = nkv * d;
    const int64_t num_layers = kinds.size() / 4;
    // Buffers allocated once per step and reused by every layer (~300 small allocations fewer).
    const auto opts = h.options();
    auto x = at::empty_like(h);
    at::Tensor sums[2] = {at::empty_like(h), at::empty_like(h)};   // the residual stream, alternating
    auto o = at::empty({n, nh, d}, opts);
    auto o_flat = o.view({n, q_size});
    auto qkv_buf = at::empty({n, stack_out_features(kinds[0], t[8])}, opts);
    auto h_attn = at::empty({n, stack_out_features(kinds[1], t[11])}, opts);
    auto gu_buf = at::empty({n, stack_out_features(kinds[2], t[14])}, opts);
    auto act = at::empty({n, std::max<int64_t>(gu_buf.size(1) / 2, 1)}, opts);
    auto h_mlp = at::empty({n, stack_out_features(kinds[3], t[17])}, opts);
    at::Tensor res;
    int cur = 0;
    for (int64_t l = 0; l < num_layers; ++l) {
        const at::Tensor* L = t.data() + l * 20;
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

}  // namespace tokenmill
