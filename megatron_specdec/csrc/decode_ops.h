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

// The ops' pieces on the calling thread, for decode_layers_cpu's one parallel region (each piece
// with its op's arithmetic, so a share computes bitwise what the op computes there).

// Rows [begin, end) of rms_norm over h features: out = in / sqrt(mean(in^2) + eps) * weight.
void rms_norm_rows(const float* in, const float* weight, float eps, int64_t h, float* out, int64_t begin,
                   int64_t end);

// out[j] = silu(gate[j]) * up[j] for j < n (silu_mul's arithmetic at any offset).
void silu_mul_span(const float* gate, const float* up, float* out, int64_t n);

// chain_attention's operands, checked once (one line naming the tensor and what was expected):
// the s new tokens' keys and values go to slots first .. first + s - 1 (write_slot, one item per
// token and group), then each task attends: a token's heads of one group, per_chunk at a time
// (attend_task, into out [s, heads * D]). `threads`: how many will share the tasks (the split
// changes the speed only, never a result).
struct ChainAttention {
  ChainAttention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys,
                 const at::Tensor& values, int64_t first, int64_t heads, double scale, int threads);
  void write_slot(int64_t item) const;
  int64_t tasks() const { return s * groups * chunks; }
  // Tasks run token by token, group by group, chunk by chunk: the cache group task reads.
  int64_t group_of(int64_t task) const { return task / chunks % groups; }
  void attend_task(int64_t task, float* scratch, float* out) const;
  // Requests into L2 the cached keys and values (slots before this chain) that tasks [begin, end)
  // read, so that the attention does not wait on them one miss at a time.
  void prefetch_cache(int64_t begin, int64_t end) const;
  // Multiply-adds of one task (a parallel grain's unit) and the floats of its scratch.
  int64_t task_flops() const;
  int64_t scratch_size() const { return per_chunk * (d + first + s); }

  int64_t s = 0, groups = 0, per_group = 0, chunks = 1, per_chunk = 1, d = 0, r = 0, width = 0, first, heads;
  float scale;

 private:
  at::Tensor qkv_, cos_, sin_;
  float* key_cache = nullptr;
  float* value_cache = nullptr;
  int64_t key_stride = 0, value_stride = 0;
};

// A run of decoding layers over one sequence's chain of s tokens (decode_layer.cpp): per layer,
// rms_norm, the QKV product (+ bias), chain_attention, the output product + residual, rms_norm,
// fc1, silu_mul, fc2 + residual, as the ops above compute them. hidden [s, 1, H]; weights: 8 a
// layer (input_norm, qkv_weight, qkv_bias or None, proj_weight, mlp_norm, fc1_weight,
// fc2_weight, hidden_norm or None; a product's weight float32 or a 16-bit copy of float32
// values); eps: 3 a layer (input, MLP, hidden norm); keys/values, heads, scale: each layer's
// cache, attention heads and softmax scale; schedules: the skinny product's schedule
// (skinny_gemm.h) for each of a layer's 4 products; embeds [s, 1, H]: the first layer is an EAGLE3 first layer (with a
// hidden_norm), whose attention reads [input_norm(embeds), hidden_norm(hidden)]. Returns the
// outputs of the layers in `capture`, then the last layer's.
std::vector<at::Tensor> decode_layers_cpu(const at::Tensor& hidden, const c10::List<c10::optional<at::Tensor>>& weights,
                                          at::ArrayRef<double> eps, const at::Tensor& cos, const at::Tensor& sin,
                                          at::TensorList keys, at::TensorList values, int64_t first,
                                          at::IntArrayRef heads, at::ArrayRef<double> scale, at::IntArrayRef schedules,
                                          at::IntArrayRef capture, const c10::optional<at::Tensor>& embeds);

}  // namespace specdec
