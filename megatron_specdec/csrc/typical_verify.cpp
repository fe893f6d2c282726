// Medusa typical acceptance of draft chains on the CPU.
#include <ATen/Parallel.h>

#include <cmath>

#include "checks.h"
#include "cpu_row.h"
#include "ops.h"

namespace specdec {

std::tuple<Tensor, Tensor> typical_verify_cpu(const Tensor& draft_ids, const Tensor& target_logits,
                                              const Tensor& draft_lens, double temperature, double eps,
                                              double alpha) {
  const char* op = "typical_verify";
  check_chain(op, draft_ids, draft_lens);
  const int64_t batch = draft_ids.size(0), k = draft_ids.size(1);
  check_logits(op, target_logits, draft_ids, k + 1);
  const int64_t vocab = target_logits.size(2);
  check_draft_ids(op, draft_ids, draft_lens, vocab);
  check_sampling(op, temperature, 0, 1.0);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, found ", eps);
  TORCH_CHECK(std::isfinite(alpha) && alpha >= 0, op, ": alpha must be finite and >= 0, found ", alpha);
  const auto d = draft_ids.contiguous(), x = target_logits.contiguous(), l = draft_lens.contiguous();
  const auto opts = d.options().dtype(at::kLong);
  auto tokens = at::empty({batch, k + 1}, opts), counts = at::empty({batch}, opts);
  const int64_t *dp = d.data_ptr<int64_t>(), *lp = l.data_ptr<int64_t>();
  int64_t *out = tokens.data_ptr<int64_t>(), *cnt = counts.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "specdec_dispatch", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
      std::vector<double> buf(vocab);
      for (int64_t b = b0; b < b1; ++b) {
        int64_t n = 0;
        for (; n < lp[b]; ++n) {
          // p(d) > min(eps, alpha * exp(-H)), H = log Z - sum e (x - max) / Z.
          const scalar_t* row = xp + (b * (k + 1) + n) * vocab;
          scale_row(row, vocab, temperature, buf.data());
          bool nan = false;
          const double max = block_max(buf.data(), vocab, &nan);
          TORCH_CHECK(!nan && max < std::numeric_limits<double>::infinity(), op, ": target_logits must be finite or -inf (after temperature); found NaN or +inf");
          TORCH_CHECK(max > -std::numeric_limits<double>::infinity(), op, ": a target_logits row is entirely -inf");
          double sum = 0.0, sum_xe = 0.0;
          block_exp_moments(buf.data(), vocab, max, &sum, &sum_xe);
          const double entropy = std::log(sum) - sum_xe / sum;
          const double p = exp_nonpos(buf[dp[b * k + n]] - max) / sum;
          if (!(p > std::min(eps, alpha * std::exp(-entropy)))) break;
        }
        write_row(out + b * (k + 1), k + 1, dp + b * k, n, row_argmax(xp + (b * (k + 1) + n) * vocab, vocab, op));
        cnt[b] = n;
      }
    });
  });
  return {tokens, counts};
}

}  // namespace specdec
