// The greedy output head (see greedy_head.h).
//
// One pass over the int8 screen: each thread sums its weight rows against every row of x in
// int32, turns each sum into a screened logit and its interval as it goes, keeps the running
// largest lower end per row of x and every row whose upper end reaches it so far; the threads'
// lists are then cut at the largest lower end of all, and the rows left are computed in float32.
#include "greedy_head.h"

#include "skinny_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SPECDEC_X86 1
#endif

namespace specdec {
namespace {

// The screen's path: int8 x int16 products summed in int32 lanes. Every path sums the same
// integers exactly, so the screened logits are the same bits on every CPU.
enum class IntPath { kScalar, kAvx2, kVnni };

// AVX-512 VNNI where the skinny GEMM takes its AVX-512 path and the CPU has it, AVX2 where the
// skinny GEMM takes a vector path (SPECDEC_SKINNY_ISA moves both down), else scalar.
IntPath int_path() {
  static const IntPath chosen = [] {
    const std::string isa = skinny_linear_isa();
#ifdef SPECDEC_X86
    __builtin_cpu_init();
    if (isa == "avx512" && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512vnni")) {
      return IntPath::kVnni;
    }
    if (isa != "scalar") return IntPath::kAvx2;
#endif
    return IntPath::kScalar;
  }();
  return chosen;
}

// The largest |p| of a row of x: K products of |q| <= 127 and |p| <= qmax sum within int32.
int32_t screen_qmax(int64_t k) {
  return static_cast<int32_t>(
      std::min<int64_t>(32767, std::numeric_limits<int32_t>::max() / (127 * std::max<int64_t>(1, k))));
}

// A float64 value as the nearest float32 at or above it.
float up(double v) {
  float f = static_cast<float>(v);
  if (f < v) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  return f;
}

// A row of x as 16-bit integers, x ~ t p with |p| <= qmax, and the norms its bound takes:
// X >= ||x||, E >= ||x - t p||. `screened` is false where the row cannot be screened (a value
// not finite, all zeros, a scale that underflows): its logits are all computed in float32.
struct RowOfX {
  float t = 0.f, X = 0.f, E = 0.f;
  bool screened = false;

  RowOfX(const float* x, int64_t k, int32_t qmax, int16_t* p) {
    float amax = 0.f;
    double squares = 0.0;
    for (int64_t i = 0; i < k; ++i) {
      amax = std::max(amax, std::fabs(x[i]));  // a NaN fails the checks below through squares
      squares += static_cast<double>(x[i]) * x[i];
    }
    const float scale = amax / static_cast<float>(qmax);
    if (!std::isfinite(squares) || !(amax > 0.f) || !std::isnormal(scale)) return;
    double error = 0.0;
    for (int64_t i = 0; i < k; ++i) {
      const float q = std::min(std::max(std::nearbyint(x[i] / scale), -static_cast<float>(qmax)),
                               static_cast<float>(qmax));
      p[i] = static_cast<int16_t>(q);
      const double d = static_cast<double>(x[i]) - static_cast<double>(scale) * q;  // t p: exact in float64
      error += d * d;
    }
    // Each float64 sum is within K 2^-53 of its value: a 2^-30 widening covers it.
    t = scale;
    X = up(std::sqrt(squares) * (1 + 0x1p-30));
    E = up(std::sqrt(error) * (1 + 0x1p-30));
    screened = std::isfinite(X);
  }
};

struct IntOperands {
  const int8_t* q;  // [N, k] int8, rows contiguous
  int64_t n;
  int64_t k;
  const int16_t* p;  // [m, kp] int16, kp >= k a multiple of 32, zero past k
  int64_t kp;
  const float* scale;  // [N]
  const float* a;  // [N]: bound[0]
  const float* c;  // [N]: bound[1]
  // t, X and E of the rows of x, zero past m to a multiple of 4 (the vector epilogue's rows).
  const float* t;
  const float* X;
  const float* E;
  // Where asked for, every screened logit: z [m, ldz] (row r of x, weight row n).
  float* z = nullptr;
  int64_t ldz = 0;
};

// What one thread's share of the weight rows leaves for each row of x: the largest lower end
// of its screened logits, the rows whose upper end reached a running lower end when they were
// scored (a superset of those that reach the largest), and whether a screened logit was not
// finite (the row of x then falls back). The running lower ends are kept in 16 lanes a group of
// four rows of x, lane (n mod 4) 4 + (r mod 4) for weight row n and row r of x, as the
// AVX-512 epilogue holds them.
struct Kept {
  // Covers what underflow can take from the relative bounds (models/layers/greedy_head.py).
  static constexpr float kSlack = 0x1p-100f;
  const IntOperands& o;
  std::vector<float> lanes;
  std::vector<std::vector<std::pair<float, int64_t>>> high;
  std::vector<char> bad;

  Kept(const IntOperands& o, int64_t m)
      : o(o), lanes((m + 3) / 4 * 16, -std::numeric_limits<float>::infinity()), high(m), bad(m, 0) {}

  void add(int64_t r, int64_t n, int32_t d) {
    const float z = (o.scale[n] * o.t[r]) * static_cast<float>(d);
    if (o.z != nullptr) o.z[r * o.ldz + n] = z;
    if (!std::isfinite(z)) bad[r] = 1;
    const float b = std::fma(o.a[n], o.X[r], o.c[n] * o.E[r]) + kSlack;
    float& low = lanes[r / 4 * 16 + n % 4 * 4 + r % 4];
    low = std::max(low, z - b);
    if (z + b >= low) high[r].emplace_back(z + b, n);
  }

  // A vector epilogue's lanes (lane 4 n + r: weight row n0 + n, row r0 + r of x) whose logit
  // was not finite (`bad_lanes`) or whose upper end his[l] reached the running lower end
  // (`keep_lanes`).
  void mark(int64_t n0, int64_t r0, unsigned bad_lanes, unsigned keep_lanes, const float* his) {
    for (unsigned mask = bad_lanes; mask; mask &= mask - 1) bad[r0 + __builtin_ctz(mask) % 4] = 1;
    for (unsigned mask = keep_lanes; mask; mask &= mask - 1) {
      const int l = __builtin_ctz(mask);
      high[r0 + l % 4].emplace_back(his[l], n0 + l / 4);
    }
  }

  float low(int64_t r) const {
    float out = -std::numeric_limits<float>::infinity();
    for (int l = 0; l < 4; ++l) out = std::max(out, lanes[r / 4 * 16 + l * 4 + r % 4]);
    return out;
  }
};

// Rows [n0, n0 + NB) of the weight against rows [r0, r0 + MB) of x.
template <int NB, int MB>
void int_block_scalar(Kept& kept, int64_t n0, int64_t r0) {
  const IntOperands& o = kept.o;
  for (int r = 0; r < MB; ++r) {
    for (int n = 0; n < NB; ++n) {
      int32_t d = 0;
      for (int64_t i = 0; i < o.k; ++i) d += int32_t{o.q[(n0 + n) * o.k + i]} * o.p[(r0 + r) * o.kp + i];
      kept.add(r0 + r, n0 + n, d);
    }
  }
}

#ifdef SPECDEC_X86
// The screen is read into L2 this many blocks ahead, two lines per 32 columns of a block of
// four rows: left to the hardware alone, one row of x took 1.4 ms where it now takes 1.0 (a
// 49152 x 576 screen, Intel Xeon with AMX, 2 cores; one block ahead or into L1, 1.05-1.1).
constexpr int64_t kBlocksAhead = 3;

// A block's weight rows [n0, n0 + NB) and rows of x [r0, r0 + MB), and the prefetch of the
// screen kBlocksAhead blocks on, shared by the vector paths.
template <int NB, int MB>
struct BlockRows {
  const int8_t* w[NB];
  const int16_t* x[MB];
  const char* ahead;

  BlockRows(const IntOperands& o, int64_t n0, int64_t r0) {
    for (int n = 0; n < NB; ++n) w[n] = o.q + (n0 + n) * o.k;
    for (int r = 0; r < MB; ++r) x[r] = o.p + (r0 + r) * o.kp;
    ahead = reinterpret_cast<const char*>(w[0] + kBlocksAhead * 4 * o.k);
  }

  // The lines of four rows' columns k .. k + 31 (a prefetch never faults, past the screen's
  // end too).
  void fetch(int64_t k) const {
    _mm_prefetch(ahead + 4 * k, _MM_HINT_T1);
    _mm_prefetch(ahead + 4 * k + 64, _MM_HINT_T1);
  }
};

// The sums of 16 int32 vectors in one, lane l holding v[kSumOrder[l]]'s (vector_sums.h's
// shuffles; integer sums are exact in any order).
__attribute__((target("avx512f"), always_inline)) inline __m512i shuffle4(__m512i a, __m512i b, const int imm) {
  return _mm512_castps_si512(_mm512_shuffle_f32x4(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), imm));
}
__attribute__((target("avx512f"), always_inline)) inline __m512i shuffle(__m512i a, __m512i b, const int imm) {
  return _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), imm));
}

// The sums of 16 int32 vectors in one, lane l holding v[kSumOrder[l]]'s (vector_sums.h's
// shuffles; integer sums are exact in any order).
__attribute__((target("avx512f"))) inline __m512i sum16(const __m512i (&v)[16]) {
  __m512i a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j) {
    a[j] = _mm512_add_epi32(shuffle4(v[2 * j], v[2 * j + 1], 0x44), shuffle4(v[2 * j], v[2 * j + 1], 0xEE));
  }
  for (int j = 0; j < 4; ++j) {
    b[j] = _mm512_add_epi32(shuffle4(a[2 * j], a[2 * j + 1], 0x88), shuffle4(a[2 * j], a[2 * j + 1], 0xDD));
  }
  for (int j = 0; j < 2; ++j) {
    c[j] = _mm512_add_epi32(shuffle(b[2 * j], b[2 * j + 1], 0x44), shuffle(b[2 * j], b[2 * j + 1], 0xEE));
  }
  return _mm512_add_epi32(shuffle(c[0], c[1], 0x88), shuffle(c[0], c[1], 0xDD));
}

// The four values of v from n0, each over four lanes (lane l: v[n0 + l / 4]).
__attribute__((target("avx512f"))) inline __m512 by_n(const float* v, int64_t n0) {
  const __m512i quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(quarter, _mm512_broadcast_f32x4(_mm_loadu_ps(v + n0)));
}

// The four values of v from r0, repeated (lane l: v[r0 + l % 4]).
__attribute__((target("avx512f"))) inline __m512 by_r(const float* v, int64_t r0) {
  return _mm512_broadcast_f32x4(_mm_loadu_ps(v + r0));
}

// Kept::add for a block of 4 weight rows from n0 and rows r0 .. r0 + rows - 1 of x at once: d
// holds D[r0 + r][n0 + n] in lane 4 n + r (sum16 of the accumulators indexed 4 r + n).
__attribute__((target("avx512f"))) void add16(Kept& kept, int64_t n0, int64_t r0, int rows, __m512i d) {
  const IntOperands& o = kept.o;
  const __mmask16 valid = static_cast<__mmask16>(0x1111 * ((1u << rows) - 1u));
  const __m512 z = _mm512_mul_ps(_mm512_mul_ps(by_n(o.scale, n0), by_r(o.t, r0)), _mm512_cvtepi32_ps(d));
  if (o.z != nullptr) {
    alignas(64) float zs[16];
    _mm512_store_ps(zs, z);
    for (uint32_t mask = valid; mask; mask &= mask - 1) {
      const int l = __builtin_ctz(mask);
      o.z[(r0 + l % 4) * o.ldz + n0 + l / 4] = zs[l];
    }
  }
  const __m512 b = _mm512_add_ps(
      _mm512_fmadd_ps(by_n(o.a, n0), by_r(o.X, r0), _mm512_mul_ps(by_n(o.c, n0), by_r(o.E, r0))),
      _mm512_set1_ps(Kept::kSlack));
  const __m512 hi = _mm512_add_ps(z, b);
  float* lanes = kept.lanes.data() + r0 / 4 * 16;
  const __m512 low = _mm512_max_ps(_mm512_loadu_ps(lanes), _mm512_sub_ps(z, b));
  _mm512_mask_storeu_ps(lanes, valid, low);
  // z * 0 is NaN exactly where z is not finite.
  const __mmask16 bad = _mm512_mask_cmp_ps_mask(valid, _mm512_mul_ps(z, _mm512_setzero_ps()),
                                                _mm512_setzero_ps(), _CMP_UNORD_Q);
  const __mmask16 keep = _mm512_mask_cmp_ps_mask(valid, hi, low, _CMP_GE_OQ);
  if (!(bad | keep)) return;
  alignas(64) float his[16];
  _mm512_store_ps(his, hi);
  kept.mark(n0, r0, bad, keep, his);
}

// Columns k .. k + 31 of the block's weight rows against each of its rows of x; `tail` masks
// the columns past K (an all-ones mask for whole steps).
template <int NB, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"), always_inline)) inline void vnni_step(
    __m512i (&acc)[MB][NB], const int8_t* const (&w)[NB], const int16_t* const (&x)[MB], int64_t k, __mmask32 tail) {
  __m512i wv[NB];
#pragma GCC unroll 4
  for (int n = 0; n < NB; ++n) wv[n] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(tail, w[n] + k));
#pragma GCC unroll 4
  for (int r = 0; r < MB; ++r) {
    const __m512i xv = _mm512_loadu_si512(x[r] + k);
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_dpwssd_epi32(acc[r][n], wv[n], xv);
  }
}

template <int NB, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void int_block_vnni(Kept& kept, int64_t n0,
                                                                                  int64_t r0) {
  const IntOperands& o = kept.o;
  const BlockRows<NB, MB> b(o, n0, r0);
  __m512i acc[MB][NB];
  for (int r = 0; r < MB; ++r) {
    for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_setzero_si512();
  }
  const int64_t full = o.k / 32 * 32;
  int64_t k = 0;
  for (; k < full; k += 32) {
    b.fetch(k);
    vnni_step<NB, MB>(acc, b.w, b.x, k, ~__mmask32{0});
  }
  if (k < o.k) vnni_step<NB, MB>(acc, b.w, b.x, k, static_cast<__mmask32>((1ull << (o.k - k)) - 1));
  if constexpr (NB == 4) {
    __m512i all[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) all[j] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int r = 0; r < MB; ++r) {
#pragma GCC unroll 4
      for (int n = 0; n < 4; ++n) all[4 * r + n] = acc[r][n];
    }
    add16(kept, n0, r0, MB, sum16(all));
  } else {
    for (int r = 0; r < MB; ++r) {
      for (int n = 0; n < NB; ++n) kept.add(r0 + r, n0 + n, _mm512_reduce_add_epi32(acc[r][n]));
    }
  }
}

// 16 weights widened to int16 (a tail of n < 16 through a zeroed buffer).
__attribute__((target("avx2"))) inline __m256i load_q16(const int8_t* q) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
}
__attribute__((target("avx2"))) inline __m256i load_q16(const int8_t* q, int64_t n) {
  alignas(16) int8_t lanes[16] = {};
  std::memcpy(lanes, q, static_cast<size_t>(n));
  return load_q16(lanes);
}

__attribute__((target("avx2"))) inline int32_t hsum_epi32(__m256i v) {
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
}

// The sums of eight int32 vectors in one, lane i holding v[i]'s (integer sums are exact in any
// order).
__attribute__((target("avx2"))) inline __m256i sum8(const __m256i (&v)[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// The two values of v from n0, each over four lanes (lane l: v[n0 + l / 4]).
__attribute__((target("avx2"))) inline __m256 by_n8(const float* v, int64_t n0) {
  return _mm256_set_m128(_mm_set1_ps(v[n0 + 1]), _mm_set1_ps(v[n0]));
}

// The four values of v from r0, twice (lane l: v[r0 + l % 4]).
__attribute__((target("avx2"))) inline __m256 by_r8(const float* v, int64_t r0) {
  return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(v + r0));
}

// Kept::add for weight rows n0, n0 + 1 (n0 even) and rows r0 .. r0 + 3 of x (r0 a multiple of
// four) at once, in Kept::add's arithmetic: d holds D[r0 + r][n0 + n] in lane 4 n + r, where Kept
// keeps that pair's running lower end.
__attribute__((target("avx2,fma"))) void add8(Kept& kept, int64_t n0, int64_t r0, __m256i d) {
  const IntOperands& o = kept.o;
  const __m256 z = _mm256_mul_ps(_mm256_mul_ps(by_n8(o.scale, n0), by_r8(o.t, r0)), _mm256_cvtepi32_ps(d));
  if (o.z != nullptr) {
    alignas(32) float zs[8];
    _mm256_store_ps(zs, z);
    for (int l = 0; l < 8; ++l) o.z[(r0 + l % 4) * o.ldz + n0 + l / 4] = zs[l];
  }
  const __m256 b = _mm256_add_ps(
      _mm256_fmadd_ps(by_n8(o.a, n0), by_r8(o.X, r0), _mm256_mul_ps(by_n8(o.c, n0), by_r8(o.E, r0))),
      _mm256_set1_ps(Kept::kSlack));
  const __m256 hi = _mm256_add_ps(z, b);
  float* lanes = kept.lanes.data() + r0 / 4 * 16 + n0 % 4 * 4;
  const __m256 low = _mm256_max_ps(_mm256_loadu_ps(lanes), _mm256_sub_ps(z, b));
  _mm256_storeu_ps(lanes, low);
  // z * 0 is NaN exactly where z is not finite.
  const int bad = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_mul_ps(z, _mm256_setzero_ps()), _mm256_setzero_ps(),
                                                   _CMP_UNORD_Q));
  const int keep = _mm256_movemask_ps(_mm256_cmp_ps(hi, low, _CMP_GE_OQ));
  if (!(bad | keep)) return;
  alignas(32) float his[8];
  _mm256_store_ps(his, hi);
  kept.mark(n0, r0, bad, keep, his);
}

template <int NB, int MB>
__attribute__((target("avx2"), always_inline)) inline void avx2_step(__m256i (&acc)[MB][NB], const __m256i (&wv)[NB],
                                                                     const int16_t* const (&x)[MB], int64_t k) {
#pragma GCC unroll 4
  for (int r = 0; r < MB; ++r) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + k));
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) acc[r][n] = _mm256_add_epi32(acc[r][n], _mm256_madd_epi16(wv[n], xv));
  }
}

template <int NB, int MB>
__attribute__((target("avx2"))) void int_block_avx2(Kept& kept, int64_t n0, int64_t r0) {
  const IntOperands& o = kept.o;
  const BlockRows<NB, MB> b(o, n0, r0);
  __m256i acc[MB][NB];
  for (int r = 0; r < MB; ++r) {
    for (int n = 0; n < NB; ++n) acc[r][n] = _mm256_setzero_si256();
  }
  const int64_t full = o.k / 32 * 32;
  int64_t k = 0;
  __m256i wv[NB];
  for (; k < full; k += 32) {
    b.fetch(k);
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) wv[n] = load_q16(b.w[n] + k);
    avx2_step<NB, MB>(acc, wv, b.x, k);
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) wv[n] = load_q16(b.w[n] + k + 16);
    avx2_step<NB, MB>(acc, wv, b.x, k + 16);
  }
  for (; k < o.k; k += 16) {
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) wv[n] = load_q16(b.w[n] + k, std::min<int64_t>(16, o.k - k));
    avx2_step<NB, MB>(acc, wv, b.x, k);
  }
  if constexpr (NB == 2 && MB == 4) {
    __m256i all[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) all[i] = acc[i % 4][i / 4];
    add8(kept, n0, r0, sum8(all));
  } else {
    for (int r = 0; r < MB; ++r) {
      for (int n = 0; n < NB; ++n) kept.add(r0 + r, n0 + n, hsum_epi32(acc[r][n]));
    }
  }
}
#endif

template <int NB, int MB>
void int_block(IntPath path, Kept& kept, int64_t n0, int64_t r0) {
#ifdef SPECDEC_X86
  if (path == IntPath::kVnni) return int_block_vnni<NB, MB>(kept, n0, r0);
  if (path == IntPath::kAvx2) return int_block_avx2<NB, MB>(kept, n0, r0);
#endif
  int_block_scalar<NB, MB>(kept, n0, r0);
}

// Weight rows [n0, n0 + NB) against all m rows of x, four at a time. AVX2's 16 registers hold
// eight accumulators beside the weights: four rows of x against two weight rows (a block of four
// taken as two), summed into one vector for add8; the rows of x left, two at a time against all
// four. (Two rows of x against four weight rows throughout, an 8-row head spent two fifths of its
// time in the scalar Kept::add and spilled accumulators: AMD EPYC Zen 3.)
template <int NB>
void int_rows(IntPath path, Kept& kept, int64_t n0, int64_t m) {
  int64_t r = 0;
  if (path == IntPath::kAvx2) {
    if constexpr (NB == 4) {
      for (; r + 4 <= m; r += 4) {
        int_block<2, 4>(path, kept, n0, r);
        int_block<2, 4>(path, kept, n0 + 2, r);
      }
    }
    for (; r + 2 <= m; r += 2) int_block<NB, 2>(path, kept, n0, r);
  } else {
    for (; r + 4 <= m; r += 4) int_block<NB, 4>(path, kept, n0, r);
  }
  switch (m - r) {
    case 3:
      return int_block<NB, 3>(path, kept, n0, r);
    case 2:
      return int_block<NB, 2>(path, kept, n0, r);
    case 1:
      return int_block<NB, 1>(path, kept, n0, r);
    default:
      return;
  }
}

// Row r's float32 logit of output feature n, bitwise the skinny GEMM's at any row count.
float exact_logit(const at::Tensor& x, const at::Tensor& weight, int64_t r, int64_t n) {
  float out = 0.f;
  const SkinnyOperands o{x.data_ptr<float>() + r * x.stride(0), x.stride(0), 1,
                         weight.data_ptr<float>() + n * weight.stride(0), weight.stride(0), x.size(1), &out, 1};
  skinny_share(o, 0, 1, 1);
  return out;
}

// torch.argmax's choice over the candidates (ascending): the first NaN, else the first maximum.
void pick(const at::Tensor& x, const at::Tensor& weight, int64_t r, const std::vector<int64_t>& candidates,
          int64_t* id, float* logit) {
  int64_t best = -1;
  float value = -std::numeric_limits<float>::infinity();
  for (const int64_t n : candidates) {
    const float v = exact_logit(x, weight, r, n);
    if (std::isnan(v)) {
      best = n;
      value = v;
      break;
    }
    if (best < 0 || v > value) {
      best = n;
      value = v;
    }
  }
  *id = best;
  *logit = value;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> greedy_head_cpu(const at::Tensor& x, const at::Tensor& screen,
                                                               const at::Tensor& scale, const at::Tensor& weight,
                                                               const at::Tensor& bound, bool screened) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "greedy_head: x must be float32 [m, K], got ",
              x.scalar_type(), " of shape ", x.sizes());
  TORCH_CHECK(screen.dim() == 2 && screen.scalar_type() == at::kChar && screen.size(1) == x.size(1) &&
                  screen.is_contiguous(),
              "greedy_head: screen must be contiguous int8 [N, ", x.size(1), "], got ", screen.scalar_type(),
              " of shape ", screen.sizes());
  const int64_t m = x.size(0), n = screen.size(0), k = x.size(1);
  TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == at::kFloat && scale.size(0) == n && scale.is_contiguous(),
              "greedy_head: scale must be contiguous float32 [", n, "], got ", scale.scalar_type(), " of shape ",
              scale.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.sizes() == screen.sizes() && weight.stride(1) == 1,
              "greedy_head: weight must be float32 ", screen.sizes(), " with contiguous rows, got ",
              weight.scalar_type(), " of shape ", weight.sizes());
  TORCH_CHECK(bound.dim() == 2 && bound.size(0) == 2 && bound.size(1) == n && bound.scalar_type() == at::kFloat &&
                  bound.is_contiguous(),
              "greedy_head: bound must be contiguous float32 [2, ", n, "], got ", bound.scalar_type(), " of shape ",
              bound.sizes());
  TORCH_CHECK(n > 0, "greedy_head: the weight has no rows");
  const int32_t qmax = screen_qmax(k);
  TORCH_CHECK(qmax >= 127, "greedy_head: K = ", k, " in-features overflow the screen's int32 sums");
  const at::Tensor rows = x.contiguous();
  at::Tensor ids = at::empty({m}, x.options().dtype(at::kLong));
  at::Tensor logits = at::empty({m}, x.options());
  at::Tensor z = at::empty({screened ? m : 0, screened ? n : 0}, x.options());
  if (m == 0) return {ids, logits, z};

  const int64_t kp = (k + 31) / 32 * 32;
  std::vector<int16_t> p(static_cast<size_t>(m * kp), 0);
  std::vector<RowOfX> row_of_x;
  row_of_x.reserve(m);
  for (int64_t r = 0; r < m; ++r) row_of_x.emplace_back(rows.data_ptr<float>() + r * k, k, qmax, p.data() + r * kp);
  const int64_t m4 = (m + 3) / 4 * 4;
  std::vector<float> t(m4, 0.f), norm_x(m4, 0.f), norm_e(m4, 0.f);
  for (int64_t r = 0; r < m; ++r) {
    t[r] = row_of_x[r].t;
    norm_x[r] = row_of_x[r].X;
    norm_e[r] = row_of_x[r].E;
  }
  const IntOperands o{screen.data_ptr<int8_t>(), n, k, p.data(), kp, scale.data_ptr<float>(),
                      bound.data_ptr<float>(), bound.data_ptr<float>() + n, t.data(), norm_x.data(), norm_e.data(),
                      screened ? z.data_ptr<float>() : nullptr, n};

  // Blocks of four weight rows spread over torch's threads; each thread's Kept joins `all`.
  const IntPath path = int_path();
  constexpr int64_t kBlock = 4;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (kBlock * k));
  std::mutex joining;
  std::vector<Kept> all;
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    Kept kept(o, m);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlock;
      if (n0 + kBlock <= n) {
        int_rows<kBlock>(path, kept, n0, m);
      } else {
        for (int64_t j = n0; j < n; ++j) int_rows<1>(path, kept, j, m);
      }
    }
    std::lock_guard<std::mutex> lock(joining);
    all.push_back(std::move(kept));
  });

  int64_t* id = ids.data_ptr<int64_t>();
  float* logit = logits.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> candidates;
    for (int64_t r = begin; r < end; ++r) {
      candidates.clear();
      bool screened = row_of_x[r].screened;
      float low = -std::numeric_limits<float>::infinity();
      for (const Kept& kept : all) {
        screened = screened && !kept.bad[r];
        low = std::max(low, kept.low(r));
      }
      if (screened) {
        for (const Kept& kept : all) {
          for (const auto& [hi, j] : kept.high[r]) {
            if (hi >= low) candidates.push_back(j);
          }
        }
        std::sort(candidates.begin(), candidates.end());
      } else {
        for (int64_t j = 0; j < n; ++j) candidates.push_back(j);
      }
      pick(rows, weight, r, candidates, id + r, logit + r);
    }
  });
  return {ids, logits, z};
}

}  // namespace specdec
