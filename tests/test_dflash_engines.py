"""vLLM's own DFlash class (the CPU build in .venv-vllm) loads a DFlash export of a
SmolLM2-135M draft: every parameter loaded with the exported values (q/k/v and gate/up
stacked as vLLM stacks them), every exported tensor handed to it, the trained mask
embedding read from mask_embedding.pt, the block attention non-causal."""

import json
import subprocess
from pathlib import Path

import pytest

from megatron_specdec import distributed

pytestmark = pytest.mark.engines
CHECK = Path(__file__).resolve().parents[1] / "megatron_specdec/methods/dflash/vllm_load_check.py"


K, CONTEXT = 7, 10


def _export_worker(hf_dir, out_dir, parity_file):
    """Export a fresh SmolLM2 DFlash draft, and the project's block logits after CONTEXT
    random context states (pending token 42)."""
    import torch

    from megatron_specdec.loading.hf_conversion import model_from_hf, read_hf_config
    from megatron_specdec.methods.dflash import hf_weights
    from megatron_specdec.methods.dflash.layers import block_attention_mask
    from megatron_specdec.methods.dflash.model import draft_logits
    from megatron_specdec.models.speculative import convert

    distributed.initialize(1, 1)
    base = model_from_hf(hf_dir)[0]
    hf = read_hf_config(hf_dir)
    spec = convert(base, "dflash", {"num_layers": 1}, hf_config=hf)
    hf_weights.export_model(spec, hf, out_dir)
    draft = spec.draft
    aux = torch.randn(CONTEXT, 1, len(spec.aux_layer_ids) * hf.hidden_size,
                      generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        block = draft.block_inputs(base.embedding(input_ids=torch.tensor([[42]]),
                                                  position_ids=None), K + 1)
        rope = spec.rotary_pos_emb(CONTEXT + K + 1)
        mask = block_attention_mask(torch.tensor([[CONTEXT]]), K + 1, CONTEXT)
        hidden = draft(block, draft.context(aux), rope[CONTEXT:], rope[:CONTEXT], mask)
        logits = draft_logits(spec, hidden[1:])[:, 0, :hf.vocab_size]
    torch.save({"aux": aux[:, 0], "pending": 42, "k": K, "logits": logits}, parity_file)


@pytest.fixture(scope="module")
def exported(default_hf_dir, module_tmp):
    """One export (and its parity logits) that both tests read: the files are not changed."""
    root = module_tmp("dflash")
    draft, parity = root / "dflash", root / "parity.pt"
    distributed.spawn(_export_worker, 1, str(default_hf_dir), str(draft), str(parity))
    return draft, parity


def test_vllm_dflash_class_loads_every_tensor(default_hf_dir, exported, tmp_path):
    """... and its modules, composed as qwen3_dflash.py composes them, give the project's
    block logits (float32)."""
    from megatron_specdec.engines.vllm_client import vllm_python

    draft, parity = exported
    out = tmp_path / "check.json"
    proc = subprocess.run([str(vllm_python()), str(CHECK), str(default_hf_dir), str(draft),
                           str(out), str(parity)], capture_output=True, text=True, timeout=900,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["class"] == "DFlashQwen3ForCausalLM"
    assert r["unloaded"] == [] and r["mismatched"] == []
    assert r["handed"] == r["tensors"] and len(r["tensors"]) == 14
    assert r["shared_from_base"] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert r["separate_mask_embedding"] is True
    assert r["causal"] == [False]
    assert r["parity"]["same_argmax"], r["parity"]
    assert r["parity"]["max_abs_diff"] <= 1e-4 * max(1.0, r["parity"]["logit_scale"]), r["parity"]


def test_vllm_cpu_serves_dflash_losslessly(default_hf_dir, exported):
    """vLLM-CPU runs `method: "dflash"` end to end (V1 runner, non-causal CPU attention): the
    speculative output equals vLLM's greedy output and drafts are made (an untrained draft is
    accepted rarely: acceptance is the trained draft's figure, not this test's)."""
    from megatron_specdec.engines import verify_export
    from megatron_specdec.engines import vllm_client as vllm

    draft = exported[0]
    prompts = verify_export.chat_prompts(default_hf_dir)[:2]
    runs = vllm.generate(default_hf_dir, prompts, 24, {
        "greedy": None,
        "dflash": {"method": "dflash", "model": str(draft), "num_speculative_tokens": 7}})
    assert runs["dflash"].error is None, runs["dflash"].error
    assert runs["dflash"].outputs == runs["greedy"].outputs
    assert runs["dflash"].drafts > 0 and runs["dflash"].draft_tokens == 7 * runs["dflash"].drafts
