// RMSNorm as transformers' LlamaRMSNorm computes it, in one pass per row, for bfloat16 on x86
// CPUs with AVX512-BF16.
//
// Why: the module's code is seven element-wise passes over [tokens, hidden] (to fp32, square,
// mean, rsqrt, multiply, back to bf16, times the weight), about 6% of SmolLM2-135M's time on
// two Zen 4 cores. Here each row is read twice and written once.
//
// Numerics are the module's: in fp32, x * (1 / sqrt(mean(x^2) + eps)), rounded to bf16 (round
// to nearest even, as torch's casts), then times the bf16 weight in fp32 and rounded again. Only
// the order of the sum of squares differs from torch's reduction.
//
// Layout: x [rows, hidden] contiguous bf16, weight [hidden] bf16, out shaped like x.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace {

#ifdef __AVX512BF16__
constexpr int64_t kLanes = 16;

inline __mmask16 lanes(int64_t left) { return left >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1u); }

inline __m512 load(const c10::BFloat16* p, __mmask16 m) {  // bf16 -> fp32 is exact: a shift
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

inline __m512 rounded(__m512 x) {  // x rounded to bf16 and back to fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}

void normalize_row(const c10::BFloat16* x, const c10::BFloat16* weight, c10::BFloat16* out, int64_t hidden,
                   float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t d = 0; d < hidden; d += kLanes) {
    const __m512 v = load(x + d, lanes(hidden - d));
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(hidden);
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t d = 0; d < hidden; d += kLanes) {
    const __mmask16 m = lanes(hidden - d);
    const __m512 y = rounded(_mm512_mul_ps(load(x + d, m), scale));
    _mm256_mask_storeu_epi16(out + d, m, to_bf16(_mm512_mul_ps(load(weight + d, m), y)));
  }
}
#endif  // __AVX512BF16__

void rms_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out, double eps) {
#ifndef __AVX512BF16__
  TORCH_CHECK(false, "rms_norm was built without AVX512-BF16");
#else
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && out.device().is_cpu(), "rms_norm runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "rms_norm takes bfloat16 x, weight and out");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(), "rms_norm needs contiguous tensors");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && out.sizes() == x.sizes(),
              "weight must be [hidden] and out shaped like x");
  const int64_t rows = hidden == 0 ? 0 : x.numel() / hidden;
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = weight.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalize_row(xp + r * hidden, wp, op + r * hidden, hidden, static_cast<float>(eps));
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(poolrunner_cpu, m) { m.def("rms_norm(Tensor x, Tensor weight, Tensor(a!) out, float eps) -> ()"); }

TORCH_LIBRARY_IMPL(poolrunner_cpu, CPU, m) { m.impl("rms_norm", &rms_norm); }
