// Horizontal sums of AVX-512 vectors in one fixed pairing of lanes, shared by the skinny GEMM
// and the attention: a result that is one vector accumulator then sum() is bitwise the same
// whether it is reduced alone or among sixteen by sum16().
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

namespace specdec {

// Lanes i and i + 8, then i and i + 4, i and i + 2, i and i + 1.
__attribute__((target("avx512f"))) inline float sum(__m512 v) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// Lane l of sum16(v) holds sum(v[kSumOrder[l]]).
constexpr int kSumOrder[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// The sums of 16 vectors at once, each by sum()'s own pairing of lanes (float addition is
// commutative, so bitwise sum()'s result) in 15 adds and 30 shuffles instead of 16 x 7.
__attribute__((target("avx512f"))) inline __m512 sum16(const __m512 (&v)[16]) {
  __m512 a[8], b[4], c[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // lanes i and i + 8 of each vector (sum's 256-bit halves)
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // then i and i + 4 (its 128-bit halves)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {  // then i and i + 2 (movehl)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}

}  // namespace specdec
#endif
