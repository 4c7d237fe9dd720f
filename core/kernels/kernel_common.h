// What rms_norm.cpp, rotary.cpp and packed_attention.cpp share: masked 16-lane bfloat16 loads
// and roundings on AVX512-BF16 builds, and the dispatch on a tensor's dtype (float32 on every
// build, bfloat16 where AVX512-BF16 is).

#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <immintrin.h>

#include <cstdint>

namespace poolrunner_cpu {

#ifdef __AVX512BF16__
constexpr int64_t kLanes = 16;

inline __mmask16 lanes(int64_t left) { return left >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1u); }

inline __m512 load(const c10::BFloat16* p, __mmask16 m) {  // bf16 -> fp32 is exact: a shift
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }  // round to nearest even

inline __m512 rounded(__m512 x) {  // x rounded to bf16 and back to fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}
#endif  // __AVX512BF16__

// body(float{}) or body(c10::BFloat16{}) as dtype says; any other dtype is refused, naming op.
template <typename Body>
void by_dtype(c10::ScalarType dtype, const char* op, Body&& body) {
  if (dtype == c10::ScalarType::Float) return body(float{});
#ifdef __AVX512BF16__
  if (dtype == c10::ScalarType::BFloat16) return body(c10::BFloat16{});
#endif
  TORCH_CHECK(false, op, " takes float32, or bfloat16 in a build with AVX512-BF16; got ", dtype);
}

}  // namespace poolrunner_cpu
