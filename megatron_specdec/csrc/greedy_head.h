// The greedy output head: the index of the largest logit of each row of x @ weight.T, bitwise
// what the skinny GEMM's float32 logits and an argmax give, from an int8 copy of the weight and
// a few float32 rows.
//
// The int8 copy screens: each row of x is rounded to 16-bit integers, the integer products are
// summed exactly, and with bound[0][n] ||x|| + bound[1][n] ||x - x16|| >= |logit32[n] - z[n]|
// (the copy's and x's rounding and the float32 sums, models/layers/greedy_head.py), every row n
// whose screened logit plus its bound falls below the best screened logit minus its bound is
// below the float32 maximum, and the others (a handful) are computed again in float32 with the
// skinny GEMM's per-element arithmetic. A greedy decoding step then streams a quarter of the
// output layer's bytes, which are a fifth of a small model's.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace specdec {

// x [m, K] float32, screen [N, K] int8 (weight row n ~ scale[n] screen[n]), scale [N] float32,
// weight [N, K] float32 (rows contiguous), bound [2, N] float32 -> (ids [m] int64, logits [m]
// float32, z): per row of x the first index of the largest float32 logit and that logit. A row of
// x that cannot be screened (a value not finite, all zeros) is computed in float32 throughout (a
// NaN logit wins, as in torch.argmax). With `screened`, z [m, N] holds every screened logit
// (within bound[0][n] ||x|| + bound[1][n] ||x - x16|| of the float32 one; zero for a row of x
// that cannot be screened), which a log-sum-exp turns into the softmax's normaliser; else z is
// empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor> greedy_head_cpu(const at::Tensor& x, const at::Tensor& screen,
                                                               const at::Tensor& scale, const at::Tensor& weight,
                                                               const at::Tensor& bound, bool screened);

}  // namespace specdec
