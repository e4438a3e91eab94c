// The decoder layer loop in C++ (decode_stack.h). Per layer, as LlamaDecoderLayer.forward:
//   x, res = norm(h)  or  add_norm(h, res)          the residual carried between layers
//   qkv = linear(x); rope(qkv) in place; write k, v at their slots and attend (one call)
//   h = o(attn); x, res = add_norm(h, res); h = down(silu_mul(gate_up(x)))
// and finally add_norm(h, res) with the final norm. A step with long prompt chunks may attend them tiled
// (TiledPrompts), as the module path does where prompts are not attended token by token. Each linear runs the kernel its Python method runs
// for the same rows (the method's LinearKernel says which), so both forwards give the same bits.
#include "decode_stack.h"

#include "attention.h"
#include "fused_ops.h"
#include "gguf_quant.h"
#include "linear.h"
#include "quant.h"

namespace tokenmill {

DecodeStack::DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                         at::Tensor cos_sin, at::Tensor final_norm)
    : nh_(num_heads), nkv_(num_kv_heads), d_(head_dim), eps_(eps), scale_(scale),
      cos_sin_(std::move(cos_sin)), final_norm_(std::move(final_norm)) {}

void DecodeStack::add_layer(at::Tensor in_norm, at::Tensor post_norm, at::Tensor k_cache, at::Tensor v_cache) {
    if (!layers_.empty()) TORCH_CHECK(layers_.back().linears.size() == 4, "DecodeStack: a layer takes 4 linears");
    layers_.push_back({std::move(in_norm), std::move(post_norm), std::move(k_cache), std::move(v_cache), {}});
}

void DecodeStack::add_linear(int64_t kind, at::Tensor weight, std::optional<at::Tensor> aux,
                             std::optional<at::Tensor> extra, std::optional<at::Tensor> bias, int64_t group,
                             int64_t out_features) {
    TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() < 4, "DecodeStack: add_layer first, 4 linears each");
    TORCH_CHECK(kind >= 0 && kind <= 3, "DecodeStack: unknown linear kind ", kind);
    const auto k = static_cast<LinearKind>(kind);
    TORCH_CHECK(k == LinearKind::dense || !bias.has_value(), "DecodeStack: only dense linears take a bias here");
    TORCH_CHECK(k != LinearKind::int8 || aux.has_value(), "DecodeStack: an int8 linear needs its scales");
    TORCH_CHECK(k == LinearKind::dense || k == LinearKind::int8 || aux.has_value(),
                "DecodeStack: an int4 linear needs its scales and zeros");
    layers_.back().linears.push_back({k, std::move(weight), std::move(aux), std::move(extra), std::move(bias), group,
                                      out_features, {}, {}});
}

void DecodeStack::add_gguf_linear(std::vector<at::Tensor> parts, std::vector<int64_t> types,
                                  std::optional<at::Tensor> bias, int64_t out_features) {
    TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() < 4, "DecodeStack: add_layer first, 4 linears each");
    TORCH_CHECK(!parts.empty() && parts.size() == types.size(), "DecodeStack: a GGUF linear takes one type per part");
    for (int64_t t : types) TORCH_CHECK(gguf_type_served(t), "DecodeStack: ggml type ", t, " is not served");
    layers_.back().linears.push_back({LinearKind::gguf, parts.front(), std::nullopt, std::nullopt, std::move(bias), 0,
                                      out_features, std::move(parts), std::move(types)});
}

// One linear into `y` [n, out] where its kernel writes into a buffer; returns the result.
static at::Tensor run_linear(const StackLinear& L, const at::Tensor& x, at::Tensor y) {
    switch (L.kind) {
        case LinearKind::dense:
            return dense_linear_into(y, x, L.weight, L.aux, L.extra, L.bias);
        case LinearKind::int4_tinygemm:
            return at::_weight_int4pack_mm_for_cpu(x, L.weight, L.group, *L.aux);
        case LinearKind::int4_k64:
            TORCH_CHECK(int4_linear(y, x, L.weight, *L.aux, std::nullopt, L.group),
                        "DecodeStack: int4 kernel refused its shape");
            return y;
        case LinearKind::int8:
            TORCH_CHECK(int8_linear(y, x, L.weight, *L.aux, L.extra), "DecodeStack: int8 kernel refused its shape");
            return y;
        case LinearKind::gguf:
            TORCH_CHECK(gguf_linear(y, x, L.parts, L.types), "DecodeStack: no GGUF integer kernel on this CPU");
            if (L.bias.has_value()) y.add_(*L.bias);
            return y;
    }
    TORCH_CHECK(false, "DecodeStack: unknown linear kind");
}

at::Tensor DecodeStack::forward(at::Tensor h, const at::Tensor& positions, const at::Tensor& slots,
                                const at::Tensor& tables, const at::Tensor& seq_lens,
                                const std::optional<at::Tensor>& key_mask,
                                const std::optional<c10::intrusive_ptr<TiledPrompts>>& tiled) const {
    TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() == 4, "DecodeStack: incomplete layers");
    const int64_t n = h.size(0), q_size = nh_ * d_, kv_size = nkv_ * d_;
    // Buffers allocated once per step and reused by every layer (~300 small allocations fewer).
    const auto opts = h.options();
    const auto& first = layers_.front().linears;
    auto x = at::empty_like(h);
    at::Tensor sums[2] = {at::empty_like(h), at::empty_like(h)};   // the residual stream, alternating
    auto o = at::empty({n, nh_, d_}, opts);
    auto o_flat = o.view({n, q_size});
    auto qkv_buf = at::empty({n, first[0].out_features}, opts);
    auto h_attn = at::empty({n, first[1].out_features}, opts);
    auto gu_buf = at::empty({n, first[2].out_features}, opts);
    auto act = at::empty({n, first[2].out_features / 2}, opts);
    auto h_mlp = at::empty({n, first[3].out_features}, opts);
    at::Tensor res;
    int cur = 0;
    for (size_t l = 0; l < layers_.size(); ++l) {
        const StackLayer& L = layers_[l];
        if (l == 0) { rms_norm(x, h, L.in_norm, eps_); res = h; }
        else { add_rms_norm(x, sums[cur], h, res, L.in_norm, eps_); res = sums[cur]; cur ^= 1; }
        auto qkv = run_linear(L.linears[0], x, qkv_buf);
        rope_inplace(qkv, nh_ + nkv_, d_, cos_sin_, positions);
        auto q = qkv.narrow(1, 0, q_size).view({n, nh_, d_});
        auto k = qkv.narrow(1, q_size, kv_size).view({n, nkv_, d_});
        auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, nkv_, d_});
        if (tiled.has_value()) {   // as the module path's attention (attention/backend.py) runs a tiled plan
            const TiledPrompts& t = **tiled;
            write_kv(k, v, slots, L.k_cache, L.v_cache);
            TORCH_CHECK(paged_prefill(o, q, L.k_cache, L.v_cache, t.block_tables, t.seq_lens, t.q_start, t.q_len, scale_),
                        "DecodeStack: the tiled prefill kernel does not serve this model or CPU");
            if (t.short_idx.has_value()) {
                auto qs = q.index_select(0, *t.short_idx);
                auto os = at::empty_like(qs);
                paged_decode(os, qs, L.k_cache, L.v_cache, tables, seq_lens, scale_, key_mask, std::nullopt);
                o.index_copy_(0, *t.short_idx, os);
            }
        } else {
            write_and_decode(o, q, k, v, slots, L.k_cache, L.v_cache, tables, seq_lens, scale_, key_mask, std::nullopt);
        }
        h = run_linear(L.linears[1], o_flat, h_attn);
        add_rms_norm(x, sums[cur], h, res, L.post_norm, eps_);
        res = sums[cur];
        cur ^= 1;
        auto gu = run_linear(L.linears[2], x, gu_buf);
        silu_mul(act, gu);
        h = run_linear(L.linears[3], act, h_mlp);
    }
    auto out = at::empty_like(h);   // returned: a fresh tensor, never a buffer
    add_rms_norm(out, sums[cur], h, res, final_norm_, eps_);
    return out;
}

}  // namespace tokenmill
