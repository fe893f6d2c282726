// The greedy output head (see greedy_head.h).
#include "greedy_head.h"

#include "skinny_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace specdec {
namespace {

// Row r's float32 logit of output feature n, bitwise the skinny GEMM's at any row count.
float exact_logit(const at::Tensor& x, const at::Tensor& weight, int64_t r, int64_t n) {
  float out = 0.f;
  const SkinnyOperands o{x.data_ptr<float>() + r * x.stride(0), x.stride(0), 1,
                         weight.data_ptr<float>() + n * weight.stride(0), weight.stride(0), x.size(1), &out, 1};
  skinny_share(o, 0, 1, 1);
  return out;
}

// The screen of one row: z [N] screened logits, b [N] bounds, s = ||x||. lowest() is the largest
// z[n] - b[n] s, or NaN when some z[n] is not finite; keep() appends each n with
// z[n] + b[n] s >= low. Vectorised where the skinny GEMM is (the scan of a 49152-word vocabulary
// in eager ATen ops cost ~0.15 ms a row, a tenth of the screened product).
struct Screen {
  const float* z;
  const float* b;
  float s;
  int64_t n;

  float lowest_scalar() const {
    float low = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isfinite(z[i])) return std::numeric_limits<float>::quiet_NaN();
      low = std::max(low, z[i] - b[i] * s);
    }
    return low;
  }
  void keep_scalar(float low, std::vector<int64_t>& out) const {
    for (int64_t i = 0; i < n; ++i) {
      if (z[i] + b[i] * s >= low) out.push_back(i);
    }
  }

#if defined(__x86_64__) && defined(__GNUC__)
  __attribute__((target("avx512f"))) float lowest_avx512() const {
    const __m512 sv = _mm512_set1_ps(s);
    __m512 low = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 bad = _mm512_setzero_ps();  // z * 0 is NaN exactly where z is not finite
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 zv = _mm512_loadu_ps(z + i);
      bad = _mm512_add_ps(bad, _mm512_mul_ps(zv, _mm512_setzero_ps()));
      low = _mm512_max_ps(low, _mm512_fnmadd_ps(_mm512_loadu_ps(b + i), sv, zv));
    }
    float out = _mm512_reduce_max_ps(low);
    if (std::isnan(_mm512_reduce_add_ps(bad))) return std::numeric_limits<float>::quiet_NaN();
    for (; i < n; ++i) {
      if (!std::isfinite(z[i])) return std::numeric_limits<float>::quiet_NaN();
      out = std::max(out, z[i] - b[i] * s);
    }
    return out;
  }
  __attribute__((target("avx512f"))) void keep_avx512(float low, std::vector<int64_t>& out) const {
    const __m512 sv = _mm512_set1_ps(s);
    const __m512 lv = _mm512_set1_ps(low);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 high = _mm512_fmadd_ps(_mm512_loadu_ps(b + i), sv, _mm512_loadu_ps(z + i));
      for (uint32_t mask = _mm512_cmp_ps_mask(high, lv, _CMP_GE_OQ); mask; mask &= mask - 1) {
        out.push_back(i + __builtin_ctz(mask));
      }
    }
    for (; i < n; ++i) {
      if (std::fma(b[i], s, z[i]) >= low) out.push_back(i);
    }
  }

  __attribute__((target("avx2,fma"))) float lowest_avx2() const {
    const __m256 sv = _mm256_set1_ps(s);
    __m256 low = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 bad = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 zv = _mm256_loadu_ps(z + i);
      bad = _mm256_add_ps(bad, _mm256_mul_ps(zv, _mm256_setzero_ps()));
      low = _mm256_max_ps(low, _mm256_fnmadd_ps(_mm256_loadu_ps(b + i), sv, zv));
    }
    alignas(32) float lanes[8], flags[8];
    _mm256_store_ps(lanes, low);
    _mm256_store_ps(flags, bad);
    float out = -std::numeric_limits<float>::infinity();
    for (int l = 0; l < 8; ++l) {
      if (std::isnan(flags[l])) return std::numeric_limits<float>::quiet_NaN();
      out = std::max(out, lanes[l]);
    }
    for (; i < n; ++i) {
      if (!std::isfinite(z[i])) return std::numeric_limits<float>::quiet_NaN();
      out = std::max(out, z[i] - b[i] * s);
    }
    return out;
  }
  __attribute__((target("avx2,fma"))) void keep_avx2(float low, std::vector<int64_t>& out) const {
    const __m256 sv = _mm256_set1_ps(s);
    const __m256 lv = _mm256_set1_ps(low);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 high = _mm256_fmadd_ps(_mm256_loadu_ps(b + i), sv, _mm256_loadu_ps(z + i));
      for (uint32_t mask = _mm256_movemask_ps(_mm256_cmp_ps(high, lv, _CMP_GE_OQ)); mask; mask &= mask - 1) {
        out.push_back(i + __builtin_ctz(mask));
      }
    }
    for (; i < n; ++i) {
      if (std::fma(b[i], s, z[i]) >= low) out.push_back(i);
    }
  }
#endif

  // The ISA the skinny GEMM takes on this CPU.
  float lowest(const std::string& isa) const {
#if defined(__x86_64__) && defined(__GNUC__)
    if (isa == "avx512") return lowest_avx512();
    if (isa == "avx2") return lowest_avx2();
#endif
    return lowest_scalar();
  }
  void keep(const std::string& isa, float low, std::vector<int64_t>& out) const {
#if defined(__x86_64__) && defined(__GNUC__)
    if (isa == "avx512") return keep_avx512(low, out);
    if (isa == "avx2") return keep_avx2(low, out);
#endif
    keep_scalar(low, out);
  }
};

// torch.argmax's choice over the candidates (ascending): the first NaN, else the first maximum.
void pick(const at::Tensor& x, const at::Tensor& weight, int64_t r, const std::vector<int64_t>& candidates,
          int64_t* id, float* logit) {
  int64_t best = -1;
  float value = -std::numeric_limits<float>::infinity();
  for (const int64_t n : candidates) {
    const float v = exact_logit(x, weight, r, n);
    if (std::isnan(v)) {
      best = n;
      value = v;
      break;
    }
    if (best < 0 || v > value) {
      best = n;
      value = v;
    }
  }
  *id = best;
  *logit = value;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> greedy_head_cpu(const at::Tensor& x, const at::Tensor& screen,
                                                   const at::Tensor& weight, const at::Tensor& bound) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "greedy_head: x must be float32 [m, K], got ",
              x.scalar_type(), " of shape ", x.sizes());
  TORCH_CHECK(screen.dim() == 2 && screen.scalar_type() == at::kHalf && screen.size(1) == x.size(1),
              "greedy_head: screen must be float16 [N, ", x.size(1), "], got ", screen.scalar_type(), " of shape ",
              screen.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.sizes() == screen.sizes() && weight.stride(1) == 1,
              "greedy_head: weight must be float32 ", screen.sizes(), " with contiguous rows, got ",
              weight.scalar_type(), " of shape ", weight.sizes());
  TORCH_CHECK(bound.dim() == 1 && bound.scalar_type() == at::kFloat && bound.size(0) == screen.size(0) &&
                  bound.is_contiguous(),
              "greedy_head: bound must be contiguous float32 [", screen.size(0), "], got ", bound.scalar_type(),
              " of shape ", bound.sizes());
  TORCH_CHECK(screen.size(0) > 0, "greedy_head: the weight has no rows");
  const at::Tensor rows = x.contiguous();
  const int64_t m = rows.size(0), n = screen.size(0), k = rows.size(1);
  at::Tensor ids = at::empty({m}, x.options().dtype(at::kLong));
  at::Tensor logits = at::empty({m}, x.options());
  if (m == 0) return {ids, logits};
  const at::Tensor screened = skinny_linear_cpu(rows, screen, 0);  // [m, N]
  static const std::string isa = skinny_linear_isa();
  int64_t* id = ids.data_ptr<int64_t>();
  float* logit = logits.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> candidates;
    for (int64_t r = begin; r < end; ++r) {
      // ||x||, rounded up to float32 (its float64 sum is exact to far below the bound's slack).
      const float* xr = rows.data_ptr<float>() + r * k;
      double squares = 0.0;
      for (int64_t i = 0; i < k; ++i) squares += static_cast<double>(xr[i]) * xr[i];
      const double norm = std::sqrt(squares);
      float s = static_cast<float>(norm);
      if (s < norm) s = std::nextafter(s, std::numeric_limits<float>::infinity());
      const Screen row{screened.data_ptr<float>() + r * n, bound.data_ptr<float>(), s, n};
      candidates.clear();
      const float low = row.lowest(isa);
      if (std::isnan(low) || std::isinf(s)) {
        for (int64_t i = 0; i < n; ++i) candidates.push_back(i);
      } else {
        row.keep(isa, low, candidates);
      }
      pick(rows, weight, r, candidates, id + r, logit + r);
    }
  });
  return {ids, logits};
}

}  // namespace specdec
