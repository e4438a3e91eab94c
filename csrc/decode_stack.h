// One decode step through every layer of a Llama-family model in C++ (tokenmill/worker/cpu_decode.py).
#pragma once

#include "common.h"

namespace tokenmill {

at::Tensor decode_stack(at::Tensor h, const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& tables,
                        const at::Tensor& seq_lens, const at::Tensor& cos_sin, at::TensorList t, c10::IntArrayRef kinds,
                        c10::IntArrayRef groups, const at::Tensor& final_norm, int64_t nh, int64_t nkv, int64_t d,
                        double eps, double scale);

}  // namespace tokenmill
