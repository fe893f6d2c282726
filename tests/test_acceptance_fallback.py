"""Without the extension the Python face runs the reference, warns once, and gives the same tokens.

The fallback is forced the documented way: SPECDEC_DISABLE_EXT=1 in the environment
of a fresh interpreter (the switch is read when the package is imported).
"""
import json
import os
import subprocess
import sys
import warnings

import torch

from megatron_specdec import acceptance

SCRIPT = r"""
import json, warnings
import torch
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    from megatron_specdec import acceptance
    from tests.test_acceptance_fallback import run_all
    results = run_all(acceptance)
print(json.dumps(dict(
    available=acceptance.extension_available(),
    warnings=[str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    results=results,
)))
"""


def run_all(module):
    """Calls every public op twice on fixed inputs and seeds; returns the outputs as lists."""
    gen = torch.Generator().manual_seed(0)
    draft = torch.randint(0, 20, (6, 4), generator=gen)
    logits = torch.randn(6, 5, 20, generator=gen) * 2
    logits[:, :4].scatter_add_(2, draft[..., None], torch.full((6, 4, 1), 2.0))
    lens = torch.tensor([4, 3, 2, 1, 0, 4])
    draft[1, 3], draft[2, 2:] = -1, 99  # padding after a request's length is never read
    probs = torch.rand(6, 4, 20, generator=gen).softmax(-1)
    tree_ids = torch.randint(0, 20, (6, 5), generator=gen)
    parents = torch.tensor([[-1, -1, 0, 0, 2]] * 6)
    nodes = torch.tensor([5, 5, 4, 3, 0, 5])
    tree_ids[2, 4], parents[3, 3:] = -7, 42  # padding nodes, never read
    tree_logits = torch.randn(6, 6, 20, generator=gen)
    out = []
    for _ in range(2):
        calls = [
            module.greedy_chain_verify(draft, logits, lens),
            module.greedy_chain_verify(draft, logits.argmax(-1), lens),
            module.stochastic_chain_verify(draft, logits, lens, probs, generator=torch.Generator().manual_seed(1)),
            module.stochastic_chain_verify(draft, logits, lens, temperature=0.7, top_k=5,
                                           generator=torch.Generator().manual_seed(2)),
            module.tree_verify(tree_ids, parents, tree_logits, nodes),
            module.tree_verify(tree_ids, parents, tree_logits, nodes, temperature=1.0,
                               generator=torch.Generator().manual_seed(3)),
            module.typical_verify(draft, logits, lens, temperature=0.8),
        ]
        out.append([[t.tolist() for t in result] for result in calls])
    return out


def test_disabled_extension_falls_back_with_one_warning():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, SPECDEC_DISABLE_EXT="1", PYTHONPATH=repo)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["available"] is False
    assert len(report["warnings"]) == 1, report["warnings"]
    assert "fall back to the PyTorch reference" in report["warnings"][0]
    assert "SPECDEC_DISABLE_EXT=1" in report["warnings"][0]
    assert acceptance.extension_available()  # this process has the fused ops
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the fused path must not warn
        fused = json.loads(json.dumps(run_all(acceptance)))
    assert report["results"] == fused
