// Rotary position embedding as transformers' apply_rotary_pos_emb computes it for one tensor
// (queries or keys), in one pass: float32 on every build, bfloat16 on x86 CPUs with AVX512-BF16.
//
// Why: the Python formula, x * cos + rotate_half(x) * sin, is five element-wise passes over the
// queries and five over the keys (slice and negate, concatenate, two products, a sum), each
// writing a new tensor: 1.04 ms per layer for a 2,048-token step of SmolLM2-135M's 9 + 3 heads in
// bfloat16 on two AMX Xeon cores (1.45 ms in float32), 0.23 ms (0.25) in one pass here.
//
// Numerics are the formula's, with its roundings: for i < d/2, with x1 = x[i], x2 = x[i + d/2],
//   out[i]       = round(round(x1 * cos[i])       + round(-x2 * sin[i]))
//   out[i + d/2] = round(round(x2 * cos[i + d/2]) + round( x1 * sin[i + d/2]))
// where round is to the tensor's dtype (bfloat16: round to nearest even from the float32 result,
// as torch's bfloat16 arithmetic does; float32: the float32 operation itself). Llama's formula
// computes in the tensor's dtype; ModernBERT's converts to float32 first and back at the end
// (round_once): there the products and the sum are float32 operations and only the result is
// rounded. No product is fused with the sum (fp-contract off below), which would round once
// where torch rounds twice.
//
// Layout: x [batch, heads, tokens, d] with d contiguous and even (any other strides: the view
// transformers hands over is [batch, tokens, heads, d] transposed); cos and sin [batch or 1,
// tokens, d] with d contiguous; out of x's shape and strides.

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include "kernel_common.h"

#include <cstdint>

namespace {

struct Strides {
  int64_t batch, head, token;
};

inline Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// round_once changes nothing in float32: every operation already rounds to float32.
void rotate_row(const float* x, const float* cos, const float* sin, float* out, int64_t half, bool /*round_once*/) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    const float a = x1 * cos[i], b = -x2 * sin[i];
    const float c = x2 * cos[i + half], e = x1 * sin[i + half];
    out[i] = a + b;
    out[i + half] = c + e;
  }
}

#ifdef __AVX512BF16__
using poolrunner_cpu::kLanes, poolrunner_cpu::lanes, poolrunner_cpu::load, poolrunner_cpu::rounded,
    poolrunner_cpu::to_bf16;

template <bool kRoundOnce>
void rotate_bf16(const c10::BFloat16* x, const c10::BFloat16* cos, const c10::BFloat16* sin, c10::BFloat16* out,
                 int64_t half) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  // The products rounded to bfloat16 as the bfloat16 formula does, or kept in float32.
  const auto product = [](__m512 p) { return kRoundOnce ? p : rounded(p); };
  for (int64_t i = 0; i < half; i += kLanes) {
    const __mmask16 m = lanes(half - i);
    const __m512 x1 = load(x + i, m), x2 = load(x + i + half, m);
    const __m512 a = product(_mm512_mul_ps(x1, load(cos + i, m)));
    const __m512 b = product(_mm512_mul_ps(_mm512_xor_ps(x2, sign), load(sin + i, m)));
    const __m512 c = product(_mm512_mul_ps(x2, load(cos + i + half, m)));
    const __m512 e = product(_mm512_mul_ps(x1, load(sin + i + half, m)));
    _mm256_mask_storeu_epi16(out + i, m, to_bf16(_mm512_add_ps(a, b)));
    _mm256_mask_storeu_epi16(out + i + half, m, to_bf16(_mm512_add_ps(c, e)));
  }
}

void rotate_row(const c10::BFloat16* x, const c10::BFloat16* cos, const c10::BFloat16* sin, c10::BFloat16* out,
                int64_t half, bool round_once) {
  if (round_once) {
    rotate_bf16<true>(x, cos, sin, out, half);
  } else {
    rotate_bf16<false>(x, cos, sin, out, half);
  }
}
#endif  // __AVX512BF16__

template <typename T>
void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool round_once, const at::Tensor& out) {
  const int64_t batch = x.size(0), heads = x.size(1), tokens = x.size(2), half = x.size(3) / 2;
  const Strides xs = strides_of(x), os = strides_of(out);
  const int64_t angle_batch = cos.size(0) == 1 ? 0 : cos.stride(0), angle_token = cos.stride(1);
  TORCH_CHECK(sin.stride(0) == cos.stride(0) && sin.stride(1) == angle_token, "cos and sin must share a layout");
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, batch * tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / tokens, t = row % tokens;
      const int64_t angle = b * angle_batch + t * angle_token;
      for (int64_t h = 0; h < heads; ++h) {
        rotate_row(xp + b * xs.batch + h * xs.head + t * xs.token, cp + angle, sp + angle,
                   op + b * os.batch + h * os.head + t * os.token, half, round_once);
      }
    }
  });
}

void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool round_once, const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu() && out.device().is_cpu(),
              "rotary runs on the CPU");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && out.scalar_type() == dtype,
              "rotary takes x, cos, sin and out of one dtype");
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 3 && sin.sizes() == cos.sizes() && out.sizes() == x.sizes(),
              "x and out must be [batch, heads, tokens, d], cos and sin [batch or 1, tokens, d]");
  TORCH_CHECK(x.size(3) % 2 == 0 && cos.size(2) == x.size(3) && cos.size(1) == x.size(2) &&
                  (cos.size(0) == 1 || cos.size(0) == x.size(0)),
              "cos and sin must match x's tokens and (even) head size");
  TORCH_CHECK(x.stride(3) == 1 && out.stride(3) == 1 && cos.stride(2) == 1 && sin.stride(2) == 1,
              "rotary needs the head dimension contiguous");
  poolrunner_cpu::by_dtype(dtype, "rotary", [&](auto tag) { rotate<decltype(tag)>(x, cos, sin, round_once, out); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(poolrunner_cpu, m) {
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool round_once, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(poolrunner_cpu, CPU, m) { m.impl("rotary", &rotary); }
