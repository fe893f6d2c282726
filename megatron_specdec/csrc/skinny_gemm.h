// Skinny GEMM of decoding: y = x @ weight.T for a few rows of x (a decode step's 1 row, a
// verify forward's k+1), streaming each weight row from memory once for all rows.
//
// Row-invariant: every output element is one dot product whose reduction order depends only on
// the in-features K and the ISA path, never on how many rows share the call, the block width or
// which block a row falls in, so a row's result is bitwise the same alone or beside others.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace specdec {

// x [..., K] float32 (any strides), weight [N, K] float32 -> [..., N] float32 (contiguous).
// block_rows: the weight rows streamed together, 0 for the ISA's block (3 or 4 rows) or 1; the
// result is bitwise the same either way, only the speed differs.
at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight, int64_t block_rows = 0);

// The instruction-set path skinny_linear_cpu takes on this CPU: "avx512", "avx2" or "scalar".
std::string skinny_linear_isa();

}  // namespace specdec
