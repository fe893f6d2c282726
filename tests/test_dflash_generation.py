"""DFlash drafting on a small seeded random Llama: the proposer's block (one draft forward
over its cache) gives the logits the training forward gives at the same anchor; speculative
output over a ragged batch equals each row's plain greedy output (fixed blocks and
confidence-cut blocks, trees from the block's per-position top-k); sampling with drafts
drawn from the draft's own distribution, chains and trees, has plain sampling's
distribution (the chi-square of test_speculative_sampling)."""

import pytest
import torch

from megatron_specdec import distributed
from test_speculative_generation import HF, PROMPT
import test_speculative_sampling as spec_sampling
from test_speculative_sampling import SETTINGS, _samples, _same_distribution
from workers import is_writer

K = 4
DFLASH = {"block_size": K + 1, "target_layer_ids": [0, 1, 2], "num_layers": 1}
_g = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(0, HF["vocab_size"], (n,), generator=_g).tolist() for n in (20, 3, 13, 7)]


def build():
    """This rank's seeded random Llama with a fresh DFlash draft (the same at any layout)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_specdec.loading.hf_conversion import load_hf_into_model
    from megatron_specdec.models.provider import build_model
    from megatron_specdec.models.speculative import convert

    hf = LlamaConfig(**HF)
    torch.manual_seed(0)
    state = LlamaForCausalLM(hf).state_dict()
    base = build_model(hf)
    load_hf_into_model(base, hf, state)
    return convert(base, "dflash", dict(DFLASH), hf_config=hf).eval()


@pytest.fixture(scope="module")
def model():
    distributed.initialize(1, 1)
    model = build()
    with torch.no_grad():  # norms and the mask embedding away from their constant init
        g = torch.Generator().manual_seed(3)
        for p in model.draft.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def test_block_matches_training_forward(model):
    """Anchor a of a sequence: the training path (context = positions < a, blocks masked as
    in the loss) and the proposer (prefill of tokens < a, pending token a) agree."""
    from megatron_specdec.methods.dflash.layers import block_attention_mask
    from megatron_specdec.methods.dflash.model import draft_logits
    from megatron_specdec.methods.dflash.proposer import DFlashDrafter

    ids = torch.tensor([PROMPT])
    a = 12
    with torch.no_grad():
        state = model.run_base(ids)
        draft = model.draft
        context = draft.context(torch.cat(state.aux, dim=-1))
        anchors = torch.tensor([[a]])
        block = draft.block_inputs(state.embeds[a:a + 1], K + 1)
        rope = model.rotary_pos_emb(len(PROMPT) + K + 1)
        positions = torch.arange(a, a + K + 1)
        mask = block_attention_mask(anchors, K + 1, len(PROMPT))
        hidden = draft(block, context, rope[positions], rope[:len(PROMPT)], mask)
        want = draft_logits(model, hidden[1:])

        class Out:
            aux = torch.cat(state.aux, dim=-1)[:a]

        drafter = DFlashDrafter(model, model.base.embedding)
        drafter.start(ids[:, :a], torch.tensor([a]), ids[:, a:a + 1], Out, 64)
        got = drafter.block_logits(K)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert int(drafter.cache.lengths[0]) == a  # the block left no entries behind


def _drafter_at(model, a: int = 12):
    """A DFlashDrafter started after PROMPT's first `a` tokens (their base states as context,
    token a pending)."""
    from megatron_specdec.methods.dflash.proposer import DFlashDrafter

    ids = torch.tensor([PROMPT])
    state = model.run_base(ids)

    class Out:
        aux = torch.cat(state.aux, dim=-1)[:a]

    drafter = DFlashDrafter(model, model.base.embedding)
    drafter.start(ids[:, :a], torch.tensor([a]), ids[:, a:a + 1], Out, 64)
    return drafter


def test_greedy_block_reads_the_screened_head(model):
    """Without a confidence policy the proposer reads each block position's argmax through
    the screened greedy head: the drafts are the argmax of the block's logits, bitwise."""
    from megatron_specdec.acceptance.ops import op_available
    from megatron_specdec.methods.dflash.model import output_weight
    from megatron_specdec.models.layers.greedy_head import output_argmax

    with torch.no_grad():
        drafter = _drafter_at(model)
        logits = drafter.block_logits(K)
        drafts, counts = drafter.propose(K)
        hidden = drafter._block_hidden(K)
        head = output_argmax(hidden.reshape(K, -1), output_weight(model), model.vocab_size,
                             model.base.tp_group)
    assert drafts[0].tolist() == logits[:, 0].argmax(-1).tolist()
    assert counts.tolist() == [K]
    if op_available("greedy_head"):  # built extension: the head, not the logits, ran
        assert head is not None and head.tolist() == drafts[0].tolist()


def test_confident_block_reads_the_screened_head(model):
    """With a confidence policy the proposer reads each block position's argmax and its
    probability through the screened head (no float32 logits): the probabilities lie within
    the screen's error of the block logits' softmax maxima, and the block is cut where their
    running product falls below the threshold."""
    from megatron_specdec.acceptance.ops import op_available
    from megatron_specdec.inference.draft_policy import DraftPolicy
    from megatron_specdec.methods.dflash.model import output_weight
    from megatron_specdec.models.layers.greedy_head import output_argmax_confidence

    if not op_available("greedy_head"):
        pytest.skip("megatron_specdec._C is not built with greedy_head: the logits path runs")
    with torch.no_grad():
        drafter = _drafter_at(model)
        logits = drafter.block_logits(K)[:, 0].float()
        hidden = drafter._block_hidden(K)
        found = output_argmax_confidence(hidden.reshape(K, -1), output_weight(model),
                                         model.vocab_size, model.base.tp_group)
        assert found is not None
        top_ids, top = found
        exact = logits.log_softmax(-1).max(-1).values.double().exp()
        assert top_ids.tolist() == logits.argmax(-1).tolist()
        assert torch.allclose(top, exact, rtol=0.02), (top, exact)
        chain = top.cumprod(0)
        keep = 3  # a threshold between the third and the fourth running product
        policy = DraftPolicy(K, float(chain[keep - 1] + chain[keep]) / 2)
        drafts, counts = drafter.propose(K, policy)
    assert counts.tolist() == [keep]
    assert drafts[0, :keep].tolist() == top_ids[:keep].tolist()


def test_batch_greedy_identity(model):
    from megatron_specdec.inference.draft_policy import DraftPolicy
    from megatron_specdec.inference.generation import plain_generate
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.tree import TreeSpec

    new = 12
    greedy = [plain_generate(model.base, [p], new, HF["vocab_size"])[0] for p in PROMPTS]
    for policy in (DraftPolicy(K, None), DraftPolicy(K, 0.02)):
        results = SpeculativeGenerator(model, K, policy=policy).generate_batch(PROMPTS, new)
        assert [r.tokens for r in results] == [g[:new] for g in greedy]
        assert all(sum(r.drafted) > 0 for r in results)  # every row drafted blocks
    trees = SpeculativeGenerator(model, K, tree=TreeSpec(3, 8), policy="fixed")
    assert [r.tokens for r in trees.generate_batch(PROMPTS, new)] == [g[:new] for g in greedy]


@pytest.fixture(scope="module")
def plain_samples(model):
    """Plain sampling's tokens (test_speculative_sampling's, drawn once for the same base)."""
    return spec_sampling.plain_samples(model.base)


# Trees sampled from the block are slow: the chain here and test_speculative_sampling's EAGLE3
# trees (default) check the same acceptance rule, and the DFlash trees' greedy identity is
# test_batch_greedy_identity above.
@pytest.mark.parametrize("shape", ["chain", pytest.param("tree", marks=pytest.mark.slow)])
def test_sampling_matches_plain_sampling(model, plain_samples, shape):
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.sampling import Sampling
    from megatron_specdec.inference.tree import TreeSpec

    tree = TreeSpec(3, 8) if shape == "tree" else None  # trees sampled from the block
    own = SpeculativeGenerator(model, K, policy="fixed", tree=tree)

    def with_draft_probs(seed):
        return own.generate(PROMPT, spec_sampling.NEW,
                            sampling=Sampling(**SETTINGS, seed=seed)).tokens

    assert _same_distribution(plain_samples, _samples(with_draft_probs)) > 1e-3, shape


def _layout_worker(tp, pp, out_file):
    from megatron_specdec.inference.generation import plain_generate
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.tree import TreeSpec
    distributed.initialize(tp, pp)
    model = build()
    greedy = [plain_generate(model.base, [p], 8, HF["vocab_size"])[0] for p in PROMPTS]
    chains = SpeculativeGenerator(model, K, policy="fixed").generate_batch(PROMPTS, 8)
    trees = SpeculativeGenerator(model, K, tree=TreeSpec(3, 8), policy="fixed").generate_batch(
        PROMPTS, 8)
    if is_writer():
        torch.save({"greedy": greedy, "chains": [r.tokens for r in chains],
                    "trees": [r.tokens for r in trees]}, out_file)


@pytest.mark.parametrize("tp,pp", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)],
                         ids=["tp2", "pp2"])
def test_batch_greedy_identity_parallel(tmp_path, tp, pp):
    """The drafter at TP=2 (vocab-parallel logits) and PP=2 (the last stage's embedding
    replica): chains and trees over the ragged batch equal plain greedy."""
    out = tmp_path / "out.pt"
    distributed.spawn(_layout_worker, tp * pp, tp, pp, str(out))
    r = torch.load(out)
    assert r["chains"] == r["trees"] == r["greedy"]
