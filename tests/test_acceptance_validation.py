"""Bad inputs raise clear errors naming the argument, in the Python face and inside the ops."""
import pytest
import torch

import megatron_specdec._C  # noqa: F401
from megatron_specdec import acceptance

OPS = torch.ops.megatron_specdec
B, K, V = 3, 4, 10


def chain(**over):
    gen = torch.Generator().manual_seed(0)
    args = dict(
        draft_ids=torch.randint(0, V, (B, K), generator=gen),
        target_logits=torch.randn(B, K + 1, V, generator=gen),
        draft_lens=torch.tensor([4, 2, 0]),
        draft_probs=torch.rand(B, K, V, generator=gen).softmax(-1),
        uniforms=torch.rand(B, K + 1, generator=gen),
        temperature=1.0, top_k=0, top_p=1.0,
    )
    args.update(over)
    return args


def set_(tensor, index, value):
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


def stochastic_face(a):
    return acceptance.stochastic_chain_verify(a["draft_ids"], a["target_logits"], a["draft_lens"], a["draft_probs"],
                                              temperature=a["temperature"], top_k=a["top_k"], top_p=a["top_p"])


def stochastic_op(a):
    return OPS.stochastic_chain_verify(a["draft_ids"], a["target_logits"], a["draft_lens"], a["draft_probs"],
                                       a["uniforms"], a["temperature"], a["top_k"], a["top_p"])


def base():
    return chain()


CHAIN_CASES = {
    "logits rows": (dict(target_logits=torch.randn(B, K, V)), r"target_logits must have shape \[3, 5, V >= 1\]"),
    "probs shape": (dict(draft_probs=torch.rand(B, K, V + 1)), r"draft_probs must have shape \[3, 4, 10\]"),
    "id too big": (dict(draft_ids=set_(base()["draft_ids"], (0, 1), V)), r"draft_ids\[0, 1\] must be in \[0, 10\)"),
    "id negative": (dict(draft_ids=set_(base()["draft_ids"], (1, 0), -3)), r"draft_ids\[1, 0\] must be in \[0, 10\)"),
    "len negative": (dict(draft_lens=torch.tensor([4, -1, 0])), r"draft_lens\[1\] must be in \[0, 4\], found -1"),
    "len above K": (dict(draft_lens=torch.tensor([5, 1, 0])), r"draft_lens\[0\] must be in \[0, 4\], found 5"),
    "lens shape": (dict(draft_lens=torch.tensor([4, 1])), r"draft_lens must have shape \[3\]"),
    "K too big": (dict(draft_ids=torch.zeros(B, 65, dtype=torch.long), draft_lens=torch.zeros(B, dtype=torch.long)),
                  r"draft_ids.*must be <= 64, found 65"),
    "ids dtype": (dict(draft_ids=base()["draft_ids"].int()), r"draft_ids must (be|have dtype).*int64"),
    "lens dtype": (dict(draft_lens=torch.tensor([4, 2, 0], dtype=torch.int32)), r"draft_lens must (be|have dtype)"),
    "logits dtype": (dict(target_logits=torch.zeros(B, K + 1, V, dtype=torch.long)), r"target_logits must"),
    "probs dtype": (dict(draft_probs=torch.zeros(B, K, V, dtype=torch.long)), r"draft_probs must"),
    "probs device": (dict(draft_probs=torch.rand(B, K, V, device="meta")), r"draft_probs must be on cpu"),
    "logits device": (dict(target_logits=torch.rand(B, K + 1, V, device="meta")), r"target_logits must be on cpu"),
    "NaN logit": (dict(target_logits=set_(base()["target_logits"], (0, 0, 3), float("nan"))),
                  r"target_logits must be finite or -inf.*NaN"),
    "-inf row": (dict(target_logits=set_(base()["target_logits"], (0, 0), float("-inf"))),
                 r"target_logits row is entirely -inf"),
    "NaN prob": (dict(draft_probs=set_(base()["draft_probs"], (0, 0), float("nan"))),
                 r"draft_probs must be finite and >= 0"),
    "negative prob": (dict(draft_probs=set_(base()["draft_probs"], (0, 0), -0.1)),
                      r"draft_probs must be finite and >= 0"),
    "temperature 0": (dict(temperature=0.0), r"temperature must be finite and > 0"),
    "top_p 0": (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    "top_k negative": (dict(top_k=-2), r"top_k must be"),
}


# With a meta (or CUDA) tensor among the inputs the dispatcher picks that device's kernel,
# so device mismatches reach the CPU op only through the face (the CUDA op checks its own).
@pytest.mark.parametrize("case,path", [(c, p) for c in sorted(CHAIN_CASES) for p in ("face", "op")
                                       if not (p == "op" and "device" in c)])
def test_stochastic_chain_rejects(case, path):
    over, message = CHAIN_CASES[case]
    args = chain(**over)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        (stochastic_face if path == "face" else stochastic_op)(args)


@pytest.mark.parametrize("uniforms,message", [
    (torch.rand(B, K + 1, dtype=torch.float64), r"uniforms must be float32"),
    (torch.ones(B, K + 1), r"uniforms must lie in \[0, 1\)"),
    (torch.rand(B, K), r"uniforms must have shape \[3, 5\]"),
])
def test_op_rejects_bad_uniforms(uniforms, message):
    with pytest.raises(RuntimeError, match=message):
        stochastic_op(chain(uniforms=uniforms))


def test_padding_beyond_lengths_is_ignored():
    a = chain(draft_ids=set_(set_(base()["draft_ids"], (1, 3), -1), (2, 0), V + 5))
    assert stochastic_op(a)[0].shape == (B, K + 1)
    assert stochastic_face(a)[0].shape == (B, K + 1)
    assert acceptance.greedy_chain_verify(a["draft_ids"], a["target_logits"], a["draft_lens"])[1].shape == (B,)


@pytest.mark.parametrize("path", ["face", "op"])
def test_greedy_and_typical_reject(path):
    a = chain()
    bad_ids = set_(a["draft_ids"], (0, 0), V)
    nan = set_(a["target_logits"], (1, 0, 0), float("nan"))
    if path == "face":
        greedy = lambda d, x, l: acceptance.greedy_chain_verify(d, x, l)  # noqa: E731
        typical = lambda d, x, l, t=1.0: acceptance.typical_verify(d, x, l, temperature=t)  # noqa: E731
    else:
        greedy = OPS.greedy_chain_verify
        typical = lambda d, x, l, t=1.0: OPS.typical_verify(d, x, l, t, 0.09, 0.3)  # noqa: E731
    errors = (ValueError, TypeError, RuntimeError)
    with pytest.raises(errors, match=r"draft_ids\[0, 0\] must be in \[0, 10\)"):
        greedy(bad_ids, a["target_logits"], a["draft_lens"])
    with pytest.raises(errors, match=r"NaN"):
        greedy(a["draft_ids"], nan, a["draft_lens"])
    with pytest.raises(errors, match=r"draft_lens\[2\] must be in \[0, 4\]"):
        typical(a["draft_ids"], a["target_logits"], torch.tensor([1, 1, 7]))
    with pytest.raises(errors, match=r"NaN"):
        typical(a["draft_ids"], nan, a["draft_lens"])
    with pytest.raises(errors, match=r"temperature must be finite and > 0"):
        typical(a["draft_ids"], a["target_logits"], a["draft_lens"], 0.0)
    with pytest.raises(errors, match=r"target_ids must"):
        target = torch.zeros(B, K, dtype=torch.long)
        (acceptance.greedy_chain_verify if path == "face" else OPS.greedy_chain_verify_ids)(
            a["draft_ids"], target, a["draft_lens"])


def tree(**over):
    args = dict(
        tree_ids=torch.tensor([[1, 2, 3, 4]] * 2),
        parents=torch.tensor([[-1, 0, 0, 1]] * 2),
        target_logits=torch.randn(2, 5, V, generator=torch.Generator().manual_seed(1)),
        num_nodes=torch.tensor([4, 3]),
    )
    args.update(over)
    return args


TREE_CASES = {
    "parent after child": (dict(parents=torch.tensor([[-1, 0, 3, 1]] * 2)), r"parents\[0, 2\] must be in \[-1, 2\)"),
    "parent below -1": (dict(parents=torch.tensor([[-2, 0, 0, 1]] * 2)), r"parents\[0, 0\] must be in \[-1, 0\)"),
    "tree id": (dict(tree_ids=torch.tensor([[1, 2, 3, 4], [1, 2, 99, 4]])), r"tree_ids\[1, 2\] must be in \[0, 10\)"),
    "num_nodes": (dict(num_nodes=torch.tensor([5, 3])), r"num_nodes\[0\] must be in \[0, 4\]"),
    "logit rows": (dict(target_logits=torch.randn(2, 4, V)), r"target_logits must have shape \[2, 5, V >= 1\]"),
    "parents shape": (dict(parents=torch.tensor([[-1, 0, 0]] * 2)), r"parents must have shape"),
    "too many nodes": (dict(tree_ids=torch.zeros(2, 257, dtype=torch.long), parents=torch.full((2, 257), -1),
                            target_logits=torch.randn(2, 258, V), num_nodes=torch.tensor([1, 1])),
                       r"must be <= 256, found 257"),
}


@pytest.mark.parametrize("case", sorted(TREE_CASES))
@pytest.mark.parametrize("path", ["face", "greedy_op", "stochastic_op"])
def test_tree_rejects(case, path):
    over, message = TREE_CASES[case]
    a = tree(**over)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        if path == "face":
            acceptance.tree_verify(a["tree_ids"], a["parents"], a["target_logits"], a["num_nodes"], temperature=1.0)
        elif path == "greedy_op":
            OPS.tree_verify_greedy(a["tree_ids"], a["parents"], a["target_logits"], a["num_nodes"], 3)
        else:
            u = torch.rand(a["tree_ids"].shape[0], a["tree_ids"].shape[1] + 1)
            OPS.tree_verify_stochastic(a["tree_ids"], a["parents"], a["target_logits"], a["num_nodes"], None, u, 3,
                                       1.0, 0, 1.0)


def test_tree_max_depth_checked():
    a = tree()
    with pytest.raises(ValueError, match=r"depth 3 > max_depth 2"):
        acceptance.tree_verify(a["tree_ids"], a["parents"], a["target_logits"], a["num_nodes"], max_depth=2)
    with pytest.raises(RuntimeError, match=r"has depth 3 > max_depth 2"):
        OPS.tree_verify_greedy(a["tree_ids"], a["parents"], a["target_logits"], a["num_nodes"], 2)
    with pytest.raises(ValueError, match=r"takes no draft_probs, top_k or top_p"):
        acceptance.tree_verify(a["tree_ids"], a["parents"], a["target_logits"], top_k=3)
