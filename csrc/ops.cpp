// The one registration of tokenmill's C++ kernels: each op's schema (arguments written in place are
// marked `(a!)`), under the `tokenmill` namespace (torch.ops.tokenmill.<name>), and the module
// tokenmill._C, which loads them and reports the instruction sets chosen at run time.
#include <torch/extension.h>
#include <torch/library.h>

#include "attention.h"
#include "common.h"
#include "decode_stack.h"
#include "fused_ops.h"
#include "gguf_quant.h"
#include "linear.h"
#include "misc.h"
#include "quant.h"

#ifndef TOKENMILL_SOURCE_HASH
#define TOKENMILL_SOURCE_HASH "unknown"
#endif

TORCH_LIBRARY(tokenmill, m) {
    // layers/fused_ops.py
    m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor w, float eps) -> ()", &tokenmill::rms_norm);
    m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) sum, Tensor x, Tensor r, Tensor w, float eps) -> ()",
          &tokenmill::add_rms_norm);
    m.def("rope_inplace(Tensor(a!) qk, int n_heads, int head_dim, Tensor cos_sin, Tensor pos) -> ()",
          &tokenmill::rope_inplace);
    m.def("silu_mul(Tensor(a!) out, Tensor x) -> ()", &tokenmill::silu_mul);
    m.def("rms_norm_unit_offset(Tensor(a!) out, Tensor x, Tensor w, float eps) -> ()", &tokenmill::rms_norm_unit_offset);
    m.def("head_rms_norm_inplace(Tensor(a!) qk, int n_heads, int head_dim, Tensor w, float eps, bool unit_offset) -> ()",
          &tokenmill::head_rms_norm_inplace);
    m.def("gelu_tanh_mul(Tensor(a!) out, Tensor x) -> ()", &tokenmill::gelu_tanh_mul);
    m.def("linear_bf16_small(Tensor(a!) y, Tensor x, Tensor w, Tensor? bias) -> bool", &tokenmill::linear_bf16_small);
    m.def("linear_bf16_vnni(Tensor(a!) y, Tensor x, Tensor wv, Tensor? bias) -> bool", &tokenmill::linear_bf16_vnni);
    m.def("linear_f32_small(Tensor(a!) y, Tensor x, Tensor w) -> bool", &tokenmill::linear_f32_small);
    m.def("linear_bf16_avx2(Tensor(a!) y, Tensor x, Tensor w, Tensor? bias) -> bool", &tokenmill::linear_bf16_avx2);
    m.def("linear_bf16_amx(Tensor(a!) y, Tensor x, Tensor wv, Tensor? bias) -> bool", &tokenmill::linear_bf16_amx);
    // layers/linear.py: the dense linear's kernel rule (linear.h), shared with DecodeStack
    m.def("dense_linear(Tensor x, Tensor w, Tensor? vnni, Tensor? packed, Tensor? bias) -> Tensor",
          &tokenmill::dense_linear);
    // attention/cpu_kernels.py
    m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
          "Tensor seq_lens, float scale, Tensor? key_mask=None, Tensor? key_start=None) -> ()", &tokenmill::paged_decode);
    m.def("write_and_decode(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor slots, Tensor(b!) k_cache, "
          "Tensor(c!) v_cache, Tensor block_tables, Tensor seq_lens, float scale, Tensor? key_mask=None, "
          "Tensor? key_start=None) -> ()",
          &tokenmill::write_and_decode);
    m.def("paged_prefill(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
          "Tensor seq_lens, Tensor q_start, Tensor q_len, float scale) -> bool", &tokenmill::paged_prefill);
    // quant/cpu_int4.py
    m.def("int4_linear(Tensor(a!) y, Tensor x, Tensor qweight, Tensor sz, Tensor? bias, int gs) -> bool",
          &tokenmill::int4_linear);
    m.def("int8_linear(Tensor(a!) y, Tensor x, Tensor qweight, Tensor scales, Tensor? offsets) -> bool",
          &tokenmill::int8_linear);
    // quant/gguf.py
    m.def("gguf_linear(Tensor(a!) y, Tensor x, Tensor[] parts, int[] types) -> bool", &tokenmill::gguf_linear);
    m.def("gguf_pack(Tensor blocks, int type) -> Tensor", &tokenmill::gguf_pack);
    m.def("gguf_dequantize_rows(Tensor(a!) out, Tensor packed, int type, Tensor rows) -> ()",
          &tokenmill::gguf_dequantize_rows);
    // worker/cpu_decode.py: the layer loop as an object built once at load (decode_stack.h); the KV
    // caches it was given are written by forward
    m.class_<tokenmill::TiledPrompts>("TiledPrompts")
        .def(torch::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>>());
    m.class_<tokenmill::DecodeStack>("DecodeStack")
        .def(torch::init<int64_t, int64_t, int64_t, double, double, std::vector<at::Tensor>, at::Tensor, int64_t, bool>())
        .def("add_layer", &tokenmill::DecodeStack::add_layer)
        .def("add_linear", &tokenmill::DecodeStack::add_linear)
        .def("add_gguf_linear", &tokenmill::DecodeStack::add_gguf_linear)
        .def("num_layers", &tokenmill::DecodeStack::num_layers)
        .def("forward", &tokenmill::DecodeStack::forward);
    // layers/sampler.py, bench/roofline.py
    m.def("argmax_rows(Tensor x) -> Tensor", &tokenmill::argmax_rows);
    m.def("stream_read(Tensor x) -> float", &tokenmill::stream_read);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "tokenmill's C++ kernels; the ops themselves are torch.ops.tokenmill.*";
    m.def("detected_isa", [] { return std::string(tokenmill::isa_name(tokenmill::detected_isa())); },
          "The instruction sets this CPU and OS support: generic, avx512, avx512_bf16 or amx.");
    m.def("isa", [] { return std::string(tokenmill::isa_name(tokenmill::current_isa())); },
          "The instruction sets the kernels use now: the detected ones, capped by TOKENMILL_ISA / set_max_isa.");
    m.def("set_max_isa", [](const std::string& name) {
              return std::string(tokenmill::isa_name(tokenmill::set_max_isa(tokenmill::isa_from_name(name))));
          }, "Caps the instruction sets the kernels may use (tests run the generic paths so); returns the old cap.");
    m.def("decode_kernel", [](const at::Tensor& q, const at::Tensor& k_cache, bool windowed) {
              return std::string(tokenmill::decode_kernel_name(tokenmill::decode_kernel(q, k_cache, windowed)));
          }, "The loop paged_decode runs for q [B, Hq, D] and a k_cache [nb, bs, Hkv, D] (windowed: with key_start) "
             "at the level in force: generic, avx2, avx512 or avx512_bf16.");
    m.def("gguf_kernel", [] { return std::string(tokenmill::gguf_kernel_name()); },
          "The GGUF integer kernel at the level in force: avx512_vnni, avx2, or none (below AVX2: dequantize).");
    m.def("int_kernel", [] { return std::string(tokenmill::int_kernel_name()); },
          "The int4 (k64) / int8 weight-only kernel at the level in force: avx512_bf16, avx2, or none.");
    m.attr("source_hash") = TOKENMILL_SOURCE_HASH;
}
