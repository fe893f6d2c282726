// Skinny GEMM of decoding (see skinny_gemm.h).
//
// Output features are split into blocks of weight rows (the ISA's kOut, or one row: the caller
// picks, by measurement, see models/layers/linear_kernels.py), spread over torch's intra-op
// (OpenMP) threads. A block's weight rows are streamed from memory once and, while they sit in
// L1, multiplied by every row of x, a few rows per pass (the ISA's kRows: kOut x kRows
// accumulators fill its vector registers); each pass prefetches its share of the next block's
// rows. A block of kOut rows keeps the FMA units busy over many rows of x; one row a block reads
// the weights as a single stream, which can be the faster read when x has few rows. Each output
// element keeps one vector accumulator over K (lane i holds k = i mod lanes), a masked tail, then
// a fixed horizontal sum: the same order whatever M, the block width, the pass a row falls in, or
// the thread, which is what makes the op row-invariant. The ISA path is picked once per process
// from the CPU (GCC target attributes, no -march in the build).
#include "skinny_gemm.h"

#include "vector_sums.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SPECDEC_X86 1
#endif

namespace specdec {
namespace {


// Weights stored in 16 bits, widened exactly to float32 as they are read: IEEE binary16 and
// bfloat16 (a float32 weight whose values are all values of one of them,
// models/weight_memory.narrow_copy), each its own type for overloading.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

template <typename W>
struct Operands {
  const float* x;
  int64_t ldx;
  const W* w;
  int64_t ldw;
  int64_t k;
  float* y;
  int64_t ldy;
  // The next block's weight rows, prefetched while this one computes so that the memory
  // stream keeps going while the block's rows of x are multiplied; nullptr: none. Each pass
  // over x prefetches its share, so that a call of many rows keeps the stream busy through all
  // its passes, not the first only: columns [prefetch_begin, prefetch_end) (whole cache
  // lines), one line a row at each line start (a block of one row; a block of kOut rows when
  // `burst`), or lines [line_begin, line_end) of the kOut rows counted row after row, spread
  // over the pass (LineSpread; a block of kOut rows otherwise).
  const W* next = nullptr;
  int64_t prefetch_begin = 0;
  int64_t prefetch_end = 0;
  int64_t line_begin = 0;
  int64_t line_end = 0;
  bool burst = false;
};

// The columns of a pass, below `full`, at whose line starts the next block's lines are
// prefetched: [first, second); empty without a next block.
template <typename W>
std::pair<int64_t, int64_t> burst_range(const Operands<W>& o, int64_t full) {
  const int64_t begin = o.next == nullptr ? full : std::min(o.prefetch_begin, full);
  return {begin, o.next == nullptr ? full : std::max(begin, std::min(o.prefetch_end, full))};
}

// The lanes of an AVX-512 accumulator in the order sum() (vector_sums.h) adds them, the leaves
// of its tree: the column groups of a packed panel (kSkinnyPanel).
constexpr int64_t kPanelLeaf[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

// Weights of element W in one 64-byte cache line.
template <typename W>
constexpr int64_t kLine = 64 / sizeof(W);

// Into L2 only: at 8 or more rows of x (8 x 576 floats is 18 KiB) the rows of x and the
// block's weights fill L1, and lines prefetched into L1 were evicted before their block ran
// (16 rows: all SmolLM2 products of a step 69 -> 57 ms; 8 rows 61 -> 56; 1 row unchanged).
inline void prefetch_l2(const void* p) {
#ifdef SPECDEC_X86
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// A block of one weight row reads that row into L1 this many bytes (eight cache lines) ahead
// of its products: a single stream without it read ~15% slower than the ISA's block, with it
// 7-13% faster (AMD EPYC Zen 3, a decode step's products at one row of x).
template <typename W>
constexpr int64_t kRowAhead = 512 / sizeof(W);

inline void prefetch_line(const void* p) {
#ifdef SPECDEC_X86
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#else
  __builtin_prefetch(p);
#endif
}

// Whether column k (a multiple of the vector width) starts a cache line of W: half-precision
// rows take two vectors a line, and each line is prefetched once.
template <typename W>
inline bool line_start(int64_t k) {
  return sizeof(W) == sizeof(float) || k % kLine<W> == 0;
}

// A pass's share of the next block's lines ([line_begin, line_end) of its kOut rows' lines, row
// after row), issued in address order a few at a time evenly over the pass's `iters` iterations
// (a counter carries the fraction): issued in a burst over part of the pass (one line per row
// every 16 columns) the stream stalled the multiply-adds and then went idle, and the 8-row
// products cost their read plus their arithmetic (a standalone copy of the AVX2 block's loop
// over 540 MB, 2 threads, AMD EPYC Zen 3: 8 rows 37.7 -> 33.9 ms, 4 rows 31.2 -> 28.9 ms, 16
// rows unchanged, the read alone 23.2 ms).
template <typename W>
class LineSpread {
 public:
  LineSpread(const Operands<W>& o, int64_t iters)
      : iters_(iters),
        lines_(o.next == nullptr || iters == 0 ? 0 : o.line_end - o.line_begin),
        ldw_(o.ldw),
        row_end_((o.k + kLine<W> - 1) / kLine<W> * kLine<W>),
        row_(lines_ == 0 ? o.w : o.next + o.line_begin / (row_end_ / kLine<W>) * o.ldw),
        col_(lines_ == 0 ? 0 : o.line_begin % (row_end_ / kLine<W>) * kLine<W>) {}

  // One iteration's lines.
  inline void tick() {
    for (due_ += lines_; due_ >= iters_; due_ -= iters_) {
      prefetch_l2(row_ + col_);
      col_ += kLine<W>;
      if (col_ >= row_end_) {
        col_ = 0;
        row_ += ldw_;
      }
    }
  }

 private:
  const int64_t iters_, lines_, ldw_, row_end_;
  const W* row_;
  int64_t col_, due_ = 0;
};

inline float widen(float v) { return v; }
inline float widen(Half h) { return c10::detail::fp16_ieee_to_fp32_value(h.bits); }
inline float widen(BFloat16 h) {
  const uint32_t bits = static_cast<uint32_t>(h.bits) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// Reference path (no vector ISA): one sequential sum per output element.
struct Scalar {
  static constexpr int kOut = 4;  // weight rows per block (streamed from memory at once)
  static constexpr int kRows = 4;  // rows of x per pass
  template <typename W, int NB, int MB>
  static void block(const Operands<W>& o) {
    float acc[MB][NB] = {};
    for (int64_t k = 0; k < o.k; ++k) {
      for (int m = 0; m < MB; ++m) {
        for (int n = 0; n < NB; ++n) acc[m][n] += widen(o.w[n * o.ldw + k]) * o.x[m * o.ldx + k];
      }
    }
    for (int m = 0; m < MB; ++m) {
      for (int n = 0; n < NB; ++n) o.y[m * o.ldy + n] = acc[m][n];
    }
  }
};

#ifdef SPECDEC_X86
// 32 zmm registers: 4x4 accumulators, 4 weight vectors and one x vector. A 4 x 4 block's 16
// sums go through sum16 (they were a fifth of its time at 8 rows one by one).
struct Avx512 {
  static constexpr int kOut = 4;
  static constexpr int kRows = 4;

  // Sixteen weights as float32 (a half-precision one widened exactly).
  __attribute__((target("avx512f"), always_inline)) static inline __m512 load(const float* p) {
    return _mm512_loadu_ps(p);
  }
  __attribute__((target("avx512f"), always_inline)) static inline __m512 load(const Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  __attribute__((target("avx512f"), always_inline)) static inline __m512 load(const BFloat16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  // The first n (< 16) weights at p, the other lanes zero.
  __attribute__((target("avx512f"))) static inline __m512 load_tail(const float* p, int64_t n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
  }
  template <typename W>
  __attribute__((target("avx512f"))) static inline __m512 load_tail(const W* p, int64_t n) {
    alignas(32) W lanes[16] = {};
    std::memcpy(lanes, p, n * sizeof(W));
    return load(lanes);
  }

  // Columns k .. k + 15 of the block's weight rows against every row of x.
  template <typename W, int NB, int MB>
  __attribute__((target("avx512f"), always_inline)) static inline void step(__m512 (&acc)[MB][NB],
                                                                          const W* const (&w)[NB],
                                                                          const float* const (&x)[MB], int64_t k) {
    __m512 wv[NB];
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) wv[n] = load(w[n] + k);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x[m] + k);
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_fmadd_ps(wv[n], xv, acc[m][n]);
    }
  }

  // Row pointers held in registers: a loop that recomputed each row's address spent nearly as
  // many instructions as its sixteen multiply-adds (Intel Xeon with AMX); a burst runs the
  // columns before, inside and after its range as three loops for the same reason. Which of
  // the two prefetches wins depends on the CPU, so each machine measures (the schedules of
  // skinny_gemm.h): on an AMD EPYC with AVX-512 the spread took a decoding step's products at 8
  // rows from 27.4-28.4 to 18.9-19.2 ms and at 1 row from 22.1-23.4 to 16.6-18.3 ms; on an
  // Intel Xeon with AMX it left 8 rows unchanged and cost 1 row 5% (bench_decode_step.py's
  // forward, builds alternated, 2 cores).
  template <typename W, int NB, int MB>
  __attribute__((target("avx512f"))) static void block(const Operands<W>& o) {
    __m512 acc[MB][NB];
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
    }
    const W* w[NB];
    const float* x[MB];
    for (int n = 0; n < NB; ++n) w[n] = o.w + n * o.ldw;
    for (int m = 0; m < MB; ++m) x[m] = o.x + m * o.ldx;
    const int64_t full = o.k / 16 * 16;
    int64_t k = 0;
    if constexpr (NB == 1) {
      const auto [begin, end] = burst_range(o, full);
      for (; k < full; k += 16) {
        if (line_start<W>(k)) {
          if (k >= begin && k < end) prefetch_line(o.next + k);
          if (k + kRowAhead<W> < o.k) prefetch_line(o.w + k + kRowAhead<W>);
        }
        step<W, NB, MB>(acc, w, x, k);
      }
    } else if (o.burst) {
      const auto [begin, end] = burst_range(o, full);
      for (; k < begin; k += 16) step<W, NB, MB>(acc, w, x, k);
      for (; k < end; k += 16) {
        if (line_start<W>(k)) {
#pragma GCC unroll 4
          for (int n = 0; n < NB; ++n) prefetch_line(o.next + n * o.ldw + k);
        }
        step<W, NB, MB>(acc, w, x, k);
      }
      for (; k < full; k += 16) step<W, NB, MB>(acc, w, x, k);
    } else {
      LineSpread<W> spread(o, full / 16);
      for (; k < full; k += 16) {
        spread.tick();
        step<W, NB, MB>(acc, w, x, k);
      }
    }
    if (k < o.k) {
      const __mmask16 mask = static_cast<__mmask16>((1u << (o.k - k)) - 1u);
      __m512 wv[NB];
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) wv[n] = load_tail(o.w + n * o.ldw + k, o.k - k);
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        const __m512 xv = _mm512_maskz_loadu_ps(mask, o.x + m * o.ldx + k);
#pragma GCC unroll 4
        for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_fmadd_ps(wv[n], xv, acc[m][n]);
      }
    }
    if constexpr (MB * NB == 16) {
      __m512 all[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) all[i] = acc[i / NB][i % NB];
      alignas(64) float sums[16];
      _mm512_store_ps(sums, sum16(all));
#pragma GCC unroll 16
      for (int l = 0; l < 16; ++l) o.y[kSumOrder[l] / NB * o.ldy + kSumOrder[l] % NB] = sums[l];
    } else {
      for (int m = 0; m < MB; ++m) {
        for (int n = 0; n < NB; ++n) o.y[m * o.ldy + n] = sum(acc[m][n]);
      }
    }
  }
};

// kSkinnyPanel (skinny_gemm.h). The block above gives output n the sum, by sum()'s pairing of
// lanes, of 16 lane accumulators, lane l the multiply-adds of columns k = l mod 16 in order.
// A panel holds kSkinnyPanelWidth outputs' weights column by column, the lanes being outputs,
// with the columns of each lane group together; the groups come in the order of sum()'s tree
// leaves, so each group's accumulators are added to the stack of partial sums as that tree adds
// lanes, vertically: the same additions in the same order, hence the same bits. Each weight
// vector loaded serves every row of x (up to 8 a pass) with no horizontal sum, and the panels
// stream as one sequence, read kPanelAhead bytes ahead into L2. x is regrouped the same way
// once a call, a column's rows side by side: broadcast from x as stored (a line for each row
// and column) the 8-row products ran no faster than the block's while the weights streamed
// (a stand-alone copy over a SmolLM2 step's weights, AMD EPYC Zen 5: 13.2-13.8 ms against
// 11.1 with x regrouped, 1 row 11.9-12.2 -> 11.9).
constexpr int kPanelVectors = kSkinnyPanelWidth / 16;
constexpr int kPanelRows = 8;  // rows of x a pass: 8 x 3 accumulators, 3 weight vectors, x
constexpr int64_t kPanelAhead = 32768;

// xt[(leaf * cols + c) * R + r] = x[r][16 c + kPanelLeaf[leaf]] for R rows.
template <typename W, int R>
__attribute__((target("avx512f"))) void panel_rows(const W* p, int64_t cols, const float* xt, float* y, int64_t ldy,
                                                   const char*& ahead, const char* stop) {
  constexpr int V = kPanelVectors;
  __m512 stack[4][R][V];
  int level[4], depth = 0;
  for (int leaf = 0; leaf < 16; ++leaf) {
    const W* group = p + leaf * cols * kSkinnyPanelWidth;
    const float* xg = xt + leaf * cols * R;
    __m512 acc[R][V];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
    }
    for (int64_t c = 0; c < cols; ++c) {
      const W* col = group + c * kSkinnyPanelWidth;
      for (const char* want = reinterpret_cast<const char*>(col + kSkinnyPanelWidth) + kPanelAhead;
           ahead < want && ahead < stop; ahead += 64) {
        prefetch_l2(ahead);
      }
      __m512 wv[V];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) wv[v] = Avx512::load(col + 16 * v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(xg[c * R + r]);
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(wv[v], xb, acc[r][v]);
      }
    }
    int merged = 0;
    for (; depth > 0 && level[depth - 1] == merged; --depth, ++merged) {
      for (int r = 0; r < R; ++r) {
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_add_ps(stack[depth - 1][r][v], acc[r][v]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < V; ++v) stack[depth][r][v] = acc[r][v];
    }
    level[depth++] = merged;
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y + r * ldy + 16 * v, stack[0][r][v]);
  }
}

// A panel against a group of r (<= R) rows of x.
template <typename W, int R>
void panel_group(int r, const W* p, int64_t cols, const float* xt, float* y, int64_t ldy, const char*& ahead,
                 const char* stop) {
  if constexpr (R > 0) {
    if (r == R) {
      panel_rows<W, R>(p, cols, xt, y, ldy, ahead, stop);
    } else {
      panel_group<W, R - 1>(r, p, cols, xt, y, ldy, ahead, stop);
    }
  }
}

// Output features [begin, end) (whole panels) of a packed weight against every row of x: x
// regrouped a group of kPanelRows rows at a time, then each panel against every group.
template <typename W>
void panel_range(const Operands<W>& o, int64_t rows, int64_t begin, int64_t end) {
  const int64_t cols = o.k / 16, panel = kSkinnyPanelWidth * o.k;
  static thread_local std::vector<float> regrouped;
  if (regrouped.size() < static_cast<size_t>(rows * o.k)) regrouped.resize(rows * o.k);
  float* xt = regrouped.data();
  for (int64_t m = 0; m < rows; m += kPanelRows) {
    const int64_t r_group = std::min<int64_t>(kPanelRows, rows - m);
    float* out = xt + m * o.k;
    for (int64_t r = 0; r < r_group; ++r) {
      const float* row = o.x + (m + r) * o.ldx;
      for (int leaf = 0; leaf < 16; ++leaf) {
        for (int64_t c = 0; c < cols; ++c) out[(leaf * cols + c) * r_group + r] = row[16 * c + kPanelLeaf[leaf]];
      }
    }
  }
  const char* stop = reinterpret_cast<const char*>(o.w + end / kSkinnyPanelWidth * panel);
  const char* ahead = reinterpret_cast<const char*>(o.w + begin / kSkinnyPanelWidth * panel) + kPanelAhead;
  for (int64_t n = begin; n < end; n += kSkinnyPanelWidth) {
    const W* p = o.w + n / kSkinnyPanelWidth * panel;
    for (int64_t m = 0; m < rows; m += kPanelRows) {
      panel_group<W, kPanelRows>(static_cast<int>(std::min<int64_t>(kPanelRows, rows - m)), p, cols, xt + m * o.k,
                                 o.y + m * o.ldy + n, o.ldy, ahead, stop);
    }
  }
}

// 16 ymm registers: 3x4 accumulators, 3 weight vectors and one x vector (seven loads for
// twelve multiply-adds: a verify's 8-16 rows stay near the FMA units' rate). A block of kOut
// rows prefetches the next block's lines at a steady rate over the whole pass (LineSpread, a
// counter an iteration beside 24 multiply-adds) or, when `burst`, one line a row at each line
// start of its range; each accumulator takes the columns in order. Every AVX2 CPU has F16C
// (half-precision weights).
struct Avx2 {
  static constexpr int kOut = 3;
  static constexpr int kRows = 4;

  __attribute__((target("avx2,fma"))) static inline float sum(__m256 v) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }

  __attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m256 load(const float* p) {
    return _mm256_loadu_ps(p);
  }
  __attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m256 load(const Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  __attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m256 load(const BFloat16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  // The first n (< 8) weights at p, the other lanes zero.
  __attribute__((target("avx2,fma,f16c"))) static inline __m256 load_tail(const float* p, __m256i mask, int64_t) {
    return _mm256_maskload_ps(p, mask);
  }
  template <typename W>
  __attribute__((target("avx2,fma,f16c"))) static inline __m256 load_tail(const W* p, __m256i, int64_t n) {
    alignas(16) W lanes[8] = {};
    std::memcpy(lanes, p, n * sizeof(W));
    return load(lanes);
  }

  // Columns k .. k + 7 of the block's weight rows against every row of x.
  template <typename W, int NB, int MB>
  __attribute__((target("avx2,fma,f16c"), always_inline)) static inline void step(__m256 (&acc)[MB][NB],
                                                                                  const Operands<W>& o, int64_t k) {
    __m256 wv[NB];
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) wv[n] = load(o.w + n * o.ldw + k);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(o.x + m * o.ldx + k);
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm256_fmadd_ps(wv[n], xv, acc[m][n]);
    }
  }

  template <typename W, int NB, int MB>
  __attribute__((target("avx2,fma,f16c"))) static void block(const Operands<W>& o) {
    __m256 acc[MB][NB];
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm256_setzero_ps();
    }
    const int64_t full = o.k / 8 * 8;
    int64_t k = 0;
    if constexpr (NB == 1) {
      // One weight row: the next block's lines at the line starts in [begin, end), and that
      // row's lines ahead into L1 as well (a test an iteration is nothing beside a single
      // stream's memory time); the loop below finishes the columns.
      const auto [begin, end] = burst_range(o, full);
      for (; k + 16 <= full; k += 16) {
        if (line_start<W>(k)) {
          if (k >= begin && k < end) prefetch_l2(o.next + k);
          if (k + kRowAhead<W> < o.k) prefetch_line(o.w + k + kRowAhead<W>);
        }
        step<W, NB, MB>(acc, o, k);
        step<W, NB, MB>(acc, o, k + 8);
      }
    } else if (o.burst) {
      const auto [begin, end] = burst_range(o, full);
      for (; k < begin; k += 8) step<W, NB, MB>(acc, o, k);
      for (; k + 16 <= end; k += 16) {
        if (line_start<W>(k)) {
#pragma GCC unroll 4
          for (int n = 0; n < NB; ++n) prefetch_l2(o.next + n * o.ldw + k);
        }
        step<W, NB, MB>(acc, o, k);
        step<W, NB, MB>(acc, o, k + 8);
      }
    } else {
      LineSpread<W> spread(o, full / 16);
      for (; k + 16 <= full; k += 16) {
        spread.tick();
        step<W, NB, MB>(acc, o, k);
        step<W, NB, MB>(acc, o, k + 8);
      }
    }
    for (; k < full; k += 8) step<W, NB, MB>(acc, o, k);
    if (k < o.k) {
      alignas(32) int32_t lanes[8];
      for (int i = 0; i < 8; ++i) lanes[i] = (k + i < o.k) ? -1 : 0;
      const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
      __m256 wv[NB];
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) wv[n] = load_tail(o.w + n * o.ldw + k, mask, o.k - k);
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        const __m256 xv = _mm256_maskload_ps(o.x + m * o.ldx + k, mask);
#pragma GCC unroll 4
        for (int n = 0; n < NB; ++n) acc[m][n] = _mm256_fmadd_ps(wv[n], xv, acc[m][n]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      for (int n = 0; n < NB; ++n) o.y[m * o.ldy + n] = sum(acc[m][n]);
    }
  }
};
#endif

// The last r (< Isa::kRows) rows of x against NB weight rows.
template <typename Isa, typename W, int NB, int MB>
void tail_rows(int64_t r, const Operands<W>& o) {
  if constexpr (MB > 0) {
    if (r == MB) {
      Isa::template block<W, NB, MB>(o);
    } else {
      tail_rows<Isa, W, NB, MB - 1>(r, o);
    }
  }
}

// Every row of x (rows) against NB weight rows starting at o.w, writing o.y[:, 0:NB].
template <typename Isa, typename W, int NB>
void all_rows(int64_t rows, Operands<W> o) {
  const int64_t passes = (rows + Isa::kRows - 1) / Isa::kRows;
  // Each pass's share of the next block's columns, in whole cache lines.
  const int64_t line = kLine<W>;
  const int64_t share = (o.k + line * passes - 1) / (line * passes) * line;
  o.prefetch_begin = 0;
  o.prefetch_end = share;
  const int64_t lines = NB * ((o.k + line - 1) / line);
  int64_t pass = 0;
  o.line_begin = 0;
  o.line_end = lines / passes;
  int64_t m = 0;
  for (; m + Isa::kRows <= rows; m += Isa::kRows) {
    Isa::template block<W, NB, Isa::kRows>(o);
    o.x += Isa::kRows * o.ldx;
    o.y += Isa::kRows * o.ldy;
    o.prefetch_begin = o.prefetch_end;
    o.prefetch_end += share;
    ++pass;
    o.line_begin = o.line_end;
    o.line_end = lines * (pass + 1) / passes;
  }
  tail_rows<Isa, W, NB, Isa::kRows - 1>(rows - m, o);
}

// Output features [begin, end) on the calling thread: blocks of kOut weight rows from `begin`,
// the remainder one row a block (the same per-element arithmetic whichever block a row is in).
template <typename Isa, typename W, int kOut>
void run_range(const Operands<W>& all, int64_t rows, int64_t begin, int64_t end) {
  if (kOut == 1 && rows == 1) {
    // One row of x: each weight row straight after the last, with no pass bookkeeping and no
    // next-row prefetch (the row's own read-ahead stays). Per row, that work had cost a third of
    // a single core's stream (AMD EPYC Zen 4, a step's 121 layer weights on one thread: 16-17
    // GB/s against 25 for the bare loop and 27 for a sum); the arithmetic is the block's.
    Operands<W> o = all;
    o.next = nullptr;
    o.w = all.w + begin * all.ldw;
    o.y = all.y + begin;
    for (int64_t n = begin; n < end; ++n, o.w += all.ldw, ++o.y) Isa::template block<W, 1, 1>(o);
    return;
  }
  for (int64_t n = begin; n < end; n += kOut) {
    Operands<W> o = all;
    o.w = all.w + n * all.ldw;
    o.y = all.y + n;
    o.next = n + 2 * kOut <= end ? o.w + kOut * all.ldw : nullptr;
    if (n + kOut <= end) {
      all_rows<Isa, W, kOut>(rows, o);
      continue;
    }
    for (int64_t j = n; j < end; ++j, o.w += all.ldw, ++o.y) all_rows<Isa, W, 1>(rows, o);
  }
}

template <typename Isa, typename W>
void run_range(const Operands<W>& all, int64_t rows, int64_t begin, int64_t end, int64_t schedule) {
  if (schedule == kSkinnyRow) {
    run_range<Isa, W, 1>(all, rows, begin, end);
  } else {
    Operands<W> o = all;
    o.burst = schedule == kSkinnyBlockBurst;
    run_range<Isa, W, Isa::kOut>(o, rows, begin, end);
  }
}

template <typename Isa, typename W>
void run(const Operands<W>& all, int64_t rows, int64_t out_features, int64_t schedule) {
  const int64_t width = skinny_block_width(schedule);
  const int64_t blocks = (out_features + width - 1) / width;
  // At least ~64 KiB of weight per task: a small matrix is not worth waking a thread for.
  const int64_t row_bytes = all.k * static_cast<int64_t>(sizeof(W));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, width * row_bytes));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    run_range<Isa, W>(all, rows, begin * width, std::min(end * width, out_features), schedule);
  });
}

enum class Path { kScalar, kAvx2, kAvx512 };

const char* name(Path p) {
  switch (p) {
    case Path::kAvx512:
      return "avx512";
    case Path::kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

// The best path this CPU runs; SPECDEC_SKINNY_ISA=avx2|scalar asks for a lower one (tests; the
// decoding ops of decode_ops.cpp follow it).
Path detect() {
  Path best = Path::kScalar;
#ifdef SPECDEC_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    best = Path::kAvx512;
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    best = Path::kAvx2;
  }
#endif
  const char* asked = std::getenv("SPECDEC_SKINNY_ISA");
  if (asked == nullptr || *asked == '\0') return best;
  for (Path p : {Path::kScalar, Path::kAvx2, Path::kAvx512}) {
    if (std::strcmp(asked, name(p)) == 0) {
      TORCH_CHECK(p <= best, "SPECDEC_SKINNY_ISA=", asked, ": this CPU supports at most ", name(best));
      return p;
    }
  }
  TORCH_CHECK(false, "SPECDEC_SKINNY_ISA=", asked, ": expected one of avx512, avx2, scalar");
  return best;
}

Path path() {
  static const Path chosen = detect();
  return chosen;
}

}  // namespace

std::string skinny_linear_isa() { return name(path()); }

bool skinny_panel_available() { return path() == Path::kAvx512; }

void check_skinny_schedule(int64_t schedule, const char* what) {
  TORCH_CHECK(schedule == kSkinnyBlockSpread || schedule == kSkinnyRow || schedule == kSkinnyBlockBurst ||
                  schedule == kSkinnyPanel,
              what, ": schedule must be 0 (the ISA's block, the next block spread over each pass), 1 (one ",
              "weight row a block), 2 (the ISA's block, the next block in a burst) or 3 (packed panels), got ",
              schedule);
  TORCH_CHECK(schedule != kSkinnyPanel || skinny_panel_available(), what,
              ": schedule 3 (packed panels) needs the avx512 path, this process takes ", name(path()));
}

int64_t skinny_block_width(int64_t schedule) {
  if (schedule == kSkinnyRow) return 1;
  if (schedule == kSkinnyPanel) return kSkinnyPanelWidth;
  switch (path()) {
#ifdef SPECDEC_X86
    case Path::kAvx512:
      return Avx512::kOut;
    case Path::kAvx2:
      return Avx2::kOut;
#endif
    default:
      return Scalar::kOut;
  }
}

WeightKind weight_kind(const at::Tensor& weight, const char* what) {
  switch (weight.scalar_type()) {
    case at::kFloat:
      return WeightKind::kFloat32;
    case at::kHalf:
      return WeightKind::kFloat16;
    case at::kBFloat16:
      return WeightKind::kBFloat16;
    default:
      TORCH_CHECK(false, what, " must be float32, float16 or bfloat16, got ", weight.scalar_type());
  }
  return WeightKind::kFloat32;
}

namespace {

// fn(W{}) for the element type the weights are stored in: the one switch over WeightKind.
template <typename Fn>
void with_weight_type(WeightKind kind, Fn&& fn) {
  switch (kind) {
    case WeightKind::kFloat16:
      return fn(Half{});
    case WeightKind::kBFloat16:
      return fn(BFloat16{});
    default:
      return fn(float{});
  }
}

// fn(Isa{}) for the ISA path this process takes: the one switch over Path of the products.
template <typename Fn>
void with_isa(Fn&& fn) {
  switch (path()) {
#ifdef SPECDEC_X86
    case Path::kAvx512:
      return fn(Avx512{});
    case Path::kAvx2:
      return fn(Avx2{});
#endif
    default:
      return fn(Scalar{});
  }
}

template <typename W>
Operands<W> operands_of(const SkinnyOperands& a) {
  return {a.x, a.ldx, static_cast<const W*>(a.w), a.ldw, a.k, a.y, a.ldy};
}

}  // namespace

void skinny_share(const SkinnyOperands& a, int64_t begin, int64_t end, int64_t schedule) {
  with_weight_type(a.kind, [&](auto element) {
    const auto o = operands_of<decltype(element)>(a);
#ifdef SPECDEC_X86
    if (schedule == kSkinnyPanel) return panel_range(o, a.rows, begin, end);
#endif
    with_isa([&](auto isa) { run_range<decltype(isa)>(o, a.rows, begin, end, schedule); });
  });
}

namespace {

// A packed weight's shape: out-features whole panels, in-features whole column groups.
void check_panel_shape(const at::Tensor& weight, const char* what) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % kSkinnyPanelWidth == 0 && weight.size(1) % 16 == 0, what,
              ": packed panels need a 2-D weight [N, K] with N a multiple of ", kSkinnyPanelWidth,
              " and K of 16, got shape ", weight.sizes());
}

}  // namespace

at::Tensor skinny_pack_cpu(const at::Tensor& weight) {
  check_panel_shape(weight, "skinny_pack");
  weight_kind(weight, "skinny_pack: weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  // [N / P, P, K / 16, 16] -> [N / P, 16 (sum()'s leaf order), K / 16, P]
  const at::Tensor leaves = at::tensor(at::ArrayRef<int64_t>(kPanelLeaf, 16), at::kLong);
  return weight.reshape({n / kSkinnyPanelWidth, kSkinnyPanelWidth, k / 16, 16})
      .permute({0, 3, 2, 1})
      .index_select(1, leaves)
      .contiguous()
      .view({n, k});
}

at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight, int64_t schedule) {
  check_skinny_schedule(schedule, "skinny_linear");
  TORCH_CHECK(weight.dim() == 2, "skinny_linear: weight must be 2-D [out, in], got shape ", weight.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "skinny_linear: x must be [..., ", weight.size(1),
              "] to match weight ", weight.sizes(), ", got shape ", x.sizes());
  const at::ScalarType wt = weight.scalar_type();
  TORCH_CHECK(x.scalar_type() == at::kFloat && (wt == at::kFloat || wt == at::kHalf || wt == at::kBFloat16),
              "skinny_linear: x must be float32 and weight float32, float16 or bfloat16, got x ", x.scalar_type(),
              " and weight ", wt);
  if (schedule == kSkinnyPanel) {
    check_panel_shape(weight, "skinny_linear");
    TORCH_CHECK(weight.is_contiguous(), "skinny_linear: a packed weight (schedule 3) must be skinny_pack's, ",
                "contiguous, got strides ", weight.strides());
  }
  const int64_t k = weight.size(1);
  const int64_t out_features = weight.size(0);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out_features;
  if (k == 0) return at::zeros(sizes, x.options());
  // Strided rows are read in place; only a non-unit stride along K is copied.
  const at::Tensor w = (weight.stride(1) == 1 || k == 1) ? weight : weight.contiguous();
  at::Tensor rows = x.reshape({-1, k});
  if (k > 1 && rows.stride(1) != 1) rows = rows.contiguous();
  const int64_t m = rows.size(0);
  at::Tensor y = at::empty({m, out_features}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0 || out_features == 0) return y.view(sizes);
  const SkinnyOperands a{rows.data_ptr<float>(), rows.stride(0), m, w.const_data_ptr(), w.stride(0), k,
                         y.data_ptr<float>(), out_features, weight_kind(w, "skinny_linear: weight")};
  if (schedule == kSkinnyPanel) {
    at::parallel_for(0, out_features / kSkinnyPanelWidth, 1, [&](int64_t begin, int64_t end) {
      skinny_share(a, begin * kSkinnyPanelWidth, end * kSkinnyPanelWidth, schedule);
    });
    return y.view(sizes);
  }
  with_weight_type(a.kind, [&](auto element) {
    const auto o = operands_of<decltype(element)>(a);
    with_isa([&](auto isa) { run<decltype(isa)>(o, m, out_features, schedule); });
  });
  return y.view(sizes);
}

}  // namespace specdec
