// Small kernels: the sampler's argmax and the roofline benchmark's streaming read.
#pragma once

#include "common.h"

namespace tokenmill {

at::Tensor argmax_rows(const at::Tensor& x);   // logits [M, N] float32 -> [M] int64, as torch.argmax(-1)
double stream_read(const at::Tensor& x);       // the sum of a float32 buffer, read once

}  // namespace tokenmill
