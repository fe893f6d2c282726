"""The draft-target pair as users serve it outside Megatron: a depth-pruned draft exported by
megatron_to_hf is an ordinary HF Llama that transformers' assisted generation
(`assistant_model=`) takes, and the pair's greedy output equals the target's plain greedy
output token for token."""

import subprocess
import sys

import torch

import train_support as ts


def test_transformers_assisted_generation_with_the_exported_draft(tmp_path):
    from transformers import AutoModelForCausalLM

    target_dir = ts.make_tiny_model(tmp_path / "target")
    data = ts.write_conversations(tmp_path / "conv.jsonl")
    pruned, draft_dir = tmp_path / "pruned", tmp_path / "draft_hf"
    for cmd in (["checkpoint_tools/prune_depth.py", "--model", target_dir, "--num-layers", "2",
                 "--data", data, "--num-tokens", "64", "--out", pruned],
                ["checkpoint_tools/megatron_to_hf.py", "--model", pruned, "--out", draft_dir]):
        subprocess.run([sys.executable, *map(str, cmd)], check=True, capture_output=True)
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    assert draft.config.num_hidden_layers == 2 and draft.config.vocab_size == target.config.vocab_size
    prompt = torch.tensor([[1, 504, 3120, 314, 253, 1435, 30, 2]])
    n = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)  # a random model may stop
    with torch.no_grad():
        plain = target.generate(prompt, **n)
        assisted = target.generate(prompt, assistant_model=draft, **n)
    assert plain.shape[1] == prompt.shape[1] + 24
    assert torch.equal(assisted, plain), (assisted, plain)
