// CPU row math shared by the acceptance ops: the target distribution of one
// logits row (temperature, top-k, top-p), probabilities, argmax and inverse-CDF draws.
// Everything is float64 so the ops agree with the PyTorch reference token for token.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace specdec {

struct SamplingParams {
  double temperature;
  int64_t top_k;  // 0: off
  double top_p;   // 1: off
};

// p_j = exp(x_j - max) / sum for x_j >= cut, else 0, where x = logit / temperature.
struct RowDist {
  double max;
  double sum;
  double cut;
};

// Vectorisable exp for x <= 0 (x = -inf gives 0); within 1 ulp of std::exp.
double exp_nonpos(double x);

// Kernels over float64 blocks, compiled for AVX-512, AVX2 and baseline (runtime pick).
double block_max(const double* x, int64_t n, bool* nan);  // max ignoring NaN; nan: one was seen
double block_sum(const double* x, int64_t n);
void block_div(double* x, int64_t n, double divisor);
// out_j = exp(x_j - shift) for x_j >= cut, else 0.
void block_exp(const double* x, double* out, int64_t n, double shift, double cut);
double block_sum_exp(const double* x, int64_t n, double shift, double cut);
// sum_j e_j and sum_j e_j (x_j - shift) with e_j = exp(x_j - shift): the entropy's terms.
void block_exp_moments(const double* x, int64_t n, double shift, double* sum, double* sum_xe);
// out_j = max(0, w_j - q_j * scale) (out may be w); false when some q_j is NaN, inf or < 0.
bool block_residual(const double* w, const double* q, double* out, int64_t n, double scale);

// Index of the first weight whose running sum exceeds u * total (u in [0, 1)).
int64_t sample_weights(const double* w, int64_t n, double u);

void floats_to_double(const float* row, int64_t n, double* out);  // SIMD clones of the loop below

// Copies row[0:n] into out as float64.
template <typename T>
inline void to_double(const T* row, int64_t n, double* out) {
  if constexpr (std::is_same_v<T, float>) {
    floats_to_double(row, n, out);
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = static_cast<double>(row[j]);
  }
}

// Copies logits[0:n] / temperature into out as float64.
template <typename T>
inline void scale_row(const T* row, int64_t n, double temperature, double* out) {
  to_double(row, n, out);
  if (temperature != 1.0) block_div(out, n, temperature);
}

// Target distribution of one logits row. Fills e[0:vocab] with exp(x_j - max)
// for x_j >= cut, else 0, so p = e / sum: the row is read twice (max, then exp)
// and a rejection needs no second exp pass. `scratch` is only used when top-k
// or top-p is on. Raises on NaN/+inf logits and all -inf rows.
template <typename T>
RowDist row_dist(const T* row, int64_t vocab, const SamplingParams& sp, std::vector<double>& scratch, double* e,
                 const char* op);

// out_j = max(0, w_j - q_j * scale) and *total = sum_j out_j (out may be w); q is
// converted one L1-sized block at a time. False when some q_j is NaN, inf or < 0.
template <typename Q>
bool row_residual(const double* w, const Q* q, int64_t n, double scale, double* out, double* total) {
  constexpr int64_t kLen = 512;
  double qbuf[kLen];
  bool ok = true;
  *total = 0.0;
  for (int64_t j = 0; j < n; j += kLen) {
    const int64_t m = std::min(kLen, n - j);
    to_double(q + j, m, qbuf);
    ok = block_residual(w + j, qbuf, out + j, m, scale) && ok;
    *total += block_sum(out + j, m);
  }
  return ok;
}

// First index of the largest logit (torch.argmax semantics); raises on NaN.
template <typename T>
int64_t row_argmax(const T* row, int64_t vocab, const char* op);

}  // namespace specdec
