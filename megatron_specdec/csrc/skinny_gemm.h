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
// How a product streams its weights. Every schedule computes the same bits; which is fastest
// depends on the CPU, so each machine measures (models/layers/linear_kernels.py).
enum SkinnySchedule : int64_t {
  // The ISA's block of weight rows (3 or 4); each pass over x prefetches its share of the next
  // block's lines spread evenly over the pass.
  kSkinnyBlockSpread = 0,
  // One weight row a block, read ahead into L1: a single stream.
  kSkinnyRow = 1,
  // The ISA's block; each pass prefetches its share of the next block's columns, one line a
  // row at each line start, over part of the pass.
  kSkinnyBlockBurst = 2,
  // Weights repacked as panels (skinny_pack): the lanes are kSkinnyPanelWidth outputs, x is
  // broadcast a column at a time, and the columns are grouped by k mod 16 in the order the
  // block's horizontal sum pairs its lanes, so every output is bitwise the other schedules'.
  // One pass over a panel serves up to 8 rows of x. AVX-512 path only.
  kSkinnyPanel = 3,
};

// Outputs of one panel (kSkinnyPanel): a product's out-features must be a multiple.
constexpr int64_t kSkinnyPanelWidth = 48;

// Whether kSkinnyPanel runs here (the AVX-512 path).
bool skinny_panel_available();

// weight [N, K] (float32, float16 or bfloat16; N a multiple of kSkinnyPanelWidth, K of 16)
// repacked as kSkinnyPanel reads it: [N / width][16 column groups][K / 16][width], returned as
// an [N, K] tensor of the same dtype.
at::Tensor skinny_pack_cpu(const at::Tensor& weight);

// Refuses a schedule that is none of the above (or kSkinnyPanel off the AVX-512 path), naming
// `what`.
void check_skinny_schedule(int64_t schedule, const char* what);

at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight, int64_t schedule = kSkinnyBlockSpread);

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

// The weight rows one block streams under `schedule`.
int64_t skinny_block_width(int64_t schedule);

// Output features [begin, end) of the product on the calling thread: one thread's share of a
// product that a caller splits over its own threads, each element bitwise skinny_linear_cpu's.
// kSkinnyPanel: w is skinny_pack's, begin and end multiples of its width.
void skinny_share(const SkinnyOperands& operands, int64_t begin, int64_t end, int64_t schedule);

}  // namespace specdec
