"""The decoding runtime's kernels and cache in one process (small seeded random Llama): the
weight-on-the-left product equals F.linear at every row count and returns a tensor a
tensor-parallel all-reduce can work on in place; the SDPA inference attention equals
megatron's DotProductAttention (grouped queries, arbitrary mask); a decode over the
rotated-key cache equals one full forward; a left-padded batch gives each row its batch-1
greedy output, and rows that finish leave a greedy batch without changing the others';
padding never puts NaN in the cache."""

import pytest
import torch
import torch.nn.functional as F

from megatron_specdec import distributed
from test_speculative_generation import HF, build


@pytest.fixture(scope="module")
def model():
    distributed.initialize(1, 1)
    return build("eagle3")


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 128, 300])
def test_small_rows_linear_equals_f_linear(rows):
    from megatron_specdec.layers.small_rows_linear import rows_linear, small_rows_linear

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1, 96, generator=g)[:, :, :64]  # a non-contiguous input
    w = torch.randn(80, 64, generator=g)
    for out in (small_rows_linear(x, w), rows_linear(x, w)):
        assert out.shape == (rows, 1, 80) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_sdpa_attention_equals_megatron_dot_product_attention(model):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_specdec.layers.decode_attention import SDPAttention, grouped_sdpa

    config = model.base.config
    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.arbitrary,
                attention_type="self")
    ours, theirs = SDPAttention(**args).eval(), DotProductAttention(**args).eval()
    g = torch.Generator().manual_seed(0)
    heads, groups, d = (config.num_attention_heads, config.num_query_groups,
                        config.kv_channels)
    q = torch.randn(5, 2, heads, d, generator=g)
    k, v = torch.randn(2, 12, 2, groups, d, generator=g)
    mask = torch.rand(2, 1, 5, 12, generator=g) > 0.6
    mask[..., 7:] = torch.eye(5, dtype=torch.bool).logical_not()  # every row sees itself
    with torch.no_grad():
        got = ours(q, k, v, mask, AttnMaskType.arbitrary)
        want = theirs(q, k, v, mask, AttnMaskType.arbitrary)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert heads > groups  # the grouped path below is exercised
    for fold in (False, True):  # fold: what a GPU takes (query heads as rows of their group)
        out = grouped_sdpa(q, k, v, ~mask, False, ours.softmax_scale, fold)
        torch.testing.assert_close(out.reshape(want.shape), want, rtol=1e-5, atol=1e-5)


def test_decode_over_the_cache_equals_a_full_forward(model):
    from megatron_specdec.generation import StageRunner

    tokens = torch.randint(0, HF["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(3))
    full = StageRunner(model.base, 1, 30, HF["vocab_size"]).step(tokens)
    runner = StageRunner(model.base, 1, 30, HF["vocab_size"])
    parts = [runner.step(tokens[:, :10]), runner.step(tokens[:, 10:11])]
    runner.rewind(1)  # a rejected draft: its slot is overwritten
    parts[-1] = runner.step(tokens[:, 10:11])
    parts.append(runner.step(tokens[:, 11:]))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-4)


def test_left_padded_batch_rows_equal_their_batch_1_output(model):
    from megatron_specdec.generation import StageRunner, plain_generate, left_pad

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, HF["vocab_size"], (n,), generator=g).tolist() for n in (3, 17, 9)]
    batch = plain_generate(model.base, prompts, 12, HF["vocab_size"])
    for prompt, row in zip(prompts, batch):
        assert row == plain_generate(model.base, [prompt], 12, HF["vocab_size"])[0]
    tokens, lengths = left_pad(prompts, 0)
    runner = StageRunner(model.base, len(prompts), tokens.shape[1], HF["vocab_size"])
    runner.step(tokens, counts=lengths)
    assert runner.lengths.tolist() == [3, 17, 9]  # padding takes no slot of its row
    for keys, values in runner.context.key_value_memory_dict.values():
        assert torch.isfinite(keys).all() and torch.isfinite(values).all()


def test_finished_rows_leave_a_greedy_batch_and_the_rest_keep_their_output(model, monkeypatch):
    from megatron_specdec.generation import StageRunner, plain_generate

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, HF["vocab_size"], (n,), generator=g).tolist()
               for n in (4, 11, 7, 15)]
    full = plain_generate(model.base, prompts, 12, HF["vocab_size"])
    eos = {full[0][2], full[1][5]}  # rows 0 and 1 stop early (others may too)
    expected = [next((row[:k] for k, t in enumerate(row) if t in eos), row) for row in full]
    kept = []
    keep_rows = StageRunner.keep_rows
    monkeypatch.setattr(StageRunner, "keep_rows",
                        lambda self, rows: (kept.append(rows.tolist()), keep_rows(self, rows)))
    assert plain_generate(model.base, prompts, 12, HF["vocab_size"], eos_ids=eos) == expected
    assert kept, "a quarter of the batch finished, yet no row left it"


def test_bad_generation_input_is_named(model):
    from megatron_specdec.decoding.generator import SpeculativeGenerator
    from megatron_specdec.generation import plain_generate

    with pytest.raises(ValueError, match="prompt 1 of the batch is empty"):
        plain_generate(model.base, [[1, 2], []], 4, HF["vocab_size"])
    with pytest.raises(ValueError, match="at least one prompt"):
        plain_generate(model.base, [], 4, HF["vocab_size"])
    with pytest.raises(ValueError, match="top_p"):
        plain_generate(model.base, [[1]], 4, HF["vocab_size"], temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeGenerator(model, 0)
    with pytest.raises(ValueError, match="draft policy 'eager'"):
        SpeculativeGenerator(model, 2, policy="eager")
    with pytest.raises(ValueError, match="drafter 'medusa' needs a model whose draft module is medusa"):
        SpeculativeGenerator(model, 2, drafter_kind="medusa")


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_grouped_attention_runs_on_a_fused_cuda_kernel(dtype):
    """A decode step's masked grouped attention on a GPU: the folded form runs on the
    memory-efficient kernel (the enable_gqa form would fall back to the math path, copying
    the cache) and equals the math path's result."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_specdec.layers.decode_attention import grouped_sdpa

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 64, 9, 64, device="cuda", dtype=dtype, generator=g)
    k, v = torch.randn(2, 300, 64, 3, 64, device="cuda", dtype=dtype, generator=g)
    lengths = torch.randint(100, 300, (64,), device="cuda", generator=g)
    mask = (torch.arange(300, device="cuda") < lengths[:, None])[:, None, None]  # may attend
    with sdpa_kernel(SDPBackend.MATH):
        want = grouped_sdpa(q, k, v, mask, False, 0.125, fold=False)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        got = grouped_sdpa(q, k, v, mask, False, 0.125, fold=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
