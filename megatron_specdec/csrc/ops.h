// CPU implementations of the acceptance ops (schemas and registration in ops.cpp).
#pragma once

#include <ATen/ATen.h>

#include <limits>
#include <optional>
#include <tuple>

namespace specdec {

using at::Tensor;

std::tuple<Tensor, Tensor> greedy_chain_verify_cpu(const Tensor& draft_ids, const Tensor& target_logits,
                                                   const Tensor& draft_lens);
std::tuple<Tensor, Tensor> greedy_chain_verify_ids_cpu(const Tensor& draft_ids, const Tensor& target_ids,
                                                       const Tensor& draft_lens);
std::tuple<Tensor, Tensor> stochastic_chain_verify_cpu(const Tensor& draft_ids, const Tensor& target_logits,
                                                       const Tensor& draft_lens,
                                                       const std::optional<Tensor>& draft_probs,
                                                       const Tensor& uniforms, double temperature, int64_t top_k,
                                                       double top_p);
std::tuple<Tensor, Tensor, Tensor> tree_verify_greedy_cpu(const Tensor& tree_ids, const Tensor& parents,
                                                          const Tensor& target_logits, const Tensor& num_nodes,
                                                          int64_t max_depth);
std::tuple<Tensor, Tensor, Tensor> tree_verify_stochastic_cpu(const Tensor& tree_ids, const Tensor& parents,
                                                              const Tensor& target_logits, const Tensor& num_nodes,
                                                              const std::optional<Tensor>& draft_probs,
                                                              const Tensor& uniforms, int64_t max_depth,
                                                              double temperature, int64_t top_k, double top_p);
std::tuple<Tensor, Tensor> typical_verify_cpu(const Tensor& draft_ids, const Tensor& target_logits,
                                              const Tensor& draft_lens, double temperature, double eps,
                                              double alpha);

// Writes one output row: ids[0:n], then `last`, then -1 up to `width`.
inline void write_row(int64_t* out, int64_t width, const int64_t* ids, int64_t n, int64_t last) {
  for (int64_t i = 0; i < n; ++i) out[i] = ids[i];
  out[n] = last;
  for (int64_t i = n + 1; i < width; ++i) out[i] = -1;
}

// Reads a draft probability, raising on NaN, inf or negative values.
template <typename Q>
inline double checked_prob(const Q* q, int64_t at, const char* op) {
  const double v = static_cast<double>(q[at]);
  TORCH_CHECK(v >= 0.0 && v < std::numeric_limits<double>::infinity(), op,
              ": draft_probs must be finite and >= 0, found ", v, " at flat index ", at);
  return v;
}

}  // namespace specdec
