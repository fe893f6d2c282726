// The greedy output head: the index of the largest logit of each row of x @ weight.T, bitwise
// what the skinny GEMM's float32 logits and an argmax give, from a half-precision copy of the
// weight and a few float32 rows.
//
// The half-precision product screens: with bound[n] >= |logit32[n] - logit16[n]| / ||x|| (the
// copy's rounding and both products' float32 sums, models/layers/greedy_head.py), every row n
// whose screened logit plus its bound falls below the best screened logit minus its bound is
// below the float32 maximum, and the others (a handful) are computed again in float32 with the
// skinny GEMM's per-element arithmetic. A greedy decoding step then streams half of the output
// layer's bytes, which are a fifth of a small model's.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace specdec {

// x [m, K] float32, screen [N, K] float16, weight [N, K] float32 (rows contiguous), bound [N]
// float32 -> (ids [m] int64, logits [m] float32): per row of x the first index of the largest
// float32 logit and that logit. A row whose screened logits are not all finite is computed in
// float32 throughout (a NaN logit wins, as in torch.argmax).
std::tuple<at::Tensor, at::Tensor> greedy_head_cpu(const at::Tensor& x, const at::Tensor& screen,
                                                   const at::Tensor& weight, const at::Tensor& bound);

}  // namespace specdec
