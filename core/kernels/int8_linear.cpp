// The two passes around a dynamic int8 linear layer's integer product, for x86 CPUs with AVX-512:
// quantizing the activations, one scale and zero point per row (per token), and turning the
// int32 product back into floats with the row's and the output channel's scales and the bias,
// then the layer's activation and an optional elementwise factor (a gated MLP's gate), so that
// neither is a pass of its own over the [rows, out] output. The product itself is torch._int_mm
// (oneDNN's VNNI / AMX-INT8 kernel).
//
// Quantization is asymmetric per row, after a per-input-channel smoothing factor (SmoothQuant):
//   y = x * inv_smooth; lo = min(min(y), 0); hi = max(max(y), 0)
//   scale = (hi - lo) / 255 (1 for an all-zero row, NaN for a row holding a NaN or an infinity,
//   so that its outputs are NaN as the float layer's would be); zero = round(-lo / scale) in [0, 255]
//   q = clamp(round(y / scale) + zero, 0, 255) - 128      (int8, as torch._int_mm takes)
// Every rounding is to nearest even, as torch.round; the division is a multiply by 1 / scale.
// With a rotation block B (a power of two from 16 to 128 dividing the row's width), y is first
// multiplied, block by block, by the B x B Hadamard matrix of Sylvester's order (entries +-1;
// its 1 / sqrt(B) is folded into inv_smooth): a fast Walsh-Hadamard transform, stages of
// butterflies (a + b, a - b) from stride B / 2 down to 1, in float32. A token's few large values
// are spread over their block, so one step quantizes its other values finely too (QuaRot,
// Ashkboos et al. 2024); the weight is multiplied by the same matrix at load.
// Then sum_k (q + 128 - zero) * w = acc + offset * col_sum with offset = 128 - zero and
// col_sum[n] = sum_k w[n, k], exactly, in int32, so:
//   out = act((acc + offset * col_sum) * (scale * col_scale) + bias) * other
// in float32, rounded once to out's dtype. The activations (kActivation*) in float32, each within
// 1e-6 (relative) of its float64 value (torch's float32 GELU: 4e-4, where 1 + erf cancels):
//   exp(x) = 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2, e^r by its Taylor polynomial
//   of degree 6 (relative error below 1.2e-7)
//   silu(x) = x / (1 + exp(-x)); gelu_tanh(x) = x / (1 + exp(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3)
//   gelu(x) = x - x/2 erfc(|x| / sqrt 2) for x >= 0, x/2 erfc(|x| / sqrt 2) below, with erfc(z) =
//   t exp(-z^2 + P(t)), t = 1 / (1 + z/2), P the Chebyshev fit of degree 9 of Press et al.,
//   Numerical Recipes, section 6.2 (relative error below 1.2e-7 for every z >= 0)
//
// Layout: x [rows, in] contiguous (float32 or bfloat16); q [rows, in] int8; scale [rows] float32;
// offset [rows] int32; acc [rows, out] int32 contiguous; col_scale [out] float32; col_sum [out]
// int32; bias [out] float32 or empty; other empty or [rows, out] like out; result [rows, out]
// contiguous, float32 or bfloat16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

inline __mmask16 lanes(int64_t left) { return left >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1u); }

inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load(const c10::BFloat16* p, __mmask16 m) {  // bf16 -> fp32 is exact: a shift
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline void store(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }

inline __m512i bf16_bits(__m512 v) {  // round to nearest even, as torch's cast; NaN stays NaN
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

inline void store(c10::BFloat16* p, __mmask16 m, __m512 v) { _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(v))); }

// kSmooth false: x is already smoothed (and rotated), inv_smooth is not read.
template <bool kSmooth = true, typename T>
void quantize_row(const T* x, const float* inv_smooth, int8_t* q, float* scale, int32_t* offset, int64_t in) {
  constexpr int kNotFinite = 0x01 | 0x08 | 0x10 | 0x80;  // vfpclassps: quiet NaN, +inf, -inf, signalling NaN
  __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();  // zero is always in the range
  __mmask16 not_finite = 0;
  for (int64_t k = 0; k < in; k += kLanes) {
    const __mmask16 m = lanes(in - k);
    const __m512 y = kSmooth ? _mm512_mul_ps(load(x + k, m), load(inv_smooth + k, m)) : load(x + k, m);
    lo = _mm512_mask_min_ps(lo, m, lo, y);
    hi = _mm512_mask_max_ps(hi, m, hi, y);
    not_finite |= _mm512_mask_fpclass_ps_mask(m, y, kNotFinite);
  }
  if (not_finite) {
    std::fill(q, q + in, int8_t{0});
    *scale = NAN;
    *offset = 0;
    return;
  }
  const float low = _mm512_reduce_min_ps(lo);
  float step = (_mm512_reduce_max_ps(hi) - low) / 255.0f;
  if (!(step > 0.0f)) step = 1.0f;  // an all-zero row quantizes to its zero point
  const float inverse = 1.0f / step;
  const float zero = std::nearbyint(-low * inverse);
  const __m512 vinverse = _mm512_set1_ps(inverse);
  const __m512i vshift = _mm512_set1_epi32(static_cast<int32_t>(zero) - 128);
  for (int64_t k = 0; k < in; k += kLanes) {
    const __mmask16 m = lanes(in - k);
    const __m512 y = kSmooth ? _mm512_mul_ps(load(x + k, m), load(inv_smooth + k, m)) : load(x + k, m);
    // level - 128 in [-129, 128]: the saturating narrowing is the clamp to [0, 255]
    const __m512i level = _mm512_add_epi32(_mm512_cvt_roundps_epi32(_mm512_mul_ps(y, vinverse), kNearest), vshift);
    _mm_mask_storeu_epi8(q + k, m, _mm512_cvtsepi32_epi8(level));
  }
  *scale = step;
  *offset = 128 - static_cast<int32_t>(zero);
}

inline __m512 butterfly(__m512 x, __m512 partner, __mmask16 upper) {  // lower lanes x + partner, upper partner - x
  return _mm512_mask_sub_ps(_mm512_add_ps(x, partner), upper, partner, x);
}

// One block of kRegs * 16 values of x * inv_smooth, times the unnormalized Hadamard matrix of
// that order, into out: the block stays in registers through every stage.
template <int kRegs, typename T>
void hadamard_block(const T* x, const float* inv_smooth, float* out) {
  __m512 r[kRegs];
  for (int i = 0; i < kRegs; ++i) {
    r[i] = _mm512_mul_ps(load(x + i * kLanes, 0xFFFF), load(inv_smooth + i * kLanes, 0xFFFF));
    __asm__("" : "+v"(r[i]));  // the product rounded on its own, as torch's: never contracted into an FMA
  }
  for (int h = kRegs / 2; h >= 1; h /= 2)  // strides of 16 values and more: whole registers
    for (int i = 0; i < kRegs; ++i)
      if ((i & h) == 0) {
        const __m512 a = r[i], b = r[i + h];
        r[i] = _mm512_add_ps(a, b);
        r[i + h] = _mm512_sub_ps(a, b);
      }
  for (int i = 0; i < kRegs; ++i) {  // strides 8, 4, 2, 1 inside a register
    __m512 v = r[i];
    v = butterfly(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)), 0xFF00);
    v = butterfly(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)), 0xF0F0);
    v = butterfly(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)), 0xCCCC);
    v = butterfly(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)), 0xAAAA);
    _mm512_storeu_ps(out + i * kLanes, v);
  }
}

// The row smoothed and rotated (see the header) into rotated[in], for quantize_row<false>; block is
// 16, 32, 64 or 128 (the Python side's ROTATION_BLOCK at most).
template <typename T>
void rotate_row(const T* x, const float* inv_smooth, float* rotated, int64_t in, int64_t block) {
  for (int64_t b = 0; b < in; b += block) {
    switch (block) {
      case 16: hadamard_block<1>(x + b, inv_smooth + b, rotated + b); break;
      case 32: hadamard_block<2>(x + b, inv_smooth + b, rotated + b); break;
      case 64: hadamard_block<4>(x + b, inv_smooth + b, rotated + b); break;
      default: hadamard_block<8>(x + b, inv_smooth + b, rotated + b); break;
    }
  }
}

// The activations a layer's conversion applies; the numbers are the Python side's.
enum Activation : int64_t { kActivationNone = 0, kActivationGelu = 1, kActivationGeluTanh = 2, kActivationRelu = 3,
                            kActivationSilu = 4 };

inline __m512 exp_ps(__m512 x) {
  // Past these e^x is 0 or infinite in float32; the clamp keeps n within scalef's exact range.
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), kNearest);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2 in two parts: r exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

inline __m512 sigmoid_times(__m512 x, __m512 u) {  // x / (1 + exp(-u))
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), u))));
}

inline __m512 gelu_erf(__m512 x) {
  const __m512 z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(0.707106781186547524f));
  const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(z, _mm512_set1_ps(0.5f), _mm512_set1_ps(1.0f)));
  __m512 p = _mm512_set1_ps(0.17087277f);
  for (const float c : {-0.82215223f, 1.48851587f, -1.13520398f, 0.27886807f, -0.18628806f, 0.09678418f, 0.37409196f,
                        1.00002368f, -1.26551223f})
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(c));
  const __m512 erfc = _mm512_mul_ps(t, exp_ps(_mm512_fnmadd_ps(z, z, p)));  // t exp(-z^2 + p(t))
  const __m512 half_tail = _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), erfc);  // x/2 erfc(|x| / sqrt 2)
  return _mm512_mask_sub_ps(half_tail, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), x, half_tail);
}

inline __m512 activate(__m512 v, Activation activation) {
  switch (activation) {
    case kActivationGelu: return gelu_erf(v);
    case kActivationGeluTanh: {
      const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(v, v), v), _mm512_set1_ps(0.044715f), v);
      return sigmoid_times(v, _mm512_mul_ps(inner, _mm512_set1_ps(2 * 0.797884560802865356f)));
    }
    case kActivationRelu: return _mm512_max_ps(_mm512_setzero_ps(), v);  // vmaxps returns its second operand for a NaN
    case kActivationSilu: return sigmoid_times(v, v);
    default: return v;
  }
}

template <typename T>
void dequantize_row(const int32_t* acc, float row_scale, int32_t row_offset, const float* col_scale,
                    const int32_t* col_sum, const float* bias, Activation activation, const T* other, T* out,
                    int64_t width) {
  const __m512i voffset = _mm512_set1_epi32(row_offset);
  const __m512 vscale = _mm512_set1_ps(row_scale);
  for (int64_t n = 0; n < width; n += kLanes) {
    const __mmask16 m = lanes(width - n);
    const __m512i exact = _mm512_add_epi32(_mm512_maskz_loadu_epi32(m, acc + n),
                                           _mm512_mullo_epi32(voffset, _mm512_maskz_loadu_epi32(m, col_sum + n)));
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(vscale, load(col_scale + n, m)));
    if (bias != nullptr) v = _mm512_add_ps(v, load(bias + n, m));
    if (activation != kActivationNone) v = activate(v, activation);
    if (other != nullptr) v = _mm512_mul_ps(v, load(other + n, m));
    store(out + n, m, v);
  }
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
}

void quantize_rows(const at::Tensor& x, const at::Tensor& inv_smooth, const at::Tensor& q, const at::Tensor& scale,
                   const at::Tensor& offset, int64_t block) {
  for (const auto& [t, name] : {std::pair{x, "x"}, {inv_smooth, "inv_smooth"}, {q, "q"}, {scale, "scale"},
                                {offset, "offset"}})
    check_cpu(t, name);
  TORCH_CHECK(x.dim() == 2 && q.sizes() == x.sizes(), "x must be [rows, in] and q shaped like it");
  const int64_t rows = x.size(0), in = x.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(inv_smooth.scalar_type() == at::kFloat && inv_smooth.numel() == in, "inv_smooth must be float32 [in]");
  TORCH_CHECK(q.scalar_type() == at::kChar, "q must be int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == rows, "scale must be float32 [rows]");
  TORCH_CHECK(offset.scalar_type() == at::kInt && offset.numel() == rows, "offset must be int32 [rows]");
  TORCH_CHECK(block == 0 || (block >= kLanes && block <= 8 * kLanes && (block & (block - 1)) == 0 && in % block == 0),
              "block must be 0 (no rotation) or a power of two from 16 to 128 dividing the row's width");
  const float* s = inv_smooth.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  int32_t* op = offset.data_ptr<int32_t>();
  auto run = [&](auto* xp) {
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> rotated(block ? in : 0);
      for (int64_t r = begin; r < end; ++r) {
        if (block == 0) {
          quantize_row(xp + r * in, s, qp + r * in, sp + r, op + r, in);
          continue;
        }
        rotate_row(xp + r * in, s, rotated.data(), in, block);
        quantize_row<false>(rotated.data(), nullptr, qp + r * in, sp + r, op + r, in);
      }
    });
  };
  if (x.scalar_type() == at::kFloat) run(x.data_ptr<float>());
  else run(x.data_ptr<c10::BFloat16>());
}

void dequantize_rows(const at::Tensor& acc, const at::Tensor& scale, const at::Tensor& offset,
                     const at::Tensor& col_scale, const at::Tensor& col_sum, const at::Tensor& bias,
                     int64_t activation, const at::Tensor& other, const at::Tensor& out) {
  for (const auto& [t, name] : {std::pair{acc, "acc"}, {scale, "scale"}, {offset, "offset"}, {col_scale, "col_scale"},
                                {col_sum, "col_sum"}, {bias, "bias"}, {other, "other"}, {out, "out"}})
    check_cpu(t, name);
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt, "acc must be int32 [rows, out]");
  const int64_t rows = acc.size(0), width = acc.size(1);
  TORCH_CHECK(out.sizes() == acc.sizes() && (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "out must be float32 or bfloat16 and shaped like acc");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == rows, "scale must be float32 [rows]");
  TORCH_CHECK(offset.scalar_type() == at::kInt && offset.numel() == rows, "offset must be int32 [rows]");
  TORCH_CHECK(col_scale.scalar_type() == at::kFloat && col_scale.numel() == width, "col_scale must be float32 [out]");
  TORCH_CHECK(col_sum.scalar_type() == at::kInt && col_sum.numel() == width, "col_sum must be int32 [out]");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == width),
              "bias must be float32 [out] or empty");
  TORCH_CHECK(activation >= kActivationNone && activation <= kActivationSilu, "activation must be 0..4, not ",
              activation);
  TORCH_CHECK(other.numel() == 0 || (other.sizes() == out.sizes() && other.scalar_type() == out.scalar_type()),
              "other must be empty or shaped and typed like out");
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* sp = scale.data_ptr<float>();
  const int32_t* op = offset.data_ptr<int32_t>();
  const float* cs = col_scale.data_ptr<float>();
  const int32_t* csum = col_sum.data_ptr<int32_t>();
  const float* bp = bias.numel() == 0 ? nullptr : bias.data_ptr<float>();
  const auto act = static_cast<Activation>(activation);
  auto run = [&](auto* outp) {
    using T = std::remove_pointer_t<decltype(outp)>;
    const T* otherp = other.numel() == 0 ? nullptr : other.data_ptr<T>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        dequantize_row(ap + r * width, sp[r], op[r], cs, csum, bp, act, otherp == nullptr ? nullptr : otherp + r * width,
                       outp + r * width, width);
    });
  };
  if (out.scalar_type() == at::kFloat) run(out.data_ptr<float>());
  else run(out.data_ptr<c10::BFloat16>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(poolrunner_cpu, m) {
  m.def("quantize_rows(Tensor x, Tensor inv_smooth, Tensor(a!) q, Tensor(b!) scale, Tensor(c!) offset, int block=0) "
        "-> ()");
  m.def("dequantize_rows(Tensor acc, Tensor scale, Tensor offset, Tensor col_scale, Tensor col_sum, Tensor bias, "
        "int activation, Tensor other, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(poolrunner_cpu, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("dequantize_rows", &dequantize_rows);
}
