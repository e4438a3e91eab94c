// The decoder layer loop in C++ (decode_stack.h). Per layer, as LlamaDecoderLayer.forward (and the other
// families' layers, whose differences are the bracketed steps, present where the layer has them):
//   x, res = norm(h)  or  add_norm(h, res)          the residual carried between layers
//   qkv = linear(x); [q_norm, k_norm per head]; rope(qkv) in place with the layer's table
//   write k, v at its group's slots and attend (one call; from key_start where the group has a window)
//   h = o(attn); [h = attn_out_norm(h)]; x, res = add_norm(h, res)
//   h = down(act(gate_up(x))), act silu_mul or gelu_tanh_mul; [h = mlp_out_norm(h)]
// and finally add_norm(h, res) with the final norm. With unit-offset norms (Gemma) every norm weighs by 1 + w
// and add_norm is the residual add (one rounding, as the module path's `h + x`) then that norm. A step with long prompt chunks may attend them tiled
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
                         std::vector<at::Tensor> cos_sin, at::Tensor final_norm, int64_t activation,
                         bool unit_offset_norms)
    : nh_(num_heads), nkv_(num_kv_heads), d_(head_dim), eps_(eps), scale_(scale), cos_sin_(std::move(cos_sin)),
      final_norm_(std::move(final_norm)), activation_(static_cast<MlpActivation>(activation)),
      unit_offset_(unit_offset_norms) {
    TORCH_CHECK(activation == 0 || activation == 1, "DecodeStack: unknown MLP activation ", activation);
    TORCH_CHECK(!cos_sin_.empty(), "DecodeStack: at least one RoPE table");
}

void DecodeStack::add_layer(at::Tensor in_norm, at::Tensor mlp_norm, std::optional<at::Tensor> attn_out_norm,
                            std::optional<at::Tensor> mlp_out_norm, std::optional<at::Tensor> q_norm,
                            std::optional<at::Tensor> k_norm, at::Tensor k_cache, at::Tensor v_cache, int64_t kv_group,
                            int64_t rope) {
    if (!layers_.empty()) TORCH_CHECK(layers_.back().linears.size() == 4, "DecodeStack: a layer takes 4 linears");
    TORCH_CHECK(rope >= 0 && rope < static_cast<int64_t>(cos_sin_.size()), "DecodeStack: no RoPE table ", rope);
    TORCH_CHECK(kv_group >= 0, "DecodeStack: a negative KV-cache group");
    for (const auto* w : {&q_norm, &k_norm})
        TORCH_CHECK(!w->has_value() || (*w)->numel() == d_, "DecodeStack: a QK-norm weight is [head_dim]");
    num_groups_ = std::max(num_groups_, kv_group + 1);
    layers_.push_back({std::move(in_norm), std::move(mlp_norm), std::move(k_cache), std::move(v_cache),
                       std::move(attn_out_norm), std::move(mlp_out_norm), std::move(q_norm), std::move(k_norm),
                       kv_group, rope, {}});
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

at::Tensor DecodeStack::forward(at::Tensor h, const at::Tensor& positions, const std::vector<at::Tensor>& slots,
                                const std::vector<at::Tensor>& tables, const at::Tensor& seq_lens,
                                const std::optional<at::Tensor>& key_mask,
                                const c10::List<std::optional<at::Tensor>>& key_start,
                                const std::optional<c10::intrusive_ptr<TiledPrompts>>& tiled,
                                const std::optional<at::Tensor>& taps, const std::vector<int64_t>& tap_layers) const {
    TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() == 4, "DecodeStack: incomplete layers");
    const auto groups = static_cast<size_t>(num_groups_);
    TORCH_CHECK(slots.size() == groups && tables.size() == groups && key_start.size() == groups,
                "DecodeStack: slots, tables and key_start take one entry per KV-cache group (", num_groups_, ")");
    TORCH_CHECK(!tiled.has_value() || num_groups_ == 1, "DecodeStack: tiled prompts with one KV-cache group only");
    const int64_t n = h.size(0), q_size = nh_ * d_, kv_size = nkv_ * d_;
    const int64_t hidden = h.size(1);
    std::vector<int64_t> tap_column(layers_.size(), -1);   // layer -> its slot in taps, or -1
    if (taps.has_value()) {
        TORCH_CHECK(taps->dim() == 2 && taps->size(0) == n &&
                        taps->size(1) == static_cast<int64_t>(tap_layers.size()) * hidden &&
                        taps->scalar_type() == h.scalar_type(),
                    "DecodeStack: taps must be [n, len(tap_layers) * hidden] in the activations' dtype");
        for (size_t j = 0; j < tap_layers.size(); ++j) {
            TORCH_CHECK(tap_layers[j] >= 0 && tap_layers[j] < static_cast<int64_t>(layers_.size()),
                        "DecodeStack: tap layer ", tap_layers[j], " out of range");
            tap_column[static_cast<size_t>(tap_layers[j])] = static_cast<int64_t>(j);
        }
    }
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
    // The norms as the module path's: Llama's RMSNorm (w * cast(x / rms), the residual add fused into the same
    // kernel), or Gemma's (x / rms * (1 + w) in float32; the residual add a plain rounded add before it).
    auto norm = [&](at::Tensor out, const at::Tensor& in, const at::Tensor& w) {
        if (unit_offset_) rms_norm_unit_offset(out, in, w, eps_);
        else rms_norm(out, in, w, eps_);
    };
    auto add_norm = [&](at::Tensor out, at::Tensor sum, const at::Tensor& in, const at::Tensor& r, const at::Tensor& w) {
        if (!unit_offset_) return add_rms_norm(out, sum, in, r, w, eps_);
        at::add_out(sum, r, in);
        rms_norm_unit_offset(out, sum, w, eps_);
    };
    at::Tensor res;
    int cur = 0;
    for (size_t l = 0; l < layers_.size(); ++l) {
        const StackLayer& L = layers_[l];
        const auto g = static_cast<size_t>(L.kv_group);
        if (l == 0) { norm(x, h, L.in_norm); res = h; }
        else { add_norm(x, sums[cur], h, res, L.in_norm); res = sums[cur]; cur ^= 1; }
        auto qkv = run_linear(L.linears[0], x, qkv_buf);
        if (L.q_norm.has_value()) head_rms_norm_inplace(qkv, nh_, d_, *L.q_norm, eps_, unit_offset_);
        if (L.k_norm.has_value())
            head_rms_norm_inplace(qkv.narrow(1, q_size, kv_size), nkv_, d_, *L.k_norm, eps_, unit_offset_);
        rope_inplace(qkv, nh_ + nkv_, d_, cos_sin_[L.rope], positions);
        auto q = qkv.narrow(1, 0, q_size).view({n, nh_, d_});
        auto k = qkv.narrow(1, q_size, kv_size).view({n, nkv_, d_});
        auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, nkv_, d_});
        if (tiled.has_value()) {   // as the module path's attention (attention/backend.py) runs a tiled plan
            const TiledPrompts& t = **tiled;
            write_kv(k, v, slots[g], L.k_cache, L.v_cache);
            TORCH_CHECK(paged_prefill(o, q, L.k_cache, L.v_cache, t.block_tables, t.seq_lens, t.q_start, t.q_len, scale_),
                        "DecodeStack: the tiled prefill kernel does not serve this model or CPU");
            if (t.short_idx.has_value()) {
                auto qs = q.index_select(0, *t.short_idx);
                auto os = at::empty_like(qs);
                paged_decode(os, qs, L.k_cache, L.v_cache, tables[g], seq_lens, scale_, key_mask, std::nullopt);
                o.index_copy_(0, *t.short_idx, os);
            }
        } else {
            write_and_decode(o, q, k, v, slots[g], L.k_cache, L.v_cache, tables[g], seq_lens, scale_, key_mask,
                             key_start.get(g));
        }
        h = run_linear(L.linears[1], o_flat, h_attn);
        if (L.attn_out_norm.has_value()) norm(h, h, *L.attn_out_norm);   // in place: a row is read before written
        add_norm(x, sums[cur], h, res, L.mlp_norm);
        res = sums[cur];
        cur ^= 1;
        auto gu = run_linear(L.linears[2], x, gu_buf);
        if (activation_ == MlpActivation::gelu_tanh) gelu_tanh_mul(act, gu);
        else silu_mul(act, gu);
        h = run_linear(L.linears[3], act, h_mlp);
        if (L.mlp_out_norm.has_value()) norm(h, h, *L.mlp_out_norm);
        if (tap_column[l] >= 0) {   // the layer's output, res + h, as the module path's layer returns it
            auto slot = taps->narrow(1, tap_column[l] * hidden, hidden);
            at::add_out(slot, res, h);
        }
    }
    auto out = at::empty_like(h);   // returned: a fresh tensor, never a buffer
    add_norm(out, sums[cur], h, res, final_norm_);
    return out;
}

}  // namespace tokenmill
