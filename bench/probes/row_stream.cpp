// How fast one core, and two, stream a decoding product's weights by the order they are read:
// 453 MB of float32 rows of 576 (SmolLM2's width) on 2 MiB pages, split between the threads,
// multiplied by one row of x. `seq`: a plain sum, as bench_linear.read_bandwidth_gbs reads;
// `row`: one weight row after another; `block4`: four rows in lockstep, as the skinny op's
// AVX-512 block reads them at one row of x; `+next`, `+4K`: each line's prefetch into L2, of
// the next block or 4 KB ahead. The first of the measured schedules that keeps up with `seq`
// is the order a one-row product should read in. AVX-512 CPUs only.
//
//   g++ -O3 -fopenmp -o /tmp/row_stream bench/probes/row_stream.cpp && /tmp/row_stream [THREADS]
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

constexpr int K = 576;

__attribute__((target("avx512f"))) float seq(const float* p, size_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

__attribute__((target("avx512f"))) float row(const float* p, size_t rows, const float* x, int ahead) {
  __m512 s = _mm512_setzero_ps();
  for (size_t r = 0; r < rows; ++r) {
    const float* w = p + r * K;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int k = 0; k < K; k += 64) {
      if (ahead) {
        for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(w + k + 16 * c) + ahead, _MM_HINT_T1);
      }
      a0 = _mm512_fmadd_ps(_mm512_load_ps(w + k), _mm512_loadu_ps(x + k), a0);
      a1 = _mm512_fmadd_ps(_mm512_load_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
      a2 = _mm512_fmadd_ps(_mm512_load_ps(w + k + 32), _mm512_loadu_ps(x + k + 32), a2);
      a3 = _mm512_fmadd_ps(_mm512_load_ps(w + k + 48), _mm512_loadu_ps(x + k + 48), a3);
    }
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
  return _mm512_reduce_add_ps(s);
}

// ahead < 0: the next block's line at the same column.
__attribute__((target("avx512f"))) float block4(const float* p, size_t rows, const float* x, int ahead) {
  __m512 s = _mm512_setzero_ps();
  for (size_t r = 0; r + 4 <= rows; r += 4) {
    const float* w = p + r * K;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int k = 0; k < K; k += 16) {
      const __m512 xv = _mm512_loadu_ps(x + k);
      if (ahead) {
        const size_t skip = ahead < 0 ? 4 * K * sizeof(float) : ahead;
        for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k) + skip, _MM_HINT_T1);
      }
      a0 = _mm512_fmadd_ps(_mm512_load_ps(w + k), xv, a0);
      a1 = _mm512_fmadd_ps(_mm512_load_ps(w + K + k), xv, a1);
      a2 = _mm512_fmadd_ps(_mm512_load_ps(w + 2 * K + k), xv, a2);
      a3 = _mm512_fmadd_ps(_mm512_load_ps(w + 3 * K + k), xv, a3);
    }
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
  return _mm512_reduce_add_ps(s);
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 2;
  const size_t rows = 49152 * 4, n = rows * K, bytes = n * sizeof(float);
  float* p = static_cast<float*>(aligned_alloc(1 << 21, bytes));
  madvise(p, bytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < n; ++i) p[i] = 1e-3f * static_cast<float>(i % 7);
  alignas(64) float x[K];
  for (float& v : x) v = 1.0f;
  const char* names[] = {"seq", "row", "row +4K", "block4", "block4 +next", "block4 +4K"};
  constexpr int kinds = 6;
  for (int round = 0; round < 3; ++round) {
    for (int kind = 0; kind < kinds; ++kind) {
      double best = 1e9;
      float sink = 0.f;
      for (int rep = 0; rep < 3; ++rep) {
        const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
          const int t = omp_get_thread_num();
          const size_t r0 = rows / threads * t, r1 = rows / threads * (t + 1);
          const float* q = p + r0 * K;
          switch (kind) {
            case 0: sink += seq(q, (r1 - r0) * K); break;
            case 1: sink += row(q, r1 - r0, x, 0); break;
            case 2: sink += row(q, r1 - r0, x, 4096); break;
            case 3: sink += block4(q, r1 - r0, x, 0); break;
            case 4: sink += block4(q, r1 - r0 - 4, x, -1); break;
            default: sink += block4(q, r1 - r0, x, 4096); break;
          }
        }
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      std::printf("%-13s %5.1f GB/s%s", names[kind], bytes / best / 1e9, kind + 1 == kinds ? "\n" : "   ");
      if (sink == 1234.5f) std::printf(" ");
    }
  }
}
