// Argument checks shared by the CPU and CUDA acceptance ops: every bad input
// becomes a TORCH_CHECK naming the argument, the expectation and what was found.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace specdec {

// draft_ids [B, K] int64 with K <= kMaxDraftLen; draft_lens [B] int64 in [0, K].
void check_chain(const char* op, const at::Tensor& draft_ids, const at::Tensor& draft_lens);

// draft ids before each request's length lie in [0, vocab).
void check_draft_ids(const char* op, const at::Tensor& draft_ids, const at::Tensor& draft_lens, int64_t vocab);

// target_logits [B, rows, V] floating point on the device of `like`.
void check_logits(const char* op, const at::Tensor& logits, const at::Tensor& like, int64_t rows);

// draft_probs [B, n, V] floating point on the device of `like` (values are checked where read).
void check_draft_probs(const char* op, const std::optional<at::Tensor>& draft_probs, const at::Tensor& like,
                       int64_t n, int64_t vocab);

// uniforms [B, n] float32 in [0, 1) on the device of `like`.
void check_uniforms(const char* op, const at::Tensor& uniforms, const at::Tensor& like, int64_t n);

// temperature finite and > 0, top_k >= 0, top_p in (0, 1].
void check_sampling(const char* op, double temperature, int64_t top_k, double top_p);

// tree_ids, parents [B, N] int64 with N <= kMaxTreeNodes, num_nodes [B] in [0, N];
// for valid nodes: -1 <= parent < index, id in [0, vocab), depth <= max_depth.
void check_tree(const char* op, const at::Tensor& tree_ids, const at::Tensor& parents,
                const at::Tensor& num_nodes, int64_t vocab, int64_t max_depth);

}  // namespace specdec
