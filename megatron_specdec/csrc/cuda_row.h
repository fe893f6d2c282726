// Device-side row math of the CUDA acceptance kernels (include from .cu files only).
// One thread block handles one request; every helper here is called by all threads
// of the block and returns the same value in each. Reductions use a fixed order,
// so results are deterministic. Probabilities are float64, as on the CPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_kernels.h"
#include "limits.h"

namespace specdec {
namespace cuda {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ double to_double(float v) { return v; }
__device__ __forceinline__ double to_double(double v) { return v; }
__device__ __forceinline__ double to_double(__half v) { return __half2float(v); }
__device__ __forceinline__ double to_double(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ double pos_inf() { return __longlong_as_double(0x7ff0000000000000LL); }

// Draft probabilities keep a runtime dtype: they are read rarely, and it saves instantiations.
__device__ __forceinline__ double load_prob(const void* q, DType t, int64_t i) {
  switch (t) {
    case DType::kFloat64: return static_cast<const double*>(q)[i];
    case DType::kFloat16: return __half2float(static_cast<const __half*>(q)[i]);
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(q)[i]);
    default: return static_cast<const float*>(q)[i];
  }
}

__device__ __forceinline__ bool bad_prob(double v) { return !(v >= 0.0 && v < pos_inf()); }

// The first error wins; the launcher raises it after the kernel.
__device__ __forceinline__ void report(int* error, int code) {
  if (threadIdx.x == 0) atomicCAS(error, 0, code);
}

struct Shared {
  double vals[kWarps];
  int64_t idx[kWarps];
  double chunk[kThreads];
  double bcast;
  int64_t bcast_idx;
};

__device__ inline double block_sum(double v, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  if (threadIdx.x % 32 == 0) sh.vals[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0.0;
    for (int w = 0; w < kWarps; ++w) s += sh.vals[w];
    sh.bcast = s;
  }
  __syncthreads();
  const double r = sh.bcast;
  __syncthreads();
  return r;
}

__device__ inline double block_max(double v, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(kFullMask, v, o));
  if (threadIdx.x % 32 == 0) sh.vals[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    double m = sh.vals[0];
    for (int w = 1; w < kWarps; ++w) m = fmax(m, sh.vals[w]);
    sh.bcast = m;
  }
  __syncthreads();
  const double r = sh.bcast;
  __syncthreads();
  return r;
}

// Largest value, first index on ties (torch.argmax). Returns -1 after reporting NaN.
template <typename T>
__device__ int64_t block_argmax(const T* row, int64_t vocab, Shared& sh, int* error) {
  double best = -pos_inf();
  int64_t at = vocab;
  int nan = 0;
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
    const double v = to_double(row[j]);
    nan |= v != v;
    if (v > best || (v == best && j < at)) {
      best = v;
      at = j;
    }
  }
  if (__syncthreads_or(nan)) {
    report(error, kBadLogit);
    return -1;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const double ov = __shfl_xor_sync(kFullMask, best, o);
    const int64_t oi = __shfl_xor_sync(kFullMask, at, o);
    if (ov > best || (ov == best && oi < at)) {
      best = ov;
      at = oi;
    }
  }
  if (threadIdx.x % 32 == 0) {
    sh.vals[threadIdx.x / 32] = best;
    sh.idx[threadIdx.x / 32] = at;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) {
      if (sh.vals[w] > best || (sh.vals[w] == best && sh.idx[w] < at)) {
        best = sh.vals[w];
        at = sh.idx[w];
      }
    }
    sh.bcast_idx = at;
  }
  __syncthreads();
  const int64_t r = sh.bcast_idx;
  __syncthreads();
  return r;
}

// p_j = exp(x_j - max) / sum for x_j >= cut, else 0, with x = logit / temperature.
struct RowDist {
  double max, sum, cut;
};

// Doubles as unsigned keys with the same order, for exact bisection over values.
__device__ __forceinline__ uint64_t order_key(double x) {
  const uint64_t b = static_cast<uint64_t>(__double_as_longlong(x));
  return (b >> 63) ? ~b : (b | 0x8000000000000000ull);
}

__device__ __forceinline__ double key_value(uint64_t k) {
  const uint64_t b = (k >> 63) ? (k & 0x7fffffffffffffffull) : ~k;
  return __longlong_as_double(static_cast<long long>(b));
}

// Largest key K with g(K) >= goal, g non-increasing, given g(lo) >= goal > g(hi).
template <typename G>
__device__ uint64_t bisect_keys(uint64_t lo, uint64_t hi, double goal, G g) {
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (g(mid) >= goal) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Target distribution of one row; top-k and top-p cuts follow the reference
// (thresholds on the logit) via exact bisection. `buf` (vocab doubles) is used
// for top-p. Returns false (after reporting) on NaN/+inf or all -inf rows.
// x = logit * (1 / temperature) here and in every CUDA op: one multiply, not a float64
// division, per logit; the order of the x (the top-k set) is the reference's.
template <typename T>
__device__ bool row_dist(const T* row, int64_t vocab, const Sampling& sp, double* buf, Shared& sh, int* error,
                         RowDist& d) {
  const double inv_t = 1.0 / sp.temperature;
  double m = -pos_inf();
  int bad = 0;
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
    const double x = to_double(row[j]) * inv_t;
    bad |= !(x < pos_inf());
    m = fmax(m, x);
  }
  bad = __syncthreads_or(bad);
  m = block_max(m, sh);
  if (bad || !(m > -pos_inf())) {
    report(error, bad ? kBadLogit : kEmptyRow);
    return false;
  }
  double cut = -pos_inf();
  const uint64_t lo = order_key(-pos_inf()), hi = order_key(m) + 1;
  if (sp.top_k > 0 && sp.top_k < vocab) {
    const uint64_t k = bisect_keys(lo, hi, static_cast<double>(sp.top_k), [&](uint64_t key) {
      double count = 0.0;
      for (int64_t j = threadIdx.x; j < vocab; j += kThreads) count += order_key(to_double(row[j]) * inv_t) >= key;
      return block_sum(count, sh);
    });
    cut = key_value(k);
  }
  if (sp.top_p < 1.0) {
    double local = 0.0;
    for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
      const double x = to_double(row[j]) * inv_t;
      buf[j] = x >= cut ? exp(x - m) : 0.0;
      local += buf[j];
    }
    const double kept = block_sum(local, sh);
    const uint64_t p = bisect_keys(lo, hi, sp.top_p, [&](uint64_t key) {
      double mass = 0.0;
      for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
        mass += order_key(to_double(row[j]) * inv_t) >= key ? buf[j] : 0.0;
      }
      return block_sum(mass, sh) / kept;
    });
    cut = fmax(cut, key_value(p));
  }
  double sum = 0.0;
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
    const double x = to_double(row[j]) * inv_t;
    sum += x >= cut ? exp(x - m) : 0.0;
  }
  d = RowDist{m, block_sum(sum, sh), cut};
  return true;
}

// p of one logit already read; inv_t = 1 / temperature.
template <typename T>
__device__ __forceinline__ double value_prob(T logit, const RowDist& d, double inv_t) {
  const double x = to_double(logit) * inv_t;
  return x >= d.cut ? exp(x - d.max) / d.sum : 0.0;
}

template <typename T>
__device__ __forceinline__ double row_prob(const T* row, int64_t j, const RowDist& d, double inv_t) {
  return value_prob(row[j], d, inv_t);
}

template <typename T>
__device__ void row_probs(const T* row, int64_t vocab, const RowDist& d, double inv_t, double* out) {
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) out[j] = row_prob(row, j, d, inv_t);
  __syncthreads();
}

// Warp 0 walks w[begin, end) 32 at a time (a warp prefix sum per step) and returns the
// first index whose running sum exceeds `target`, or -1 with `running` advanced past the end.
__device__ inline int64_t warp_find(const double* w, int64_t begin, int64_t end, double target, double& running) {
  const int lane = threadIdx.x % 32;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t j = base + lane;
    double v = j < end ? w[j] : 0.0;
    for (int o = 1; o < 32; o <<= 1) {
      const double up = __shfl_up_sync(kFullMask, v, o);
      if (lane >= o) v += up;
    }
    const unsigned hit = __ballot_sync(kFullMask, j < end && running + v > target);
    if (hit) return base + __ffs(static_cast<int>(hit)) - 1;
    running += __shfl_sync(kFullMask, v, 31);
  }
  return -1;
}

// The first index j of w[begin, end) at which `running` plus w[begin..j] exceeds `target`
// (u >= 0: u times the range's sum instead), or -1 with `running` advanced by the range's sum.
// Each thread sums one contiguous piece; warp 0 finds the piece, then the index in it.
__device__ inline int64_t sample_range(const double* w, int64_t begin, int64_t end, double target, double& running,
                                       Shared& sh, double u = -1.0) {
  const int64_t piece = (end - begin + kThreads - 1) / kThreads;
  const int64_t lo = begin + threadIdx.x * piece, hi = lo + piece < end ? lo + piece : end;
  double s = 0.0;
  for (int64_t j = lo; j < hi; ++j) s += w[j];
  sh.chunk[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x < 32) {
    if (u >= 0.0) {
      double total = 0.0;
      for (int c = threadIdx.x; c < kThreads; c += 32) total += sh.chunk[c];
      for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(kFullMask, total, o);
      target = u * total;
    }
    double run = running;
    int64_t pick = -1;
    const int64_t c = warp_find(sh.chunk, 0, kThreads, target, run);
    if (c >= 0) {
      // From the mass ahead of piece c; rounding may carry the search into later pieces.
      run = running;
      warp_find(sh.chunk, 0, c, pos_inf(), run);
      pick = warp_find(w, begin + c * piece, end, target, run);
    }
    if (threadIdx.x == 0) {
      // Rounding put the target past the last running sum of the whole row: the last drawable index.
      if (pick < 0 && u >= 0.0) {
        for (int64_t j = end - 1; pick < 0 && j > begin; --j) {
          if (w[j] > 0.0) pick = j;
        }
        if (pick < 0) pick = begin;
      }
      sh.bcast_idx = pick;
      sh.bcast = run;
    }
  }
  __syncthreads();
  const int64_t r = sh.bcast_idx;
  running = sh.bcast;
  __syncthreads();
  return r;
}

// Inverse-CDF draw from weights w: the first index whose running sum exceeds u * total.
__device__ inline int64_t sample_buffer(const double* w, int64_t vocab, double u, Shared& sh) {
  double running = 0.0;
  return sample_range(w, 0, vocab, 0.0, running, sh, u);
}

// Writes one output row: ids[0:n] (ids[i] read through `id`), then `last`, then -1.
template <typename Id>
__device__ void write_row(int64_t* out, int64_t width, int64_t n, int64_t last, Id id) {
  for (int64_t i = threadIdx.x; i < width; i += kThreads) out[i] = i < n ? id(i) : (i == n ? last : -1);
}

}  // namespace cuda
}  // namespace specdec

namespace specdec {
namespace cuda {

// Calls f(T{}) with the C++ type of a logits dtype (host side, to pick a kernel instantiation).
template <typename F>
void dispatch_logits(DType dtype, F f) {
  switch (dtype) {
    case DType::kFloat64: f(double{}); break;
    case DType::kFloat16: f(__half{}); break;
    case DType::kBFloat16: f(__nv_bfloat16{}); break;
    default: f(float{});
  }
}

}  // namespace cuda
}  // namespace specdec
