// The parallel pass of the CUDA chain ops: one block per (row, chunk) of the target logits
// reads its chunk once and writes a RowPart (cuda_row_stats.h). Rows are split into enough
// chunks for several waves of blocks, so no partial last wave holds the pass up.
#include <type_traits>

#include "cuda_kernels.h"
#include "cuda_row_stats.h"

namespace specdec {
namespace cuda {
namespace {

// Smallest chunk: 32 logits a thread, so each block's reduction is paid over enough loads.
constexpr int64_t kMinChunk = 32 * kThreads;
// Blocks the split aims for, per SM: about eight waves at four resident blocks an SM.
constexpr int64_t kBlocksPerSm = 32;

__device__ __forceinline__ RowPart shfl_part(const RowPart& p, int lane_mask) {
  RowPart o;
  o.max = __shfl_xor_sync(kFullMask, p.max, lane_mask);
  o.sum = __shfl_xor_sync(kFullMask, p.sum, lane_mask);
  o.xsum = __shfl_xor_sync(kFullMask, p.xsum, lane_mask);
  o.best = __shfl_xor_sync(kFullMask, p.best, lane_mask);
  o.best_idx = __shfl_xor_sync(kFullMask, p.best_idx, lane_mask);
  o.flags = __shfl_xor_sync(kFullMask, p.flags, lane_mask);
  return o;
}

// Logits are compared (NaN, argmax) in their own precision: float for the 16/32-bit types.
template <typename T>
using Compare = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
__device__ __forceinline__ Compare<T> to_compare(T v) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) {
    return v;
  } else {
    return static_cast<float>(to_double(v));
  }
}

// A thread's running softmax over its logits in float: the largest logit m it has seen (in the
// logits' own units), s = sum 2^y and xs = sum 2^y y ln2 with y = (v - m) log2(e) / T.
// float32 exp2 here, instead of float64 exp, is what keeps the pass near memory speed (the
// float64 exp made it instruction-bound at 14% of DRAM bandwidth, H200 profile); the
// per-thread sums (~60 terms) are within ~1e-6 relative of float64, and the block merges stay
// in float64. The rare new maximum rescales; every logit then takes the same straight path.
__device__ __forceinline__ float pos_inf_f() { return __int_as_float(0x7f800000); }

struct ThreadSoftmax {
  float m, s, xs;

  __device__ ThreadSoftmax() : m(-pos_inf_f()), s(0.0f), xs(0.0f) {}

  template <bool kEntropy>
  __device__ __forceinline__ void add(float v, float k) {  // k = log2(e) / T
    constexpr float kLn2 = 0.6931471805599453f;
    if (v > m) {
      const float y = (m - v) * k, scale = exp2f(y);  // 0 for the first finite logit (m = -inf)
      if (kEntropy) xs = scale > 0.0f ? scale * (xs + y * kLn2 * s) : 0.0f;
      s *= scale;
      m = v;
    }
    const float y = (v - m) * k, e = v > -pos_inf_f() ? exp2f(y) : 0.0f;
    s += e;
    if (kEntropy) xs += e > 0.0f ? e * y * kLn2 : 0.0f;
  }
};

template <typename T, int kWants>
__global__ void __launch_bounds__(kThreads) row_stats_kernel(const T* logits, const int64_t* lens, RowStatsShape s,
                                                             double inv_t, RowPart* parts) {
  using C = Compare<T>;
  constexpr bool kArgmax = kWants & kWantArgmax, kSoftmax = kWants & kWantSoftmax;
  constexpr bool kEntropy = kWants & kWantEntropy;
  constexpr bool kFloatSums = !std::is_same_v<C, double>;
  __shared__ RowPart warp_parts[kWarps];
  const int64_t r = blockIdx.x / s.chunks, c = blockIdx.x % s.chunks;
  if (lens != nullptr && r % s.rows_per_request > lens[r / s.rows_per_request]) return;  // never read
  const int64_t begin = c * s.chunk_len, end = begin + s.chunk_len < s.vocab ? begin + s.chunk_len : s.vocab;
  // log2(e)/T in float; a temperature below float's range saturates (every logit but the largest gets 0)
  const double k2 = inv_t * 1.4426950408889634;
  const float k2f = k2 < 3.0e38 ? static_cast<float>(k2) : 3.0e38f;
  RowPart p = empty_part();
  ThreadSoftmax ts;
  C best = 0;
  for_each_in(logits + r * s.vocab, begin, end, [&](int64_t j, T raw) {
    const C v = to_compare(raw);
    if (v != v) {
      p.flags |= kPartNaN | kPartBad;
      return;
    }
    if (kArgmax && (p.best_idx < 0 || v > best)) {  // indices arrive in increasing order: the first maximum stays
      best = v;
      p.best_idx = j;
    }
    if (!kSoftmax) return;
    if constexpr (kFloatSums) {
      ts.add<kEntropy>(v, k2f);
      return;
    }
    const double x = static_cast<double>(v) * inv_t;
    if (!(x < pos_inf())) p.flags |= kPartBad;
    if (x > p.max) {
      if (p.max > -pos_inf()) {
        const double scale = exp(p.max - x);
        if (kEntropy) p.xsum = scale * (p.xsum + (p.max - x) * p.sum);
        p.sum = scale * p.sum + 1.0;
      } else {
        p.sum = 1.0;
      }
      p.max = x;
    } else if (x > -pos_inf()) {
      const double d = x - p.max, e = exp(d);
      p.sum += e;
      if (kEntropy) p.xsum += e > 0.0 ? e * d : 0.0;
    }
  });
  if (kFloatSums && kSoftmax && ts.m > -pos_inf_f()) {
    p.max = static_cast<double>(ts.m) * inv_t;  // the same float64 max as the float64 path
    if (!(p.max < pos_inf())) p.flags |= kPartBad;
    p.sum = ts.s;
    p.xsum = ts.xs;
  }
  if (p.best_idx >= 0) p.best = static_cast<double>(best);
  for (int o = 16; o > 0; o >>= 1) {
    const RowPart other = shfl_part(p, o);
    // Both lanes of a pair merge (lower lane, upper lane), so they agree bit for bit.
    if ((threadIdx.x & o) == 0) {
      merge_parts(p, other);
    } else {
      RowPart lower = other;
      merge_parts(lower, p);
      p = lower;
    }
  }
  if (threadIdx.x % 32 == 0) warp_parts[threadIdx.x / 32] = p;
  __syncthreads();
  if (threadIdx.x == 0) {
    RowPart total = warp_parts[0];
    for (int w = 1; w < kWarps; ++w) merge_parts(total, warp_parts[w]);
    parts[r * s.chunks + c] = total;
  }
}

int sm_count() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 1;
  }
  return sms;
}

}  // namespace

RowStatsShape row_stats_shape(int64_t requests, int64_t rows_per_request, int64_t vocab) {
  const int64_t rows = requests * rows_per_request;
  const int64_t want = rows > 0 ? (kBlocksPerSm * sm_count() + rows - 1) / rows : 1;
  const int64_t most = (vocab + kMinChunk - 1) / kMinChunk;
  const int64_t chunks = want < 1 ? 1 : (want > most ? most : want);
  constexpr int64_t kAlign = 8;  // elements: chunk starts stay 16-byte aligned for 2-byte logits
  const int64_t len = ((vocab + chunks - 1) / (chunks > 0 ? chunks : 1) + kAlign - 1) / kAlign * kAlign;
  return RowStatsShape{rows, rows_per_request, vocab, len > 0 ? (vocab + len - 1) / len : 1, len > 0 ? len : 1};
}

int64_t workspace_bytes(const RowStatsShape& shape, int64_t batch) {
  return align16(shape.rows * shape.chunks * static_cast<int64_t>(sizeof(RowPart))) +
         align16(shape.rows * static_cast<int64_t>(sizeof(RowPart))) +
         align16(batch * static_cast<int64_t>(sizeof(Stop))) +
         batch * shape.chunks * static_cast<int64_t>(sizeof(double2));
}

void launch_row_stats(const void* logits, DType logits_dtype, const int64_t* lens, const RowStatsShape& shape,
                      double inv_t, int wants, void* parts, cudaStream_t stream) {
  if (shape.rows == 0 || shape.vocab == 0) return;
  const unsigned blocks = static_cast<unsigned>(shape.rows * shape.chunks);
  auto* out = static_cast<RowPart*>(parts);
  dispatch_logits(logits_dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto* x = static_cast<const T*>(logits);
    switch (wants) {
      case kWantArgmax:
        row_stats_kernel<T, kWantArgmax><<<blocks, kThreads, 0, stream>>>(x, lens, shape, inv_t, out);
        break;
      case kWantSoftmax:
        row_stats_kernel<T, kWantSoftmax><<<blocks, kThreads, 0, stream>>>(x, lens, shape, inv_t, out);
        break;
      default:
        row_stats_kernel<T, kWantArgmax | kWantSoftmax | kWantEntropy>
            <<<blocks, kThreads, 0, stream>>>(x, lens, shape, inv_t, out);
    }
  });
}

}  // namespace cuda
}  // namespace specdec
