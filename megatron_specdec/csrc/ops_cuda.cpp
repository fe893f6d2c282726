// CUDA kernels of the acceptance ops as torch operators (compiled in CUDA builds only:
// setup.py defines SPECDEC_WITH_CUDA when torch has CUDA and nvcc exists).
// Arguments are checked on the host first (index tensors are small); value errors
// found by the kernels come back through a device flag and raise here (one sync).
#ifdef SPECDEC_WITH_CUDA

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>

#include "checks.h"
#include "cuda_kernels.h"
#include "limits.h"
#include "ops.h"

namespace specdec {
namespace {

cuda::DType dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kDouble: return cuda::DType::kFloat64;
    case at::kHalf: return cuda::DType::kFloat16;
    case at::kBFloat16: return cuda::DType::kBFloat16;
    case at::kFloat: return cuda::DType::kFloat32;
    default: TORCH_CHECK(false, "unsupported floating dtype ", t.scalar_type());
  }
}

void check_cuda(const char* op, const Tensor& t) {
  TORCH_CHECK(t.is_cuda(), op, ": expected CUDA tensors, found one on ", t.device());
}

Tensor new_error_flag(const Tensor& like) {
  return at::zeros({1}, like.options().dtype(at::kInt));
}

void raise_value_error(const char* op, const Tensor& flag) {
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int code = flag.item<int>();
  TORCH_CHECK(code != kBadLogit, op, ": target_logits must be finite or -inf (after temperature); found NaN or +inf");
  TORCH_CHECK(code != kEmptyRow, op, ": a target_logits row is entirely -inf (no token can be sampled)");
  TORCH_CHECK(code != kBadDraftProb, op, ": draft_probs must be finite and >= 0; found NaN, inf or a negative value");
  TORCH_CHECK(code != kBadId, op, ": a token id or parent index is out of range");
}

// The row-statistics split of an op whose ids are [B, K] (a chain's drafts, a tree's nodes:
// K + 1 logits rows a request) and its workspace as a byte tensor: one split per call, handed
// to the launcher that reads it.
struct StatsWorkspace {
  cuda::RowStatsShape stats;
  Tensor bytes;
};

StatsWorkspace stats_workspace(const Tensor& ids, int64_t vocab) {
  const auto stats = cuda::row_stats_shape(ids.size(0), ids.size(1) + 1, vocab);
  return {stats, at::empty({cuda::workspace_bytes(stats, ids.size(0))}, ids.options().dtype(at::kByte))};
}

std::tuple<Tensor, Tensor> chain_outputs(const Tensor& draft_ids) {
  const auto opts = draft_ids.options().dtype(at::kLong);
  return {at::empty({draft_ids.size(0), draft_ids.size(1) + 1}, opts), at::empty({draft_ids.size(0)}, opts)};
}

std::tuple<Tensor, Tensor> greedy_chain_verify_ids_cuda(const Tensor& draft_ids, const Tensor& target_ids,
                                                        const Tensor& draft_lens) {
  const char* op = "greedy_chain_verify_ids";
  check_cuda(op, draft_ids);
  check_chain(op, draft_ids, draft_lens);
  TORCH_CHECK(target_ids.scalar_type() == at::kLong && target_ids.dim() == 2 &&
                  target_ids.size(0) == draft_ids.size(0) && target_ids.size(1) == draft_ids.size(1) + 1 &&
                  target_ids.device() == draft_ids.device(),
              op, ": target_ids must be int64 of shape [", draft_ids.size(0), ", ", draft_ids.size(1) + 1, "] on ",
              draft_ids.device(), ", found ", target_ids.scalar_type(), " ", target_ids.sizes(), " on ",
              target_ids.device());
  const c10::cuda::CUDAGuard guard(draft_ids.device());
  const auto d = draft_ids.contiguous(), t = target_ids.contiguous(), l = draft_lens.contiguous();
  auto [tokens, counts] = chain_outputs(d);
  cuda::launch_greedy_chain_ids(d.data_ptr<int64_t>(), t.data_ptr<int64_t>(), l.data_ptr<int64_t>(),
                                {d.size(0), d.size(1), 0}, tokens.data_ptr<int64_t>(), counts.data_ptr<int64_t>(),
                                c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {tokens, counts};
}

std::tuple<Tensor, Tensor> greedy_chain_verify_cuda(const Tensor& draft_ids, const Tensor& target_logits,
                                                    const Tensor& draft_lens) {
  const char* op = "greedy_chain_verify";
  check_cuda(op, draft_ids);
  check_chain(op, draft_ids, draft_lens);
  check_logits(op, target_logits, draft_ids, draft_ids.size(1) + 1);
  const int64_t vocab = target_logits.size(2);
  check_draft_ids(op, draft_ids, draft_lens, vocab);
  const c10::cuda::CUDAGuard guard(draft_ids.device());
  const auto d = draft_ids.contiguous(), x = target_logits.contiguous(), l = draft_lens.contiguous();
  auto [tokens, counts] = chain_outputs(d);
  auto flag = new_error_flag(d);
  const auto workspace = stats_workspace(d, vocab);
  cuda::launch_greedy_chain(d.data_ptr<int64_t>(), x.data_ptr(), dtype_of(x), l.data_ptr<int64_t>(),
                            {d.size(0), d.size(1), vocab}, workspace.stats, workspace.bytes.data_ptr(),
                            tokens.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), flag.data_ptr<int>(),
                            c10::cuda::getCurrentCUDAStream());
  raise_value_error(op, flag);
  return {tokens, counts};
}

std::tuple<Tensor, Tensor> stochastic_chain_verify_cuda(const Tensor& draft_ids, const Tensor& target_logits,
                                                        const Tensor& draft_lens,
                                                        const std::optional<Tensor>& draft_probs,
                                                        const Tensor& uniforms, double temperature, int64_t top_k,
                                                        double top_p) {
  const char* op = "stochastic_chain_verify";
  check_cuda(op, draft_ids);
  check_chain(op, draft_ids, draft_lens);
  const int64_t k = draft_ids.size(1);
  check_logits(op, target_logits, draft_ids, k + 1);
  const int64_t vocab = target_logits.size(2);
  check_draft_ids(op, draft_ids, draft_lens, vocab);
  check_draft_probs(op, draft_probs, draft_ids, k, vocab);
  check_uniforms(op, uniforms, draft_ids, k + 1);
  check_sampling(op, temperature, top_k, top_p);
  const c10::cuda::CUDAGuard guard(draft_ids.device());
  const auto d = draft_ids.contiguous(), x = target_logits.contiguous(), l = draft_lens.contiguous();
  const auto u = uniforms.contiguous();
  const auto q = draft_probs.has_value() ? draft_probs->contiguous() : Tensor();
  auto [tokens, counts] = chain_outputs(d);
  auto flag = new_error_flag(d);
  auto scratch = at::empty({d.size(0), vocab}, x.options().dtype(at::kDouble));
  const auto workspace = stats_workspace(d, vocab);
  cuda::launch_stochastic_chain(d.data_ptr<int64_t>(), x.data_ptr(), dtype_of(x), l.data_ptr<int64_t>(),
                                q.defined() ? q.data_ptr() : nullptr,
                                q.defined() ? dtype_of(q) : cuda::DType::kFloat32, u.data_ptr<float>(),
                                {temperature, top_k, top_p}, {d.size(0), k, vocab}, scratch.data_ptr<double>(),
                                workspace.stats, workspace.bytes.data_ptr(), tokens.data_ptr<int64_t>(),
                                counts.data_ptr<int64_t>(), flag.data_ptr<int>(), c10::cuda::getCurrentCUDAStream());
  raise_value_error(op, flag);
  return {tokens, counts};
}

std::tuple<Tensor, Tensor> typical_verify_cuda(const Tensor& draft_ids, const Tensor& target_logits,
                                               const Tensor& draft_lens, double temperature, double eps,
                                               double alpha) {
  const char* op = "typical_verify";
  check_cuda(op, draft_ids);
  check_chain(op, draft_ids, draft_lens);
  check_logits(op, target_logits, draft_ids, draft_ids.size(1) + 1);
  const int64_t vocab = target_logits.size(2);
  check_draft_ids(op, draft_ids, draft_lens, vocab);
  check_sampling(op, temperature, 0, 1.0);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, found ", eps);
  TORCH_CHECK(std::isfinite(alpha) && alpha >= 0, op, ": alpha must be finite and >= 0, found ", alpha);
  const c10::cuda::CUDAGuard guard(draft_ids.device());
  const auto d = draft_ids.contiguous(), x = target_logits.contiguous(), l = draft_lens.contiguous();
  auto [tokens, counts] = chain_outputs(d);
  auto flag = new_error_flag(d);
  const auto workspace = stats_workspace(d, vocab);
  cuda::launch_typical(d.data_ptr<int64_t>(), x.data_ptr(), dtype_of(x), l.data_ptr<int64_t>(), temperature, eps,
                       alpha, {d.size(0), d.size(1), vocab}, workspace.stats, workspace.bytes.data_ptr(),
                       tokens.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), flag.data_ptr<int>(),
                       c10::cuda::getCurrentCUDAStream());
  raise_value_error(op, flag);
  return {tokens, counts};
}

using TreeOutputs = std::tuple<Tensor, Tensor, Tensor>;

TreeOutputs tree_outputs(const Tensor& tree_ids, int64_t max_depth) {
  const auto opts = tree_ids.options().dtype(at::kLong);
  const int64_t batch = tree_ids.size(0);
  return {at::empty({batch, max_depth + 1}, opts), at::empty({batch}, opts), at::empty({batch, max_depth}, opts)};
}

void check_tree_inputs(const char* op, const Tensor& tree_ids, const Tensor& parents, const Tensor& target_logits,
                       const Tensor& num_nodes, int64_t max_depth) {
  check_cuda(op, tree_ids);
  TORCH_CHECK(tree_ids.dim() == 2, op, ": tree_ids must have 2 dims [B, N], found shape ", tree_ids.sizes());
  check_logits(op, target_logits, tree_ids, tree_ids.size(1) + 1);
  check_tree(op, tree_ids, parents, num_nodes, target_logits.size(2), max_depth);
}

TreeOutputs tree_verify_greedy_cuda(const Tensor& tree_ids, const Tensor& parents, const Tensor& target_logits,
                                    const Tensor& num_nodes, int64_t max_depth) {
  const char* op = "tree_verify_greedy";
  check_tree_inputs(op, tree_ids, parents, target_logits, num_nodes, max_depth);
  const c10::cuda::CUDAGuard guard(tree_ids.device());
  const auto t = tree_ids.contiguous(), p = parents.contiguous(), x = target_logits.contiguous();
  const auto l = num_nodes.contiguous();
  auto [tokens, counts, path] = tree_outputs(t, max_depth);
  auto flag = new_error_flag(t);
  cuda::launch_tree_greedy(t.data_ptr<int64_t>(), p.data_ptr<int64_t>(), x.data_ptr(), dtype_of(x),
                           l.data_ptr<int64_t>(), {t.size(0), t.size(1), x.size(2), max_depth},
                           tokens.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), path.data_ptr<int64_t>(),
                           flag.data_ptr<int>(), c10::cuda::getCurrentCUDAStream());
  raise_value_error(op, flag);
  return {tokens, counts, path};
}

TreeOutputs tree_verify_stochastic_cuda(const Tensor& tree_ids, const Tensor& parents, const Tensor& target_logits,
                                        const Tensor& num_nodes, const std::optional<Tensor>& draft_probs,
                                        const Tensor& uniforms, int64_t max_depth, double temperature,
                                        int64_t top_k, double top_p) {
  const char* op = "tree_verify_stochastic";
  check_tree_inputs(op, tree_ids, parents, target_logits, num_nodes, max_depth);
  const int64_t n = tree_ids.size(1), vocab = target_logits.size(2);
  check_draft_probs(op, draft_probs, tree_ids, n, vocab);
  check_uniforms(op, uniforms, tree_ids, n + 1);
  check_sampling(op, temperature, top_k, top_p);
  const c10::cuda::CUDAGuard guard(tree_ids.device());
  const auto t = tree_ids.contiguous(), p = parents.contiguous(), x = target_logits.contiguous();
  const auto l = num_nodes.contiguous(), u = uniforms.contiguous();
  const auto q = draft_probs.has_value() ? draft_probs->contiguous() : Tensor();
  auto [tokens, counts, path] = tree_outputs(t, max_depth);
  auto flag = new_error_flag(t);
  auto scratch = at::empty({t.size(0), vocab}, x.options().dtype(at::kDouble));
  const auto workspace = stats_workspace(t, vocab);
  cuda::launch_tree_stochastic(t.data_ptr<int64_t>(), p.data_ptr<int64_t>(), x.data_ptr(), dtype_of(x),
                               l.data_ptr<int64_t>(), q.defined() ? q.data_ptr() : nullptr,
                               q.defined() ? dtype_of(q) : cuda::DType::kFloat32, u.data_ptr<float>(),
                               {temperature, top_k, top_p}, {t.size(0), n, vocab, max_depth},
                               scratch.data_ptr<double>(), workspace.stats, workspace.bytes.data_ptr(),
                               tokens.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), path.data_ptr<int64_t>(),
                               flag.data_ptr<int>(), c10::cuda::getCurrentCUDAStream());
  raise_value_error(op, flag);
  return {tokens, counts, path};
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(megatron_specdec, CUDA, m) {
  m.impl("greedy_chain_verify", &specdec::greedy_chain_verify_cuda);
  m.impl("greedy_chain_verify_ids", &specdec::greedy_chain_verify_ids_cuda);
  m.impl("stochastic_chain_verify", &specdec::stochastic_chain_verify_cuda);
  m.impl("tree_verify_greedy", &specdec::tree_verify_greedy_cuda);
  m.impl("tree_verify_stochastic", &specdec::tree_verify_stochastic_cuda);
  m.impl("typical_verify", &specdec::typical_verify_cuda);
}

#endif  // SPECDEC_WITH_CUDA
