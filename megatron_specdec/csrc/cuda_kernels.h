// Launchers of the CUDA acceptance kernels, callable without torch headers.
// The kernels live in the .cu files (CUDA headers only); ops_cuda.cpp wraps them
// as torch ops. Pointers are device pointers to contiguous tensors; `error` is a
// device int set to a ValueError code (limits.h) when a value read is invalid.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace specdec {
namespace cuda {

enum class DType : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

struct Sampling {
  double temperature;
  int64_t top_k;  // 0: off
  double top_p;   // 1: off
};

// Shapes shared by the chain ops: B requests, K drafts, V vocabulary.
struct ChainShape {
  int64_t batch, k, vocab;
};

// Rows of target logits split into chunks for the parallel statistics pass (row_stats_cuda.cu):
// `rows` = requests x rows_per_request, each of `vocab` logits, read as `chunks` of `chunk_len`.
struct RowStatsShape {
  int64_t rows, rows_per_request, vocab, chunks, chunk_len;
};

// The split for this device (several waves of blocks over its SMs).
RowStatsShape row_stats_shape(int64_t requests, int64_t rows_per_request, int64_t vocab);
// Bytes of a chain op's workspace for that split and `batch` requests (cuda_row_stats.h).
int64_t workspace_bytes(const RowStatsShape& shape, int64_t batch);

// Writes one RowPart per (row, chunk) into `parts`; rows past lens[request] are skipped
// (lens may be null). `wants`: the kWant* bits (cuda_row_stats.h) of what to compute;
// x = logit * inv_t with inv_t = 1 / temperature.
void launch_row_stats(const void* logits, DType logits_dtype, const int64_t* lens, const RowStatsShape& shape,
                      double inv_t, int wants, void* parts, cudaStream_t stream);

// `stats`: row_stats_shape(batch, k + 1, vocab), computed once by the caller, which sizes
// `workspace` with workspace_bytes(stats, batch); here and below.
void launch_greedy_chain(const int64_t* draft, const void* logits, DType logits_dtype, const int64_t* lens,
                         ChainShape shape, const RowStatsShape& stats, void* workspace, int64_t* tokens,
                         int64_t* counts, int* error, cudaStream_t stream);

void launch_greedy_chain_ids(const int64_t* draft, const int64_t* target_ids, const int64_t* lens, ChainShape shape,
                             int64_t* tokens, int64_t* counts, cudaStream_t stream);

// scratch: batch * vocab doubles (the stop rows' weights). Under top-k or top-p each
// request's block finds its rows' cuts itself; the statistics part of the workspace is unused.
void launch_stochastic_chain(const int64_t* draft, const void* logits, DType logits_dtype, const int64_t* lens,
                             const void* draft_probs, DType probs_dtype, const float* uniforms, Sampling sampling,
                             ChainShape shape, double* scratch, const RowStatsShape& stats, void* workspace,
                             int64_t* tokens, int64_t* counts, int* error, cudaStream_t stream);

void launch_typical(const int64_t* draft, const void* logits, DType logits_dtype, const int64_t* lens,
                    double temperature, double eps, double alpha, ChainShape shape, const RowStatsShape& stats,
                    void* workspace, int64_t* tokens, int64_t* counts, int* error, cudaStream_t stream);

// Shapes of the tree ops: B requests, N nodes, V vocabulary, outputs sized by max_depth.
struct TreeShape {
  int64_t batch, nodes, vocab, max_depth;
};

void launch_tree_greedy(const int64_t* ids, const int64_t* parents, const void* logits, DType logits_dtype,
                        const int64_t* num_nodes, TreeShape shape, int64_t* tokens, int64_t* counts, int64_t* path,
                        int* error, cudaStream_t stream);

// scratch: batch * vocab doubles; `stats`: row_stats_shape(batch, nodes + 1, vocab) and its
// workspace, as for the chain ops (the statistics pass gives every row's distribution unless
// top-k or top-p is on).
void launch_tree_stochastic(const int64_t* ids, const int64_t* parents, const void* logits, DType logits_dtype,
                            const int64_t* num_nodes, const void* draft_probs, DType probs_dtype,
                            const float* uniforms, Sampling sampling, TreeShape shape, double* scratch,
                            const RowStatsShape& stats, void* workspace, int64_t* tokens, int64_t* counts,
                            int64_t* path, int* error, cudaStream_t stream);

}  // namespace cuda
}  // namespace specdec
