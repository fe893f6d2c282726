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

// x [..., K] float32 (any strides), weight [N, K] float32, float16 or bfloat16 -> [..., N]
// float32 (contiguous). A 16-bit weight is widened exactly as it is read and multiplied in
// float32: half the bytes streamed, the result bitwise that of its float32 copy.
// block_rows: the weight rows streamed together, 0 for the ISA's block (3 or 4 rows) or 1; the
// result is bitwise the same either way, only the speed differs.
at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight, int64_t block_rows = 0);

// The instruction-set path skinny_linear_cpu takes on this CPU: "avx512", "avx2" or "scalar".
std::string skinny_linear_isa();

// How a product's weights are stored: float32, or 16 bits widened exactly as they are read.
enum class WeightKind { kFloat32, kFloat16, kBFloat16 };

// The kind of a float32, float16 or bfloat16 weight tensor (any other dtype is refused, naming
// `what`).
WeightKind weight_kind(const at::Tensor& weight, const char* what);

// A product's raw operands: y[r, n] = x[r, :] . w[n, :] for r < rows, over k in-features.
struct SkinnyOperands {
  const float* x;
  int64_t ldx;
  int64_t rows;
  const void* w;
  int64_t ldw;
  int64_t k;
  float* y;
  int64_t ldy;
  WeightKind kind = WeightKind::kFloat32;
};

// The weight rows one block streams at `block_rows` (0 or 1, as skinny_linear_cpu takes it).
int64_t skinny_block_width(int64_t block_rows);

// Output features [begin, end) of the product on the calling thread: one thread's share of a
// product that a caller splits over its own threads, each element bitwise skinny_linear_cpu's.
void skinny_share(const SkinnyOperands& operands, int64_t begin, int64_t end, int64_t block_rows);

}  // namespace specdec
