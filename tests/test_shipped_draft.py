"""The drafts shipped in models/ (EAGLE3 and the DFlash block draft): committed in files
under 16 MB with an index and a card, imported through their method's importer onto SmolLM2
at TP=2, each drafts tokens the base accepts and its greedy speculative output equals plain
greedy output."""

import json
from pathlib import Path

import pytest
import torch

from megatron_specdec import distributed, registry
from workers import is_writer

MODELS = Path(__file__).resolve().parents[1] / "models"
SHIPPED = {"eagle3": MODELS / "eagle3_smollm2", "dflash": MODELS / "dflash_smollm2"}
NEW = 48


@pytest.mark.parametrize("algo", sorted(SHIPPED))
def test_shipped_files_are_committable_and_described(algo):
    files = sorted(SHIPPED[algo].glob("*.safetensors"))
    assert files and all(f.stat().st_size < 16 * 10**6 for f in files)
    if len(files) > 1:
        index = json.loads((SHIPPED[algo] / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == {f.name for f in files}
    card = (SHIPPED[algo] / "README.md").read_text()
    for field in ("Data", "Recipe", "Command", "Steps", "Hardware", "Acceptance length"):
        assert field in card, field


def _worker(ckpt, prompt, out_file):
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.generation import plain_generate
    from megatron_specdec.loading.speculative import load_speculative

    distributed.initialize(2, 1)
    model, _, _ = load_speculative(ckpt)
    model.eval()
    greedy = plain_generate(model.base, [prompt], NEW, model.vocab_size)[0]
    result = SpeculativeGenerator(model, 7, policy="fixed").generate(prompt, NEW)
    if is_writer():
        torch.save({"greedy": greedy, "tokens": result.tokens, "accepted": result.accepted},
                   out_file)


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(SHIPPED))
def test_shipped_draft_imports_at_tp2_and_equals_greedy(algo, default_hf_dir, chat_prompt_ids,
                                                         tmp_path):
    from megatron_specdec.loading.hf_conversion import hf_to_megatron

    base, spec = tmp_path / "base", tmp_path / "spec"
    hf_to_megatron(default_hf_dir, base, tp=2)  # 3 query groups: TP=2 pads them to 4 at import
    cfg = registry.get(algo).import_hf(SHIPPED[algo], base, spec, tp=2)
    assert cfg.algo == algo
    if algo == "eagle3":  # shipped with its reduced draft vocabulary
        assert cfg.draft_vocab_size < 49152
    out = tmp_path / "out.pt"
    distributed.spawn(_worker, 2, str(spec), chat_prompt_ids, str(out))
    got = torch.load(out, weights_only=True)
    assert got["tokens"] == got["greedy"]
    # a live draft: a random or mis-imported one accepts almost nothing
    assert sum(got["accepted"]) / len(got["accepted"]) > 0.1, got["accepted"]
