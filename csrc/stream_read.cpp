// A streaming read of a float32 buffer for the roofline benchmark (tokenmill/bench/roofline.py).
#include "misc.h"

namespace tokenmill {

#include "isa/avx512_begin.h"

// The sum of 64-float chunks [b, e) with four independent accumulators (so the loads cannot be elided).
static double sum_chunks_avx512(const float* p, int64_t b, int64_t e) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = b; i < e; ++i) {
        const float* q = p + i * 64;
        a0 = _mm512_add_ps(a0, _mm512_loadu_ps(q));
        a1 = _mm512_add_ps(a1, _mm512_loadu_ps(q + 16));
        a2 = _mm512_add_ps(a2, _mm512_loadu_ps(q + 32));
        a3 = _mm512_add_ps(a3, _mm512_loadu_ps(q + 48));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

#include "isa/avx512_end.h"

double stream_read(const at::Tensor& x) {
    TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat, "stream_read: contiguous float32");
    const float* p = x.data_ptr<float>();
    const int64_t n = x.numel();
    const bool vec = cpu_has_avx512();
    std::vector<double> part(at::get_num_threads() + 1, 0.0);
    at::parallel_for(0, n / 64, 4096, [&](int64_t b, int64_t e) {
        double s = 0.0;
        if (vec) s = sum_chunks_avx512(p, b, e);
        else for (int64_t i = b * 64; i < e * 64; ++i) s += p[i];
        part[at::get_thread_num()] += s;
    });
    double t = 0.0;
    for (double v : part) t += v;
    return t;
}

}  // namespace tokenmill
