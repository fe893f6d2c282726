// What streaming a decode step's weights leaves in the caches for the code that runs after it.
// A decode step reads ~450 MB of weights once; between two such streams Python runs the step's
// small ops (cache bookkeeping, embedding, norms, the greedy head's wrapper), whose state is
// scattered lines. This streams S MB on 2 OpenMP threads, then times, on one thread:
//   walk  a chain of dependent loads over 16384 lines scattered in 64 MiB (1 MiB of state);
//   sum   a re-read of a 16 MiB buffer;
// each against the same right after it ran (warm), for three ways of reading the stream:
//   plain  a sum, as the skinny op reads its weights;
//   nta    the same, each line prefetched 4 KiB ahead with PREFETCHNTA (not kept in L3 on CPUs
//          that honour the hint);
//   flush  the same, each line evicted with CLFLUSHOPT once read.
// Where walk and sum after the stream stay near warm, the stream spares the caches. AVX-512
// CPUs with CLFLUSHOPT only.
//
//   g++ -O3 -fopenmp -o /tmp/eviction bench/probes/stream_eviction.cpp && /tmp/eviction
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

namespace {

constexpr size_t kLine = 64;
constexpr size_t kWalkLines = 16384;
constexpr size_t kWalkSpan = size_t{64} << 20;
constexpr size_t kSumBytes = size_t{16} << 20;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

float* huge(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  madvise(p, bytes, MADV_HUGEPAGE);
  return static_cast<float*>(p);
}

// Sum of [p, p + n) floats; mode 1 prefetches non-temporally ahead, mode 2 flushes behind.
__attribute__((target("avx512f,clflushopt"))) float stream_part(const float* p, size_t n, int mode) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < n; i += 64) {
    if (mode == 1) {
      for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + i + 1024 + 16 * l), _MM_HINT_NTA);
    }
    a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
    if (mode == 2) {
      for (int l = 0; l < 4; ++l) _mm_clflushopt(const_cast<float*>(p + i + 16 * l));
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

float stream(const float* p, size_t floats, int mode) {
  float total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const size_t share = floats / omp_get_num_threads() / 64 * 64;
    total += stream_part(p + omp_get_thread_num() * share, share, mode);
  }
  return total;
}

size_t walk(const size_t* next, size_t at) {
  for (size_t i = 0; i < kWalkLines; ++i) at = next[at];
  return at;
}

__attribute__((target("avx512f"))) float sum(const float* p) { return stream_part(p, kSumBytes / 4, 0); }

}  // namespace

int main() {
  const size_t sizes_mb[] = {1, 8, 24, 64, 256, 424};
  const size_t most = sizes_mb[5] << 20;
  float* weights = huge(most);
  for (size_t i = 0; i < most / 4; ++i) weights[i] = 1.0f;
  float* other = huge(kSumBytes);
  for (size_t i = 0; i < kSumBytes / 4; ++i) other[i] = 1.0f;
  // A random cycle over kWalkLines lines of kWalkSpan: each line holds the index of the next.
  auto* chain = reinterpret_cast<size_t*>(huge(kWalkSpan));
  std::vector<size_t> lines(kWalkSpan / kLine);
  std::iota(lines.begin(), lines.end(), 0);
  std::shuffle(lines.begin(), lines.end(), std::mt19937_64(0));
  lines.resize(kWalkLines);
  constexpr size_t kStep = kLine / sizeof(size_t);
  for (size_t i = 0; i < kWalkLines; ++i) chain[lines[i] * kStep] = lines[(i + 1) % kWalkLines] * kStep;
  const size_t first = lines[0] * kStep;

  volatile float sink = 0;
  volatile size_t where = 0;
  const char* modes[] = {"plain", "nta", "flush"};
  std::printf("| stream MB | read | GB/s | walk us | walk warm us | 16 MiB sum us | sum warm us |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (size_t mb : sizes_mb) {
    for (int mode = 0; mode < 3; ++mode) {
      std::vector<double> rate, cold_walk, warm_walk, cold_sum, warm_sum;
      for (int r = 0; r < 9; ++r) {
        double t = now();
        sink = sink + stream(weights, (mb << 20) / 4, mode);
        rate.push_back((mb << 20) / (now() - t) / 1e9);
        t = now();
        where = where + walk(chain, first);
        cold_walk.push_back(now() - t);
        t = now();
        where = where + walk(chain, first);
        warm_walk.push_back(now() - t);
        sink = sink + stream(weights, (mb << 20) / 4, mode);
        t = now();
        sink = sink + sum(other);
        cold_sum.push_back(now() - t);
        t = now();
        sink = sink + sum(other);
        warm_sum.push_back(now() - t);
      }
      auto median = [](std::vector<double> v) {
        std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
        return v[v.size() / 2];
      };
      std::printf("| %zu | %s | %.1f | %.0f | %.0f | %.0f | %.0f |\n", mb, modes[mode], median(rate),
                  median(cold_walk) * 1e6, median(warm_walk) * 1e6, median(cold_sum) * 1e6,
                  median(warm_sum) * 1e6);
    }
  }
  return 0;
}
