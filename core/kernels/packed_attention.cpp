// Attention over a packed, padding-free batch on x86 CPUs, in one call per layer: float32 and
// bfloat16 with AVX-512 (bfloat16 needs AVX512-BF16; with AMX its products run on tiles), float32
// alone with AVX2 and FMA.
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
// bf16 first, as a bf16 product would, adds 14% to the mean error). On AMX tiles they go in as
// two bf16 parts (the tiles' section below).
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

#include "kernel_common.h"
#ifdef __AMX_BF16__
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

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
    for (int64_t d = 0; d < p.dim; d += kKeys)  // head_dim is a multiple of 16: whole vectors
      vstore(panel.values.data() + j * p.dim + d, poolrunner_cpu::load(vrow + d, poolrunner_cpu::lanes(p.dim - d)));
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
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), poolrunner_cpu::to_bf16(x));
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

// The keys an item's rows see: from its first row's first (a window's lower edge) to its last
// row's last (causal rows see no key past the block's last row).
inline int64_t item_keys(const Problem& p, const Item& item) {
  const int64_t last_row = std::min(item.first_row + kQueryBlock, item.length);
  return end_key(p, last_row - 1, item.length) - first_key(p, item.first_row);
}

template <typename T>
void run_item(const Problem& p, Item item, Panel& panel, std::vector<float>& s) {
  const int64_t last_row = std::min(item.first_row + kQueryBlock, item.length);
  item.key0 = first_key(p, item.first_row);
  const int64_t keys = item_keys(p, item);
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

// ---- bfloat16 on AMX tiles -------------------------------------------------------------------
// On CPUs with AMX (Intel Xeon, 4th generation on) both products of a bfloat16 item run on tiles,
// 16 query rows at a time: scores in 16 x 16 blocks (exact products, fp32 sums, as vdpbf16ps),
// the values product 32 keys a step. Tiles multiply bf16 only, so each fp32 softmax numerator e
// goes in as two bf16 parts, hi (e with its low 16 bits cleared, exact) and lo = bf16(e - hi):
// a relative error under 2^-16, where one rounding to bf16 (torch's flash kernel) leaves 2^-9.
// The numerators are 2^(s c - max c), c = scale log2(e): one FMA and a degree-5 fit of 2^f
// (relative error 2.4e-7, 2 ulp) instead of exp_ps's range reduction by ln 2.
// Why: the attention of 32- to 512-token requests takes 1.6-3x less time than on the vector
// units (2 Xeon cores), and torch's flash kernel, which also uses tiles, pays its per-call
// overhead on every request (cpu_kernels.TILE_KEYS, bench/README.md).

#ifdef __AMX_BF16__
constexpr int64_t kTileRows = 16;     // query rows per tile, and keys per block of scores
constexpr int64_t kTileKeys = 32;     // keys per step of the values product
constexpr int64_t kTileDim = 32;      // head_dim per step of the scores product
constexpr int64_t kTileBytes = 64;    // one tile row
constexpr int64_t kTileWords = kTileRows * kTileBytes / 4;  // one tile, in 32-bit pairs
// Items whose rows see fewer keys stay on the vector units: on 2 AMX Xeon cores, 12 heads, the
// tiles' time over theirs is 1.4x at 4 keys, 1.0x at 8, 0.83x at 12 and 0.55x from 32 keys.
constexpr int64_t kTileMinKeys = 12;

// GCC's tile intrinsics are assembler templates without memory operands: the compiler must not
// move plain loads or stores of a tile's buffer across them.
inline void tile_fence() { asm volatile("" ::: "memory"); }

// This CPU has AMX-BF16 and the Linux kernel lets this process use tile state (asked once).
bool amx_available() {
  static const bool available = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return available;
}

// Every tile 16 rows of 64 bytes: tmm0 and tmm1 left operands, tmm2 and tmm3 right ones, tmm4 to
// tmm7 sums. Per thread; oneDNN loads its own configuration before each of its products.
void configure_tiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = kTileBytes;
    config.rows[t] = kTileRows;
  }
  tile_fence();  // the intrinsic's operand is the configuration's first 8 bytes only
  _tile_loadconfig(&config);
}

// The first n (<= 4) sum tiles, zeroed or stored: tile numbers must be literals.
inline void zero_sums(int64_t n) {
  _tile_zero(4);
  if (n > 1) _tile_zero(5);
  if (n > 2) _tile_zero(6);
  if (n > 3) _tile_zero(7);
}
inline void store_sums(int64_t n, float* dst, int64_t next, int64_t stride) {
  _tile_stored(4, dst, stride);
  if (n > 1) _tile_stored(5, dst + next, stride);
  if (n > 2) _tile_stored(6, dst + 2 * next, stride);
  if (n > 3) _tile_stored(7, dst + 3 * next, stride);
  tile_fence();
}
// Sum tile j += tmm0 x right tile j, for j < n (<= 4); the right tiles `next` words apart.
inline void multiply(int64_t n, const uint32_t* right, int64_t next) {
  _tile_loadd(2, right, kTileBytes);
  _tile_dpbf16ps(4, 0, 2);
  if (n > 1) {
    _tile_loadd(3, right + next, kTileBytes);
    _tile_dpbf16ps(5, 0, 3);
  }
  if (n > 2) {
    _tile_loadd(2, right + 2 * next, kTileBytes);
    _tile_dpbf16ps(6, 0, 2);
  }
  if (n > 3) {
    _tile_loadd(3, right + 3 * next, kTileBytes);
    _tile_dpbf16ps(7, 0, 3);
  }
}
// For j < n (<= 2): sum tile 4 + j += tmm0 x right tile j and sum tile 6 + j += tmm1 x it: the
// two parts in sums of their own, so that neither product waits for the other.
inline void multiply_parts(int64_t n, const uint32_t* right, int64_t next) {
  _tile_loadd(2, right, kTileBytes);
  _tile_dpbf16ps(4, 0, 2);
  _tile_dpbf16ps(6, 1, 2);
  if (n > 1) {
    _tile_loadd(3, right + next, kTileBytes);
    _tile_dpbf16ps(5, 0, 3);
    _tile_dpbf16ps(7, 1, 3);
  }
}

// 2^t in fp32: a degree-5 fit of 2^f on |f| <= 1/2 (relative error 2.4e-7), scaled by
// 2^round(t) (below 2^-126 subnormal, then 0). 8 operations where exp_ps takes 14.
inline Vec exp2_ps(Vec t) {
  const Vec n = vround(t);
  const Vec f = vsub(t, n);
  Vec p = vset(1.3276464e-3f);
  p = vfma(p, f, vset(9.6755410e-3f));
  p = vfma(p, f, vset(5.5507135e-2f));
  p = vfma(p, f, vset(2.4022120e-1f));
  p = vfma(p, f, vset(6.9314694e-1f));
  p = vfma(p, f, vset(1.0000001f));
  return vpow2_times(p, n);
}

// One item's keys and values in the tiles' right-operand layout, and one thread's tile scratch.
struct TilePanel {
  int64_t padded = 0;  // keys rounded up to kTileKeys; padding keys are 0
  int64_t stride = 0;  // elements from one score row to the next: padded, off a power of two
  std::vector<uint32_t> keys;    // [padded / 16][dim / 32] tiles: row t, column n: k[n] pair t
  std::vector<uint32_t> values;  // [padded / 32][dim / 16] tiles: row t, column n: v[2t][n], v[2t + 1][n]
  std::vector<uint16_t> q;       // [16][dim], the tile's query rows (zero past the request)
  std::vector<float> s;          // [16][stride] raw scores
  std::vector<uint16_t> hi, lo;  // [16][stride] the numerators' two bf16 parts
  std::vector<float> o;          // [2][16][dim] unnormalized output rows: hi's products, lo's
};

// The 16 x 16 matrix of 32-bit elements in r transposed in place (row i, element j <-> row j,
// element i): pairs within 128-bit lanes, then quads, then whole lanes across registers.
void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + e], lane L: element 4L + e of rows i .. i + 3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i a = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), b = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i c = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
    const __m512i d = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(a, c, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(a, c, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(b, d, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
}

// Keys: per block of 16 keys and step of 32 head_dim, the block's rows of pairs transposed.
// Values: per step of 32 keys and block of 16 head_dim, each two keys' rows interleaved.
void pack_tiles(const Problem& p, int64_t start, int64_t length, int64_t kv_head, TilePanel& panel) {
  const int64_t steps = p.dim / kTileDim, blocks = p.dim / kTileRows;
  panel.keys.resize(panel.padded / kTileRows * steps * kTileWords);
  panel.values.resize(panel.padded / kTileKeys * blocks * kTileWords);
  const auto* k = static_cast<const uint16_t*>(p.k) + start * p.k_token + kv_head * p.k_head;
  const auto* v = static_cast<const uint16_t*>(p.v) + start * p.v_token + kv_head * p.v_head;
  for (int64_t j0 = 0; j0 < panel.padded; j0 += kTileRows) {
    for (int64_t t = 0; t < steps; ++t) {
      __m512i rows[16];
      for (int64_t n = 0; n < kTileRows; ++n) {
        const bool key = j0 + n < length;
        rows[n] = key ? _mm512_loadu_si512(k + (j0 + n) * p.k_token + t * kTileDim) : _mm512_setzero_si512();
      }
      transpose16(rows);
      uint32_t* tile = panel.keys.data() + (j0 / kTileRows * steps + t) * kTileWords;
      for (int64_t n = 0; n < kTileRows; ++n) _mm512_storeu_si512(tile + n * kTileRows, rows[n]);
    }
  }
  // Element 2n of a tile row from the even key, 2n + 1 from the odd one.
  alignas(64) static constexpr uint16_t kInterleave[32] = {
      0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const auto value_row = [&](int64_t j, int64_t d) {  // 16 values of key j from head_dim 16 d, or 0
    const auto* src = reinterpret_cast<const __m256i*>(v + j * p.v_token + d * kTileRows);
    return _mm512_castsi256_si512(j < length ? _mm256_loadu_si256(src) : _mm256_setzero_si256());
  };
  for (int64_t j = 0; j < panel.padded; j += 2) {
    uint32_t* row = panel.values.data() + (j / kTileKeys * blocks * kTileRows + j % kTileKeys / 2) * kTileRows;
    for (int64_t d = 0; d < blocks; ++d)
      _mm512_storeu_si512(row + d * kTileWords,
                          _mm512_permutex2var_epi16(value_row(j, d), interleave, value_row(j + 1, d)));
  }
}

// Softmax numerators of one score row e (raw sums) as their bf16 parts into h and l over keys
// first .. first + width: exp(e * scale - max) on keys lo .. hi, 0 elsewhere (scale > 0: the
// largest sum gives the largest score). Returns the fp32 sum of the numerators.
float split_row(const float* e, uint16_t* h, uint16_t* l, int64_t first, int64_t width, int64_t lo, int64_t hi,
                float scale) {
  const int64_t b0 = lo / kKeys, b1 = (hi + kKeys - 1) / kKeys;
  const auto whole = [&](int64_t b) { return b * kKeys >= lo && (b + 1) * kKeys <= hi; };
  Vec top = vset(-INFINITY);
  for (int64_t b = b0; b < b1; ++b)
    top = whole(b) ? vmax(top, vload(e + b * kKeys)) : max_on(top, valid_lanes(b, lo, hi), vload(e + b * kKeys));
  // exp(s scale - max) = 2^(s c - max_s c), c = scale log2(e): one FMA; the rounding of max_s c
  // scales the whole row alike, which the normalization cancels.
  const float c = scale * 1.44269504088896341f;
  const Vec times = vset(c), shift = vset(-vtop(top) * c);
  // hi: x with its low 16 bits cleared (exact in bf16); lo: bf16(x - hi), x - hi exact in fp32.
  const __m512i upper = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  Vec sum = vzero();
  for (int64_t j = 0; j < width; j += kTileKeys) {
    Vec x[2], top_part[2];
    for (int u = 0; u < 2; ++u) {
      const int64_t b = (first + j) / kKeys + u;
      x[u] = vzero();
      if (b >= b0 && b < b1) {
        x[u] = exp2_ps(vfma(vload(e + b * kKeys), times, shift));
        if (!whole(b)) x[u] = keep(valid_lanes(b, lo, hi), x[u]);
        sum = vadd(sum, x[u]);
      }
      top_part[u] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x[u]), upper));
    }
    _mm512_storeu_si512(h + j, (__m512i)_mm512_cvtne2ps_pbh(top_part[1], top_part[0]));
    _mm512_storeu_si512(l + j, (__m512i)_mm512_cvtne2ps_pbh(vsub(x[1], top_part[1]), vsub(x[0], top_part[0])));
  }
  return vsum(sum);
}

// Query rows r0 .. r0 + m (m <= 16) of the item's request: scores, numerators, values, output.
void tile_rows(const Problem& p, TilePanel& panel, const Item& item, int64_t r0, int64_t m) {
  const auto* q = static_cast<const uint16_t*>(p.q);
  int64_t lo[kTileRows], hi[kTileRows];
  for (int64_t i = 0; i < kTileRows; ++i) {
    uint16_t* dst = panel.q.data() + i * p.dim;
    if (i < m) {
      std::copy_n(q + (item.start + r0 + i) * p.q_token + item.head * p.q_head, p.dim, dst);
      lo[i] = first_key(p, r0 + i) - item.key0;
      hi[i] = end_key(p, r0 + i, item.length) - item.key0;
    } else {
      std::fill_n(dst, p.dim, uint16_t{0});
    }
  }
  const int64_t b0 = lo[0] / kTileRows, b1 = (hi[m - 1] + kTileRows - 1) / kTileRows;
  const int64_t steps = p.dim / kTileDim;
  tile_fence();
  for (int64_t b = b0; b < b1; b += 4) {
    const int64_t n = std::min<int64_t>(4, b1 - b);
    zero_sums(n);
    for (int64_t t = 0; t < steps; ++t) {
      _tile_loadd(0, panel.q.data() + t * kTileDim, p.dim * 2);
      multiply(n, panel.keys.data() + (b * steps + t) * kTileWords, steps * kTileWords);
    }
    store_sums(n, panel.s.data() + b * kTileRows, kTileRows, panel.stride * 4);
  }
  // Numerators over whole steps of 32 keys c0 .. c1; keys outside a row's span are 0.
  const int64_t c0 = b0 / 2, c1 = (b1 + 1) / 2;
  const int64_t first = c0 * kTileKeys, width = (c1 - c0) * kTileKeys;
  float inv_sum[kTileRows];
  for (int64_t i = 0; i < kTileRows; ++i) {
    float* e = panel.s.data() + i * panel.stride;
    uint16_t* h = panel.hi.data() + i * panel.stride + first;
    uint16_t* l = panel.lo.data() + i * panel.stride + first;
    if (i >= m) {
      std::fill_n(h, width, uint16_t{0});
      std::fill_n(l, width, uint16_t{0});
      continue;
    }
    inv_sum[i] = 1.0f / split_row(e, h, l, first, width, lo[i], hi[i], p.scale);
  }
  tile_fence();
  const int64_t blocks = p.dim / kTileRows;
  for (int64_t d = 0; d < blocks; d += 2) {
    const int64_t n = std::min<int64_t>(2, blocks - d);
    zero_sums(4);
    for (int64_t c = c0; c < c1; ++c) {
      _tile_loadd(0, panel.hi.data() + c * kTileKeys, panel.stride * 2);
      _tile_loadd(1, panel.lo.data() + c * kTileKeys, panel.stride * 2);
      multiply_parts(n, panel.values.data() + (c * blocks + d) * kTileWords, kTileWords);
    }
    float* top_sums = panel.o.data() + d * kTileRows;
    float* rest_sums = top_sums + kTileRows * p.dim;
    _tile_stored(4, top_sums, p.dim * 4);
    _tile_stored(6, rest_sums, p.dim * 4);
    if (n > 1) {
      _tile_stored(5, top_sums + kTileRows, p.dim * 4);
      _tile_stored(7, rest_sums + kTileRows, p.dim * 4);
    }
    tile_fence();
  }
  for (int64_t i = 0; i < m; ++i) {
    auto* dst = static_cast<c10::BFloat16*>(p.out) + ((item.start + r0 + i) * p.heads + item.head) * p.dim;
    const float* top_sums = panel.o.data() + i * p.dim;
    const float* rest_sums = top_sums + kTileRows * p.dim;
    for (int64_t d = 0; d < p.dim; d += kKeys)
      store(dst + d, vmul(vadd(vload(top_sums + d), vload(rest_sums + d)), vset(inv_sum[i])));
  }
}

void run_tile_item(const Problem& p, Item item, TilePanel& panel) {
  const int64_t last_row = std::min(item.first_row + kQueryBlock, item.length);
  item.key0 = first_key(p, item.first_row);
  const int64_t keys = item_keys(p, item);
  panel.padded = (keys + kTileKeys - 1) / kTileKeys * kTileKeys;
  panel.stride = panel.padded + (panel.padded / kTileKeys % 2 == 0 ? kTileKeys : 0);
  pack_tiles(p, item.start + item.key0, keys, item.head / p.group, panel);
  panel.q.resize(kTileRows * p.dim);
  panel.s.resize(kTileRows * panel.stride);
  panel.hi.resize(kTileRows * panel.stride);
  panel.lo.resize(kTileRows * panel.stride);
  panel.o.resize(2 * kTileRows * p.dim);
  for (int64_t r0 = item.first_row; r0 < last_row; r0 += kTileRows)
    tile_rows(p, panel, item, r0, std::min(kTileRows, last_row - r0));
}
#endif  // __AMX_BF16__

void packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                      const at::Tensor& starts, const at::Tensor& lengths, int64_t before, int64_t after,
                      double scale, bool tiles) {
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
#ifdef __AMX_BF16__
  tiles = tiles && dtype == at::kBFloat16 && dim % kTileDim == 0 && scale > 0 && amx_available();
#else
  (void)tiles;  // no tiles in this build
#endif
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
#ifdef __AMX_BF16__
    if (tiles) configure_tiles();
    TilePanel tile_panel;
#endif
    Panel panel;
    std::vector<float> s;
    for (int64_t i = next++; i < count; i = next++) {
#ifdef __AMX_BF16__
      if (tiles && item_keys(p, items[i]) >= kTileMinKeys) {
        run_tile_item(p, items[i], tile_panel);
        continue;
      }
#endif
      if (dtype == at::kFloat) {
        run_item<float>(p, items[i], panel, s);
      } else {
#ifdef __AVX512BF16__
        run_item<c10::BFloat16>(p, items[i], panel, s);
#endif
      }
    }
#ifdef __AMX_BF16__
    if (tiles) _tile_release();
#endif
  });
}

}  // namespace

TORCH_LIBRARY(poolrunner_cpu, m) {
  m.def("packed_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor starts, Tensor lengths, "
        "int before, int after, float scale, bool tiles) -> ()");
}

TORCH_LIBRARY_IMPL(poolrunner_cpu, CPU, m) { m.impl("packed_attention", &packed_attention); }
