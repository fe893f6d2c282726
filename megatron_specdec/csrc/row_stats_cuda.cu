// The parallel pass of the CUDA chain ops: one block per (row, chunk) of the target logits
// reads its chunk once and writes a RowPart (cuda_row_stats.h). Enough chunks per row are
// launched to give every SM several blocks, so one request's rows are read by many SMs.
#include "cuda_kernels.h"
#include "cuda_row_stats.h"

namespace specdec {
namespace cuda {
namespace {

// Smallest chunk: 16 loads of 16 bytes per thread of a float32 row keep the loads in flight.
constexpr int64_t kMinChunk = 16 * 4 * kThreads;

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

template <typename T, bool kSoftmax>
__global__ void __launch_bounds__(kThreads) row_stats_kernel(const T* logits, const int64_t* lens, RowStatsShape s,
                                                             double temperature, RowPart* parts) {
  __shared__ RowPart warp_parts[kWarps];
  const int64_t r = blockIdx.x / s.chunks, c = blockIdx.x % s.chunks;
  if (lens != nullptr && r % s.rows_per_request > lens[r / s.rows_per_request]) return;  // never read
  const int64_t begin = c * s.chunk_len, end = begin + s.chunk_len < s.vocab ? begin + s.chunk_len : s.vocab;
  RowPart p = empty_part();
  for_each_in(logits + r * s.vocab, begin, end, [&](int64_t j, T raw) {
    const double v = to_double(raw);
    if (v != v) {
      p.flags |= kPartNaN | kPartBad;
      return;
    }
    if (p.best_idx < 0 || v > p.best) {  // indices arrive in increasing order: the first maximum stays
      p.best = v;
      p.best_idx = j;
    }
    if (!kSoftmax) return;
    const double x = v / temperature;
    if (!(x < pos_inf())) p.flags |= kPartBad;
    if (x > p.max) {
      if (p.max > -pos_inf()) {
        const double scale = exp(p.max - x);
        p.xsum = scale * (p.xsum + (p.max - x) * p.sum);
        p.sum = scale * p.sum + 1.0;
      } else {
        p.sum = 1.0;
        p.xsum = 0.0;
      }
      p.max = x;
    } else if (x > -pos_inf()) {
      const double d = x - p.max, e = exp(d);
      p.sum += e;
      p.xsum += e > 0.0 ? e * d : 0.0;
    }
  });
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
  const int64_t want = rows > 0 ? (4 * sm_count() + rows - 1) / rows : 1;
  const int64_t most = vocab / kMinChunk > 1 ? vocab / kMinChunk : 1;
  const int64_t chunks = want < 1 ? 1 : (want > most ? most : want);
  constexpr int64_t kAlign = 8;  // elements: chunk starts stay 16-byte aligned for 2-byte logits
  const int64_t len = ((vocab + chunks - 1) / chunks + kAlign - 1) / kAlign * kAlign;
  return RowStatsShape{rows, rows_per_request, vocab, (vocab + len - 1) / (len > 0 ? len : 1), len};
}

int64_t row_stats_bytes(const RowStatsShape& shape) {
  return shape.rows * shape.chunks * static_cast<int64_t>(sizeof(RowPart));
}

void launch_row_stats(const void* logits, DType logits_dtype, const int64_t* lens, const RowStatsShape& shape,
                      double temperature, bool softmax, void* parts, cudaStream_t stream) {
  if (shape.rows == 0 || shape.vocab == 0) return;
  const unsigned blocks = static_cast<unsigned>(shape.rows * shape.chunks);
  auto* out = static_cast<RowPart*>(parts);
  dispatch_logits(logits_dtype, [&](auto tag) {
    using T = decltype(tag);
    if (softmax) {
      row_stats_kernel<T, true><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(logits), lens, shape,
                                                                  temperature, out);
    } else {
      row_stats_kernel<T, false><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(logits), lens, shape,
                                                                   temperature, out);
    }
  });
}

}  // namespace cuda
}  // namespace specdec
