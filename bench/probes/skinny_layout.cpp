// Two layouts for the few-row products of a decode step, over all of a SmolLM2 step's layer
// weights (30 x QKV 960x576, output 576x576, fc1 3072x576, fc2 576x1536; 425 MB float32 on
// 2 MiB pages) from memory, on 2 OpenMP threads, a barrier after each product:
//
//  A  rows of W as stored [N, K]: blocks of 4 weight rows x 4 rows of x, one 16-lane
//     accumulator per output over K, then a horizontal sum; the next block prefetched into L2
//     over the passes (the structure of csrc/skinny_gemm.cpp's AVX-512 path).
//  B  W repacked as panels [N/P][K][P] (P = 16 V outputs): the lanes are outputs, each row of
//     x broadcast a column at a time, one sequential FMA chain over K per output (no
//     horizontal sums; the same bits at any row count, panel width or vector width); the
//     stream prefetched AHEAD bytes ahead into L2.
//  C  W repacked as panels [N/P][16][K/16][P] whose columns are grouped by k mod 16, the groups
//     in the order A's horizontal sum pairs its lanes (0, 8, 4, 12, ...): one accumulator per
//     output and group, the groups' partial sums added vector by vector in that pairing, so
//     every output is bitwise A's; x regrouped the same way once a call (a column's rows side
//     by side: broadcast from x as stored, a line for each row and column, it streamed no
//     faster than A); prefetched as B. skinny_gemm.cpp's schedule 3.
//
// Prints milliseconds a step's products at 1-16 rows of x for each, and (with `cache`) one
// thread's rate on the 576x576 weight from L2. AVX-512 CPUs only.
//
//   g++ -O3 -fopenmp -o /tmp/layout bench/probes/skinny_layout.cpp && /tmp/layout [V [AHEAD]] [cache]
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

struct Shape {
  int n, k;
};
constexpr Shape kShapes[4] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
constexpr int kLayers = 30;
int g_ahead = 32768;

template <int MB>
__attribute__((target("avx512f"))) void block_a(const float* w, int k, const float* x, float* y, int ldy,
                                                const float* next, int pb, int pe) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < 4; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int kk = 0; kk < k; kk += 16) {
    if (next && kk >= pb && kk < pe)
      for (int n = 0; n < 4; ++n) _mm_prefetch(reinterpret_cast<const char*>(next + n * k + kk), _MM_HINT_T1);
    __m512 wv[4];
    for (int n = 0; n < 4; ++n) wv[n] = _mm512_loadu_ps(w + n * k + kk);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * k + kk);
      for (int n = 0; n < 4; ++n) acc[m][n] = _mm512_fmadd_ps(wv[n], xv, acc[m][n]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < 4; ++n) y[m * ldy + n] = _mm512_reduce_add_ps(acc[m][n]);
}

void product_a(const float* w, int n_out, int k, const float* x, int rows, float* y, int tid, int nt) {
  const int blocks = n_out / 4, per = (blocks + nt - 1) / nt;
  const int b0 = tid * per, b1 = std::min(blocks, b0 + per);
  const int passes = (rows + 3) / 4, share = (k / passes + 15) / 16 * 16;
  for (int b = b0; b < b1; ++b) {
    const float* wb = w + static_cast<size_t>(b) * 4 * k;
    const float* next = b + 1 < b1 ? wb + 4 * k : nullptr;
    for (int p = 0, m = 0; m < rows; ++p, m += 4) {
      float* yy = y + static_cast<size_t>(m) * n_out + b * 4;
      const float* xx = x + static_cast<size_t>(m) * k;
      switch (std::min(4, rows - m)) {
        case 4: block_a<4>(wb, k, xx, yy, n_out, next, p * share, (p + 1) * share); break;
        case 3: block_a<3>(wb, k, xx, yy, n_out, next, p * share, (p + 1) * share); break;
        case 2: block_a<2>(wb, k, xx, yy, n_out, next, p * share, (p + 1) * share); break;
        default: block_a<1>(wb, k, xx, yy, n_out, next, p * share, (p + 1) * share); break;
      }
    }
  }
}

template <int R, int V>
__attribute__((target("avx512f"))) void panel_b(const float* p, int k, const float* x, float* y, int ldy) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int kk = 0; kk < k; ++kk) {
    const float* pk = p + static_cast<size_t>(kk) * 16 * V;
    __m512 wv[V];
    for (int v = 0; v < V; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(pk + 16 * v) + g_ahead, _MM_HINT_T1);
      wv[v] = _mm512_load_ps(pk + 16 * v);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * k + kk]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(wv[v], xb, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y + r * ldy + 16 * v, acc[r][v]);
}

template <int V>
void rows_b(const float* p, int k, const float* x, int rows, float* y, int n_out) {
  for (int m = 0; m < rows; m += 8) {
    const float* xx = x + static_cast<size_t>(m) * k;
    float* yy = y + static_cast<size_t>(m) * n_out;
    switch (std::min(8, rows - m)) {
      case 8: panel_b<8, V>(p, k, xx, yy, n_out); break;
      case 7: panel_b<7, V>(p, k, xx, yy, n_out); break;
      case 6: panel_b<6, V>(p, k, xx, yy, n_out); break;
      case 5: panel_b<5, V>(p, k, xx, yy, n_out); break;
      case 4: panel_b<4, V>(p, k, xx, yy, n_out); break;
      case 3: panel_b<3, V>(p, k, xx, yy, n_out); break;
      case 2: panel_b<2, V>(p, k, xx, yy, n_out); break;
      default: panel_b<1, V>(p, k, xx, yy, n_out); break;
    }
  }
}

void product_b(const float* packed, int v, int n_out, int k, const float* x, int rows, float* y, int tid, int nt) {
  const int width = 16 * v, panels = n_out / width, per = (panels + nt - 1) / nt;
  const int q0 = tid * per, q1 = std::min(panels, q0 + per);
  for (int q = q0; q < q1; ++q) {
    const float* p = packed + static_cast<size_t>(q) * k * width;
    if (v == 2) rows_b<2>(p, k, x, rows, y + q * width, n_out);
    else if (v == 4) rows_b<4>(p, k, x, rows, y + q * width, n_out);
    else rows_b<3>(p, k, x, rows, y + q * width, n_out);
  }
}

// Lane l of A's accumulator holds k = l mod 16; _mm512_reduce_add_ps adds lanes l and l + 8,
// then l + 4, l + 2, l + 1: a binary tree whose leaves, left to right, are these lanes.
constexpr int kLeaf[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

template <int R, int V>
__attribute__((target("avx512f"))) void panel_c(const float* p, int k, const float* x, float* y, int ldy,
                                                const float* stop) {
  const int cols = k / 16;
  __m512 stack[4][R][V];
  int level[4], depth = 0;
  for (int i = 0; i < 16; ++i) {
    const float* pj = p + static_cast<size_t>(i) * cols * 16 * V;
    __m512 acc[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int c = 0; c < cols; ++c) {
      const float* pk = pj + static_cast<size_t>(c) * 16 * V;
      __m512 wv[V];
      for (int v = 0; v < V; ++v) {
        const char* ahead = reinterpret_cast<const char*>(pk + 16 * v) + g_ahead;
        if (ahead < reinterpret_cast<const char*>(stop)) _mm_prefetch(ahead, _MM_HINT_T1);
        wv[v] = _mm512_load_ps(pk + 16 * v);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(x[(i * cols + c) * R + r]);
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(wv[v], xb, acc[r][v]);
      }
    }
    int lv = 0;
    for (; depth > 0 && level[depth - 1] == lv; --depth, ++lv)
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_add_ps(stack[depth - 1][r][v], acc[r][v]);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) stack[depth][r][v] = acc[r][v];
    level[depth++] = lv;
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y + r * ldy + 16 * v, stack[0][r][v]);
}

template <int V>
void rows_c(const float* p, int k, const float* x, int rows, float* y, int n_out, const float* stop) {
  for (int m = 0; m < rows; m += 8) {
    const float* xx = x + static_cast<size_t>(m) * k;  // regrouped by product_c
    float* yy = y + static_cast<size_t>(m) * n_out;
    switch (std::min(8, rows - m)) {
      case 8: panel_c<8, V>(p, k, xx, yy, n_out, stop); break;
      case 7: panel_c<7, V>(p, k, xx, yy, n_out, stop); break;
      case 6: panel_c<6, V>(p, k, xx, yy, n_out, stop); break;
      case 5: panel_c<5, V>(p, k, xx, yy, n_out, stop); break;
      case 4: panel_c<4, V>(p, k, xx, yy, n_out, stop); break;
      case 3: panel_c<3, V>(p, k, xx, yy, n_out, stop); break;
      case 2: panel_c<2, V>(p, k, xx, yy, n_out, stop); break;
      default: panel_c<1, V>(p, k, xx, yy, n_out, stop); break;
    }
  }
}

void product_c(const float* packed, int v, int n_out, int k, const float* x, int rows, float* y, int tid, int nt) {
  const int width = 16 * v, panels = n_out / width, per = (panels + nt - 1) / nt, cols = k / 16;
  const int q0 = tid * per, q1 = std::min(panels, q0 + per);
  const float* stop = packed + static_cast<size_t>(q1) * k * width;
  // x regrouped once a call as panel_c reads it: a group's R rows of a column side by side
  static thread_local std::vector<float> xt;
  xt.resize(static_cast<size_t>(rows) * k);
  for (int m = 0; m < rows; m += 8) {
    const int r_group = std::min(8, rows - m);
    for (int r = 0; r < r_group; ++r)
      for (int i = 0; i < 16; ++i)
        for (int c = 0; c < cols; ++c)
          xt[static_cast<size_t>(m) * k + (i * cols + c) * r_group + r] = x[static_cast<size_t>(m + r) * k + 16 * c + kLeaf[i]];
  }
  for (int q = q0; q < q1; ++q) {
    const float* p = packed + static_cast<size_t>(q) * k * width;
    if (v == 2) rows_c<2>(p, k, xt.data(), rows, y + q * width, n_out, stop);
    else if (v == 4) rows_c<4>(p, k, xt.data(), rows, y + q * width, n_out, stop);
    else rows_c<3>(p, k, xt.data(), rows, y + q * width, n_out, stop);
  }
}

void pack_c(const float* w, int n_out, int k, int width, float* out) {
  const int cols = k / 16;
  for (int q = 0; q < n_out / width; ++q)
    for (int i = 0; i < 16; ++i)
      for (int c = 0; c < cols; ++c)
        for (int j = 0; j < width; ++j)
          out[((static_cast<size_t>(q) * 16 + i) * cols + c) * width + j] =
              w[static_cast<size_t>(q * width + j) * k + 16 * c + kLeaf[i]];
}

void pack(const float* w, int n_out, int k, int width, float* out) {
  for (int q = 0; q < n_out / width; ++q)
    for (int kk = 0; kk < k; ++kk)
      for (int j = 0; j < width; ++j)
        out[(static_cast<size_t>(q) * k + kk) * width + j] = w[static_cast<size_t>(q * width + j) * k + kk];
}

float* huge(size_t floats) {
  const size_t bytes = (floats * 4 + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  void* p = std::aligned_alloc(2 << 20, bytes);
  madvise(p, bytes, MADV_HUGEPAGE);
  return static_cast<float*>(p);
}

}  // namespace

int main(int argc, char** argv) {
  const int v = argc > 1 && std::strcmp(argv[1], "cache") ? std::atoi(argv[1]) : 3;
  if (argc > 2 && std::strcmp(argv[2], "cache")) g_ahead = std::atoi(argv[2]);
  const bool cache = std::strcmp(argv[argc - 1], "cache") == 0;
  size_t total = 0;
  for (const Shape s : kShapes) total += static_cast<size_t>(s.n) * s.k;
  total *= kLayers;
  float* w = huge(total);
  float* packed = huge(total);
  float* grouped = huge(total);
  std::srand(1);
  for (size_t i = 0; i < total; ++i) w[i] = (std::rand() / static_cast<float>(RAND_MAX) - 0.5f) * 0.1f;
  std::vector<const float*> wl, pl, gl;
  size_t off = 0;
  for (int l = 0; l < kLayers; ++l)
    for (const Shape s : kShapes) {
      wl.push_back(w + off);
      pack(w + off, s.n, s.k, 16 * v, packed + off);
      pl.push_back(packed + off);
      pack_c(w + off, s.n, s.k, 16 * v, grouped + off);
      gl.push_back(grouped + off);
      off += static_cast<size_t>(s.n) * s.k;
    }
  std::vector<float> x(16 * 1536), ya(16 * 3072), yb(16 * 3072), yc(16 * 3072), one(3072);
  for (float& e : x) e = std::rand() / static_cast<float>(RAND_MAX) - 0.5f;
  for (int si : {0, 3}) {  // B against float64, and a row alone against the same row among 8
    const Shape s = kShapes[si];
    product_b(pl[si], v, s.n, s.k, x.data(), 8, yb.data(), 0, 1);
    product_b(pl[si], v, s.n, s.k, x.data() + 5 * s.k, 1, one.data(), 0, 1);
    double err = 0;
    int differ = 0;
    for (int n = 0; n < s.n; ++n) {
      double ref = 0;
      for (int kk = 0; kk < s.k; ++kk) ref += static_cast<double>(wl[si][static_cast<size_t>(n) * s.k + kk]) * x[5 * s.k + kk];
      err = std::max(err, std::fabs(ref - yb[5 * s.n + n]));
      differ += one[n] != yb[5 * s.n + n];
    }
    std::printf("B %dx%d: largest error against float64 %.3g; row alone vs among 8: %d outputs differ\n", s.n, s.k,
                err, differ);
  }
  for (int si = 0; si < 4; ++si) {  // C against A bit for bit, at 1 and 8 rows, and a row alone
    const Shape s = kShapes[si];
    int differ = 0;
    for (int rows : {1, 8}) {
      product_a(wl[si], s.n, s.k, x.data(), rows, ya.data(), 0, 1);
      product_c(gl[si], v, s.n, s.k, x.data(), rows, yc.data(), 0, 1);
      for (int i = 0; i < rows * s.n; ++i) differ += std::memcmp(&ya[i], &yc[i], sizeof(float)) != 0;
    }
    std::printf("C %dx%d: outputs that differ from A's bits at 1 and 8 rows: %d\n", s.n, s.k, differ);
  }
  if (cache) {
    for (int rows : {1, 4, 8, 16}) {
      double best[3] = {1e9, 1e9, 1e9};
      for (int rep = 0; rep < 200; ++rep)
        for (int which = 0; which < 3; ++which) {
          const auto t0 = std::chrono::steady_clock::now();
          if (which == 0) product_a(wl[1], 576, 576, x.data(), rows, ya.data(), 0, 1);
          else if (which == 1) product_b(pl[1], v, 576, 576, x.data(), rows, yb.data(), 0, 1);
          else product_c(gl[1], v, 576, 576, x.data(), rows, yc.data(), 0, 1);
          best[which] = std::min(best[which], std::chrono::duration<double, std::micro>(
                                                  std::chrono::steady_clock::now() - t0).count());
        }
      const double fmas = 576.0 * 576 * rows / 16;
      std::printf("576x576 from L2, one thread, %2d rows: A %6.1f us (%.2f G zmm FMA/s), B %6.1f us (%.2f), "
                  "C %6.1f us (%.2f)\n", rows, best[0], fmas / best[0] / 1e3, best[1], fmas / best[1] / 1e3,
                  best[2], fmas / best[2] / 1e3);
    }
    return 0;
  }
  for (int rows : {1, 2, 4, 8, 16}) {
    double best[3] = {1e9, 1e9, 1e9};
    for (int rep = 0; rep < 12; ++rep)
      for (int which = 0; which < 3; ++which) {
        const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(2)
        {
          const int tid = omp_get_thread_num();
          size_t i = 0;
          for (int l = 0; l < kLayers; ++l)
            for (int si = 0; si < 4; ++si, ++i) {
              const Shape s = kShapes[si];
              if (which == 0) product_a(wl[i], s.n, s.k, x.data(), rows, ya.data(), tid, 2);
              else if (which == 1) product_b(pl[i], v, s.n, s.k, x.data(), rows, yb.data(), tid, 2);
              else product_c(gl[i], v, s.n, s.k, x.data(), rows, yc.data(), tid, 2);
#pragma omp barrier
            }
        }
        best[which] = std::min(best[which], std::chrono::duration<double, std::milli>(
                                                std::chrono::steady_clock::now() - t0).count());
      }
    std::printf("%2d rows: A (rows as stored) %6.2f ms, B (panels of %d, L2 prefetch %d B ahead) %6.2f ms, "
                "C (B grouped by k mod 16) %6.2f ms\n", rows, best[0], 16 * v, g_ahead, best[1], best[2]);
  }
}
