// CPU row math of the acceptance ops (see cpu_row.h).
#include "cpu_row.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

// GCC emits one copy per ISA and picks one at load time; the loops below are
// written so the compiler vectorises them (no intrinsics to maintain).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPECDEC_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SPECDEC_SIMD_CLONES
#endif

namespace specdec {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Rows are reduced in fixed chunks so the result does not depend on the thread count.
constexpr int64_t kChunk = 8192;
constexpr int64_t kBlock = 512;  // stack buffer of the exp passes

// Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2, then a degree-13 Taylor
// polynomial: relative error ~2e-16. Below -708 the result would be subnormal
// and is flushed to 0 (such a probability is never drawn nor accepted).
inline double exp_nonpos_inline(double x) {
  constexpr double kLog2e = 1.4426950408889634;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kShifter = 6755399441055744.0;  // 1.5 * 2^52: rounds to an integer in the low bits
  const double xc = x < -708.0 ? -708.0 : x;
  const double t = xc * kLog2e + kShifter;
  const double k = t - kShifter;
  const double r = (xc - k * kLn2Hi) - k * kLn2Lo;
  double p = 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  int64_t ki;
  std::memcpy(&ki, &t, sizeof(ki));
  const uint64_t bits = static_cast<uint64_t>(ki - 0x18000000000000LL + 1023) << 52;
  double scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -708.0 ? 0.0 : p * scale;
}

// GCC vector types: one loop body becomes AVX-512, AVX2 or SSE2 code in each clone.
// They never cross a function boundary (helpers are always inlined), so the
// ABI note GCC gives for 64-byte vector arguments does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
typedef double VecD __attribute__((vector_size(64)));
typedef long long VecL __attribute__((vector_size(64)));
constexpr int kVec = 8;
#define SPECDEC_INLINE inline __attribute__((always_inline))

SPECDEC_INLINE VecD splat(double v) {
  return VecD{} + v;
}

SPECDEC_INLINE VecD load(const double* p) {
  VecD v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

SPECDEC_INLINE void store(double* p, VecD v) {
  std::memcpy(p, &v, sizeof(v));
}

SPECDEC_INLINE double lanes_sum(VecD v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

void check_row(bool bad, double max, const char* op) {
  TORCH_CHECK(!bad, op, ": target_logits must be finite or -inf (after temperature); found NaN or +inf");
  TORCH_CHECK(max > -kInf, op, ": a target_logits row is entirely -inf (no token can be sampled)");
}

// Max of x (flagging NaN or +inf) for a logits row already scaled into x.
double checked_max(const double* x, int64_t n, bool* bad) {
  bool nan = false;
  const double m = block_max(x, n, &nan);
  *bad = *bad || nan || m == kInf;
  return m;
}

SPECDEC_SIMD_CLONES
double block_weighted(const double* x, const double* e, int64_t n, double shift) {
  VecD acc = {};
  int64_t j = 0;
  for (; j + kVec <= n; j += kVec) {
    const VecD ev = load(e + j);
    acc += ev > 0.0 ? ev * (load(x + j) - shift) : splat(0.0);
  }
  double total = lanes_sum(acc);
  for (; j < n; ++j) total += e[j] > 0.0 ? e[j] * (x[j] - shift) : 0.0;
  return total;
}

// Max of the row, then e = exp(x - max) and the normaliser, in L1-sized blocks of
// fixed chunks whose partial results are merged in order.
template <typename T>
RowDist plain_row_dist(const T* row, int64_t vocab, double temperature, double* e, const char* op) {
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  std::vector<double> maxs(chunks), sums(chunks);
  std::vector<char> bads(chunks, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    double buf[kBlock];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t end = std::min(vocab, (c + 1) * kChunk);
      bool bad = false;
      double m = -kInf;
      for (int64_t j = c * kChunk; j < end; j += kBlock) {
        const int64_t n = std::min(kBlock, end - j);
        scale_row(row + j, n, temperature, buf);
        m = std::max(m, checked_max(buf, n, &bad));
      }
      maxs[c] = m;
      bads[c] = bad;
    }
  });
  RowDist d{-kInf, 0.0, -kInf};
  bool bad = false;
  for (int64_t c = 0; c < chunks; ++c) {
    bad = bad || bads[c];
    d.max = std::max(d.max, maxs[c]);
  }
  check_row(bad, d.max, op);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t end = std::min(vocab, (c + 1) * kChunk);
      double s = 0.0;
      for (int64_t j = c * kChunk; j < end; j += kBlock) {
        const int64_t n = std::min(kBlock, end - j);
        scale_row(row + j, n, temperature, e + j);
        block_exp(e + j, e + j, n, d.max, -kInf);
        s += block_sum(e + j, n);
      }
      sums[c] = s;
    }
  });
  for (int64_t c = 0; c < chunks; ++c) d.sum += sums[c];
  return d;
}

// top-k / top-p: the cut is a threshold on x found on a sorted copy (reference semantics).
template <typename T>
RowDist cut_row_dist(const T* row, int64_t vocab, const SamplingParams& sp, std::vector<double>& scratch, double* e,
                     const char* op) {
  scratch.resize(vocab);
  double* x = e;  // x is turned into e in place at the end
  double* tmp = scratch.data();
  scale_row(row, vocab, sp.temperature, x);
  bool bad = false;
  RowDist d{checked_max(x, vocab, &bad), 0.0, -kInf};
  check_row(bad, d.max, op);
  if (sp.top_k > 0 && sp.top_k < vocab) {
    std::copy(x, x + vocab, tmp);
    std::nth_element(tmp, tmp + sp.top_k - 1, tmp + vocab, std::greater<double>());
    d.cut = tmp[sp.top_k - 1];
  }
  if (sp.top_p < 1.0) {
    const int64_t kept = std::copy_if(x, x + vocab, tmp, [&](double v) { return v >= d.cut; }) - tmp;
    std::sort(tmp, tmp + kept, std::greater<double>());
    const double sum = block_sum_exp(tmp, kept, d.max, -kInf);
    double cum = 0.0;
    for (int64_t j = 0; j < kept; ++j) {
      cum += exp_nonpos_inline(tmp[j] - d.max) / sum;
      if (!(cum < sp.top_p)) {
        d.cut = std::max(d.cut, tmp[j]);
        break;
      }
    }
  }
  block_exp(x, e, vocab, d.max, d.cut);
  d.sum = block_sum(e, vocab);
  return d;
}

}  // namespace

double exp_nonpos(double x) {
  return exp_nonpos_inline(x);
}

SPECDEC_SIMD_CLONES
double block_max(const double* x, int64_t n, bool* nan) {
  VecD acc = splat(-kInf);
  VecL seen = {};
  int64_t j = 0;
  for (; j + kVec <= n; j += kVec) {
    const VecD v = load(x + j);
    seen |= v != v;
    acc = v > acc ? v : acc;
  }
  double m = -kInf;
  bool any = false;
  for (int l = 0; l < kVec; ++l) {
    m = acc[l] > m ? acc[l] : m;
    any = any || seen[l];
  }
  for (; j < n; ++j) {
    any = any || x[j] != x[j];
    m = x[j] > m ? x[j] : m;
  }
  *nan = *nan || any;
  return m;
}

SPECDEC_SIMD_CLONES
double block_sum(const double* x, int64_t n) {
  VecD acc = {};
  int64_t j = 0;
  for (; j + kVec <= n; j += kVec) acc += load(x + j);
  double total = lanes_sum(acc);
  for (; j < n; ++j) total += x[j];
  return total;
}

SPECDEC_SIMD_CLONES
void floats_to_double(const float* row, int64_t n, double* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = row[j];
}

SPECDEC_SIMD_CLONES
void block_div(double* x, int64_t n, double divisor) {
  for (int64_t j = 0; j < n; ++j) x[j] /= divisor;
}

SPECDEC_SIMD_CLONES
void block_exp(const double* x, double* out, int64_t n, double shift, double cut) {
  for (int64_t j = 0; j < n; ++j) out[j] = x[j] >= cut ? exp_nonpos_inline(x[j] - shift) : 0.0;
}

double block_sum_exp(const double* x, int64_t n, double shift, double cut) {
  double e[kBlock];
  double total = 0.0;
  for (int64_t j = 0; j < n; j += kBlock) {
    const int64_t m = std::min(kBlock, n - j);
    block_exp(x + j, e, m, shift, cut);
    total += block_sum(e, m);
  }
  return total;
}

void block_exp_moments(const double* x, int64_t n, double shift, double* sum, double* sum_xe) {
  double e[kBlock];
  *sum = *sum_xe = 0.0;
  for (int64_t j = 0; j < n; j += kBlock) {
    const int64_t m = std::min(kBlock, n - j);
    block_exp(x + j, e, m, shift, -kInf);
    *sum += block_sum(e, m);
    *sum_xe += block_weighted(x + j, e, m, shift);
  }
}

SPECDEC_SIMD_CLONES
bool block_residual(const double* w, const double* q, double* out, int64_t n, double scale) {
  // q * 0 is NaN exactly for NaN and +-inf q: summed, it flags them without per-lane masks.
  VecD poison = {}, low = {};
  int64_t j = 0;
  for (; j + kVec <= n; j += kVec) {
    const VecD qv = load(q + j);
    poison += qv * 0.0;
    low = qv < low ? qv : low;
    const VecD r = load(w + j) - qv * scale;
    store(out + j, r > 0.0 ? r : splat(0.0));
  }
  bool ok = lanes_sum(poison) == 0.0;
  for (int l = 0; l < kVec; ++l) ok = ok && low[l] >= 0.0;
  for (; j < n; ++j) {
    ok = ok && q[j] >= 0.0 && q[j] < kInf;
    out[j] = std::max(0.0, w[j] - q[j] * scale);
  }
  return ok;
}

int64_t sample_weights(const double* w, int64_t n, double u) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> block_total(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    block_total[b] = block_sum(w + b * kBlock, std::min(kBlock, n - b * kBlock));
    total += block_total[b];
  }
  const double target = u * total;
  double running = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (running + block_total[b] <= target) {
      running += block_total[b];
      continue;
    }
    const int64_t end = std::min(n, (b + 1) * kBlock);
    for (int64_t j = b * kBlock; j < end; ++j) {
      running += w[j];
      if (running > target) return j;
    }
  }
  // Rounding put the target past the last partial sum: take the last drawable index.
  for (int64_t j = n - 1; j > 0; --j) {
    if (w[j] > 0.0) return j;
  }
  return 0;
}

template <typename T>
RowDist row_dist(const T* row, int64_t vocab, const SamplingParams& sp, std::vector<double>& scratch, double* e,
                 const char* op) {
  if ((sp.top_k > 0 && sp.top_k < vocab) || sp.top_p < 1.0) return cut_row_dist(row, vocab, sp, scratch, e, op);
  return plain_row_dist(row, vocab, sp.temperature, e, op);
}

template <typename T>
int64_t row_argmax(const T* row, int64_t vocab, const char* op) {
  double buf[kChunk];
  double best = -kInf;
  int64_t best_chunk = 0;
  bool nan = false;
  for (int64_t c = 0; c * kChunk < vocab; ++c) {
    const int64_t n = std::min(kChunk, vocab - c * kChunk);
    to_double(row + c * kChunk, n, buf);
    const double m = block_max(buf, n, &nan);
    if (m > best) {
      best = m;
      best_chunk = c;
    }
  }
  TORCH_CHECK(!nan, op, ": target_logits contains NaN");
  const int64_t begin = best_chunk * kChunk, end = std::min(vocab, begin + kChunk);
  for (int64_t j = begin; j < end; ++j) {
    if (static_cast<double>(row[j]) == best) return j;
  }
  return begin;
}

#define SPECDEC_INSTANTIATE(T)                                                                       \
  template RowDist row_dist<T>(const T*, int64_t, const SamplingParams&, std::vector<double>&, double*, \
                               const char*);                                                               \
  template int64_t row_argmax<T>(const T*, int64_t, const char*);
SPECDEC_INSTANTIATE(float)
SPECDEC_INSTANTIATE(double)
SPECDEC_INSTANTIATE(c10::Half)
SPECDEC_INSTANTIATE(c10::BFloat16)
#undef SPECDEC_INSTANTIATE

}  // namespace specdec
