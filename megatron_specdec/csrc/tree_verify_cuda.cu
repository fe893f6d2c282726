// CUDA kernels of greedy and lossless stochastic tree verification: one block per
// request walks the tree as tree_verify.cpp does; per-node state sits in shared memory.
// Without top-k/top-p the stochastic walk takes each row's distribution from the parallel
// statistics pass (row_stats_cuda.cu) instead of two passes of its own block.
#include "cuda_kernels.h"
#include "cuda_row_stats.h"

namespace specdec {
namespace cuda {
namespace {

// Checks the tree of one request (the launcher did too) and links children in index order.
__device__ bool build_children(const int64_t* tok, const int64_t* par, int64_t n, int64_t vocab, int* first,
                               int* next, int* error) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = 1;
    for (int64_t i = 0; i <= n; ++i) first[i] = -1;
    for (int64_t i = n - 1; i >= 0; --i) {
      if (par[i] < -1 || par[i] >= i || tok[i] < 0 || tok[i] >= vocab) {
        ok = 0;
        break;
      }
      next[i] = first[par[i] + 1];
      first[par[i] + 1] = static_cast<int>(i);
    }
    if (!ok) atomicCAS(error, 0, kBadId);
  }
  __syncthreads();
  return ok;
}

__device__ void write_tree_outputs(const int64_t* tok, const int64_t* nodes, int64_t depth, int64_t last,
                                   int64_t max_depth, int64_t* tokens, int64_t* path) {
  for (int64_t i = threadIdx.x; i <= max_depth; i += kThreads) {
    tokens[i] = i < depth ? tok[nodes[i]] : (i == depth ? last : -1);
    if (i < max_depth) path[i] = i < depth ? nodes[i] : -1;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) tree_greedy_kernel(const int64_t* ids, const int64_t* parents,
                                                               const T* logits, const int64_t* num_nodes,
                                                               TreeShape s, int64_t* tokens, int64_t* counts,
                                                               int64_t* path, int* error) {
  __shared__ Shared sh;
  __shared__ int first[kMaxTreeNodes + 1], next[kMaxTreeNodes];
  __shared__ int64_t argmax[kMaxTreeNodes + 1], nodes[kMaxTreeNodes];
  __shared__ int depth[kMaxTreeNodes + 1];
  const int64_t b = blockIdx.x, n = s.nodes, vocab = s.vocab, valid = num_nodes[b];
  const int64_t* tok = ids + b * n;
  const int64_t* par = parents + b * n;
  const T* rows = logits + b * (n + 1) * vocab;
  if (!build_children(tok, par, valid, vocab, first, next, error)) return;
  for (int64_t i = threadIdx.x; i <= n; i += kThreads) {
    argmax[i] = -1;
    depth[i] = i == 0 ? 0 : -1;  // -1: not accepted
  }
  __syncthreads();
  int64_t best = -1;
  for (int64_t i = 0; i < valid; ++i) {
    const int64_t up = par[i] + 1;
    if (depth[up] < 0) continue;
    int64_t a = argmax[up];
    if (a < 0) {
      a = block_argmax(rows + up * vocab, vocab, sh, error);
      if (a < 0) return;
      if (threadIdx.x == 0) argmax[up] = a;
    }
    if (tok[i] == a && threadIdx.x == 0) depth[i + 1] = depth[up] + 1;
    __syncthreads();
    if (depth[i + 1] > depth[best + 1]) best = i;
  }
  const int64_t d = depth[best + 1];
  if (d > s.max_depth) return report(error, kBadId);
  if (threadIdx.x == 0) {
    for (int64_t node = best, level = d - 1; node >= 0; node = par[node], --level) nodes[level] = node;
  }
  int64_t last = argmax[best + 1];
  __syncthreads();
  if (last < 0) last = block_argmax(rows + (best + 1) * vocab, vocab, sh, error);
  if (last < 0) return;
  write_tree_outputs(tok, nodes, d, last, s.max_depth, tokens + b * (s.max_depth + 1), path + b * s.max_depth);
  if (threadIdx.x == 0) counts[b] = d;
}

// The distribution of one row: from its merged statistics when there are some, else found
// by this block (w as buffer). Reports and returns false on NaN/+inf or all -inf rows.
template <typename T>
__device__ bool tree_row_dist(const T* row, const RowPart* merged, int64_t vocab, const Sampling& sp, double* w,
                              Shared& sh, int* error, RowDist& dist) {
  if (merged == nullptr) return row_dist(row, vocab, sp, w, sh, error, dist);
  const int code = part_dist(*merged, dist);
  if (code != kOk) report(error, code);
  return code == kOk;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) tree_stochastic_kernel(const int64_t* ids, const int64_t* parents,
                                                                   const T* logits, const int64_t* num_nodes,
                                                                   const void* q, DType q_dtype,
                                                                   const float* uniforms, Sampling sp, TreeShape s,
                                                                   double* scratch, const RowPart* parts,
                                                                   RowPart* merged_rows, int64_t chunks,
                                                                   int64_t* tokens, int64_t* counts, int64_t* path,
                                                                   int* error) {
  __shared__ Shared sh;
  __shared__ int first[kMaxTreeNodes + 1], next[kMaxTreeNodes];
  __shared__ int64_t nodes[kMaxTreeNodes], excluded[kMaxTreeNodes];
  const int64_t b = blockIdx.x, n = s.nodes, vocab = s.vocab;
  const int64_t* tok = ids + b * n;
  const float* u = uniforms + b * (n + 1);
  const T* rows = logits + b * (n + 1) * vocab;
  double* w = scratch + b * vocab;
  const double inv_t = 1.0 / sp.temperature;
  if (!build_children(tok, parents + b * n, num_nodes[b], vocab, first, next, error)) return;
  // Rows 0 .. num_nodes[b] have statistics (the pass skips the rest); merged a row a thread.
  RowPart* merged = parts ? merged_rows + b * (n + 1) : nullptr;
  if (merged) {
    for (int64_t r = threadIdx.x; r <= num_nodes[b]; r += kThreads) {
      merged[r] = combine_parts(parts + (b * (n + 1) + r) * chunks, chunks);
    }
    __syncthreads();
  }
  int64_t depth = 0, n_excluded = 0;
  const T* row = rows;
  RowDist dist;
  if (!tree_row_dist(row, merged, vocab, sp, w, sh, error, dist)) return;
  // Residual r: p (minus `excluded` when q is one-hot) until `dense`, then w[] with total `total`.
  bool dense = false;
  double total = 1.0;
  for (int c = first[0]; c >= 0;) {
    const int64_t t = tok[c];
    const int64_t qrow = (b * n + c) * vocab;
    const double qt = q ? load_prob(q, q_dtype, qrow + t) : 1.0;
    if (bad_prob(qt)) return report(error, kBadDraftProb);
    double rt = dense ? w[t] : row_prob(row, t, dist, inv_t);
    for (int64_t e = 0; e < n_excluded; ++e) rt = excluded[e] == t ? 0.0 : rt;
    if (static_cast<double>(u[c]) * qt * total < rt) {
      if (depth >= s.max_depth) return report(error, kBadId);
      if (threadIdx.x == 0) nodes[depth] = c;
      ++depth;
      row = rows + (c + 1) * vocab;
      __syncthreads();  // everyone has read w before row_dist may reuse it
      if (!tree_row_dist(row, merged ? merged + c + 1 : nullptr, vocab, sp, w, sh, error, dist)) return;
      dense = false;
      total = 1.0;
      n_excluded = 0;
      c = first[c + 1];
      continue;
    }
    if (q) {
      __syncthreads();
      if (!dense) row_probs(row, vocab, dist, inv_t, w);
      dense = true;
      double local = 0.0;
      int bad = 0;
      for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
        const double qj = load_prob(q, q_dtype, qrow + j);
        bad |= bad_prob(qj);
        local += fmax(0.0, w[j] - qj * total);
      }
      if (__syncthreads_or(bad)) return report(error, kBadDraftProb);
      const double new_total = block_sum(local, sh);
      if (new_total > 0.0) {
        for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
          w[j] = fmax(0.0, w[j] - load_prob(q, q_dtype, qrow + j) * total);
        }
        __syncthreads();
        total = new_total;
      }
    } else if (total - rt > 0.0) {
      if (threadIdx.x == 0) excluded[n_excluded] = t;
      ++n_excluded;
      total -= rt;
      __syncthreads();
    }
    c = next[c];
  }
  if (!dense) {
    __syncthreads();
    row_probs(row, vocab, dist, inv_t, w);
    if (threadIdx.x == 0) {
      for (int64_t e = 0; e < n_excluded; ++e) w[excluded[e]] = 0.0;
    }
    __syncthreads();
  }
  const int64_t last = sample_buffer(w, vocab, static_cast<double>(u[n]), sh);
  write_tree_outputs(tok, nodes, depth, last, s.max_depth, tokens + b * (s.max_depth + 1), path + b * s.max_depth);
  if (threadIdx.x == 0) counts[b] = depth;
}

}  // namespace

void launch_tree_greedy(const int64_t* ids, const int64_t* parents, const void* logits, DType logits_dtype,
                        const int64_t* num_nodes, TreeShape shape, int64_t* tokens, int64_t* counts, int64_t* path,
                        int* error, cudaStream_t stream) {
  if (shape.batch == 0) return;
  dispatch_logits(logits_dtype, [&](auto tag) {
    using T = decltype(tag);
    tree_greedy_kernel<T><<<static_cast<unsigned>(shape.batch), kThreads, 0, stream>>>(
        ids, parents, static_cast<const T*>(logits), num_nodes, shape, tokens, counts, path, error);
  });
}

void launch_tree_stochastic(const int64_t* ids, const int64_t* parents, const void* logits, DType logits_dtype,
                            const int64_t* num_nodes, const void* draft_probs, DType probs_dtype,
                            const float* uniforms, Sampling sampling, TreeShape shape, double* scratch,
                            const RowStatsShape& stats, void* workspace, int64_t* tokens, int64_t* counts,
                            int64_t* path, int* error, cudaStream_t stream) {
  if (shape.batch == 0) return;
  const Workspace ws = carve_workspace(workspace, stats, shape.batch);
  const bool filtered = sampling.top_k > 0 || sampling.top_p < 1.0;
  if (!filtered) {
    launch_row_stats(logits, logits_dtype, num_nodes, stats, 1.0 / sampling.temperature, kWantSoftmax, ws.parts,
                     stream);
  }
  dispatch_logits(logits_dtype, [&](auto tag) {
    using T = decltype(tag);
    tree_stochastic_kernel<T><<<static_cast<unsigned>(shape.batch), kThreads, 0, stream>>>(
        ids, parents, static_cast<const T*>(logits), num_nodes, draft_probs, probs_dtype, uniforms, sampling, shape,
        scratch, filtered ? nullptr : ws.parts, ws.merged, stats.chunks, tokens, counts, path, error);
  });
}

}  // namespace cuda
}  // namespace specdec
