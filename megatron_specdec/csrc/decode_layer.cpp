// The whole decoding layer of a batch-1 chain in one parallel region (see decode_ops.h).
//
// Run as separate ops, each of a layer's four weight products forks and joins torch's threads,
// and between them the norms and the attention run while no weight streams: in a SmolLM2 step
// on 2 cores the 120 layer products streamed at ~80% of the read bandwidth, against ~95% for
// the same bytes in one call (Intel Xeon with AMX). Here the threads stay in one region for
// the whole layer, each taking its share of every piece, with a barrier wherever the next piece
// reads all of the last; before it waits, a thread fetches the first lines of its share of the
// next product into L2, so that the stream does not start cold after the barrier. Every element
// is computed by its op's own arithmetic, so the output is bitwise the ops' one by one.
#include "decode_ops.h"

#include "skinny_gemm.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace specdec {
namespace {

// Thread t's share [begin, end) of n items, in whole units (a product's block width) but the
// last.
std::pair<int64_t, int64_t> share(int64_t n, int64_t unit, int t, int threads) {
  const int64_t units = (n + unit - 1) / unit;
  return {std::min(units * t / threads * unit, n), std::min(units * (t + 1) / threads * unit, n)};
}

// How much of its next share a thread fetches before a barrier: about a microsecond of one
// core's stream, less than a block of a large product and far less than L2.
constexpr int64_t kAheadBytes = 16 << 10;

// The first kAheadBytes of weight rows [begin, end) into L2.
void prefetch_rows(const float* w, int64_t ldw, int64_t k, int64_t begin, int64_t end) {
  int64_t left = kAheadBytes / static_cast<int64_t>(sizeof(float));
  for (int64_t n = begin; n < end && left > 0; ++n) {
    const float* row = w + n * ldw;
    const int64_t len = std::min(k, left);
    for (int64_t j = 0; j < len; j += 16) __builtin_prefetch(row + j, 0, 2);
    left -= len;
  }
}

at::Tensor weight_of(const at::Tensor& w, int64_t out, int64_t in, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(0) == out && w.size(1) == in,
              "decode_layer: ", name, " must be float32 [", out, ", ", in, "], got ", w.scalar_type(), " ",
              w.sizes());
  return w.contiguous();
}

at::Tensor norm_of(const at::Tensor& w, int64_t h, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == h, "decode_layer: ", name,
              " must be float32 [", h, "], got ", w.scalar_type(), " ", w.sizes());
  return w.contiguous();
}

}  // namespace

at::Tensor decode_layer_cpu(const at::Tensor& hidden, const at::Tensor& input_norm, double input_eps,
                            const at::Tensor& qkv_weight, const c10::optional<at::Tensor>& qkv_bias,
                            const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys,
                            const at::Tensor& values, int64_t first, int64_t heads, double scale,
                            const at::Tensor& proj_weight, const at::Tensor& mlp_norm, double mlp_eps,
                            const at::Tensor& fc1_weight, const at::Tensor& fc2_weight,
                            at::IntArrayRef block_rows) {
  TORCH_CHECK(block_rows.size() == 4, "decode_layer: block_rows must hold 4 widths (QKV, output, fc1, fc2), got ",
              block_rows.size());
  for (int64_t b : block_rows) {
    TORCH_CHECK(b == 0 || b == 1, "decode_layer: block_rows must be 0 (the ISA's block) or 1, got ", b);
  }
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 3 && hidden.size(1) == 1,
              "decode_layer: hidden must be float32 [s, 1, H] (one sequence's chain), got ", hidden.scalar_type(),
              " ", hidden.sizes());
  const int64_t s = hidden.size(0), h = hidden.size(2);
  const int64_t qkv_out = qkv_weight.size(0), f2 = fc1_weight.size(0);
  TORCH_CHECK(f2 % 2 == 0, "decode_layer: fc1_weight must hold gate and up rows (an even count), got ", f2);
  const int64_t f = f2 / 2;
  const at::Tensor x = hidden.contiguous();
  const at::Tensor norm1 = norm_of(input_norm, h, "input_norm"), norm2 = norm_of(mlp_norm, h, "mlp_norm");
  const at::Tensor wqkv = weight_of(qkv_weight, qkv_out, h, "qkv_weight");
  const at::Tensor wfc1 = weight_of(fc1_weight, f2, h, "fc1_weight");
  const at::Tensor wfc2 = weight_of(fc2_weight, h, f, "fc2_weight");
  at::Tensor bias;
  if (qkv_bias.has_value()) {
    bias = norm_of(*qkv_bias, qkv_out, "qkv_bias");
  }
  const auto options = x.options();
  at::Tensor qkv = at::empty({s, 1, qkv_out}, options);
  const ChainAttention attention(qkv, cos, sin, keys, values, first, heads, scale);
  const int64_t att_width = heads * attention.d;
  const at::Tensor wproj = weight_of(proj_weight, h, att_width, "proj_weight");
  at::Tensor normed = at::empty({s, h}, options), att = at::empty({s, att_width}, options);
  at::Tensor mid = at::empty({s, h}, options), normed2 = at::empty({s, h}, options);
  at::Tensor up = at::empty({s, f2}, options), act = at::empty({s, f}, options);
  at::Tensor out = at::empty({s, 1, h}, options);

  const float* xp = x.data_ptr<float>();
  float* normed_p = normed.data_ptr<float>();
  float* qkv_p = qkv.data_ptr<float>();
  float* att_p = att.data_ptr<float>();
  float* mid_p = mid.data_ptr<float>();
  float* normed2_p = normed2.data_ptr<float>();
  float* up_p = up.data_ptr<float>();
  float* act_p = act.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  const float* bias_p = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const SkinnyOperands qkv_op{normed_p, h, s, wqkv.data_ptr<float>(), h, h, qkv_p, qkv_out};
  const SkinnyOperands proj_op{att_p, att_width, s, wproj.data_ptr<float>(), att_width, att_width, mid_p, h};
  const SkinnyOperands fc1_op{normed2_p, h, s, wfc1.data_ptr<float>(), h, h, up_p, f2};
  const SkinnyOperands fc2_op{act_p, f, s, wfc2.data_ptr<float>(), f, f, out_p, h};
  int64_t width[4];
  for (int i = 0; i < 4; ++i) width[i] = skinny_block_width(block_rows[i]);

  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  std::vector<float> scratch(static_cast<size_t>(threads) * attention.scratch_size());
  const float eps1 = static_cast<float>(input_eps), eps2 = static_cast<float>(mlp_eps);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), n_threads = omp_get_num_threads();
    const auto rows = share(s, 1, t, n_threads);
    rms_norm_rows(xp, norm1.data_ptr<float>(), eps1, h, normed_p, rows.first, rows.second);
#pragma omp barrier
    const auto q = share(qkv_out, width[0], t, n_threads);
    skinny_share(qkv_op, q.first, q.second, block_rows[0]);
    if (bias_p != nullptr) {
      for (int64_t r = 0; r < s; ++r) {
        for (int64_t j = q.first; j < q.second; ++j) qkv_p[r * qkv_out + j] += bias_p[j];
      }
    }
    const auto o = share(h, width[1], t, n_threads);
    prefetch_rows(proj_op.w, att_width, att_width, o.first, o.second);
#pragma omp barrier
    const auto slots = share(s * attention.groups, 1, t, n_threads);
    for (int64_t item = slots.first; item < slots.second; ++item) attention.write_slot(item);
#pragma omp barrier
    const auto tasks = share(s * heads, 1, t, n_threads);
    float* own = scratch.data() + static_cast<size_t>(t) * attention.scratch_size();
    for (int64_t task = tasks.first; task < tasks.second; ++task) attention.attend_task(task, own, att_p);
#pragma omp barrier
    skinny_share(proj_op, o.first, o.second, block_rows[1]);
    for (int64_t r = 0; r < s; ++r) {
      for (int64_t j = o.first; j < o.second; ++j) mid_p[r * h + j] += xp[r * h + j];
    }
    const auto g = share(f, width[2], t, n_threads);
    prefetch_rows(fc1_op.w, h, h, g.first, g.second);
#pragma omp barrier
    rms_norm_rows(mid_p, norm2.data_ptr<float>(), eps2, h, normed2_p, rows.first, rows.second);
#pragma omp barrier
    // A thread's gate rows and their up rows: the gated SiLU of its columns needs no barrier.
    skinny_share(fc1_op, g.first, g.second, block_rows[2]);
    skinny_share(fc1_op, f + g.first, f + g.second, block_rows[2]);
    for (int64_t r = 0; r < s; ++r) {
      silu_mul_span(up_p + r * f2 + g.first, up_p + r * f2 + f + g.first, act_p + r * f + g.first,
                    g.second - g.first);
    }
    const auto d = share(h, width[3], t, n_threads);
    prefetch_rows(fc2_op.w, f, f, d.first, d.second);
#pragma omp barrier
    skinny_share(fc2_op, d.first, d.second, block_rows[3]);
    for (int64_t r = 0; r < s; ++r) {
      for (int64_t j = d.first; j < d.second; ++j) out_p[r * h + j] += mid_p[r * h + j];
    }
  }
  return out;
}

}  // namespace specdec
