// Argument checks of the acceptance ops (see checks.h). Index tensors are small
// ([B, K] or [B, N]): they are read on the host, after a copy when on a GPU.
#include "checks.h"

#include <cmath>

#include "limits.h"

namespace specdec {
namespace {

void check_index_tensor(const char* op, const char* name, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kLong, op, ": ", name, " must be int64, found ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must have ", dim, " dims, found shape ", t.sizes());
}

void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like) {
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " must be on ", like.device(), " (like draft ids), found ",
              t.device());
}

void check_lengths(const char* op, const char* name, const at::Tensor& lens, int64_t batch, int64_t max_len,
                   const at::Tensor& like) {
  check_index_tensor(op, name, lens, 1);
  check_same_device(op, name, lens, like);
  TORCH_CHECK(lens.size(0) == batch, op, ": ", name, " must have shape [", batch, "], found ", lens.sizes());
  const auto host = lens.cpu().contiguous();
  const int64_t* l = host.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(l[b] >= 0 && l[b] <= max_len, op, ": ", name, "[", b, "] must be in [0, ", max_len, "], found ",
                l[b]);
  }
}

}  // namespace

void check_chain(const char* op, const at::Tensor& draft_ids, const at::Tensor& draft_lens) {
  check_index_tensor(op, "draft_ids", draft_ids, 2);
  const int64_t k = draft_ids.size(1);
  TORCH_CHECK(k <= kMaxDraftLen, op, ": draft length K = draft_ids.size(1) must be <= ", kMaxDraftLen, ", found ", k);
  check_lengths(op, "draft_lens", draft_lens, draft_ids.size(0), k, draft_ids);
}

void check_draft_ids(const char* op, const at::Tensor& draft_ids, const at::Tensor& draft_lens, int64_t vocab) {
  const int64_t batch = draft_ids.size(0), k = draft_ids.size(1);
  const auto ids = draft_ids.cpu().contiguous();
  const auto lens = draft_lens.cpu().contiguous();
  const int64_t* d = ids.data_ptr<int64_t>();
  const int64_t* l = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < l[b]; ++i) {
      const int64_t id = d[b * k + i];
      TORCH_CHECK(id >= 0 && id < vocab, op, ": draft_ids[", b, ", ", i, "] must be in [0, ", vocab, "), found ", id);
    }
  }
}

void check_logits(const char* op, const at::Tensor& logits, const at::Tensor& like, int64_t rows) {
  TORCH_CHECK(at::isFloatingType(logits.scalar_type()), op,
              ": target_logits must be float32/float64/float16/bfloat16, found ", logits.scalar_type());
  check_same_device(op, "target_logits", logits, like);
  TORCH_CHECK(logits.dim() == 3 && logits.size(0) == like.size(0) && logits.size(1) == rows && logits.size(2) > 0,
              op, ": target_logits must have shape [", like.size(0), ", ", rows, ", V >= 1], found ", logits.sizes());
}

void check_draft_probs(const char* op, const std::optional<at::Tensor>& draft_probs, const at::Tensor& like,
                       int64_t n, int64_t vocab) {
  if (!draft_probs.has_value()) return;
  const auto& q = *draft_probs;
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), op,
              ": draft_probs must be float32/float64/float16/bfloat16, found ", q.scalar_type());
  check_same_device(op, "draft_probs", q, like);
  TORCH_CHECK(q.dim() == 3 && q.size(0) == like.size(0) && q.size(1) == n && q.size(2) == vocab, op,
              ": draft_probs must have shape [", like.size(0), ", ", n, ", ", vocab, "], found ", q.sizes());
}

void check_uniforms(const char* op, const at::Tensor& uniforms, const at::Tensor& like, int64_t n) {
  TORCH_CHECK(uniforms.scalar_type() == at::kFloat, op, ": uniforms must be float32, found ", uniforms.scalar_type());
  check_same_device(op, "uniforms", uniforms, like);
  TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == like.size(0) && uniforms.size(1) == n, op,
              ": uniforms must have shape [", like.size(0), ", ", n, "], found ", uniforms.sizes());
  if (uniforms.numel() == 0) return;
  const auto bad = at::logical_or(uniforms < 0, uniforms >= 1).logical_or_(at::isnan(uniforms)).any();
  TORCH_CHECK(!bad.item<bool>(), op, ": uniforms must lie in [0, 1)");
}

void check_sampling(const char* op, double temperature, int64_t top_k, double top_p) {
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0, op,
              ": temperature must be finite and > 0 (use the greedy op for temperature 0), found ", temperature);
  TORCH_CHECK(top_k >= 0, op, ": top_k must be >= 0 (0 = off), found ", top_k);
  TORCH_CHECK(top_p > 0 && top_p <= 1, op, ": top_p must be in (0, 1], found ", top_p);
}

void check_tree(const char* op, const at::Tensor& tree_ids, const at::Tensor& parents, const at::Tensor& num_nodes,
                int64_t vocab, int64_t max_depth) {
  check_index_tensor(op, "tree_ids", tree_ids, 2);
  const int64_t batch = tree_ids.size(0), n = tree_ids.size(1);
  TORCH_CHECK(n <= kMaxTreeNodes, op, ": tree size N = tree_ids.size(1) must be <= ", kMaxTreeNodes, ", found ", n);
  check_index_tensor(op, "parents", parents, 2);
  check_same_device(op, "parents", parents, tree_ids);
  TORCH_CHECK(parents.sizes() == tree_ids.sizes(), op, ": parents must have shape ", tree_ids.sizes(), ", found ",
              parents.sizes());
  TORCH_CHECK(max_depth >= 0 && max_depth <= n, op, ": max_depth must be in [0, ", n, "], found ", max_depth);
  check_lengths(op, "num_nodes", num_nodes, batch, n, tree_ids);
  const auto ids = tree_ids.cpu().contiguous();
  const auto par = parents.cpu().contiguous();
  const auto lens = num_nodes.cpu().contiguous();
  const int64_t* t = ids.data_ptr<int64_t>();
  const int64_t* p = par.data_ptr<int64_t>();
  const int64_t* l = lens.data_ptr<int64_t>();
  std::vector<int64_t> depth(n);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < l[b]; ++i) {
      const int64_t id = t[b * n + i], up = p[b * n + i];
      TORCH_CHECK(id >= 0 && id < vocab, op, ": tree_ids[", b, ", ", i, "] must be in [0, ", vocab, "), found ", id);
      TORCH_CHECK(up >= -1 && up < i, op, ": parents[", b, ", ", i, "] must be in [-1, ", i,
                  ") (parents precede children), found ", up);
      depth[i] = up < 0 ? 1 : depth[up] + 1;
      TORCH_CHECK(depth[i] <= max_depth, op, ": node ", i, " of request ", b, " has depth ", depth[i],
                  " > max_depth ", max_depth);
    }
  }
}

}  // namespace specdec
