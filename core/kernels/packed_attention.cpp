// Attention over a packed, padding-free batch on x86 CPUs, in one call per layer: float32 and
// bfloat16 with AVX-512 (bfloat16 needs AVX512-BF16), float32 alone with AVX2 and FMA.
//
// Why: torch's CPU flash-attention kernel runs each (request, head) through general matrix
// products sized for long sequences; with the short requests and 32- or 64-wide heads of
// embedding models it spends most of its time in call overhead (35 GFLOP/s at 31 tokens on two
// Zen 4 cores). Here one work item is one request's head (or 256 of its query rows): its keys
// and values are repacked once into the layout the vector units want, and every score row
// stays in registers or L1.
//
// Numerics are torch's CPU SDPA's: everything in fp32 (bf16 inputs are exact in fp32), the
// output rounded once to its dtype. bf16 scores use AVX512-BF16 (vdpbf16ps: exact products,
// fp32 sums); the softmax numerators stay fp32 for the product with the values (rounding them to
// bf16 first, as a bf16 product would, adds 14% to the mean error).
//
// Layout: q [num_tokens, num_heads, head_dim], k and v [num_tokens, num_kv_heads, head_dim]
// (any token and head strides, head_dim contiguous), out [num_tokens, num_heads, head_dim]
// contiguous. Request i spans tokens starts[i] .. starts[i] + lengths[i]; its queries see its
// own keys only: query i sees keys i - before .. i + after of them (-1: no bound on that side),
// so before = after = -1 is full attention, after = 0 causal, both bounded a sliding window.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

// ---- fp32 vectors: the only part that differs between instruction sets -----------------------
// A vector holds kKeys fp32 lanes (one block of keys, or kKeys value columns); a Lanes value
// marks some of them. A micro-kernel takes kRows query rows against 2 key blocks, or kGroups
// value column vectors: its kRows * 2 (or * kGroups) sums stay in registers (32 zmm with
// AVX-512, 16 ymm with AVX2).

#ifdef __AVX512F__
using Vec = __m512;
using Lanes = __mmask16;
constexpr int64_t kKeys = 16;
constexpr int kRows = 4;
constexpr int kGroups = 4;

inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float x) { return _mm512_set1_ps(x); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec x) { _mm512_storeu_ps(p, x); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
inline Vec vfnma(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline float vsum(Vec x) { return _mm512_reduce_add_ps(x); }
inline float vtop(Vec x) { return _mm512_reduce_max_ps(x); }
inline Vec vround(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vpow2_times(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
// Lanes below .. upto - 1 (0 <= below, upto <= kKeys).
inline Lanes lanes_between(int64_t below, int64_t upto) {
  return static_cast<Lanes>(((1u << upto) - 1u) & ~((1u << below) - 1u));
}
inline Vec keep(Lanes m, Vec x) { return _mm512_maskz_mov_ps(m, x); }             // x on m, 0 elsewhere
inline Vec max_on(Vec top, Lanes m, Vec x) { return _mm512_mask_max_ps(top, m, top, x); }  // max on m
#else  // AVX2 and FMA
using Vec = __m256;
using Lanes = __m256;  // all ones on a marked lane, zeros elsewhere
constexpr int64_t kKeys = 8;
constexpr int kRows = 6;
constexpr int kGroups = 2;

inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec x) { _mm256_storeu_ps(p, x); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vfnma(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline __m128 fold(__m256 x, __m128 (*op)(__m128, __m128)) {  // the 8 lanes folded to lane 0 by op
  __m128 h = op(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  h = op(h, _mm_movehl_ps(h, h));
  return op(h, _mm_shuffle_ps(h, h, 1));
}
inline float vsum(Vec x) { return _mm_cvtss_f32(fold(x, [](__m128 a, __m128 b) { return _mm_add_ps(a, b); })); }
inline float vtop(Vec x) { return _mm_cvtss_f32(fold(x, [](__m128 a, __m128 b) { return _mm_max_ps(a, b); })); }
inline Vec vround(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integral n >= -127: 2^n built in the exponent field; n = -127 gives 0, a flush
// to zero that AVX-512's scalef does not make (a numerator below 2^-126, next to the row's 1).
inline Vec vpow2_times(Vec p, Vec n) {
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
inline Lanes lanes_between(int64_t below, int64_t upto) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i from = _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int>(below) - 1));
  const __m256i to = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(upto)), lane);
  return _mm256_castsi256_ps(_mm256_and_si256(from, to));
}
inline Vec keep(Lanes m, Vec x) { return _mm256_and_ps(m, x); }
inline Vec max_on(Vec top, Lanes m, Vec x) { return _mm256_blendv_ps(top, _mm256_max_ps(top, x), m); }
#endif

constexpr int64_t kHeadDimMultiple = 16;  // the contract of cpu_kernels.HEAD_DIM_MULTIPLE
constexpr int64_t kQueryBlock = 256;      // query rows per work item

// exp(x) for x <= 0 in fp32 (Cephes' expf polynomial, about 1 ulp); results below 2^-126
// flush towards 0 as the masked lanes do anyway.
inline Vec exp_ps(Vec x) {
  x = vmax(x, vset(-88.0f));
  const Vec n = vround(vmul(x, vset(1.44269504088896341f)));
  Vec r = vfnma(n, vset(0.693359375f), x);
  r = vfnma(n, vset(-2.12194440e-4f), r);
  Vec p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset(1.0f)));
  return vpow2_times(p, n);
}

// The lanes of key block `block` whose keys are in lo .. hi.
inline Lanes valid_lanes(int64_t block, int64_t lo, int64_t hi) {
  return lanes_between(std::clamp<int64_t>(lo - block * kKeys, 0, kKeys),
                       std::clamp<int64_t>(hi - block * kKeys, 0, kKeys));
}

// Softmax numerator of one score row in place: exp(s - max) on keys lo .. hi, 0 on the rest of
// blocks b0 .. b1. Returns the fp32 sum of the numerators.
inline float exp_row(float* s, int64_t b0, int64_t b1, int64_t lo, int64_t hi) {
  Vec top = vset(-INFINITY);
  for (int64_t b = b0; b < b1; ++b) top = max_on(top, valid_lanes(b, lo, hi), vload(s + b * kKeys));
  const Vec row_max = vset(vtop(top));
  Vec sum = vzero();
  for (int64_t b = b0; b < b1; ++b) {
    const Vec e = keep(valid_lanes(b, lo, hi), exp_ps(vsub(vload(s + b * kKeys), row_max)));
    vstore(s + b * kKeys, e);
    sum = vadd(sum, e);
  }
  return vsum(sum);
}

// One request's keys (and, for bf16, values) for one kv head, repacked for the vector units.
struct Panel {
  int64_t padded = 0;              // keys rounded up to kKeys; padding keys are 0
  // Elements from one row of keys to the next: padded, made an odd number of blocks so that the
  // rows fall in different cache sets (at a power-of-two stride the repacking stores missed L1).
  int64_t stride = 0;
  std::vector<uint32_t> key_pairs;  // bf16: [head_dim / 2][stride] pairs (k[j][2t], k[j][2t+1])
  std::vector<float> keys;          // fp32: [head_dim][stride]
  std::vector<float> values;        // bf16 inputs: the values in fp32, [padded][head_dim]
};

struct Problem {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  int64_t q_token, q_head, k_token, k_head, v_token, v_head;  // strides in elements
  int64_t heads, group, dim;  // query heads, query heads per kv head, head_dim
  float scale;
  int64_t before, after;  // query i sees keys i - before .. i + after; -1: unbounded
};

// The first key query `row` of a request sees, and one past its last.
inline int64_t first_key(const Problem& p, int64_t row) {
  return p.before < 0 ? 0 : std::max<int64_t>(0, row - p.before);
}
inline int64_t end_key(const Problem& p, int64_t row, int64_t length) {
  return p.after < 0 ? length : std::min(length, row + p.after + 1);
}

// ---- scores: q . k for R query rows against key blocks ---------------------------------------

#ifdef __AVX512BF16__
void pack_bf16(const Problem& p, int64_t start, int64_t length, int64_t kv_head, Panel& panel) {
  const int64_t pairs = p.dim / 2;
  panel.key_pairs.assign(pairs * panel.stride, 0u);
  panel.values.assign(panel.padded * p.dim, 0.0f);
  const auto* k = static_cast<const uint16_t*>(p.k);
  const auto* v = static_cast<const c10::BFloat16*>(p.v);
  for (int64_t j = 0; j < length; ++j) {
    const auto* row = reinterpret_cast<const uint32_t*>(k + (start + j) * p.k_token + kv_head * p.k_head);
    for (int64_t t = 0; t < pairs; ++t) panel.key_pairs[t * panel.stride + j] = row[t];
    const c10::BFloat16* vrow = v + (start + j) * p.v_token + kv_head * p.v_head;
    for (int64_t d = 0; d < p.dim; ++d) panel.values[j * p.dim + d] = static_cast<float>(vrow[d]);
  }
}
#endif  // __AVX512BF16__

void pack_f32(const Problem& p, int64_t start, int64_t length, int64_t kv_head, Panel& panel) {
  panel.keys.assign(p.dim * panel.stride, 0.0f);
  const auto* k = static_cast<const float*>(p.k);
  for (int64_t j = 0; j < length; ++j) {
    const float* row = k + (start + j) * p.k_token + kv_head * p.k_head;
    for (int64_t d = 0; d < p.dim; ++d) panel.keys[d * panel.stride + j] = row[d];
  }
}

// q . k for R query rows against B key blocks from block b, scaled, into s. bf16: q holds
// the rows' bf16 pairs and the keys are the panel's pairs, multiplied exactly into fp32 and
// summed in fp32 (vdpbf16ps); fp32: FMAs. B blocks at a time: R * B independent sums hide the
// instruction's latency, and each query broadcast serves B blocks.
template <typename T, int R, int B>
void score_blocks(const Problem& p, const Panel& panel, const T* const* q, int64_t b, float* s) {
  constexpr bool kPairs = std::is_same_v<T, uint32_t>;
  Vec acc[B][R];
  for (int c = 0; c < B; ++c)
    for (int i = 0; i < R; ++i) acc[c][i] = vzero();
  const T* keys = (kPairs ? reinterpret_cast<const T*>(panel.key_pairs.data())
                          : reinterpret_cast<const T*>(panel.keys.data())) + b * kKeys;
  for (int64_t t = 0; t < (kPairs ? p.dim / 2 : p.dim); ++t) {
    const T* row = keys + t * panel.stride;
    Vec kv[B];
    for (int c = 0; c < B; ++c) kv[c] = vload(reinterpret_cast<const float*>(row + c * kKeys));
    for (int i = 0; i < R; ++i) {
      if constexpr (kPairs) {
#ifdef __AVX512BF16__
        const __m512bh qi = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[i][t]));
        for (int c = 0; c < B; ++c) acc[c][i] = _mm512_dpbf16_ps(acc[c][i], qi, (__m512bh)kv[c]);
#endif
      } else {
        const Vec qi = vset(q[i][t]);
        for (int c = 0; c < B; ++c) acc[c][i] = vfma(qi, kv[c], acc[c][i]);
      }
    }
  }
  for (int c = 0; c < B; ++c)
    for (int i = 0; i < R; ++i)
      vstore(s + i * panel.padded + (b + c) * kKeys, vmul(acc[c][i], vset(p.scale)));
}

// Scores of R query rows (element offsets q_rows into q) against key blocks b0 .. b1.
template <typename T, int R>
void scores(const Problem& p, const Panel& panel, const int64_t* q_rows, int64_t b0, int64_t b1, float* s) {
  using Q = std::conditional_t<std::is_same_v<T, float>, float, uint32_t>;  // bf16 rows as pairs
  const Q* q[R];
  for (int i = 0; i < R; ++i) q[i] = reinterpret_cast<const Q*>(static_cast<const T*>(p.q) + q_rows[i]);
  int64_t b = b0;
  for (; b + 2 <= b1; b += 2) score_blocks<Q, R, 2>(p, panel, q, b, s);
  if (b < b1) score_blocks<Q, R, 1>(p, panel, q, b, s);
}

// ---- values: sum over keys of e[i][j] * v[j], in fp32 ----------------------------------------

// acc[i][g] += sum_j e[i][j] * v[j][d0 + kKeys g .. d0 + kKeys (g + 1)] for keys j0 <= j < j1,
// g < width; G: the widths still to choose from.
template <int R, int G = kGroups>
void values(int width, const float* const* e, const float* v, int64_t v_token, int64_t j0, int64_t j1, int64_t d0,
            Vec (*acc)[kGroups]) {
  if constexpr (G > 1) {
    if (width < G) return values<R, G - 1>(width, e, v, v_token, j0, j1, d0, acc);
  }
  // Summed in locals: vector types may alias the floats read, so sums kept in *acc would be
  // stored back at every key.
  Vec sum[R][G];
  for (int i = 0; i < R; ++i)
    for (int g = 0; g < G; ++g) sum[i][g] = acc[i][g];
  for (int64_t j = j0; j < j1; ++j) {
    Vec vv[G];
    for (int g = 0; g < G; ++g) vv[g] = vload(v + j * v_token + d0 + g * kKeys);
    for (int i = 0; i < R; ++i) {
      const Vec ei = vset(e[i][j]);
      for (int g = 0; g < G; ++g) sum[i][g] = vfma(ei, vv[g], sum[i][g]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int g = 0; g < G; ++g) acc[i][g] = sum[i][g];
}

inline void store(float* dst, Vec x) { vstore(dst, x); }
#ifdef __AVX512BF16__
inline void store(c10::BFloat16* dst, Vec x) {  // round to nearest even, as torch's casts do
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(x));
}
#endif

// ---- one work item ---------------------------------------------------------------------------

struct Item {
  int64_t start, length, head, first_row;
  int64_t key0;  // the first key the item's rows see: the panel's key 0
};

// R query rows from row r0 of the item's request: scores, softmax numerators, values, output.
// Keys are counted from the item's key0 (the panel's first key); row i sees lo[i] .. hi[i], both
// non-decreasing in i.
template <typename T, int R>
void rows(const Problem& p, const Panel& panel, const Item& item, int64_t r0, std::vector<float>& s) {
  int64_t lo[R], hi[R];
  int64_t q_rows[R];
  const float* e[R];
  for (int i = 0; i < R; ++i) {
    lo[i] = first_key(p, r0 + i) - item.key0;
    hi[i] = end_key(p, r0 + i, item.length) - item.key0;
    q_rows[i] = (item.start + r0 + i) * p.q_token + item.head * p.q_head;
    e[i] = s.data() + i * panel.padded;
  }
  const int64_t b0 = lo[0] / kKeys, b1 = (hi[R - 1] + kKeys - 1) / kKeys;
  scores<T, R>(p, panel, q_rows, b0, b1, s.data());
  float inv_sum[R];
  for (int i = 0; i < R; ++i) inv_sum[i] = 1.0f / exp_row(s.data() + i * panel.padded, b0, b1, lo[i], hi[i]);
  // fp32 values are read in place; bf16 ones from the panel's fp32 copy.
  const bool in_place = std::is_same_v<T, float>;
  const float* v = in_place ? static_cast<const float*>(p.v) + (item.start + item.key0) * p.v_token +
                                  (item.head / p.group) * p.v_head
                            : panel.values.data();
  const int64_t v_token = in_place ? p.v_token : p.dim;
  const int64_t j0 = lo[0], j1 = hi[R - 1];
  for (int64_t d0 = 0; d0 < p.dim; d0 += kGroups * kKeys) {
    const int width = static_cast<int>(std::min<int64_t>(kGroups, (p.dim - d0) / kKeys));
    Vec acc[R][kGroups];
    for (int i = 0; i < R; ++i)
      for (int g = 0; g < kGroups; ++g) acc[i][g] = vzero();
    values<R>(width, e, v, v_token, j0, j1, d0, acc);
    for (int i = 0; i < R; ++i) {
      T* dst = static_cast<T*>(p.out) + ((item.start + r0 + i) * p.heads + item.head) * p.dim + d0;
      for (int g = 0; g < width; ++g) store(dst + g * kKeys, vmul(acc[i][g], vset(inv_sum[i])));
    }
  }
}

// The item's last `count` (< kRows) rows from row r0.
template <typename T, int R = kRows - 1>
void last_rows(int count, const Problem& p, const Panel& panel, const Item& item, int64_t r0, std::vector<float>& s) {
  if (count == R) return rows<T, R>(p, panel, item, r0, s);
  if constexpr (R > 1) last_rows<T, R - 1>(count, p, panel, item, r0, s);
}

template <typename T>
void run_item(const Problem& p, Item item, Panel& panel, std::vector<float>& s) {
  const int64_t last_row = std::min(item.first_row + kQueryBlock, item.length);
  // The keys the block's rows see: from its first row's first (a window's lower edge) to its last
  // row's last (causal rows see no key past the block's last row).
  item.key0 = first_key(p, item.first_row);
  const int64_t keys = end_key(p, last_row - 1, item.length) - item.key0;
  panel.padded = (keys + kKeys - 1) / kKeys * kKeys;
  panel.stride = panel.padded + (panel.padded / kKeys % 2 == 0 ? kKeys : 0);
  if constexpr (std::is_same_v<T, float>) {
    pack_f32(p, item.start + item.key0, keys, item.head / p.group, panel);
  } else {
#ifdef __AVX512BF16__
    pack_bf16(p, item.start + item.key0, keys, item.head / p.group, panel);
#endif
  }
  s.resize(kRows * panel.padded);
  int64_t r0 = item.first_row;
  for (; r0 + kRows <= last_row; r0 += kRows) rows<T, kRows>(p, panel, item, r0, s);
  last_rows<T>(static_cast<int>(last_row - r0), p, panel, item, r0, s);
}

void packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                      const at::Tensor& starts, const at::Tensor& lengths, int64_t before, int64_t after,
                      double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && out.device().is_cpu(),
              "packed_attention runs on the CPU");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k and v must be [num_tokens, heads, head_dim]");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "packed_attention takes bfloat16 or float32, not ",
              dtype);
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && out.scalar_type() == dtype,
              "q, k, v and out must share one dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be a contiguous tensor shaped like q");
  const int64_t dim = q.size(2);
  TORCH_CHECK(dim % kHeadDimMultiple == 0 && k.size(2) == dim && v.size(2) == dim,
              "head_dim must be a multiple of ", kHeadDimMultiple);
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && k.size(1) == v.size(1), "query heads must be a multiple of kv heads");
  TORCH_CHECK(before >= -1 && after >= -1, "before and after are key counts, or -1 for no bound");
  if (dtype == at::kBFloat16) {
#ifndef __AVX512BF16__
    TORCH_CHECK(false, "packed_attention was built without AVX512-BF16: bfloat16 is not available");
#endif
    TORCH_CHECK(q.stride(1) % 2 == 0 && q.stride(0) % 2 == 0 && k.stride(1) % 2 == 0 && k.stride(0) % 2 == 0,
                "bfloat16 query and key rows must start at even offsets");
  }
  const auto starts_c = starts.to(at::kLong).contiguous();
  const auto lengths_c = lengths.to(at::kLong).contiguous();
  const int64_t* start_of = starts_c.data_ptr<int64_t>();
  const int64_t* length_of = lengths_c.data_ptr<int64_t>();

  const Problem p{q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                  q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                  q.size(1), q.size(1) / k.size(1), dim, static_cast<float>(scale), before, after};
  std::vector<Item> items;
  for (int64_t r = 0; r < starts_c.numel(); ++r) {
    TORCH_CHECK(start_of[r] >= 0 && length_of[r] >= 0 && start_of[r] + length_of[r] <= q.size(0),
                "request ", r, " spans tokens outside q");
    for (int64_t row = 0; row < length_of[r]; row += kQueryBlock)
      for (int64_t h = 0; h < p.heads; ++h) items.push_back({start_of[r], length_of[r], h, row, 0});
  }
  // Work items differ in cost (lengths, causal blocks): threads take the next one as they finish.
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Panel panel;
    std::vector<float> s;
    for (int64_t i = next++; i < count; i = next++) {
      if (dtype == at::kFloat) {
        run_item<float>(p, items[i], panel, s);
      } else {
#ifdef __AVX512BF16__
        run_item<c10::BFloat16>(p, items[i], panel, s);
#endif
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(poolrunner_cpu, m) {
  m.def("packed_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor starts, Tensor lengths, "
        "int before, int after, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(poolrunner_cpu, CPU, m) { m.impl("packed_attention", &packed_attention); }
