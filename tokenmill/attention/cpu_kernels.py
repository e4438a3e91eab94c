"""A small C++ kernel for decode attention over paged KV blocks on CPU.

Why: the reference decode path gathers every decode's blocks into a contiguous
[B, max_len, Hkv, D] copy (written, then read again by SDPA), and CPU SDPA with a mask is
slow for 3-row queries. This kernel reads each request's K and V once, straight from the
blocks, with one task per (request, KV head) on torch's intra-op thread pool:

    for each (b, h) in parallel:                 h: KV head; its G = Hq / Hkv query heads
        s[g, t] = scale * <q[b, h*G + g], K[block_tables[b, t // bs], t % bs, h]>   t < seq_lens[b]
        p[g, :] = softmax(s[g, :])               (float32)
        out[b, h*G + g] = sum_t p[g, t] * V[...same slot..., h]

Built on first use with torch.utils.cpp_extension.load_inline (cached on disk, ~1 min the
first time on 2 cores). If there is no compiler, the build fails, or TOKENMILL_NO_CPP_KERNELS=1
is set, `paged_decode_attention` returns None and callers keep the pure PyTorch path.
Covered by an exact-oracle test against the reference path (tests/attention).
"""
from __future__ import annotations

import logging
import os
import threading

import torch

logger = logging.getLogger("tokenmill")

_CPP_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>
#include <cmath>
#include <algorithm>
#include <cstring>

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }
template <>
inline float to_f<at::BFloat16>(at::BFloat16 x) {
    uint32_t bits = static_cast<uint32_t>(x.x) << 16;
    float f; std::memcpy(&f, &bits, sizeof(f)); return f;
}

template <typename scalar_t, int DC>
static void decode_impl(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                        torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
    // q, out: [B, Hq, D] contiguous; k/v_cache: [num_blocks, bs, Hkv, D] (strided views ok:
    // the innermost three dims must be contiguous); block_tables [B, nb] int64; seq_lens [B] int64.
    const int64_t B = q.size(0), Hq = q.size(1), D = DC > 0 ? DC : q.size(2);
    const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
    const int64_t G = Hq / Hkv;
    const int64_t kb_stride = k_cache.stride(0), vb_stride = v_cache.stride(0);
    const int64_t tok_stride = Hkv * D;
    const int64_t nb_max = block_tables.size(1);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    const int64_t* tp = block_tables.data_ptr<int64_t>();
    const int64_t* sp = seq_lens.data_ptr<int64_t>();
    const float fscale = static_cast<float>(scale);
    // Tasks: one request (all KV heads: token rows are read contiguously) when there are
    // enough requests to fill the threads, else one (request, KV head) pair.
    const int64_t hpt = B >= 2 * at::get_num_threads() ? Hkv : 1;   // KV heads per task
    const int64_t tasks_per_b = Hkv / hpt;
    // Small calls (e.g. one short sequence) run on the calling thread: a parallel region costs
    // more than it saves there, and much more when the cores are shared with other processes.
    int64_t total_tokens = 0;
    for (int64_t b = 0; b < B; ++b) total_tokens += sp[b];
    const int64_t num_tasks = B * tasks_per_b;
    const int64_t grain = total_tokens * Hq * D < (int64_t(1) << 20) ? num_tasks : 1;
    at::parallel_for(0, num_tasks, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> qf(Hkv * G * D), acc(Hkv * G * D), s;
        float kf[512];
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = task / tasks_per_b, h0 = (task % tasks_per_b) * hpt;
            const int64_t L = sp[b];
            const int64_t R = hpt * G;   // query rows handled by this task
            s.assign(R * L, 0.f);
            for (int64_t r = 0; r < R; ++r)
                for (int64_t d = 0; d < D; ++d)
                    qf[r * D + d] = to_f(qp[(b * Hq + h0 * G + r) * D + d]) * fscale;
            // pass 1: scores
            for (int64_t t = 0; t < L; ++t) {
                const int64_t blk = tp[b * nb_max + t / bs];
                const scalar_t* kr = kp + blk * kb_stride + (t % bs) * tok_stride + h0 * D;
                for (int64_t hh = 0; hh < hpt; ++hh) {
                    for (int64_t d = 0; d < D; ++d) kf[d] = to_f(kr[hh * D + d]);
                    for (int64_t g = 0; g < G; ++g) {
                        const int64_t r = hh * G + g;
                        const float* qg = qf.data() + r * D;
                        float acc_s = 0.f;
                        #pragma omp simd reduction(+:acc_s)
                        for (int64_t d = 0; d < D; ++d) acc_s += qg[d] * kf[d];
                        s[r * L + t] = acc_s;
                    }
                }
            }
            // softmax per query row
            for (int64_t r = 0; r < R; ++r) {
                float* sr = s.data() + r * L;
                float m = -INFINITY;
                for (int64_t t = 0; t < L; ++t) m = std::max(m, sr[t]);
                float sum = 0.f;
                for (int64_t t = 0; t < L; ++t) { sr[t] = std::exp(sr[t] - m); sum += sr[t]; }
                const float inv = sum > 0.f ? 1.f / sum : 0.f;
                for (int64_t t = 0; t < L; ++t) sr[t] *= inv;
            }
            // pass 2: weighted sum of values
            std::fill(acc.begin(), acc.begin() + R * D, 0.f);
            for (int64_t t = 0; t < L; ++t) {
                const int64_t blk = tp[b * nb_max + t / bs];
                const scalar_t* vr = vp + blk * vb_stride + (t % bs) * tok_stride + h0 * D;
                for (int64_t hh = 0; hh < hpt; ++hh) {
                    for (int64_t d = 0; d < D; ++d) kf[d] = to_f(vr[hh * D + d]);
                    for (int64_t g = 0; g < G; ++g) {
                        const int64_t r = hh * G + g;
                        const float w = s[r * L + t];
                        float* ar = acc.data() + r * D;
                        #pragma omp simd
                        for (int64_t d = 0; d < D; ++d) ar[d] += w * kf[d];
                    }
                }
            }
            for (int64_t r = 0; r < R; ++r)
                for (int64_t d = 0; d < D; ++d)
                    op[(b * Hq + h0 * G + r) * D + d] = static_cast<scalar_t>(acc[r * D + d]);
        }
    });
}

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
    TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "q/out must be contiguous");
    TORCH_CHECK(q.size(2) <= 512, "head_dim > 512");
    TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
                k_cache.stride(1) == k_cache.size(2) * k_cache.size(3), "k_cache inner dims must be contiguous");
    TORCH_CHECK(v_cache.stride(3) == 1 && v_cache.stride(2) == v_cache.size(3) &&
                v_cache.stride(1) == v_cache.size(2) * v_cache.size(3), "v_cache inner dims must be contiguous");
    const int64_t D = q.size(2);
    if (q.scalar_type() == at::kFloat) {
        if (D == 64) decode_impl<float, 64>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
        else if (D == 128) decode_impl<float, 128>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
        else decode_impl<float, 0>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
    } else if (q.scalar_type() == at::kBFloat16) {
        if (D == 64) decode_impl<at::BFloat16, 64>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
        else if (D == 128) decode_impl<at::BFloat16, 128>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
        else decode_impl<at::BFloat16, 0>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
    } else {
        TORCH_CHECK(false, "paged_decode: unsupported dtype");
    }
}
"""

_CPP_DECL = ("void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, "
             "torch::Tensor block_tables, torch::Tensor seq_lens, double scale);")

_lock = threading.Lock()
_module = None
_failed = False


def _load():
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        if os.environ.get("TOKENMILL_NO_CPP_KERNELS") == "1":
            _failed = True
            return None
        try:
            from torch.utils.cpp_extension import load_inline
            _module = load_inline(name="tokenmill_cpu_kernels_v4", cpp_sources=[_CPP_DECL, _CPP_SOURCE],
                                  functions=["paged_decode"], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                  extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as e:  # no compiler, no headers, ...: keep the reference path
            logger.warning("C++ decode-attention kernel unavailable (%s); using the PyTorch path", e)
            _failed = True
    return _module


def is_available() -> bool:
    return _load() is not None


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """q [B, Hq, D]; kv_cache [2, num_blocks, bs, Hkv, D]; block_tables [B, nb] int64; seq_lens [B]
    int64 -> [B, Hq, D], or None when the kernel cannot serve this call (caller falls back)."""
    if (q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16) or kv_cache.dtype != q.dtype
            or kv_cache.shape[-1] != q.shape[-1]):
        return None
    mod = _load()
    if mod is None:
        return None
    q = q.contiguous()
    out = torch.empty_like(q)
    mod.paged_decode(out, q, kv_cache[0], kv_cache[1], block_tables.contiguous(), seq_lens.contiguous(), scale)
    return out
