// Registers the acceptance ops, the decoding skinny GEMM, the greedy output head and the decoding layer's ops as torch.ops.megatron_specdec.*
// with their CPU kernels.
// The CUDA kernels register themselves in ops_cuda.cpp (CUDA builds only).
#include <Python.h>
#include <torch/library.h>

#include "decode_ops.h"
#include "greedy_head.h"
#include "ops.h"
#include "skinny_gemm.h"

// Importing megatron_specdec._C loads the library, which runs the registrations below.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "Fused speculative-decoding acceptance ops.", -1,
                               nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(megatron_specdec, m) {
  m.def("greedy_chain_verify(Tensor draft_ids, Tensor target_logits, Tensor draft_lens) -> (Tensor, Tensor)");
  m.def("greedy_chain_verify_ids(Tensor draft_ids, Tensor target_ids, Tensor draft_lens) -> (Tensor, Tensor)");
  m.def(
      "stochastic_chain_verify(Tensor draft_ids, Tensor target_logits, Tensor draft_lens, Tensor? draft_probs, "
      "Tensor uniforms, float temperature, int top_k, float top_p) -> (Tensor, Tensor)");
  m.def(
      "tree_verify_greedy(Tensor tree_ids, Tensor parents, Tensor target_logits, Tensor num_nodes, int max_depth) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "tree_verify_stochastic(Tensor tree_ids, Tensor parents, Tensor target_logits, Tensor num_nodes, "
      "Tensor? draft_probs, Tensor uniforms, int max_depth, float temperature, int top_k, float top_p) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "typical_verify(Tensor draft_ids, Tensor target_logits, Tensor draft_lens, float temperature, float eps, "
      "float alpha) -> (Tensor, Tensor)");
  m.def("skinny_linear(Tensor x, Tensor weight, int schedule=0) -> Tensor");
  m.def("skinny_linear_isa() -> str", &specdec::skinny_linear_isa);
  m.def("skinny_pack(Tensor weight) -> Tensor");
  // Outputs of a packed panel (schedule 3); 0 where this process's path has none.
  m.def("skinny_panel_width() -> int",
        [] { return specdec::skinny_panel_available() ? specdec::kSkinnyPanelWidth : int64_t{0}; });
  m.def(
      "greedy_head(Tensor x, Tensor screen, Tensor scale, Tensor weight, Tensor bound, bool screened=False) -> "
      "(Tensor, Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def(
      "chain_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, int first, "
      "int heads, float scale) -> Tensor");
  m.def(
      "decode_layers(Tensor hidden, Tensor?[] weights, float[] eps, Tensor cos, Tensor sin, Tensor(a!)[] keys, "
      "Tensor(b!)[] values, int first, int[] heads, float[] scale, int[] schedules, int[] capture, Tensor? embeds=None) "
      "-> Tensor[]");
}

TORCH_LIBRARY_IMPL(megatron_specdec, CPU, m) {
  m.impl("greedy_chain_verify", &specdec::greedy_chain_verify_cpu);
  m.impl("greedy_chain_verify_ids", &specdec::greedy_chain_verify_ids_cpu);
  m.impl("stochastic_chain_verify", &specdec::stochastic_chain_verify_cpu);
  m.impl("tree_verify_greedy", &specdec::tree_verify_greedy_cpu);
  m.impl("tree_verify_stochastic", &specdec::tree_verify_stochastic_cpu);
  m.impl("typical_verify", &specdec::typical_verify_cpu);
  m.impl("skinny_linear", &specdec::skinny_linear_cpu);
  m.impl("skinny_pack", &specdec::skinny_pack_cpu);
  m.impl("greedy_head", &specdec::greedy_head_cpu);
  m.impl("rms_norm", &specdec::rms_norm_cpu);
  m.impl("silu_mul", &specdec::silu_mul_cpu);
  m.impl("chain_attention", &specdec::chain_attention_cpu);
  m.impl("decode_layers", &specdec::decode_layers_cpu);
}
