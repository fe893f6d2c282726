// Decoding layer ops (see decode_ops.h).
//
// Reductions (a row's sum of squares, a query-key dot product) keep kLanes partial sums, lane
// i taking elements i mod kLanes, then add the lanes in a fixed order: the result depends on
// the data alone, and the compiler can vectorise the lanes without reassociating. Each row
// (and each query-head pair of the attention) is computed start to end by one thread.
#include "decode_ops.h"

#include "skinny_gemm.h"
#include "vector_sums.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SPECDEC_X86 1
#endif

namespace specdec {
namespace {

constexpr int kLanes = 8;

// The most queries one attention task takes together (AVX-512 path; the others take one).
constexpr int64_t kMaxQueries = 4;

// Parallel work is split into chunks of at least this many multiply-adds: a region's thread
// wake-up costs more than a small chunk's arithmetic.
constexpr int64_t kGrainFlops = int64_t{1} << 15;

inline float lane_sum(const float (&acc)[kLanes]) {
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

__attribute__((target_clones("arch=x86-64-v3", "default"))) float dot(const float* a, const float* b,
                                                                        int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  }
  for (int j = 0; i + j < n; ++j) acc[j] += a[i + j] * b[i + j];
  return lane_sum(acc);
}

// Portable paths: one libm exp per element.
void silu_mul_row_scalar(const float* gate, const float* up, float* out, int64_t f) {
  for (int64_t j = 0; j < f; ++j) out[j] = (gate[j] / (1.0f + std::exp(-gate[j]))) * up[j];
}

// One query's attention over a group's slots 0 .. seen - 1: out [d] = softmax(q . k * scale) v.
void attend_scalar(const float* query, const float* keys, int64_t key_stride, const float* values,
                   int64_t value_stride, int64_t seen, int64_t d, float scale, float* scores, float* out) {
  float top = -INFINITY;
  for (int64_t t = 0; t < seen; ++t) {
    scores[t] = dot(query, keys + t * key_stride, d) * scale;
    top = std::max(top, scores[t]);
  }
  float total = 0.0f;
  for (int64_t t = 0; t < seen; ++t) {
    scores[t] = std::exp(scores[t] - top);
    total += scores[t];
  }
  std::fill(out, out + d, 0.0f);
  for (int64_t t = 0; t < seen; ++t) {
    for (int64_t j = 0; j < d; ++j) out[j] += scores[t] * values[t * value_stride + j];
  }
  const float inv = 1.0f / total;
  for (int64_t j = 0; j < d; ++j) out[j] *= inv;
}

#ifdef SPECDEC_X86
// exp of 8 floats to ~2 ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n,
// 2^n as two factors so that n = 128 does not overflow the exponent field).
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)));
  const __m256 fn = _mm256_cvtepi32_ps(n);
  __m256 r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i half = _mm256_srai_epi32(n, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(n, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, lo), hi);
}

// A tail of n < 8 floats as a zero-padded vector (through a buffer: the same arithmetic as the
// full vectors, whatever the length).
__attribute__((target("avx2,fma"))) inline __m256 load_tail(const float* p, int64_t n) {
  alignas(32) float buf[8] = {};
  std::copy(p, p + n, buf);
  return _mm256_load_ps(buf);
}

__attribute__((target("avx2,fma"))) inline void store_tail(__m256 v, float* p, int64_t n) {
  alignas(32) float buf[8];
  _mm256_store_ps(buf, v);
  std::copy(buf, buf + n, p);
}

__attribute__((target("avx2,fma"))) inline __m256 silu(__m256 g, __m256 u) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

__attribute__((target("avx2,fma"))) void silu_mul_row_avx2(const float* gate, const float* up, float* out,
                                                          int64_t f) {
  int64_t j = 0;
  for (; j + 8 <= f; j += 8) _mm256_storeu_ps(out + j, silu(_mm256_loadu_ps(gate + j), _mm256_loadu_ps(up + j)));
  if (j < f) store_tail(silu(load_tail(gate + j, f - j), load_tail(up + j, f - j)), out + j, f - j);
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, v);
  return lane_sum(lanes);
}

// attend_scalar with 8-lane vectors, four keys at a time (independent accumulators).
__attribute__((target("avx2,fma"))) void attend_avx2(const float* query, const float* keys, int64_t key_stride,
                                                    const float* values, int64_t value_stride, int64_t seen,
                                                    int64_t d, float scale, float* scores, float* out) {
  const int64_t full = d / 8 * 8;
  const __m256 qt = load_tail(query + full, d - full);
  float top = -INFINITY;
  int64_t t = 0;
  for (; t + 4 <= seen; t += 4) {
    const float* k = keys + t * key_stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j < full; j += 8) {
      const __m256 q = _mm256_loadu_ps(query + j);
      a0 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + j), a0);
      a1 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + key_stride + j), a1);
      a2 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 2 * key_stride + j), a2);
      a3 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 3 * key_stride + j), a3);
    }
    if (full < d) {
      a0 = _mm256_fmadd_ps(qt, load_tail(k + full, d - full), a0);
      a1 = _mm256_fmadd_ps(qt, load_tail(k + key_stride + full, d - full), a1);
      a2 = _mm256_fmadd_ps(qt, load_tail(k + 2 * key_stride + full, d - full), a2);
      a3 = _mm256_fmadd_ps(qt, load_tail(k + 3 * key_stride + full, d - full), a3);
    }
    scores[t] = hsum(a0) * scale;
    scores[t + 1] = hsum(a1) * scale;
    scores[t + 2] = hsum(a2) * scale;
    scores[t + 3] = hsum(a3) * scale;
  }
  for (; t < seen; ++t) {
    const float* k = keys + t * key_stride;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < full; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(query + j), _mm256_loadu_ps(k + j), acc);
    if (full < d) acc = _mm256_fmadd_ps(qt, load_tail(k + full, d - full), acc);
    scores[t] = hsum(acc) * scale;
  }
  for (t = 0; t < seen; ++t) top = std::max(top, scores[t]);
  const __m256 shift = _mm256_set1_ps(top);
  for (t = 0; t + 8 <= seen; t += 8) {
    _mm256_storeu_ps(scores + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift)));
  }
  if (t < seen) store_tail(exp8(_mm256_sub_ps(load_tail(scores + t, seen - t), shift)), scores + t, seen - t);
  float total = 0.0f;
  for (t = 0; t < seen; ++t) total += scores[t];
  // Each output element sums its values in slot order; 64 columns at a time stay in registers
  // over the slots (through memory, a verify's attention was bound by store-to-load latency).
  int64_t j = 0;
  for (; j + 8 <= full; j += 64) {
    const int64_t n = std::min<int64_t>(8, (full - j) / 8);
    __m256 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
    for (t = 0; t < seen; ++t) {
      const __m256 w = _mm256_set1_ps(scores[t]);
      const float* v = values + t * value_stride + j;
      if (n == 8) {
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), acc[c]);
      } else {
        for (int c = 0; c < n; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), acc[c]);
      }
    }
    for (int c = 0; c < n; ++c) _mm256_storeu_ps(out + j + 8 * c, acc[c]);
  }
  for (j = full; j < d; ++j) {
    float acc = 0.0f;
    for (t = 0; t < seen; ++t) acc = std::fma(scores[t], values[t * value_stride + j], acc);
    out[j] = acc;
  }
  const float inv = 1.0f / total;
  for (int64_t j = 0; j < d; ++j) out[j] *= inv;
}

// AVX-512: the queries of one token that share a group's keys (up to four heads) read each key
// and value once. Each (query, key) score is one vector accumulator over D, then sum()'s fixed
// pairing (sum16 for a block), and each output column one accumulator over the slots in order,
// so a query's result does not depend on the queries beside it or the block its key falls in.
// chain_attention of 8 tokens over 300 slots, SmolLM2's 9 heads in 3 groups: 164 -> 100 us
// on one thread, 91 -> 60 us on two, against one head a task with 8-lane vectors (Intel Xeon
// with AMX, the op called from Python, alternated twice).
__attribute__((target("avx512f"))) inline __mmask16 lanes_below(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// exp8 on each 256-bit half: its arithmetic, lane for lane.
__attribute__((target("avx512f,avx2,fma"))) inline __m512 exp16(__m512 x) {
  const __m256 lo = exp8(_mm512_castps512_ps256(x));
  const __m256 hi = exp8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

// Scores of NQ queries [NQ, d] against keys t .. t + valid - 1 (valid <= KB), scaled, into
// scores[q * ld + t + j].
template <int NQ, int KB>
__attribute__((target("avx512f"))) void score_block(const float* query, const float* keys, int64_t key_stride,
                                                   int64_t t, int valid, int64_t d, float scale, float* scores,
                                                   int64_t ld) {
  static_assert(NQ * KB <= 16);
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const float* key[KB];
#pragma GCC unroll 16
  for (int j = 0; j < KB; ++j) key[j] = keys + (t + std::min(j, valid - 1)) * key_stride;
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 mask = lanes_below(d - c);
    __m512 kv[KB];
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) kv[j] = _mm512_maskz_loadu_ps(mask, key[j] + c);
#pragma GCC unroll 4
    for (int q = 0; q < NQ; ++q) {
      const __m512 qv = _mm512_maskz_loadu_ps(mask, query + q * d + c);
#pragma GCC unroll 16
      for (int j = 0; j < KB; ++j) acc[q * KB + j] = _mm512_fmadd_ps(kv[j], qv, acc[q * KB + j]);
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, sum16(acc));
#pragma GCC unroll 16
  for (int l = 0; l < 16; ++l) {
    const int i = kSumOrder[l], q = i / KB, j = i % KB;
    if (i < NQ * KB && j < valid) scores[q * ld + t + j] = sums[l] * scale;
  }
}

// NQ queries' attention over slots 0 .. seen - 1: scores [NQ, seen] as scratch, out[q * out_stride].
template <int NQ>
__attribute__((target("avx512f"))) void attend_queries(const float* query, const float* keys, int64_t key_stride,
                                                      const float* values, int64_t value_stride, int64_t seen,
                                                      int64_t d, float scale, float* scores, float* out,
                                                      int64_t out_stride) {
  constexpr int KB = 16 / NQ;
  for (int64_t t = 0; t < seen; t += KB) {
    score_block<NQ, KB>(query, keys, key_stride, t, static_cast<int>(std::min<int64_t>(KB, seen - t)), d, scale,
                        scores, seen);
  }
  // Softmax of each query's scores; the max and the total in 16 lanes (a sequential chain of
  // maxss or addss over the slots took two fifths of the task).
  float inv[NQ];
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  for (int q = 0; q < NQ; ++q) {
    float* row = scores + q * seen;
    __m512 top = lowest;
    for (int64_t t = 0; t < seen; t += 16) {
      top = _mm512_max_ps(top, _mm512_mask_loadu_ps(lowest, lanes_below(seen - t), row + t));
    }
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < seen; t += 16) {
      const __mmask16 mask = lanes_below(seen - t);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + t), shift));
      _mm512_mask_storeu_ps(row + t, mask, e);
      total = _mm512_mask_add_ps(total, mask, total, e);
    }
    inv[q] = 1.0f / sum(total);
  }
  // 64 columns a pass: NQ x 4 accumulators stay in registers over the slots.
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    __mmask16 mask[4];
    for (int c = 0; c < 4; ++c) mask[c] = lanes_below(std::max<int64_t>(0, d - c0 - 16 * c));
    __m512 acc[NQ][4];
#pragma GCC unroll 4
    for (int q = 0; q < NQ; ++q) {
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[q][c] = _mm512_setzero_ps();
    }
    for (int64_t t = 0; t < seen; ++t) {
      const float* v = values + t * value_stride + c0;
      __m512 vv[4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) vv[c] = _mm512_maskz_loadu_ps(mask[c], v + 16 * c);
#pragma GCC unroll 4
      for (int q = 0; q < NQ; ++q) {
        const __m512 w = _mm512_set1_ps(scores[q * seen + t]);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) acc[q][c] = _mm512_fmadd_ps(w, vv[c], acc[q][c]);
      }
    }
#pragma GCC unroll 4
    for (int q = 0; q < NQ; ++q) {
      const __m512 scale_q = _mm512_set1_ps(inv[q]);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        _mm512_mask_storeu_ps(out + q * out_stride + c0 + 16 * c, mask[c], _mm512_mul_ps(acc[q][c], scale_q));
      }
    }
  }
}

void attend_avx512(int64_t n, const float* query, const float* keys, int64_t key_stride, const float* values,
                   int64_t value_stride, int64_t seen, int64_t d, float scale, float* scores, float* out,
                   int64_t out_stride) {
  switch (n) {
    case 1:
      return attend_queries<1>(query, keys, key_stride, values, value_stride, seen, d, scale, scores, out, out_stride);
    case 2:
      return attend_queries<2>(query, keys, key_stride, values, value_stride, seen, d, scale, scores, out, out_stride);
    case 3:
      return attend_queries<3>(query, keys, key_stride, values, value_stride, seen, d, scale, scores, out, out_stride);
    default:
      return attend_queries<4>(query, keys, key_stride, values, value_stride, seen, d, scale, scores, out, out_stride);
  }
}
#endif

// AVX2 + FMA where the skinny GEMM takes a vector path (skinny_gemm.cpp decides once from the
// CPU, and SPECDEC_SKINNY_ISA=scalar sends these ops down the portable paths too), else the
// portable paths.
bool avx2() {
  static const bool yes = skinny_linear_isa() != "scalar";
  return yes;
}

bool avx512() {
  static const bool yes = skinny_linear_isa() == "avx512";
  return yes;
}


void attend(const float* query, const float* keys, int64_t key_stride, const float* values, int64_t value_stride,
            int64_t seen, int64_t d, float scale, float* scores, float* out) {
#ifdef SPECDEC_X86
  if (avx2()) return attend_avx2(query, keys, key_stride, values, value_stride, seen, d, scale, scores, out);
#endif
  attend_scalar(query, keys, key_stride, values, value_stride, seen, d, scale, scores, out);
}

// out[j] = t[j] cos[j] + rotate_half(t)[j] sin[j] for j < r, t[j] beyond (megatron's unfused
// RoPE, rope_utils._apply_rotary_pos_emb_bshd).
void rotate(const float* t, const float* cos, const float* sin, int64_t r, int64_t d, float* out) {
  const int64_t half = r / 2;
  for (int64_t j = 0; j < half; ++j) out[j] = t[j] * cos[j] + (-t[j + half]) * sin[j];
  for (int64_t j = half; j < r; ++j) out[j] = t[j] * cos[j] + t[j - half] * sin[j];
  for (int64_t j = r; j < d; ++j) out[j] = t[j];
}

at::Tensor rows_of(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dim");
  return x.reshape({-1, x.size(-1)}).contiguous();
}

}  // namespace

void rms_norm_rows(const float* in, const float* weight, float eps, int64_t h, float* out, int64_t begin,
                   int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const float* row = in + r * h;
    const float inv = 1.0f / std::sqrt(dot(row, row, h) / static_cast<float>(h) + eps);
    for (int64_t j = 0; j < h; ++j) out[r * h + j] = (row[j] * inv) * weight[j];
  }
}

void silu_mul_span(const float* gate, const float* up, float* out, int64_t n) {
#ifdef SPECDEC_X86
  if (avx2()) return silu_mul_row_avx2(gate, up, out, n);
#endif
  silu_mul_row_scalar(gate, up, out, n);
}

ChainAttention::ChainAttention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& keys, const at::Tensor& values, int64_t first, int64_t heads,
                               double scale, int threads)
    : first(first), heads(heads), scale(static_cast<float>(scale)) {
  TORCH_CHECK(keys.dim() == 4 && keys.size(1) == 1 && keys.sizes() == values.sizes(),
              "chain_attention: keys and values must be one sequence's cache [L, 1, groups, D], got ",
              keys.sizes(), " and ", values.sizes());
  groups = keys.size(2);
  d = keys.size(3);
  const int64_t slots = keys.size(0);
  for (const at::Tensor* t : {&qkv, &cos, &sin, &keys, &values}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, "chain_attention: tensors must be float32, got ",
                t->scalar_type());
  }
  TORCH_CHECK(keys.stride(3) == 1 && keys.stride(2) == d && values.stride(3) == 1 && values.stride(2) == d,
              "chain_attention: each cache slot's [groups, D] must be contiguous");
  TORCH_CHECK(heads > 0 && heads % groups == 0, "chain_attention: heads (", heads,
              ") must be a multiple of the cache's groups (", groups, ")");
  per_group = heads / groups;
  width = (per_group + 2) * d;
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(1) == 1 && qkv.size(2) == groups * width,
              "chain_attention: qkv must be [s, 1, ", groups * width, "], got ", qkv.sizes());
  s = qkv.size(0);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == s && cos.sizes() == sin.sizes() && cos.size(1) <= d &&
                  cos.size(1) % 2 == 0,
              "chain_attention: cos and sin must be [", s, ", R] with R even and <= ", d, ", got ", cos.sizes(),
              " and ", sin.sizes());
  TORCH_CHECK(first >= 0 && first + s <= slots, "chain_attention: slots ", first, "..", first + s - 1,
              " do not fit a cache of ", slots);
  r = cos.size(1);
  // One query a task, or (AVX-512) a group's heads in as few tasks as keep every thread busy
  // (at least two tasks a thread), each of at most kMaxQueries.
  chunks = per_group;
  if (avx512()) {
    const int64_t wanted = (2 * threads + s * groups - 1) / (s * groups);
    chunks = std::min(per_group, std::max(wanted, (per_group + kMaxQueries - 1) / kMaxQueries));
  }
  per_chunk = (per_group + chunks - 1) / chunks;
  chunks = (per_group + per_chunk - 1) / per_chunk;
  qkv_ = qkv.contiguous();
  cos_ = cos.contiguous();
  sin_ = sin.contiguous();
  key_cache = keys.data_ptr<float>();
  value_cache = values.data_ptr<float>();
  key_stride = keys.stride(0);
  value_stride = values.stride(0);
}

void ChainAttention::write_slot(int64_t item) const {
  const int64_t i = item / groups, g = item % groups;
  const float* group = qkv_.data_ptr<float>() + (i * groups + g) * width;
  rotate(group + per_group * d, cos_.data_ptr<float>() + i * r, sin_.data_ptr<float>() + i * r, r, d,
         key_cache + (first + i) * key_stride + g * d);
  std::copy(group + (per_group + 1) * d, group + (per_group + 2) * d, value_cache + (first + i) * value_stride + g * d);
}

void ChainAttention::attend_task(int64_t task, float* scratch, float* out) const {
  const int64_t i = task / (groups * chunks), g = group_of(task), c = task % chunks;
  const int64_t h = g * per_group + c * per_chunk, n = std::min(per_chunk, per_group - c * per_chunk);
  const float* q = qkv_.data_ptr<float>() + (i * groups + g) * width + c * per_chunk * d;
  for (int64_t j = 0; j < n; ++j) {
    rotate(q + j * d, cos_.data_ptr<float>() + i * r, sin_.data_ptr<float>() + i * r, r, d, scratch + j * d);
  }
  float* at = out + i * heads * d + h * d;
  const int64_t seen = first + i + 1;
#ifdef SPECDEC_X86
  if (avx512()) {
    return attend_avx512(n, scratch, key_cache + g * d, key_stride, value_cache + g * d, value_stride, seen, d, scale,
                         scratch + n * d, at, d);
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    attend(scratch + j * d, key_cache + g * d, key_stride, value_cache + g * d, value_stride, seen, d, scale,
           scratch + n * d, at + j * d);
  }
}

void ChainAttention::prefetch_cache(int64_t begin, int64_t end) const {
#ifdef SPECDEC_X86
  if (begin >= end) return;
  // A run of tasks visits groups g0, g0 + 1, ... (cyclically), all of them once it spans a token.
  const int64_t g0 = group_of(begin);
  const int64_t visited = end - begin >= groups * chunks ? groups : (group_of(end - 1) - g0 + groups) % groups + 1;
  for (int64_t j = 0; j < visited; ++j) {
    const int64_t g = (g0 + j) % groups;
    for (int64_t t = 0; t < first; ++t) {
      for (int64_t c = 0; c < d; c += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(key_cache + t * key_stride + g * d + c), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(value_cache + t * value_stride + g * d + c), _MM_HINT_T1);
      }
    }
  }
#endif
}

int64_t ChainAttention::task_flops() const { return 2 * (first + s) * d * per_chunk; }

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t h = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h && weight.scalar_type() == at::kFloat,
              "rms_norm: weight must be float32 [", h, "], got ", weight.scalar_type(), " ", weight.sizes());
  const at::Tensor rows = rows_of(x, "rms_norm");
  const at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty_like(rows);
  at::parallel_for(0, rows.size(0), std::max<int64_t>(1, kGrainFlops / std::max<int64_t>(1, h)),
                   [&](int64_t begin, int64_t end) {
                     rms_norm_rows(rows.data_ptr<float>(), w.data_ptr<float>(), static_cast<float>(eps), h,
                                   y.data_ptr<float>(), begin, end);
                   });
  return y.view(x.sizes());
}

at::Tensor silu_mul_cpu(const at::Tensor& x) {
  const int64_t two_f = x.size(-1);
  TORCH_CHECK(two_f % 2 == 0, "silu_mul: the last dim of x must be even (gate, up), got ", two_f);
  const int64_t f = two_f / 2;
  const at::Tensor rows = rows_of(x, "silu_mul");
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = f;
  at::Tensor y = at::empty({rows.size(0), f}, rows.options());
  const float* in = rows.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, rows.size(0), std::max<int64_t>(1, kGrainFlops / std::max<int64_t>(1, 8 * f)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t r = begin; r < end; ++r) {
                       const float* gate = in + r * two_f;
                       silu_mul_span(gate, gate + f, out + r * f, f);
                     }
                   });
  return y.view(sizes);
}

at::Tensor chain_attention_cpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& keys, const at::Tensor& values, int64_t first,
                               int64_t heads, double scale) {
  const ChainAttention attention(qkv, cos, sin, keys, values, first, heads, scale, at::get_num_threads());
  // The new tokens' keys (rotated) and values into their slots.
  for (int64_t item = 0; item < attention.s * attention.groups; ++item) attention.write_slot(item);
  at::Tensor y = at::empty({attention.s, 1, heads * attention.d}, qkv.options());
  float* out = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainFlops / std::max<int64_t>(1, attention.task_flops()));
  at::parallel_for(0, attention.tasks(), grain,
                   [&](int64_t begin, int64_t end) {
                     std::vector<float> scratch(attention.scratch_size());
                     for (int64_t task = begin; task < end; ++task) attention.attend_task(task, scratch.data(), out);
                   });
  return y;
}

}  // namespace specdec
