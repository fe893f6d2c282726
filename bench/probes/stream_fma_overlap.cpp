// Whether a core overlaps its memory stream with multiply-adds: two threads read 425 MB of
// float32 (a SmolLM2 step's layer weights) from 2 MiB pages, and per 64-byte line do F
// register-only FMAs on 16 independent zmm chains; beside it, the same FMAs without the stream.
// If the time of both stays at the stream's alone while F x lines FMAs fit in it, the machine
// can hide a verify's extra multiply-adds behind the weights' read. AVX-512 CPUs only.
//
//   g++ -O3 -fopenmp -o /tmp/overlap bench/probes/stream_fma_overlap.cpp && /tmp/overlap [AHEAD]
//
// AHEAD: bytes ahead of the stream each line is prefetched into L1 (default 4096; 0: none).
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

template <int F>
__attribute__((target("avx512f"))) float run(const float* p, size_t lines, bool stream, int ahead) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512 s = _mm512_setzero_ps();
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.001f);
  for (size_t l = 0; l < lines; ++l) {
    if (stream) {
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(p + l * 16) + ahead, _MM_HINT_T0);
      s = _mm512_add_ps(s, _mm512_load_ps(p + l * 16));
    }
#pragma GCC unroll 64
    for (int f = 0; f < F; ++f) acc[f % 16] = _mm512_fmadd_ps(acc[f % 16], a, b);
  }
  for (int i = 0; i < 16; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

template <typename Fn>
double best_ms(const float* p, size_t lines, Fn fn) {
  double best = 1e9;
  float sink = 0.f;
  for (int r = 0; r < 7; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(2) reduction(+ : sink)
    {
      const int t = omp_get_thread_num();
      sink += fn(p + t * (lines / 2) * 16, lines / 2);
    }
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  if (sink == 12345.f) std::printf(" ");
  return best;
}

template <int F>
void row(const float* p, size_t lines, int ahead) {
  const double both = best_ms(p, lines, [&](const float* q, size_t n) { return run<F>(q, n, true, ahead); });
  const double alone = best_ms(p, lines, [&](const float* q, size_t n) { return run<F>(q, n, false, ahead); });
  std::printf("FMAs a line %2d: stream + FMAs %6.2f ms, FMAs alone %6.2f ms\n", F, both, alone);
}

int main(int argc, char** argv) {
  const int ahead = argc > 1 ? std::atoi(argv[1]) : 4096;
  const size_t bytes = size_t{425} << 20;
  float* p = static_cast<float*>(std::aligned_alloc(2 << 20, bytes));
  madvise(p, bytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < bytes / 4; ++i) p[i] = 1.0f;
  const size_t lines = bytes / 64;
  row<0>(p, lines, ahead);
  row<4>(p, lines, ahead);
  row<8>(p, lines, ahead);
  row<16>(p, lines, ahead);
  row<24>(p, lines, ahead);
  row<32>(p, lines, ahead);
}
