// RMSNorm as transformers' LlamaRMSNorm and Gemma's RMSNorm compute it, in one pass per row:
// float32 on every build (AVX2 or AVX-512, vectorized by the compiler), bfloat16 on x86 CPUs with
// AVX512-BF16.
//
// Why: the module's code is element-wise passes over [tokens, hidden] (square, mean, rsqrt,
// multiply, times the weight; in bfloat16 also the casts to fp32 and back), about 6% of
// SmolLM2-135M's time in bfloat16 on two Zen 4 cores; in float32 on two Zen 3 cores 2% (0.24 s of
// a 12 s pass), 0.8% here. Gemma's, six norms a layer in Gemma 3 (EmbeddingGemma), took 55% of a
// bfloat16 pass of EmbeddingGemma-300m's shape on two AMX Xeon cores. Each row is read twice and
// written once.
//
// Numerics are the module's: in fp32, x * (1 / sqrt(mean(x^2) + eps)), then times the weight; in
// bfloat16 Llama's product x * scale is rounded to bf16 (round to nearest even, as torch's casts),
// then times the bf16 weight in fp32 and rounded again. Gemma's (unit_offset) multiplies by
// (1 + weight) in fp32 and rounds once, at the end. Only the order of the sum of squares differs
// from torch's reduction.
//
// Layout: x [rows, hidden] contiguous, weight [hidden], out shaped like x, all of one dtype.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include "kernel_common.h"

#include <cmath>
#include <cstdint>

namespace {

#ifdef __AVX512BF16__
using poolrunner_cpu::kLanes, poolrunner_cpu::lanes, poolrunner_cpu::load, poolrunner_cpu::rounded,
    poolrunner_cpu::to_bf16;

void normalize_row(const c10::BFloat16* x, const c10::BFloat16* weight, c10::BFloat16* out, int64_t hidden,
                   float eps, bool unit_offset) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t d = 0; d < hidden; d += kLanes) {
    const __m512 v = load(x + d, lanes(hidden - d));
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(hidden);
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t d = 0; d < hidden; d += kLanes) {
    const __mmask16 m = lanes(hidden - d);
    const __m512 y = _mm512_mul_ps(load(x + d, m), scale);
    const __m512 w = load(weight + d, m);
    const __m512 product = unit_offset ? _mm512_mul_ps(y, _mm512_add_ps(one, w)) : _mm512_mul_ps(w, rounded(y));
    _mm256_mask_storeu_epi16(out + d, m, to_bf16(product));
  }
}
#endif  // __AVX512BF16__

void normalize_row(const float* x, const float* weight, float* out, int64_t hidden, float eps, bool unit_offset) {
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t d = 0; d < hidden; ++d) squares += x[d] * x[d];
  const float scale = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + eps);
  if (unit_offset) {
#pragma omp simd
    for (int64_t d = 0; d < hidden; ++d) out[d] = (x[d] * scale) * (1.0f + weight[d]);
  } else {
#pragma omp simd
    for (int64_t d = 0; d < hidden; ++d) out[d] = weight[d] * (x[d] * scale);
  }
}

template <typename T>
void normalize_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out, double eps,
                    bool unit_offset) {
  const int64_t hidden = x.size(-1);
  const int64_t rows = hidden == 0 ? 0 : x.numel() / hidden;
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      normalize_row(xp + r * hidden, wp, op + r * hidden, hidden, static_cast<float>(eps), unit_offset);
    }
  });
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out, double eps, bool unit_offset) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && out.device().is_cpu(), "rms_norm runs on the CPU");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(weight.scalar_type() == dtype && out.scalar_type() == dtype,
              "rms_norm takes x, weight and out of one dtype");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(),
              "rms_norm needs contiguous tensors");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && out.sizes() == x.sizes(),
              "weight must be [hidden] and out shaped like x");
  poolrunner_cpu::by_dtype(dtype, "rms_norm", [&](auto tag) {
    normalize_rows<decltype(tag)>(x, weight, out, eps, unit_offset);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(poolrunner_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, Tensor(a!) out, float eps, bool unit_offset) -> ()");
}

TORCH_LIBRARY_IMPL(poolrunner_cpu, CPU, m) { m.impl("rms_norm", &rms_norm); }
