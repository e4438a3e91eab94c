// The decoder layers of a model as one C++ loop (tokenmill/worker/cpu_decode.py): the layer the module path
// defines (models/llama.py's LlamaDecoderLayer.forward; Qwen3's QK-norm, models/qwen3.py; Gemma 3's four norms,
// GeGLU, two RoPE bases and sliding windows, models/gemma3.py), described as data by the model's DecoderLayout
// (models/interface.py), with each linear described by its method's kernel (layers/linear.py, LinearKernel)
// instead of a module call.
#pragma once

#include "common.h"

#include <torch/custom_class.h>

namespace tokenmill {

// How one linear runs; the numbers are layers/linear.py's KernelKind.
enum class LinearKind : int64_t { dense = 0, int4_tinygemm = 1, int4_k64 = 2, int8 = 3, gguf = 4 };

struct StackLinear {
    LinearKind kind;
    at::Tensor weight;                 // dense: [N, K]; quantized: the packed codes
    std::optional<at::Tensor> aux;     // dense: the VNNI copy; int4: scales_and_zeros; int8: scales [N]
    std::optional<at::Tensor> extra;   // dense: oneDNN's prepacked copy; int8: offsets [N]
    std::optional<at::Tensor> bias;    // dense and gguf only
    int64_t group;                     // int4: the group size
    int64_t out_features;
    std::vector<at::Tensor> parts;     // gguf: each part packed (gguf_layout.h), filling the output columns in order
    std::vector<int64_t> types;        // gguf: each part's ggml type
};

// The MLP's gate activation; the numbers are models/interface.py's MlpActivation.
enum class MlpActivation : int64_t { silu = 0, gelu_tanh = 1 };

// One layer: models/interface.py's DecoderLayerParts. The optional norms are the families' differences as data:
// q_norm / k_norm [head_dim] (Qwen3, Gemma 3: QK-norm of each head before RoPE); attn_out_norm / mlp_out_norm
// [hidden] (Gemma 3: a norm of each sublayer's output before it joins the residual).
struct StackLayer {
    at::Tensor in_norm, mlp_norm, k_cache, v_cache;
    std::optional<at::Tensor> attn_out_norm, mlp_out_norm, q_norm, k_norm;
    int64_t kv_group;                  // the KV-cache group whose slots, tables and window this layer's attention reads
    int64_t rope;                      // its RoPE table, an index into the stack's cos_sin tables
    std::vector<StackLinear> linears;  // qkv, o, gate_up, down
};

// A step's long prompt chunks for the tiled prefill kernel (attention.h, paged_prefill), built by
// worker/cpu_decode.py from attention/backend.py's TiledPlan: the same plan the module path runs.
struct TiledPrompts : torch::CustomClassHolder {
    at::Tensor block_tables, seq_lens, q_start, q_len;   // [num_long, max_blocks], then [num_long] each
    std::optional<at::Tensor> short_idx;                  // [num_short] rows attended token by token
    TiledPrompts(at::Tensor block_tables, at::Tensor seq_lens, at::Tensor q_start, at::Tensor q_len,
                 std::optional<at::Tensor> short_idx)
        : block_tables(std::move(block_tables)), seq_lens(std::move(seq_lens)), q_start(std::move(q_start)),
          q_len(std::move(q_len)), short_idx(std::move(short_idx)) {}
};

class DecodeStack : public torch::CustomClassHolder {
  public:
    // cos_sin: one [max_position, head_dim] float32 table per RoPE base (Gemma 3: global and local layers');
    // activation: an MlpActivation; unit_offset_norms: every norm weight applies as 1 + w (Gemma).
    DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                std::vector<at::Tensor> cos_sin, at::Tensor final_norm, int64_t activation, bool unit_offset_norms);
    // Appends a layer; its four linears follow with add_linear, in the order qkv, o, gate_up, down.
    void add_layer(at::Tensor in_norm, at::Tensor mlp_norm, std::optional<at::Tensor> attn_out_norm,
                   std::optional<at::Tensor> mlp_out_norm, std::optional<at::Tensor> q_norm,
                   std::optional<at::Tensor> k_norm, at::Tensor k_cache, at::Tensor v_cache, int64_t kv_group,
                   int64_t rope);
    void add_linear(int64_t kind, at::Tensor weight, std::optional<at::Tensor> aux, std::optional<at::Tensor> extra,
                    std::optional<at::Tensor> bias, int64_t group, int64_t out_features);
    // A GGUF linear, its parts packed (gguf_quant.h), in place of an add_linear call.
    void add_gguf_linear(std::vector<at::Tensor> parts, std::vector<int64_t> types, std::optional<at::Tensor> bias,
                         int64_t out_features);
    int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
    // h [n, hidden] embedded tokens -> final-normed hidden states [n, hidden]. Per KV-cache group g (one list
    // entry each, a layer reads its kv_group's): K/V written at slots[g] [n]; every token attends as a decode
    // over its own prefix (tables[g] [n, max_blocks], seq_lens [n]), from key key_start[g] [n] on where the
    // group has a sliding window (None: from key 0); key_mask [n] (token trees, or None): keys each token must
    // not see (attention.h).
    // With `tiled` (a step with long prompt chunks, bf16 on AVX512-BF16; one group only): those chunks' rows
    // attend through the tiled prefill kernel, and tables / seq_lens / key_mask describe only the other rows,
    // tiled.short_idx in order (empty tensors and no short_idx when there are none).
    // With `taps` [n, len(tap_layers) * hidden] (models/interface.py's LayerTaps): the residual stream after layer
    // tap_layers[j] (the module path's layer output) is written to columns j * hidden .. (j + 1) * hidden.
    at::Tensor forward(at::Tensor h, const at::Tensor& positions, const std::vector<at::Tensor>& slots,
                       const std::vector<at::Tensor>& tables, const at::Tensor& seq_lens,
                       const std::optional<at::Tensor>& key_mask, const c10::List<std::optional<at::Tensor>>& key_start,
                       const std::optional<c10::intrusive_ptr<TiledPrompts>>& tiled,
                       const std::optional<at::Tensor>& taps, const std::vector<int64_t>& tap_layers) const;

  private:
    int64_t nh_, nkv_, d_;
    double eps_, scale_;
    std::vector<at::Tensor> cos_sin_;
    at::Tensor final_norm_;
    MlpActivation activation_;
    bool unit_offset_;
    int64_t num_groups_ = 0;           // 1 + the largest kv_group of a layer
    std::vector<StackLayer> layers_;
};

}  // namespace tokenmill
