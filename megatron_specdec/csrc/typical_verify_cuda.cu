// CUDA kernel of Medusa typical acceptance: one block per request (see typical_verify.cpp).
#include <cmath>

#include "cuda_kernels.h"
#include "cuda_row.h"

namespace specdec {
namespace cuda {
namespace {

template <typename T>
__global__ void __launch_bounds__(kThreads) typical_kernel(const int64_t* draft, const T* logits,
                                                           const int64_t* lens, double temperature, double eps,
                                                           double alpha, ChainShape s, int64_t* tokens,
                                                           int64_t* counts, int* error) {
  __shared__ Shared sh;
  const int64_t b = blockIdx.x, vocab = s.vocab;
  const int64_t* d = draft + b * s.k;
  const T* rows = logits + b * (s.k + 1) * vocab;
  int64_t n = 0;
  for (; n < lens[b]; ++n) {
    // p(d) > min(eps, alpha * exp(-H)), H = log Z - sum e (x - max) / Z.
    const T* row = rows + n * vocab;
    if (d[n] < 0 || d[n] >= vocab) return report(error, kBadId);
    double m = -pos_inf();
    int bad = 0;
    for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
      const double x = to_double(row[j]) / temperature;
      bad |= !(x < pos_inf());
      m = fmax(m, x);
    }
    bad = __syncthreads_or(bad);
    m = block_max(m, sh);
    if (bad || !(m > -pos_inf())) return report(error, bad ? kBadLogit : kEmptyRow);
    double z = 0.0, xe = 0.0;
    for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
      const double v = to_double(row[j]) / temperature - m, e = exp(v);
      z += e;
      xe += e > 0.0 ? e * v : 0.0;
    }
    z = block_sum(z, sh);
    xe = block_sum(xe, sh);
    const double entropy = log(z) - xe / z;
    const double p = exp(to_double(row[d[n]]) / temperature - m) / z;
    if (!(p > fmin(eps, alpha * exp(-entropy)))) break;
  }
  const int64_t last = block_argmax(rows + n * vocab, vocab, sh, error);
  if (last < 0) return;
  write_row(tokens + b * (s.k + 1), s.k + 1, n, last, [&](int64_t i) { return d[i]; });
  if (threadIdx.x == 0) counts[b] = n;
}

}  // namespace

void launch_typical(const int64_t* draft, const void* logits, DType logits_dtype, const int64_t* lens,
                    double temperature, double eps, double alpha, ChainShape shape, int64_t* tokens, int64_t* counts,
                    int* error, cudaStream_t stream) {
  if (shape.batch == 0) return;
  dispatch_logits(logits_dtype, [&](auto tag) {
    using T = decltype(tag);
    typical_kernel<T><<<static_cast<unsigned>(shape.batch), kThreads, 0, stream>>>(
        draft, static_cast<const T*>(logits), lens, temperature, eps, alpha, shape, tokens, counts, error);
  });
}

}  // namespace cuda
}  // namespace specdec
