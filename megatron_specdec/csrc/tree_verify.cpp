// Greedy and lossless stochastic verification of flattened draft trees on the CPU.
// Node i of a request has token tree_ids[i] and parent parents[i] (-1: the root);
// logits row 0 follows the root and row i+1 follows node i. Parents precede children.
#include <ATen/Parallel.h>

#include "checks.h"
#include "cpu_row.h"
#include "ops.h"

namespace specdec {
namespace {

using Outputs = std::tuple<Tensor, Tensor, Tensor>;

Outputs new_outputs(const Tensor& tree_ids, int64_t max_depth) {
  const auto opts = tree_ids.options().dtype(at::kLong);
  const int64_t batch = tree_ids.size(0);
  return {at::empty({batch, max_depth + 1}, opts), at::empty({batch}, opts), at::empty({batch, max_depth}, opts)};
}

// Children in index order as linked lists: first[node + 1], next[child].
void build_children(const int64_t* parents, int64_t n, std::vector<int64_t>& first, std::vector<int64_t>& next) {
  first.assign(n + 1, -1);
  next.assign(n, -1);
  for (int64_t i = n - 1; i >= 0; --i) {
    next[i] = first[parents[i] + 1];
    first[parents[i] + 1] = i;
  }
}

// Writes the path (node ids, their tokens) and the final token of one request.
void write_path(const int64_t* ids, const int64_t* path_nodes, int64_t depth, int64_t last, int64_t max_depth,
                int64_t* tokens, int64_t* path) {
  for (int64_t i = 0; i < max_depth; ++i) path[i] = i < depth ? path_nodes[i] : -1;
  for (int64_t i = 0; i <= max_depth; ++i) tokens[i] = i < depth ? ids[path_nodes[i]] : -1;
  tokens[depth] = last;
}

void check_tree_inputs(const char* op, const Tensor& tree_ids, const Tensor& parents, const Tensor& target_logits,
                       const Tensor& num_nodes, int64_t max_depth) {
  TORCH_CHECK(tree_ids.dim() == 2, op, ": tree_ids must have 2 dims [B, N], found shape ", tree_ids.sizes());
  check_logits(op, target_logits, tree_ids, tree_ids.size(1) + 1);
  check_tree(op, tree_ids, parents, num_nodes, target_logits.size(2), max_depth);
}

template <typename T, typename Q>
void stochastic_tree_kernel(const int64_t* ids, const int64_t* parents, const T* logits, const int64_t* num_nodes,
                            const Q* q, const float* uniforms, const SamplingParams& sp, int64_t batch, int64_t n,
                            int64_t vocab, int64_t max_depth, int64_t* tokens, int64_t* counts, int64_t* path) {
  const char* op = "tree_verify_stochastic";
  at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
    std::vector<double> scratch, weights(vocab), spare(q ? vocab : 0);
    std::vector<int64_t> first, next, nodes(max_depth), excluded;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t* tok = ids + b * n;
      const float* u = uniforms + b * (n + 1);
      const T* rows = logits + b * (n + 1) * vocab;
      build_children(parents + b * n, num_nodes[b], first, next);
      int64_t node = -1, depth = 0;
      const T* row = rows;
      RowDist dist = row_dist(row, vocab, sp, scratch, weights.data(), op);
      // Residual r: weights = exp(x - max) of `row` (r = p minus the `excluded` tokens when q
      // is one-hot) until `dense`, then the residual itself, of mass `total`.
      bool dense = false;
      double total = 1.0;
      excluded.clear();
      for (int64_t c = first[0]; c >= 0;) {
        const int64_t t = tok[c];
        const double qt = q ? checked_prob(q, (b * n + c) * vocab + t, op) : 1.0;
        double rt = dense ? weights[t] : weights[t] / dist.sum;
        for (int64_t e : excluded) rt = e == t ? 0.0 : rt;
        if (static_cast<double>(u[c]) * qt * total < rt) {
          nodes[depth++] = node = c;
          row = rows + (c + 1) * vocab;
          dist = row_dist(row, vocab, sp, scratch, weights.data(), op);
          dense = false;
          total = 1.0;
          excluded.clear();
          c = first[c + 1];
          continue;
        }
        if (q) {
          if (!dense) block_div(weights.data(), vocab, dist.sum);
          dense = true;
          double new_total = 0.0;
          TORCH_CHECK(row_residual(weights.data(), q + (b * n + c) * vocab, vocab, total, spare.data(), &new_total),
                      op, ": draft_probs must be finite and >= 0; found NaN, inf or a negative value in row [", b,
                      ", ", c, "]");
          if (new_total > 0.0) {
            weights.swap(spare);
            total = new_total;
          }
        } else if (total - rt > 0.0) {
          excluded.push_back(t);
          total -= rt;
        }
        c = next[c];
      }
      if (!dense) {
        for (int64_t e : excluded) weights[e] = 0.0;
      }
      const int64_t last = sample_weights(weights.data(), vocab, u[n]);
      write_path(tok, nodes.data(), depth, last, max_depth, tokens + b * (max_depth + 1), path + b * max_depth);
      counts[b] = depth;
    }
  });
}

}  // namespace

Outputs tree_verify_greedy_cpu(const Tensor& tree_ids, const Tensor& parents, const Tensor& target_logits,
                               const Tensor& num_nodes, int64_t max_depth) {
  const char* op = "tree_verify_greedy";
  check_tree_inputs(op, tree_ids, parents, target_logits, num_nodes, max_depth);
  const auto t = tree_ids.contiguous(), p = parents.contiguous(), x = target_logits.contiguous();
  const auto l = num_nodes.contiguous();
  auto [tokens, counts, path] = new_outputs(t, max_depth);
  const int64_t batch = t.size(0), n = t.size(1), vocab = x.size(2);
  const int64_t *tp = t.data_ptr<int64_t>(), *pp = p.data_ptr<int64_t>(), *lp = l.data_ptr<int64_t>();
  int64_t *out = tokens.data_ptr<int64_t>(), *cnt = counts.data_ptr<int64_t>(), *pth = path.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "specdec_dispatch", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
      // argmax[r] of logits row r, computed only for rows whose node is accepted (-1: not yet).
      std::vector<int64_t> argmax(n + 1), depth(n + 1), nodes(max_depth);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t* tok = tp + b * n;
        const int64_t* par = pp + b * n;
        const scalar_t* rows = xp + b * (n + 1) * vocab;
        std::fill(argmax.begin(), argmax.end(), -1);
        std::fill(depth.begin(), depth.end(), -1);  // -1: not accepted
        depth[0] = 0;
        int64_t best = -1;
        for (int64_t i = 0; i < lp[b]; ++i) {
          const int64_t up = par[i] + 1;
          if (depth[up] < 0) continue;
          if (argmax[up] < 0) argmax[up] = row_argmax(rows + up * vocab, vocab, op);
          if (tok[i] != argmax[up]) continue;
          depth[i + 1] = depth[up] + 1;
          if (depth[i + 1] > depth[best + 1]) best = i;
        }
        const int64_t d = depth[best + 1];
        for (int64_t node = best, level = d - 1; node >= 0; node = par[node], --level) nodes[level] = node;
        if (argmax[best + 1] < 0) argmax[best + 1] = row_argmax(rows + (best + 1) * vocab, vocab, op);
        write_path(tok, nodes.data(), d, argmax[best + 1], max_depth, out + b * (max_depth + 1), pth + b * max_depth);
        cnt[b] = d;
      }
    });
  });
  return {tokens, counts, path};
}

Outputs tree_verify_stochastic_cpu(const Tensor& tree_ids, const Tensor& parents, const Tensor& target_logits,
                                   const Tensor& num_nodes, const std::optional<Tensor>& draft_probs,
                                   const Tensor& uniforms, int64_t max_depth, double temperature, int64_t top_k,
                                   double top_p) {
  const char* op = "tree_verify_stochastic";
  check_tree_inputs(op, tree_ids, parents, target_logits, num_nodes, max_depth);
  const int64_t n = tree_ids.size(1), vocab = target_logits.size(2);
  check_draft_probs(op, draft_probs, tree_ids, n, vocab);
  check_uniforms(op, uniforms, tree_ids, n + 1);
  check_sampling(op, temperature, top_k, top_p);
  const auto t = tree_ids.contiguous(), p = parents.contiguous(), x = target_logits.contiguous();
  const auto l = num_nodes.contiguous(), u = uniforms.contiguous();
  const auto q = draft_probs.has_value() ? draft_probs->contiguous() : at::empty({0}, x.options());
  auto [tokens, counts, path] = new_outputs(t, max_depth);
  const SamplingParams sp{temperature, top_k, top_p};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "specdec_dispatch", [&] {
    using logit_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "specdec_dispatch", [&] {
      stochastic_tree_kernel<logit_t, scalar_t>(
          t.data_ptr<int64_t>(), p.data_ptr<int64_t>(), x.data_ptr<logit_t>(), l.data_ptr<int64_t>(),
          draft_probs.has_value() ? q.data_ptr<scalar_t>() : nullptr, u.data_ptr<float>(), sp, t.size(0), n, vocab,
          max_depth, tokens.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), path.data_ptr<int64_t>());
    });
  });
  return {tokens, counts, path};
}

}  // namespace specdec
