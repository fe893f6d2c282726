"""Speculative generation on a small seeded random Llama (fast): identity with plain greedy
for EAGLE3 (chain and parallel drafting), Medusa and n-gram drafting, fixed and adaptive draft length, at TP=1, TP=2 and
PP=2; an oracle drafter that proposes the known
greedy continuation with planned mistakes, so rounds accept several tokens and roll back at
chosen places (exact accepted counts)."""

import pytest
import torch

from megatron_specdec import distributed
from megatron_specdec.inference.oracle import OracleDrafter
from workers import is_writer

HF = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=128, vocab_size=512, max_position_embeddings=256,
          tie_word_embeddings=True, rms_norm_eps=1e-5, initializer_range=0.3)
EAGLE3 = {"draft_vocab_size": 300, "eagle_aux_hidden_state_layer_ids": [0, 1, 2], "ttt_steps": 4}
ALGOS = {"eagle3": ("eagle3", EAGLE3),  # name: (draft algo, its config)
         "peagle": ("eagle3", dict(EAGLE3, parallel_drafting=True)),
         "medusa": ("medusa", {"medusa_num_heads": 4})}
CHAINS_ONLY = {"peagle"}  # a parallel-drafting draft drafts no tree of its own
K, NEW = 4, 40
# The random drafts' top probabilities lie around this, so the adaptive runs draft 0..K.
THRESHOLD = {"eagle3": 0.02, "peagle": 0.02, "medusa": 0.02}
WRONG_AT = (5, 6, 13, 30)  # emitted positions the oracle gets wrong
PROMPT = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(5)).tolist()


def build(algo):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_specdec import convert
    from megatron_specdec.loading.hf_conversion import load_hf_into_model
    from megatron_specdec.models.provider import build_model

    hf = LlamaConfig(**HF)
    torch.manual_seed(0)
    state = LlamaForCausalLM(hf).state_dict()
    base = build_model(hf)
    load_hf_into_model(base, hf, state)
    torch.manual_seed(1)
    return convert(base, *ALGOS[algo], hf_config=hf).eval()


def expected_accepts(k, new_tokens, wrong_at):
    """Accepted counts per round when drafts are right except at `wrong_at`."""
    counts, emitted = [], 1
    while emitted < new_tokens:
        a = next((j for j in range(k) if emitted + j in wrong_at), k)
        counts.append(a)
        emitted += a + 1
    return counts


def identity_worker(tp, pp, out_file, tree=None, oracle_tree=None):
    """Plain greedy, speculative with random drafts, and speculative with an oracle drafter;
    `tree`/`oracle_tree` are the TreeSpecs of the last two (None: chain)."""
    from megatron_specdec.inference.draft_policy import DraftPolicy
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.generation import plain_generate

    distributed.initialize(tp, pp)
    results = {}
    for algo in ALGOS:
        if tree is not None and algo in CHAINS_ONLY:
            continue
        model = build(algo)
        greedy = plain_generate(model.base, [PROMPT], NEW + K + 1, HF["vocab_size"])[0]
        plain = SpeculativeGenerator(model, K, tree=tree, policy="fixed").generate(PROMPT, NEW)
        results[f"{algo}-adaptive"] = {"greedy": greedy[:NEW], "plain": SpeculativeGenerator(
            model, K, tree=tree, policy=DraftPolicy(K, THRESHOLD[algo])).generate(PROMPT, NEW)}
        if tree is None:
            results[f"ngram-{algo}"] = {"greedy": greedy[:NEW], "plain": SpeculativeGenerator(
                model, K, drafter_kind="ngram").generate(PROMPT, NEW)}
        generator = SpeculativeGenerator(model, K, tree=oracle_tree, policy="fixed")
        if generator.drafter is not None:  # the last stage
            generator.drafter = OracleDrafter(generator.drafter, [greedy], [WRONG_AT],
                                              HF["vocab_size"])
        results[algo] = {"greedy": greedy[:NEW], "plain": plain,
                         "oracle": generator.generate(PROMPT, NEW)}
    if is_writer():
        torch.save(results, out_file)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_speculative_equals_greedy(tp, pp, tmp_path):
    out = tmp_path / "out.pt"
    distributed.spawn(identity_worker, tp * pp, tp, pp, str(out))
    results = torch.load(out, weights_only=False)
    for algo, got in results.items():
        assert got["plain"].tokens == got["greedy"], algo
        if "oracle" in got:
            assert got["oracle"].tokens == got["greedy"], algo
            assert got["oracle"].accepted == expected_accepts(K, NEW, WRONG_AT), algo
            assert set(got["plain"].drafted) == {K}, algo  # fixed length
    for algo in ALGOS:  # adaptive: the chain length varies (0 = a plain decoding step)
        assert len(set(results[f"{algo}-adaptive"]["plain"].drafted)) > 1, \
            results[f"{algo}-adaptive"]["plain"].drafted
        ngram = results[f"ngram-{algo}"]["plain"]
        assert max(ngram.drafted) > 0 and 0 in ngram.drafted, ngram.drafted  # found and not


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    from megatron_specdec.methods.ngram.proposer import NgramDrafter

    drafter = NgramDrafter(max_ngram=2)
    one = torch.ones(1, dtype=torch.long)
    drafter.start(torch.tensor([[5, 1, 2, 3, 1, 2, 4, 1]]), 8 * one, torch.tensor([[2]]), None, 0)
    assert drafter.propose(3)[0].tolist() == [[4, 1, 2]]  # "1 2" last seen before "4 1 2"
    drafter.accept(torch.tensor([[7]]), one, None)
    assert drafter.propose(3)[0].shape == (1, 0)  # 7 never occurred before
    drafter.accept(torch.tensor([[5]]), one, None)
    assert drafter.propose(2)[0].tolist() == [[1, 2]]  # unigram fallback
    # A batch: each row looks up its own history (padding is not history).
    drafter.start(torch.tensor([[7, 8, 5, 1, 3], [1, 2, 3, 1, 2]]), torch.tensor([3, 5]),
                  torch.tensor([[7], [3]]), None, 0)
    drafts, counts = drafter.propose(2)
    assert counts.tolist() == [0, 2] and drafts[1].tolist() == [1, 2]
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(min_ngram=0)
