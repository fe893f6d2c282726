// CUDA kernels of greedy and lossless stochastic chain verification (see chain_verify.cpp).
// A parallel pass first reads every row a request may need (row_stats_cuda.cu); the
// decisions then take one logit per row, and one dense pass where the chain stops.
#include "cuda_kernels.h"
#include "cuda_row_stats.h"

namespace specdec {
namespace cuda {
namespace {

__global__ void greedy_chain_ids_kernel(const int64_t* draft, const int64_t* target, const int64_t* lens,
                                        ChainShape s, int64_t* tokens, int64_t* counts) {
  const int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (b >= s.batch) return;
  const int64_t* d = draft + b * s.k;
  const int64_t* t = target + b * (s.k + 1);
  int64_t n = 0;
  while (n < lens[b] && d[n] == t[n]) ++n;
  for (int64_t i = 0; i <= s.k; ++i) tokens[b * (s.k + 1) + i] = i <= n ? t[i] : -1;
  counts[b] = n;
}

// One thread per request, after the argmax pass: accepts while the draft equals the argmax.
__global__ void greedy_chain_kernel(const int64_t* draft, const RowPart* parts, const int64_t* lens, ChainShape s,
                                    int64_t chunks, int64_t* tokens, int64_t* counts, int* error) {
  const int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (b >= s.batch) return;
  const int64_t* d = draft + b * s.k;
  int64_t n = 0, last = 0;
  for (;; ++n) {
    const RowPart row = combine_parts(parts + (b * (s.k + 1) + n) * chunks, chunks);
    if (row.flags & kPartNaN) {
      atomicCAS(error, 0, kBadLogit);
      return;
    }
    last = row.best_idx;
    if (n == lens[b] || d[n] != last) break;
  }
  for (int64_t i = 0; i <= s.k; ++i) tokens[b * (s.k + 1) + i] = i < n ? d[i] : (i == n ? last : -1);
  counts[b] = n;
}

// The distribution of row n: from the parallel pass when there is one (no top-k/top-p),
// else found by this block. Reports and returns false on NaN/+inf or all -inf rows.
template <typename T>
__device__ bool chain_row_dist(const T* row, const RowPart* row_parts, int64_t chunks, int64_t vocab,
                               const Sampling& sp, double* w, Shared& sh, int* error, RowDist& dist) {
  if (row_parts == nullptr) return row_dist(row, vocab, sp, w, sh, error, dist);
  const RowPart p = combine_parts(row_parts, chunks);
  if ((p.flags & kPartBad) || !(p.max > -pos_inf())) {
    report(error, (p.flags & kPartBad) ? kBadLogit : kEmptyRow);
    return false;
  }
  dist = RowDist{p.max, p.sum, -pos_inf()};
  return true;
}

// One block per request: accept tests read one logit per row; the block's threads share
// the one dense pass, over the row where the chain stops (residual or bonus token).
template <typename T>
__global__ void __launch_bounds__(kThreads) stochastic_chain_kernel(const int64_t* draft, const T* logits,
                                                                    const int64_t* lens, const void* q,
                                                                    DType q_dtype, const float* uniforms,
                                                                    Sampling sp, ChainShape s, const RowPart* parts,
                                                                    int64_t chunks, double* scratch,
                                                                    int64_t* tokens, int64_t* counts, int* error) {
  __shared__ Shared sh;
  const int64_t b = blockIdx.x, vocab = s.vocab;
  const int64_t* d = draft + b * s.k;
  const float* u = uniforms + b * (s.k + 1);
  const T* rows = logits + b * (s.k + 1) * vocab;
  const RowPart* row_parts = parts ? parts + b * (s.k + 1) * chunks : nullptr;
  double* w = scratch + b * vocab;
  RowDist dist;
  int64_t n = 0;
  bool rejected = false;
  for (; n < lens[b]; ++n) {
    const T* row = rows + n * vocab;
    if (d[n] < 0 || d[n] >= vocab) return report(error, kBadId);
    if (!chain_row_dist(row, row_parts ? row_parts + n * chunks : nullptr, chunks, vocab, sp, w, sh, error, dist)) {
      return;
    }
    const double p = row_prob(row, d[n], dist, sp.temperature);
    const double qd = q ? load_prob(q, q_dtype, (b * s.k + n) * vocab + d[n]) : 1.0;
    if (bad_prob(qd)) return report(error, kBadDraftProb);
    if (static_cast<double>(u[n]) * qd < p) continue;
    // Residual max(0, p - q): p without the draft token when q is one-hot; its mass on the way.
    double local = 0.0;
    int bad = 0;
    const int64_t qrow = (b * s.k + n) * vocab, drafted = d[n];
    for_each_in(row, 0, vocab, [&](int64_t j, T raw) {
      const double pj = value_prob(raw, dist, sp.temperature);
      double r;
      if (q) {
        const double qj = load_prob(q, q_dtype, qrow + j);
        bad |= bad_prob(qj);
        r = fmax(0.0, pj - qj);
      } else {
        r = j == drafted ? 0.0 : pj;
      }
      w[j] = r;
      local += r;
    });
    if (__syncthreads_or(bad)) return report(error, kBadDraftProb);
    // Rounding left no residual mass: fall back to p.
    if (!(block_sum(local, sh) > 0.0)) row_probs(row, vocab, dist, sp.temperature, w);
    rejected = true;
    break;
  }
  if (!rejected) {
    const T* row = rows + n * vocab;
    if (!chain_row_dist(row, row_parts ? row_parts + n * chunks : nullptr, chunks, vocab, sp, w, sh, error, dist)) {
      return;
    }
    row_probs(row, vocab, dist, sp.temperature, w);
  }
  const int64_t last = sample_buffer(w, vocab, static_cast<double>(u[s.k]), sh);
  write_row(tokens + b * (s.k + 1), s.k + 1, n, last, [&](int64_t i) { return d[i]; });
  if (threadIdx.x == 0) counts[b] = n;
}

}  // namespace

void launch_greedy_chain_ids(const int64_t* draft, const int64_t* target_ids, const int64_t* lens, ChainShape shape,
                             int64_t* tokens, int64_t* counts, cudaStream_t stream) {
  if (shape.batch == 0) return;
  const int blocks = static_cast<int>((shape.batch + kThreads - 1) / kThreads);
  greedy_chain_ids_kernel<<<blocks, kThreads, 0, stream>>>(draft, target_ids, lens, shape, tokens, counts);
}

void launch_greedy_chain(const int64_t* draft, const void* logits, DType logits_dtype, const int64_t* lens,
                         ChainShape shape, const RowStatsShape& stats, void* workspace, int64_t* tokens,
                         int64_t* counts, int* error, cudaStream_t stream) {
  if (shape.batch == 0) return;
  launch_row_stats(logits, logits_dtype, lens, stats, 1.0, false, workspace, stream);
  constexpr int kPerBlock = 128;
  greedy_chain_kernel<<<static_cast<unsigned>((shape.batch + kPerBlock - 1) / kPerBlock), kPerBlock, 0, stream>>>(
      draft, static_cast<const RowPart*>(workspace), lens, shape, stats.chunks, tokens, counts, error);
}

void launch_stochastic_chain(const int64_t* draft, const void* logits, DType logits_dtype, const int64_t* lens,
                             const void* draft_probs, DType probs_dtype, const float* uniforms, Sampling sampling,
                             ChainShape shape, double* scratch, const RowStatsShape& stats, void* workspace,
                             int64_t* tokens, int64_t* counts, int* error, cudaStream_t stream) {
  if (shape.batch == 0) return;
  const bool filtered = sampling.top_k > 0 || sampling.top_p < 1.0;
  if (!filtered) launch_row_stats(logits, logits_dtype, lens, stats, sampling.temperature, true, workspace, stream);
  const RowPart* parts = filtered ? nullptr : static_cast<const RowPart*>(workspace);
  dispatch_logits(logits_dtype, [&](auto tag) {
    using T = decltype(tag);
    stochastic_chain_kernel<T><<<static_cast<unsigned>(shape.batch), kThreads, 0, stream>>>(
        draft, static_cast<const T*>(logits), lens, draft_probs, probs_dtype, uniforms, sampling, shape, parts,
        stats.chunks, scratch, tokens, counts, error);
  });
}

}  // namespace cuda
}  // namespace specdec
