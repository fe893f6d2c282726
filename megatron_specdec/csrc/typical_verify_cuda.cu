// CUDA kernel of Medusa typical acceptance (see typical_verify.cpp): the parallel pass
// (row_stats_cuda.cu) gives each row's max, normaliser, entropy sum and argmax; one
// thread per request then walks its chain reading one logit per row.
#include <cmath>

#include "cuda_kernels.h"
#include "cuda_row_stats.h"

namespace specdec {
namespace cuda {
namespace {

template <typename T>
__global__ void typical_kernel(const int64_t* draft, const T* logits, const RowPart* parts, int64_t chunks,
                               const int64_t* lens, double temperature, double eps, double alpha, ChainShape s,
                               int64_t* tokens, int64_t* counts, int* error) {
  const int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (b >= s.batch) return;
  const int64_t vocab = s.vocab;
  const int64_t* d = draft + b * s.k;
  const T* rows = logits + b * (s.k + 1) * vocab;
  const RowPart* row_parts = parts + b * (s.k + 1) * chunks;
  int64_t n = 0;
  for (; n < lens[b]; ++n) {
    // p(d) > min(eps, alpha * exp(-H)), H = log Z - sum e (x - max) / Z.
    if (d[n] < 0 || d[n] >= vocab) {
      atomicCAS(error, 0, kBadId);
      return;
    }
    const RowPart row = combine_parts(row_parts + n * chunks, chunks);
    if ((row.flags & kPartBad) || !(row.max > -pos_inf())) {
      atomicCAS(error, 0, (row.flags & kPartBad) ? kBadLogit : kEmptyRow);
      return;
    }
    const double entropy = log(row.sum) - row.xsum / row.sum;
    const double p = exp(to_double(rows[n * vocab + d[n]]) / temperature - row.max) / row.sum;
    if (!(p > fmin(eps, alpha * exp(-entropy)))) break;
  }
  const RowPart last = combine_parts(row_parts + n * chunks, chunks);
  if (last.flags & kPartNaN) {
    atomicCAS(error, 0, kBadLogit);
    return;
  }
  for (int64_t i = 0; i <= s.k; ++i) tokens[b * (s.k + 1) + i] = i < n ? d[i] : (i == n ? last.best_idx : -1);
  counts[b] = n;
}

}  // namespace

void launch_typical(const int64_t* draft, const void* logits, DType logits_dtype, const int64_t* lens,
                    double temperature, double eps, double alpha, ChainShape shape, const RowStatsShape& stats,
                    void* workspace, int64_t* tokens, int64_t* counts, int* error, cudaStream_t stream) {
  if (shape.batch == 0) return;
  launch_row_stats(logits, logits_dtype, lens, stats, temperature, true, workspace, stream);
  constexpr int kPerBlock = 128;
  const unsigned blocks = static_cast<unsigned>((shape.batch + kPerBlock - 1) / kPerBlock);
  dispatch_logits(logits_dtype, [&](auto tag) {
    using T = decltype(tag);
    typical_kernel<T><<<blocks, kPerBlock, 0, stream>>>(draft, static_cast<const T*>(logits),
                                                        static_cast<const RowPart*>(workspace), stats.chunks, lens,
                                                        temperature, eps, alpha, shape, tokens, counts, error);
  });
}

}  // namespace cuda
}  // namespace specdec
