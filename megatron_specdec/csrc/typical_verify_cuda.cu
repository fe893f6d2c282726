// CUDA kernel of Medusa typical acceptance (see typical_verify.cpp): the parallel pass
// (row_stats_cuda.cu) gives each row's max, normaliser, entropy sum and argmax; one warp per
// request merges its rows' chunks, then lane 0 walks the chain reading one logit per row.
#include <cmath>

#include "cuda_kernels.h"
#include "cuda_row_stats.h"

namespace specdec {
namespace cuda {
namespace {

template <typename T>
__global__ void typical_kernel(const int64_t* draft, const T* logits, const int64_t* lens, double inv_t, double eps,
                               double alpha, ChainShape s, Workspace ws, int64_t chunks, int64_t* tokens,
                               int64_t* counts, int* error) {
  const int64_t b = warp_request();
  if (b >= s.batch) return;
  const int64_t vocab = s.vocab, base = b * (s.k + 1);
  merge_request_rows(ws.parts + base * chunks, chunks, lens[b] + 1, ws.merged + base);
  if (threadIdx.x % 32 != 0) return;
  const int64_t* d = draft + b * s.k;
  const T* rows = logits + base * vocab;
  int64_t n = 0;
  for (; n < lens[b]; ++n) {
    // p(d) > min(eps, alpha * exp(-H)), H = log Z - sum e (x - max) / Z.
    if (d[n] < 0 || d[n] >= vocab) return fail(error, kBadId);
    const RowPart& row = ws.merged[base + n];
    RowDist dist;
    const int code = part_dist(row, dist);
    if (code != kOk) return fail(error, code);
    const double entropy = log(row.sum) - row.xsum / row.sum;
    const double p = value_prob(rows[n * vocab + d[n]], dist, inv_t);
    if (!(p > fmin(eps, alpha * exp(-entropy)))) break;
  }
  const RowPart& last = ws.merged[base + n];
  if (last.flags & kPartNaN) return fail(error, kBadLogit);
  for (int64_t i = 0; i <= s.k; ++i) tokens[base + i] = i < n ? d[i] : (i == n ? last.best_idx : -1);
  counts[b] = n;
}

}  // namespace

void launch_typical(const int64_t* draft, const void* logits, DType logits_dtype, const int64_t* lens,
                    double temperature, double eps, double alpha, ChainShape shape, const RowStatsShape& stats,
                    void* workspace, int64_t* tokens, int64_t* counts, int* error, cudaStream_t stream) {
  if (shape.batch == 0) return;
  const Workspace ws = carve_workspace(workspace, stats, shape.batch);
  const double inv_t = 1.0 / temperature;
  launch_row_stats(logits, logits_dtype, lens, stats, inv_t, kWantArgmax | kWantSoftmax | kWantEntropy, ws.parts,
                   stream);
  dispatch_logits(logits_dtype, [&](auto tag) {
    using T = decltype(tag);
    typical_kernel<T><<<warp_blocks(shape.batch), 32 * kWarpsPerBlock, 0, stream>>>(
        draft, static_cast<const T*>(logits), lens, inv_t, eps, alpha, shape, ws, stats.chunks, tokens, counts,
        error);
  });
}

}  // namespace cuda
}  // namespace specdec
