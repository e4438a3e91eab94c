// The dense linear's kernel rule (linear.h): one function for every caller, so a row's result does not
// depend on which forward (module path or C++ layer loop) computed it.
#include "linear.h"

#include "fused_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace tokenmill {

static at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
    static auto op = c10::Dispatcher::singleton()
        .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                          c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
    c10::List<std::optional<at::Scalar>> scalars;
    scalars.push_back(std::nullopt);
    return op.call(x, packed, bias, "none", scalars, std::nullopt);
}

at::Tensor dense_linear_into(at::Tensor y, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& vnni,
                             const std::optional<at::Tensor>& packed, const std::optional<at::Tensor>& bias) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "dense_linear: x must be a contiguous [M, K] tensor");
    const int64_t m = x.size(0), n = w.size(0);
    const bool bf16 = x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16;
    const bool has_vnni = vnni.has_value() && vnni->defined() && vnni->numel();
    if (bf16 && has_vnni) {
        if (cpu_has_amx() && linear_bf16_amx(y, x, *vnni, bias)) return y;
        if (m >= 1 && m <= kSmallLinearMaxRows && linear_bf16_vnni(y, x, *vnni, bias)) return y;
    }
    if (x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && m == 1 && !bias.has_value()
            && w.is_contiguous() && linear_f32_small(y, x, w)) {
        return y;
    }
    if (bf16 && m <= kSmallLinearMaxRows && (m == 1 || m * n <= kSmallLinearMaxOutputs) && w.is_contiguous()
            && linear_bf16_small(y, x, w, bias)) {
        return y;
    }
    if (bf16 && packed.has_value() && packed->defined() && packed->numel()) return onednn_linear(x, *packed, bias);
    if (bf16 && w.is_contiguous() && linear_bf16_avx2(y, x, w, bias)) return y;
    return at::linear(x, w, bias);
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& vnni,
                        const std::optional<at::Tensor>& packed, const std::optional<at::Tensor>& bias) {
    auto xc = x.contiguous();
    return dense_linear_into(at::empty({xc.size(0), w.size(0)}, xc.options()), xc, w, vnni, packed, bias);
}

}  // namespace tokenmill
