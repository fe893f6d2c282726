// Per-row statistics of target logits, computed by many blocks at once (include from .cu files).
// The chain ops read every row a request may need in one parallel pass (row_stats_cuda.cu):
// a row is split into chunks, one block per (row, chunk), each reading its chunk once with
// 16-byte loads and keeping an online softmax in float64. The per-request decisions then
// merge a row's chunks in index order, so results do not depend on the launch.
#pragma once

#include "cuda_row.h"

namespace specdec {
namespace cuda {

// Flags of a RowPart: a NaN logit; a NaN or +inf logit after temperature.
constexpr int kPartNaN = 1;
constexpr int kPartBad = 2;

// What the statistics pass computes (RowStatsMode, cuda_kernels.h, as bits): the argmax, the
// softmax's max and normaliser, the entropy sum. Each op asks only for what it reads.
constexpr int kWantArgmax = 1;
constexpr int kWantSoftmax = 2;
constexpr int kWantEntropy = 4;

// What was read of one chunk of a row, with x = logit / temperature in float64:
// max x, sum exp(x - max), sum exp(x - max) (x - max) (for the entropy), and the
// largest raw logit with its first index (torch.argmax).
struct RowPart {
  double max, sum, xsum, best;
  int64_t best_idx;
  int flags;
};

__device__ __forceinline__ RowPart empty_part() { return RowPart{-pos_inf(), 0.0, 0.0, -pos_inf(), -1, 0}; }

// Adds chunk `o` to `a`; both hold sums relative to their own max.
__device__ __forceinline__ void merge_parts(RowPart& a, const RowPart& o) {
  if (o.max > a.max) {
    const double c = a.max > -pos_inf() ? exp(a.max - o.max) : 0.0;
    a.xsum = a.max > -pos_inf() ? c * (a.xsum + (a.max - o.max) * a.sum) + o.xsum : o.xsum;
    a.sum = c * a.sum + o.sum;
    a.max = o.max;
  } else if (o.max > -pos_inf()) {
    const double c = exp(o.max - a.max);
    a.xsum += c * (o.xsum + (o.max - a.max) * o.sum);
    a.sum += c * o.sum;
  }
  if (o.best_idx >= 0 && (a.best_idx < 0 || o.best > a.best || (o.best == a.best && o.best_idx < a.best_idx))) {
    a.best = o.best;
    a.best_idx = o.best_idx;
  }
  a.flags |= o.flags;
}

// One row's statistics from its chunks (any thread; chunks merged in index order).
__device__ inline RowPart combine_parts(const RowPart* parts, int64_t chunks) {
  RowPart r = empty_part();
  for (int64_t c = 0; c < chunks; ++c) merge_parts(r, parts[c]);
  return r;
}

// The target distribution of a row from its merged statistics: 0, or the ValueError code
// (limits.h) of a row with a NaN/+inf logit or with every logit -inf.
__device__ __forceinline__ int part_dist(const RowPart& p, RowDist& dist) {
  if (p.flags & kPartBad) return kBadLogit;
  if (!(p.max > -pos_inf())) return kEmptyRow;
  dist = RowDist{p.max, p.sum, -pos_inf()};
  return kOk;
}

// Kernels that decide one request a warp: requests per block, the warp's request, blocks.
constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ int64_t warp_request() {
  return (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
}

__host__ inline unsigned warp_blocks(int64_t batch) {
  return static_cast<unsigned>((batch + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// Records an error from any one thread (report() is thread 0 of a block's).
__device__ __forceinline__ void fail(int* error, int code) { atomicCAS(error, 0, code); }

// The lanes of one warp merge the chunks of a request's rows [0, rows) into merged[0, rows),
// a row per lane, so a decision (lane 0) does not merge row after row on its own.
__device__ inline void merge_request_rows(const RowPart* parts, int64_t chunks, int64_t rows, RowPart* merged) {
  for (int64_t r = threadIdx.x % 32; r < rows; r += 32) merged[r] = combine_parts(parts + r * chunks, chunks);
  __syncwarp();
}

// Where a chain op's stop row is: the first rejected position, or the bonus row after
// `n` accepted tokens; `n` < 0 after an error. The target distribution of that row rides along.
struct Stop {
  RowDist dist;
  int64_t n;
  int rejected;
};

// A chain op's workspace (one byte buffer): per (row, chunk) statistics, per-row merges, per
// request stop rows, and per (request, chunk) weight sums {w, p} of the stop rows.
struct Workspace {
  RowPart* parts;
  RowPart* merged;
  Stop* stops;
  double2* chunk_sums;
};

__host__ __device__ inline int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

__host__ inline Workspace carve_workspace(void* base, const RowStatsShape& s, int64_t batch) {
  char* p = static_cast<char*>(base);
  Workspace w;
  w.parts = reinterpret_cast<RowPart*>(p);
  p += align16(s.rows * s.chunks * static_cast<int64_t>(sizeof(RowPart)));
  w.merged = reinterpret_cast<RowPart*>(p);
  p += align16(s.rows * static_cast<int64_t>(sizeof(RowPart)));
  w.stops = reinterpret_cast<Stop*>(p);
  p += align16(batch * static_cast<int64_t>(sizeof(Stop)));
  w.chunk_sums = reinterpret_cast<double2*>(p);
  return w;
}

// Calls f(j, value) for j in [begin, end) of `row`, thread-strided: 16-byte loads of the
// aligned body, single loads of the unaligned head and the tail. Each thread sees its
// indices in increasing order.
template <typename T, typename F>
__device__ __forceinline__ void for_each_in(const T* row, int64_t begin, int64_t end, F f) {
  constexpr int64_t kVec = 16 / sizeof(T);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(row + begin);
  int64_t head = static_cast<int64_t>((16 - addr % 16) % 16) / static_cast<int64_t>(sizeof(T));
  if (head > end - begin) head = end - begin;
  for (int64_t j = begin + threadIdx.x; j < begin + head; j += blockDim.x) f(j, row[j]);
  const int64_t body = begin + head, nvec = (end - body) / kVec;
  const uint4* vec = reinterpret_cast<const uint4*>(row + body);
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    const uint4 raw = __ldg(vec + i);
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int64_t e = 0; e < kVec; ++e) f(body + i * kVec + e, v[e]);
  }
  for (int64_t j = body + nvec * kVec + threadIdx.x; j < end; j += blockDim.x) f(j, row[j]);
}

}  // namespace cuda
}  // namespace specdec
