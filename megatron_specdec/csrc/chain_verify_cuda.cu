// CUDA kernels of greedy and lossless stochastic chain verification (see chain_verify.cpp).
// A parallel pass reads every row a request may need (row_stats_cuda.cu); one warp per
// request merges its rows' chunks and decides, reading one logit per row; the stochastic
// chain then spreads the dense pass over the row where it stops across (request, chunk)
// blocks, and one block per request draws the last token from it.
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

// One warp per request, after the argmax pass: accepts while the draft equals the argmax.
__global__ void greedy_chain_kernel(const int64_t* draft, const int64_t* lens, ChainShape s, Workspace ws,
                                    int64_t chunks, int64_t* tokens, int64_t* counts, int* error) {
  const int64_t b = warp_request();
  if (b >= s.batch) return;
  const int64_t base = b * (s.k + 1);
  merge_request_rows(ws.parts + base * chunks, chunks, lens[b] + 1, ws.merged + base);
  if (threadIdx.x % 32 != 0) return;
  const int64_t* d = draft + b * s.k;
  int64_t n = 0, last = 0;
  for (;; ++n) {
    const RowPart& row = ws.merged[base + n];
    if (row.flags & kPartNaN) return fail(error, kBadLogit);
    last = row.best_idx;
    if (n == lens[b] || d[n] != last) break;
  }
  for (int64_t i = 0; i <= s.k; ++i) tokens[base + i] = i < n ? d[i] : (i == n ? last : -1);
  counts[b] = n;
}

// Accepts draft token d of a row with target distribution `dist` when u * q(d) < p(d).
// Returns 1 (accept), 0 (reject) or -1 after reporting a bad draft probability.
template <typename T>
__device__ int accept_draft(const T* row, int64_t d, const RowDist& dist, double inv_t, const void* q, DType q_dtype,
                            int64_t qrow, float u, int* error) {
  const double p = row_prob(row, d, dist, inv_t);
  const double qd = q ? load_prob(q, q_dtype, qrow + d) : 1.0;
  if (bad_prob(qd)) {
    fail(error, kBadDraftProb);
    return -1;
  }
  return static_cast<double>(u) * qd < p ? 1 : 0;
}

// The decision of one request once each row's distribution can be had: `dist_of(n, out)`
// returns false after reporting. Writes the accepted tokens, the count and the stop row.
template <typename T, typename DistOf>
__device__ void decide_chain(const int64_t* d, const T* rows, int64_t len, const void* q, DType q_dtype,
                             const float* u, double inv_t, ChainShape s, int64_t b, DistOf dist_of, Stop& stop,
                             int64_t* tokens, int64_t* counts, int* error) {
  Stop out{RowDist{0.0, 0.0, 0.0}, -1, 0};
  int64_t n = 0;
  for (; n < len; ++n) {
    if (d[n] < 0 || d[n] >= s.vocab) return fail(error, kBadId);
    if (!dist_of(n, out.dist)) return;
    const int verdict = accept_draft(rows + n * s.vocab, d[n], out.dist, inv_t, q, q_dtype, (b * s.k + n) * s.vocab,
                                     u[n], error);
    if (verdict < 0) return;
    if (verdict == 0) {
      out.rejected = 1;
      break;
    }
  }
  if (!out.rejected && !dist_of(n, out.dist)) return;
  out.n = n;
  stop = out;
  for (int64_t i = 0; i <= s.k; ++i) tokens[b * (s.k + 1) + i] = i < n ? d[i] : -1;  // token n: the draw
  counts[b] = n;
}

// Unfiltered sampling: one warp per request merges the statistics of its rows, lane 0 decides.
template <typename T>
__global__ void stochastic_decide_kernel(const int64_t* draft, const T* logits, const int64_t* lens, const void* q,
                                         DType q_dtype, const float* uniforms, double inv_t, ChainShape s,
                                         Workspace ws, int64_t chunks, int64_t* tokens, int64_t* counts,
                                         int* error) {
  const int64_t b = warp_request();
  if (b >= s.batch) return;
  const int64_t base = b * (s.k + 1);
  merge_request_rows(ws.parts + base * chunks, chunks, lens[b] + 1, ws.merged + base);
  if (threadIdx.x % 32 != 0) return;
  ws.stops[b].n = -1;
  const auto dist_of = [&](int64_t n, RowDist& dist) {
    const int code = part_dist(ws.merged[base + n], dist);
    if (code != kOk) fail(error, code);
    return code == kOk;
  };
  decide_chain(draft + b * s.k, logits + base * s.vocab, lens[b], q, q_dtype, uniforms + base, inv_t, s, b, dist_of,
               ws.stops[b], tokens, counts, error);
}

// Top-k or top-p: each request's block finds its rows' cuts (row_dist, with the request's
// scratch row as buffer) one row at a time, up to the first rejection.
template <typename T>
__global__ void __launch_bounds__(kThreads) stochastic_decide_filtered_kernel(
    const int64_t* draft, const T* logits, const int64_t* lens, const void* q, DType q_dtype, const float* uniforms,
    Sampling sp, ChainShape s, Workspace ws, double* scratch, int64_t* tokens, int64_t* counts, int* error) {
  __shared__ Shared sh;
  __shared__ RowDist row_dists[kMaxDraftLen + 1];
  __shared__ int ok;
  const int64_t b = blockIdx.x, base = b * (s.k + 1), len = lens[b];
  const T* rows = logits + base * s.vocab;
  const double inv_t = 1.0 / sp.temperature;
  if (threadIdx.x == 0) ws.stops[b].n = -1;
  // Rows are found in order while the chain is accepted; thread 0 decides after each, then
  // replays the decision with the rows found to write the stop row.
  int64_t found = 0;
  const auto dist_of = [&](int64_t n, RowDist& dist) {
    dist = row_dists[n];
    return n < found;
  };
  for (int64_t n = 0; n <= len; ++n) {
    RowDist dist;
    if (!row_dist(rows + n * s.vocab, s.vocab, sp, scratch + b * s.vocab, sh, error, dist)) return;
    found = n + 1;
    if (threadIdx.x == 0) {
      row_dists[n] = dist;
      ok = 1;
      if (n < len) {
        if (draft[b * s.k + n] < 0 || draft[b * s.k + n] >= s.vocab) {
          fail(error, kBadId);
          ok = -1;
        } else {
          ok = accept_draft(rows + n * s.vocab, draft[b * s.k + n], row_dists[n], inv_t, q, q_dtype,
                            (b * s.k + n) * s.vocab, uniforms[base + n], error);
        }
      }
    }
    __syncthreads();
    const int verdict = ok;
    __syncthreads();
    if (verdict < 0) return;
    if (verdict == 0 || n == len) break;
  }
  if (threadIdx.x == 0) {
    decide_chain(draft + b * s.k, rows, len, q, q_dtype, uniforms + base, inv_t, s, b, dist_of, ws.stops[b], tokens,
                 counts, error);
  }
}

// One block per (request, chunk) of the stop row: weights w (the residual max(0, p - q), p
// without the draft token when q is one-hot, or p for the bonus row) into the request's
// scratch row, and the chunk's sums of w and of p.
template <typename T>
__global__ void __launch_bounds__(kThreads) stop_weights_kernel(const int64_t* draft, const T* logits, const void* q,
                                                                DType q_dtype, double inv_t, ChainShape s,
                                                                RowStatsShape st, Workspace ws, double* scratch,
                                                                int* error) {
  __shared__ Shared sh;
  const int64_t b = blockIdx.x / st.chunks, c = blockIdx.x % st.chunks;
  const Stop stop = ws.stops[b];
  if (stop.n < 0) return;
  const T* row = logits + (b * (s.k + 1) + stop.n) * s.vocab;
  const int64_t begin = c * st.chunk_len, end = begin + st.chunk_len < s.vocab ? begin + st.chunk_len : s.vocab;
  const int64_t qrow = (b * s.k + stop.n) * s.vocab, drafted = stop.rejected ? draft[b * s.k + stop.n] : -1;
  const bool residual_q = stop.rejected && q != nullptr;
  double* w = scratch + b * s.vocab;
  double wsum = 0.0, psum = 0.0;
  int bad = 0;
  for_each_in(row, begin, end, [&](int64_t j, T raw) {
    const double pj = value_prob(raw, stop.dist, inv_t);
    double r = j == drafted ? 0.0 : pj;
    if (residual_q) {
      const double qj = load_prob(q, q_dtype, qrow + j);
      bad |= bad_prob(qj);
      r = fmax(0.0, pj - qj);
    }
    w[j] = r;
    wsum += r;
    psum += pj;
  });
  if (__syncthreads_or(bad)) return report(error, kBadDraftProb);
  wsum = block_sum(wsum, sh);
  psum = block_sum(psum, sh);
  if (threadIdx.x == 0) ws.chunk_sums[b * st.chunks + c] = make_double2(wsum, psum);
}

// One block per request: the inverse-CDF draw of the last token from the stop row's weights,
// the chunk found from the chunk sums, the index by a scan of that chunk.
template <typename T>
__global__ void __launch_bounds__(kThreads) stop_draw_kernel(const T* logits, const float* uniforms, double inv_t,
                                                             ChainShape s, RowStatsShape st, Workspace ws,
                                                             double* scratch, int64_t* tokens) {
  __shared__ Shared sh;
  const int64_t b = blockIdx.x;
  const Stop stop = ws.stops[b];
  if (stop.n < 0) return;
  const double2* sums = ws.chunk_sums + b * st.chunks;
  double* w = scratch + b * s.vocab;
  double total = 0.0;
  for (int64_t c = 0; c < st.chunks; ++c) total += sums[c].x;
  const bool use_p = !(total > 0.0);  // rounding left no residual mass: draw from p
  if (use_p) {
    row_probs(logits + (b * (s.k + 1) + stop.n) * s.vocab, s.vocab, stop.dist, inv_t, w);
    total = 0.0;
    for (int64_t c = 0; c < st.chunks; ++c) total += sums[c].y;
  }
  const double target = static_cast<double>(uniforms[b * (s.k + 1) + s.k]) * total;
  double running = 0.0;
  int64_t c = 0;
  for (; c < st.chunks; ++c) {
    const double mass = use_p ? sums[c].y : sums[c].x;
    if (running + mass > target) break;
    running += mass;
  }
  int64_t pick = -1;
  if (c < st.chunks) {
    const int64_t begin = c * st.chunk_len, end = begin + st.chunk_len < s.vocab ? begin + st.chunk_len : s.vocab;
    pick = sample_range(w, begin, end, target, running, sh);
    if (pick < 0 && end < s.vocab) pick = sample_range(w, end, s.vocab, target, running, sh);
  }
  if (pick < 0) pick = sample_buffer(w, s.vocab, 1.0, sh);  // rounding: u = 1 gives the last drawable index
  if (threadIdx.x == 0) tokens[b * (s.k + 1) + stop.n] = pick;
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
  const Workspace ws = carve_workspace(workspace, stats, shape.batch);
  launch_row_stats(logits, logits_dtype, lens, stats, 1.0, kWantArgmax, ws.parts, stream);
  greedy_chain_kernel<<<warp_blocks(shape.batch), 32 * kWarpsPerBlock, 0, stream>>>(draft, lens, shape, ws,
                                                                                    stats.chunks, tokens, counts,
                                                                                    error);
}

void launch_stochastic_chain(const int64_t* draft, const void* logits, DType logits_dtype, const int64_t* lens,
                             const void* draft_probs, DType probs_dtype, const float* uniforms, Sampling sampling,
                             ChainShape shape, double* scratch, const RowStatsShape& stats, void* workspace,
                             int64_t* tokens, int64_t* counts, int* error, cudaStream_t stream) {
  if (shape.batch == 0) return;
  const Workspace ws = carve_workspace(workspace, stats, shape.batch);
  const double inv_t = 1.0 / sampling.temperature;
  const bool filtered = sampling.top_k > 0 || sampling.top_p < 1.0;
  if (!filtered) launch_row_stats(logits, logits_dtype, lens, stats, inv_t, kWantSoftmax, ws.parts, stream);
  dispatch_logits(logits_dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto* x = static_cast<const T*>(logits);
    if (filtered) {
      stochastic_decide_filtered_kernel<T><<<static_cast<unsigned>(shape.batch), kThreads, 0, stream>>>(
          draft, x, lens, draft_probs, probs_dtype, uniforms, sampling, shape, ws, scratch, tokens, counts, error);
    } else {
      stochastic_decide_kernel<T><<<warp_blocks(shape.batch), 32 * kWarpsPerBlock, 0, stream>>>(
          draft, x, lens, draft_probs, probs_dtype, uniforms, inv_t, shape, ws, stats.chunks, tokens, counts, error);
    }
    stop_weights_kernel<T><<<static_cast<unsigned>(shape.batch * stats.chunks), kThreads, 0, stream>>>(
        draft, x, draft_probs, probs_dtype, inv_t, shape, stats, ws, scratch, error);
    stop_draw_kernel<T><<<static_cast<unsigned>(shape.batch), kThreads, 0, stream>>>(x, uniforms, inv_t, shape, stats,
                                                                                     ws, scratch, tokens);
  });
}

}  // namespace cuda
}  // namespace specdec
