// Greedy and lossless stochastic verification of draft chains on the CPU.
// Each request stops reading logits at its first rejection; requests run in parallel.
#include <ATen/Parallel.h>

#include "checks.h"
#include "cpu_row.h"
#include "ops.h"

namespace specdec {
namespace {

std::tuple<Tensor, Tensor> new_outputs(const Tensor& draft_ids) {
  const auto opts = draft_ids.options().dtype(at::kLong);
  return {at::empty({draft_ids.size(0), draft_ids.size(1) + 1}, opts), at::empty({draft_ids.size(0)}, opts)};
}

template <typename T, typename Q>
void stochastic_chain_kernel(const int64_t* draft, const T* logits, const int64_t* lens, const Q* q,
                             const float* uniforms, const SamplingParams& sp, int64_t batch, int64_t k,
                             int64_t vocab, int64_t* tokens, int64_t* counts) {
  const char* op = "stochastic_chain_verify";
  at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
    // e: exp(x - max) of the row read last, turned in place into the weights of the last token.
    std::vector<double> scratch, e(vocab);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t* d = draft + b * k;
      const float* u = uniforms + b * (k + 1);
      const T* rows = logits + b * (k + 1) * vocab;
      int64_t n = 0;
      bool rejected = false;
      for (; n < lens[b]; ++n) {
        const T* row = rows + n * vocab;
        const RowDist dist = row_dist(row, vocab, sp, scratch, e.data(), op);
        const double p = e[d[n]] / dist.sum;
        const double qd = q ? checked_prob(q, (b * k + n) * vocab + d[n], op) : 1.0;
        if (!(static_cast<double>(u[n]) * qd < p)) {
          // Residual max(0, p - q): p with the draft token removed when q is one-hot.
          double left = 0.0;
          if (q) {
            block_div(e.data(), vocab, dist.sum);
            TORCH_CHECK(row_residual(e.data(), q + (b * k + n) * vocab, vocab, 1.0, e.data(), &left), op,
                        ": draft_probs must be finite and >= 0; found NaN, inf or a negative value in row [", b,
                        ", ", n, "]");
          } else {
            e[d[n]] = 0.0;
            left = block_sum(e.data(), vocab);
          }
          // Rounding left no residual mass: fall back to p.
          if (!(left > 0.0)) row_dist(row, vocab, sp, scratch, e.data(), op);
          rejected = true;
          break;
        }
      }
      if (!rejected) row_dist(rows + n * vocab, vocab, sp, scratch, e.data(), op);
      write_row(tokens + b * (k + 1), k + 1, d, n, sample_weights(e.data(), vocab, u[k]));
      counts[b] = n;
    }
  });
}

}  // namespace

std::tuple<Tensor, Tensor> greedy_chain_verify_ids_cpu(const Tensor& draft_ids, const Tensor& target_ids,
                                                       const Tensor& draft_lens) {
  const char* op = "greedy_chain_verify_ids";
  check_chain(op, draft_ids, draft_lens);
  TORCH_CHECK(target_ids.scalar_type() == at::kLong && target_ids.dim() == 2 &&
                  target_ids.size(0) == draft_ids.size(0) && target_ids.size(1) == draft_ids.size(1) + 1,
              op, ": target_ids must be int64 of shape [B, K+1] = [", draft_ids.size(0), ", ", draft_ids.size(1) + 1,
              "], found ", target_ids.scalar_type(), " ", target_ids.sizes());
  TORCH_CHECK(target_ids.device() == draft_ids.device(), op, ": target_ids must be on ", draft_ids.device());
  const auto d = draft_ids.contiguous(), t = target_ids.contiguous(), l = draft_lens.contiguous();
  auto [tokens, counts] = new_outputs(d);
  const int64_t batch = d.size(0), k = d.size(1);
  const int64_t *dp = d.data_ptr<int64_t>(), *tp = t.data_ptr<int64_t>(), *lp = l.data_ptr<int64_t>();
  int64_t *out = tokens.data_ptr<int64_t>(), *cnt = counts.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    int64_t n = 0;
    while (n < lp[b] && dp[b * k + n] == tp[b * (k + 1) + n]) ++n;
    write_row(out + b * (k + 1), k + 1, dp + b * k, n, tp[b * (k + 1) + n]);
    cnt[b] = n;
  }
  return {tokens, counts};
}

std::tuple<Tensor, Tensor> greedy_chain_verify_cpu(const Tensor& draft_ids, const Tensor& target_logits,
                                                   const Tensor& draft_lens) {
  const char* op = "greedy_chain_verify";
  check_chain(op, draft_ids, draft_lens);
  check_logits(op, target_logits, draft_ids, draft_ids.size(1) + 1);
  const int64_t vocab = target_logits.size(2);
  check_draft_ids(op, draft_ids, draft_lens, vocab);
  const auto d = draft_ids.contiguous(), x = target_logits.contiguous(), l = draft_lens.contiguous();
  auto [tokens, counts] = new_outputs(d);
  const int64_t batch = d.size(0), k = d.size(1);
  const int64_t *dp = d.data_ptr<int64_t>(), *lp = l.data_ptr<int64_t>();
  int64_t *out = tokens.data_ptr<int64_t>(), *cnt = counts.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "specdec_dispatch", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        int64_t n = 0, last = 0;
        for (;; ++n) {
          last = row_argmax(xp + (b * (k + 1) + n) * vocab, vocab, op);
          if (n == lp[b] || dp[b * k + n] != last) break;
        }
        write_row(out + b * (k + 1), k + 1, dp + b * k, n, last);
        cnt[b] = n;
      }
    });
  });
  return {tokens, counts};
}

std::tuple<Tensor, Tensor> stochastic_chain_verify_cpu(const Tensor& draft_ids, const Tensor& target_logits,
                                                       const Tensor& draft_lens,
                                                       const std::optional<Tensor>& draft_probs,
                                                       const Tensor& uniforms, double temperature, int64_t top_k,
                                                       double top_p) {
  const char* op = "stochastic_chain_verify";
  check_chain(op, draft_ids, draft_lens);
  const int64_t k = draft_ids.size(1);
  check_logits(op, target_logits, draft_ids, k + 1);
  const int64_t vocab = target_logits.size(2);
  check_draft_ids(op, draft_ids, draft_lens, vocab);
  check_draft_probs(op, draft_probs, draft_ids, k, vocab);
  check_uniforms(op, uniforms, draft_ids, k + 1);
  check_sampling(op, temperature, top_k, top_p);
  const auto d = draft_ids.contiguous(), x = target_logits.contiguous(), l = draft_lens.contiguous();
  const auto u = uniforms.contiguous();
  const auto q = draft_probs.has_value() ? draft_probs->contiguous() : at::empty({0}, x.options());
  auto [tokens, counts] = new_outputs(d);
  const SamplingParams sp{temperature, top_k, top_p};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "specdec_dispatch", [&] {
    using logit_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "specdec_dispatch", [&] {
      stochastic_chain_kernel<logit_t, scalar_t>(
          d.data_ptr<int64_t>(), x.data_ptr<logit_t>(), l.data_ptr<int64_t>(),
          draft_probs.has_value() ? q.data_ptr<scalar_t>() : nullptr, u.data_ptr<float>(), sp, d.size(0), k, vocab,
          tokens.data_ptr<int64_t>(), counts.data_ptr<int64_t>());
    });
  });
  return {tokens, counts};
}

}  // namespace specdec
