// Decoding layer ops (see decode_ops.h).
//
// Reductions (a row's sum of squares, a query-key dot product) keep kLanes partial sums, lane
// i taking elements i mod kLanes, then add the lanes in a fixed order: the result depends on
// the data alone, and the compiler can vectorise the lanes without reassociating. Each row
// (and each query-head pair of the attention) is computed start to end by one thread.
#include "decode_ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace specdec {
namespace {

constexpr int kLanes = 8;

// Parallel work is split into chunks of at least this many multiply-adds: a region's thread
// wake-up costs more than a small chunk's arithmetic.
constexpr int64_t kGrainFlops = int64_t{1} << 15;

inline float lane_sum(const float (&acc)[kLanes]) {
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

__attribute__((target_clones("arch=x86-64-v3", "default"))) float dot(const float* a, const float* b,
                                                                        int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  }
  for (int j = 0; i + j < n; ++j) acc[j] += a[i + j] * b[i + j];
  return lane_sum(acc);
}

__attribute__((target_clones("arch=x86-64-v3", "default"))) void axpy(float alpha, const float* x, float* y,
                                                                        int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// out[j] = t[j] cos[j] + rotate_half(t)[j] sin[j] for j < r, t[j] beyond (megatron's unfused
// RoPE, rope_utils._apply_rotary_pos_emb_bshd).
void rotate(const float* t, const float* cos, const float* sin, int64_t r, int64_t d, float* out) {
  const int64_t half = r / 2;
  for (int64_t j = 0; j < half; ++j) out[j] = t[j] * cos[j] + (-t[j + half]) * sin[j];
  for (int64_t j = half; j < r; ++j) out[j] = t[j] * cos[j] + t[j - half] * sin[j];
  for (int64_t j = r; j < d; ++j) out[j] = t[j];
}

at::Tensor rows_of(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dim");
  return x.reshape({-1, x.size(-1)}).contiguous();
}

}  // namespace

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t h = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h && weight.scalar_type() == at::kFloat,
              "rms_norm: weight must be float32 [", h, "], got ", weight.scalar_type(), " ", weight.sizes());
  const at::Tensor rows = rows_of(x, "rms_norm");
  const at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty_like(rows);
  const float* in = rows.data_ptr<float>();
  const float* g = w.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, rows.size(0), std::max<int64_t>(1, kGrainFlops / std::max<int64_t>(1, h)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t r = begin; r < end; ++r) {
                       const float* row = in + r * h;
                       const float inv = 1.0f / std::sqrt(dot(row, row, h) / static_cast<float>(h) + epsilon);
                       for (int64_t j = 0; j < h; ++j) out[r * h + j] = (row[j] * inv) * g[j];
                     }
                   });
  return y.view(x.sizes());
}

at::Tensor silu_mul_cpu(const at::Tensor& x) {
  const int64_t two_f = x.size(-1);
  TORCH_CHECK(two_f % 2 == 0, "silu_mul: the last dim of x must be even (gate, up), got ", two_f);
  const int64_t f = two_f / 2;
  const at::Tensor rows = rows_of(x, "silu_mul");
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = f;
  at::Tensor y = at::empty({rows.size(0), f}, rows.options());
  const float* in = rows.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, rows.size(0), std::max<int64_t>(1, kGrainFlops / std::max<int64_t>(1, 8 * f)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t r = begin; r < end; ++r) {
                       const float* gate = in + r * two_f;
                       const float* up = gate + f;
                       for (int64_t j = 0; j < f; ++j) {
                         out[r * f + j] = (gate[j] / (1.0f + std::exp(-gate[j]))) * up[j];
                       }
                     }
                   });
  return y.view(sizes);
}

at::Tensor chain_attention_cpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& keys, const at::Tensor& values, int64_t first,
                               int64_t heads, double scale) {
  TORCH_CHECK(keys.dim() == 4 && keys.size(1) == 1 && keys.sizes() == values.sizes(),
              "chain_attention: keys and values must be one sequence's cache [L, 1, groups, D], got ",
              keys.sizes(), " and ", values.sizes());
  const int64_t groups = keys.size(2), d = keys.size(3), slots = keys.size(0);
  for (const at::Tensor* t : {&qkv, &cos, &sin, &keys, &values}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, "chain_attention: tensors must be float32, got ",
                t->scalar_type());
  }
  TORCH_CHECK(keys.stride(3) == 1 && keys.stride(2) == d && values.stride(3) == 1 && values.stride(2) == d,
              "chain_attention: each cache slot's [groups, D] must be contiguous");
  TORCH_CHECK(heads > 0 && heads % groups == 0, "chain_attention: heads (", heads,
              ") must be a multiple of the cache's groups (", groups, ")");
  const int64_t per_group = heads / groups, width = (per_group + 2) * d;
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(1) == 1 && qkv.size(2) == groups * width,
              "chain_attention: qkv must be [s, 1, ", groups * width, "], got ", qkv.sizes());
  const int64_t s = qkv.size(0);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == s && cos.sizes() == sin.sizes() && cos.size(1) <= d &&
                  cos.size(1) % 2 == 0,
              "chain_attention: cos and sin must be [", s, ", R] with R even and <= ", d, ", got ", cos.sizes(),
              " and ", sin.sizes());
  TORCH_CHECK(first >= 0 && first + s <= slots, "chain_attention: slots ", first, "..", first + s - 1,
              " do not fit a cache of ", slots);
  const int64_t r = cos.size(1);
  const at::Tensor in = qkv.contiguous(), c = cos.contiguous(), sn = sin.contiguous();
  const float* q_in = in.data_ptr<float>();
  const float* cs = c.data_ptr<float>();
  const float* ss = sn.data_ptr<float>();
  float* key_cache = keys.data_ptr<float>();
  float* value_cache = values.data_ptr<float>();
  const int64_t key_stride = keys.stride(0), value_stride = values.stride(0);

  // The new tokens' keys (rotated) and values into their slots.
  for (int64_t i = 0; i < s; ++i) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* group = q_in + (i * groups + g) * width;
      rotate(group + per_group * d, cs + i * r, ss + i * r, r, d, key_cache + (first + i) * key_stride + g * d);
      std::copy(group + (per_group + 1) * d, group + (per_group + 2) * d,
                value_cache + (first + i) * value_stride + g * d);
    }
  }
  at::Tensor y = at::empty({s, 1, heads * d}, qkv.options());
  float* out = y.data_ptr<float>();
  const float softmax_scale = static_cast<float>(scale);
  const int64_t tasks = s * heads;
  const int64_t per_task = 2 * (first + s) * d;
  at::parallel_for(0, tasks, std::max<int64_t>(1, kGrainFlops / std::max<int64_t>(1, per_task)),
                   [&](int64_t begin, int64_t end) {
                     std::vector<float> query(d), scores(first + s);
                     for (int64_t task = begin; task < end; ++task) {
                       const int64_t i = task / heads, h = task % heads;
                       const int64_t g = h / per_group, p = h % per_group;
                       const int64_t seen = first + i + 1;
                       rotate(q_in + (i * groups + g) * width + p * d, cs + i * r, ss + i * r, r, d, query.data());
                       float top = -INFINITY;
                       for (int64_t t = 0; t < seen; ++t) {
                         scores[t] = dot(query.data(), key_cache + t * key_stride + g * d, d) * softmax_scale;
                         top = std::max(top, scores[t]);
                       }
                       float total = 0.0f;
                       for (int64_t t = 0; t < seen; ++t) {
                         scores[t] = std::exp(scores[t] - top);
                         total += scores[t];
                       }
                       float* o = out + i * heads * d + h * d;
                       std::fill(o, o + d, 0.0f);
                       for (int64_t t = 0; t < seen; ++t) {
                         axpy(scores[t], value_cache + t * value_stride + g * d, o, d);
                       }
                       const float inv = 1.0f / total;
                       for (int64_t j = 0; j < d; ++j) o[j] *= inv;
                     }
                   });
  return y;
}

}  // namespace specdec
