// CUDA kernels of greedy and lossless stochastic chain verification: one block per
// request, which stops reading logits at its first rejection (see chain_verify.cpp).
#include "cuda_kernels.h"
#include "cuda_row.h"

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

template <typename T>
__global__ void __launch_bounds__(kThreads) greedy_chain_kernel(const int64_t* draft, const T* logits,
                                                                const int64_t* lens, ChainShape s, int64_t* tokens,
                                                                int64_t* counts, int* error) {
  __shared__ Shared sh;
  const int64_t b = blockIdx.x;
  const int64_t* d = draft + b * s.k;
  int64_t n = 0, last = 0;
  for (;; ++n) {
    last = block_argmax(logits + (b * (s.k + 1) + n) * s.vocab, s.vocab, sh, error);
    if (last < 0) return;
    if (n == lens[b] || d[n] != last) break;
  }
  write_row(tokens + b * (s.k + 1), s.k + 1, n, last, [&](int64_t i) { return d[i]; });
  if (threadIdx.x == 0) counts[b] = n;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) stochastic_chain_kernel(const int64_t* draft, const T* logits,
                                                                    const int64_t* lens, const void* q,
                                                                    DType q_dtype, const float* uniforms,
                                                                    Sampling sp, ChainShape s, double* scratch,
                                                                    int64_t* tokens, int64_t* counts, int* error) {
  __shared__ Shared sh;
  const int64_t b = blockIdx.x, vocab = s.vocab;
  const int64_t* d = draft + b * s.k;
  const float* u = uniforms + b * (s.k + 1);
  const T* rows = logits + b * (s.k + 1) * vocab;
  double* w = scratch + b * vocab;
  RowDist dist;
  int64_t n = 0;
  bool rejected = false;
  for (; n < lens[b]; ++n) {
    const T* row = rows + n * vocab;
    if (d[n] < 0 || d[n] >= vocab) return report(error, kBadId);
    if (!row_dist(row, vocab, sp, w, sh, error, dist)) return;
    const double p = row_prob(row, d[n], dist, sp.temperature);
    const double qd = q ? load_prob(q, q_dtype, (b * s.k + n) * vocab + d[n]) : 1.0;
    if (bad_prob(qd)) return report(error, kBadDraftProb);
    if (static_cast<double>(u[n]) * qd < p) continue;
    // Residual max(0, p - q): p without the draft token when q is one-hot.
    row_probs(row, vocab, dist, sp.temperature, w);
    int bad = 0;
    if (q) {
      for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
        const double qj = load_prob(q, q_dtype, (b * s.k + n) * vocab + j);
        bad |= bad_prob(qj);
        w[j] = fmax(0.0, w[j] - qj);
      }
    } else if (threadIdx.x == 0) {
      w[d[n]] = 0.0;
    }
    if (__syncthreads_or(bad)) return report(error, kBadDraftProb);
    // Rounding left no residual mass: fall back to p.
    if (!(buffer_sum(w, vocab, sh) > 0.0)) row_probs(row, vocab, dist, sp.temperature, w);
    rejected = true;
    break;
  }
  if (!rejected) {
    const T* row = rows + n * vocab;
    if (!row_dist(row, vocab, sp, w, sh, error, dist)) return;
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
                         ChainShape shape, int64_t* tokens, int64_t* counts, int* error, cudaStream_t stream) {
  if (shape.batch == 0) return;
  dispatch_logits(logits_dtype, [&](auto tag) {
    using T = decltype(tag);
    greedy_chain_kernel<T><<<static_cast<unsigned>(shape.batch), kThreads, 0, stream>>>(
        draft, static_cast<const T*>(logits), lens, shape, tokens, counts, error);
  });
}

void launch_stochastic_chain(const int64_t* draft, const void* logits, DType logits_dtype, const int64_t* lens,
                             const void* draft_probs, DType probs_dtype, const float* uniforms, Sampling sampling,
                             ChainShape shape, double* scratch, int64_t* tokens, int64_t* counts, int* error,
                             cudaStream_t stream) {
  if (shape.batch == 0) return;
  dispatch_logits(logits_dtype, [&](auto tag) {
    using T = decltype(tag);
    stochastic_chain_kernel<T><<<static_cast<unsigned>(shape.batch), kThreads, 0, stream>>>(
        draft, static_cast<const T*>(logits), lens, draft_probs, probs_dtype, uniforms, sampling, shape, scratch,
        tokens, counts, error);
  });
}

}  // namespace cuda
}  // namespace specdec
