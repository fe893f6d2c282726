// The element-wise and attention work of a decoding layer (models/layers/decode_layer.py) as one
// op each: around the weight products of a small model's decode step, PyTorch's eager ops
// (a dozen for RoPE, the cache write and attention, six for an RMSNorm) cost more than the
// arithmetic. Float32, row-invariant: a row's result does not depend on the other rows of the
// call, its position in the call or the thread count.
#pragma once

#include <ATen/ATen.h>

namespace specdec {

// torch.nn.functional.rms_norm over the last dim: x [..., H], weight [H] -> [..., H].
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);

// A gated SiLU: x [..., 2F] -> silu(x[..., :F]) * x[..., F:], [..., F].
at::Tensor silu_mul_cpu(const at::Tensor& x);

// One sequence's causal chain of s new tokens at cache slots first .. first + s - 1:
// qkv [s, 1, groups * (heads / groups + 2) * D] (megatron's interleaved QKV layout),
// cos/sin [s, R] (RoPE of the new tokens, rotate-half, R <= D even), keys/values
// [L, 1, groups, D]. Rotates the queries and keys, writes the keys and values at their slots
// and returns each query's attention over slots 0 .. its own, [s, 1, heads * D].
at::Tensor chain_attention_cpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& keys, const at::Tensor& values, int64_t first,
                               int64_t heads, double scale);

// A whole pre-norm decoder layer over a batch-1 causal chain (hidden [s, 1, H]): RMSNorm,
// QKV product (+ bias), chain_attention, output product + residual, RMSNorm, fc1 product, gated
// SiLU, fc2 product + residual. The same kernels in the same order as those ops called one by
// one, so bitwise their result, without a dispatch and a Python call per op. block_rows: the
// skinny GEMM's block width for the QKV, output, fc1 and fc2 products.
at::Tensor decode_layer_cpu(const at::Tensor& hidden, const at::Tensor& input_norm, double input_eps,
                            const at::Tensor& qkv_weight, const c10::optional<at::Tensor>& qkv_bias,
                            const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys,
                            const at::Tensor& values, int64_t first, int64_t heads, double scale,
                            const at::Tensor& proj_weight, const at::Tensor& mlp_norm, double mlp_eps,
                            const at::Tensor& fc1_weight, const at::Tensor& fc2_weight,
                            at::IntArrayRef block_rows);

}  // namespace specdec
