"""EAGLE3 in one process: config parsing, the training-time-test mask, the vocab-parallel soft
cross-entropy against a plain softmax, aux capture against HF hidden states, and the draft's
training-time-test logits against an independent plain-PyTorch EAGLE3 that drafts chains
step by step from HF-layout weights (what an inference engine runs)."""

import pytest
import torch
import torch.nn.functional as F

from megatron_specdec import registry
from megatron_specdec.models.families import rope_settings
from megatron_specdec.models.layers import losses
from megatron_specdec.methods.eagle3.ttt_attention import TTTMask, ttt_attention
from megatron_specdec.registry import ConfigError as SpecConfigError


# ---- configuration ------------------------------------------------------------------------
def test_config_defaults_and_modelopt_forms():
    cfg = registry.parse_config("eagle3", {"eagle_num_layers": 2, "use_last_layernorm": False}, 30, 49152)
    assert cfg.aux_layer_ids == [1, 14, 26] and cfg.ttt_steps == 7 and cfg.ttt_decay == 0.8
    assert cfg.draft_vocab_size == 49152 and cfg.padded_draft_vocab_size == 49152
    listed = registry.parse_config([("eagle", {"draft_vocab_size": 1000})], None, 30, 49152)
    assert listed.algo == "eagle3" and listed.padded_draft_vocab_size == 1024
    medusa = registry.parse_config([("medusa", {"medusa_num_heads": 3, "medusa_num_layers": 2})], None, 30, 49152)
    assert medusa.medusa_head_weights == pytest.approx([1.0, 0.8, 0.64])
    assert registry.config_from_dict(registry.config_to_dict(cfg)) == cfg


@pytest.mark.parametrize("algo,config,message", [
    ("eagle3", {"eagle_num_layer": 1}, "unknown eagle3 config key(s) 'eagle_num_layer'"),
    ("eagle3", {"eagle_aux_hidden_state_layer_ids": [1, 30]}, "aux layer id 30 is out of range"),
    ("eagle3", {"eagle_aux_hidden_state_layer_ids": [-1]}, "valid: 0..29"),
    ("eagle3", {"draft_vocab_size": 49153}, "draft_vocab_size=49153 is out of range"),
    ("eagle3", {"lm_head_init": "tied"}, "lm_head_init='tied' is not one of base, random"),
    ("eagle3", {"ttt_steps": 0}, "ttt_steps=0"),
    ("eagle3", {"parallel_drafting": "yes"}, "parallel_drafting must be true or false"),
    ("eagle3", {"parallel_drafting": True, "mask_token_id": 49152},
     "mask_token_id=49152 is out of range (valid: 0..49151)"),
    ("eagle3", {"mask_token_id": 3}, "mask_token_id is read only with parallel_drafting: true"),
    ("medusa", {"medusa_head_weights": [1.0]}, "needs 4 non-negative values"),
    ("lookahead", {}, "valid: eagle3, medusa"),
])
def test_config_errors_name_the_problem(algo, config, message):
    with pytest.raises(SpecConfigError, match=None) as e:
        registry.parse_config(algo, config, 30, 49152)
    assert message in str(e.value)


def test_parallel_drafting_defaults_and_draft_count():
    from megatron_specdec.methods.eagle3.config import check_num_draft_tokens

    cfg = registry.parse_config("eagle3", {"parallel_drafting": True, "ttt_steps": 5}, 30, 49152)
    assert cfg.mask_token_id == 49151  # the last vocabulary id
    check_num_draft_tokens(cfg, 5)
    with pytest.raises(SpecConfigError, match="ttt_steps 5 drafts 1..5 tokens"):
        check_num_draft_tokens(cfg, 6)
    check_num_draft_tokens(registry.parse_config("eagle3", {"ttt_steps": 5}, 30, 49152), 9)


# ---- training-time test attention ---------------------------------------------------------
def dense_ttt_mask(base_mask, s, step):
    """The dense [b|1, 1, s, (step+1)*s] mask of TTT step `step` (True = may not attend):
    row u sees the base mask's row u-step over the step-0 keys and, of each later step j,
    the single key at u-step+j."""
    if base_mask is None:
        base_mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    rows = torch.arange(s) - step
    blocks = [base_mask[..., rows.clamp(min=0), :] | (rows < 0)[:, None]]
    u = torch.arange(s)
    for j in range(1, step + 1):
        blocks.append((u[None, :] != (u - step + j)[:, None]).expand(*blocks[0].shape[:-2], s, s))
    return torch.cat(blocks, dim=-1)


def test_ttt_mask_follows_the_chain():
    s, k = 6, 2
    allowed = ~dense_ttt_mask(None, s, k)[0, 0]  # [s, 3s]
    u = 4  # chain from the real prefix ending at u-k = 2
    assert allowed[u, :s].nonzero().flatten().tolist() == [0, 1, 2]
    assert allowed[u, s:2 * s].nonzero().flatten().tolist() == [3]  # step-1 key at 3
    assert allowed[u, 2 * s:].nonzero().flatten().tolist() == [4]  # its own step-2 key
    # the SDPA mask: k sinks (step j = k-p at column p, present once u >= p), then the
    # step-0 keys shifted right by k, seen as the base mask's row u-k sees them
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    sdpa = TTTMask(causal, k).sdpa_mask(s)[0, 0]
    assert torch.equal(sdpa, ~causal[0, 0])  # a causal base mask is plain causal SDPA
    assert torch.equal(sdpa[:, k:], allowed[:, : s - k])
    assert torch.equal(sdpa[:, 0], allowed[:, 2 * s:].any(-1))  # own key: always
    assert torch.equal(sdpa[:, 1], allowed[:, s:2 * s].any(-1))  # step-1 key: from u = 1


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("step", [0, 1, 3, 6])
def test_structured_ttt_attention_equals_dense_mask(packed, step):
    """ttt_attention (SDPA over sinks and shifted step-0 keys) against softmax attention over
    every block's keys with the dense mask: outputs and gradients, GQA 4 heads / 2 groups."""
    g = torch.Generator().manual_seed(step)
    s, b, heads, groups, d = 9, 2, 4, 2, 8
    base = None
    if packed:  # two sequences per row, split at 4 and 6
        seg = torch.tensor([[0] * 4 + [1] * 5, [0] * 6 + [1] * 3])
        base = (seg[:, :, None] != seg[:, None, :]) | torch.ones(s, s, dtype=torch.bool).triu(1)
        base = base[:, None]
    q = torch.randn(s, b, heads, d, generator=g, requires_grad=True)
    blocks = [(torch.randn(s, b, groups, d, generator=g, requires_grad=True),
               torch.randn(s, b, groups, d, generator=g, requires_grad=True))
              for _ in range(step + 1)]
    got = ttt_attention(q, blocks, TTTMask(base, step), d ** -0.5)
    keys = torch.cat([k for k, _ in blocks]).repeat_interleave(heads // groups, 2)
    values = torch.cat([v for _, v in blocks]).repeat_interleave(heads // groups, 2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, keys) * d ** -0.5
    probs = scores.masked_fill(dense_ttt_mask(base, s, step), float("-inf")).softmax(-1)
    want = torch.einsum("bhst,tbhd->sbhd", probs, values).reshape(s, b, heads * d)
    assert torch.allclose(got, want, atol=1e-6)
    weight = torch.randn(s, b, heads * d, generator=g)
    leaves = [q] + [t for block in blocks for t in block]
    got_grads = torch.autograd.grad((got * weight).sum(), leaves)
    want_grads = torch.autograd.grad((want * weight).sum(), leaves)
    for a, w in zip(got_grads, want_grads):
        assert torch.allclose(a, w, atol=1e-6)


# ---- vocab-parallel soft cross-entropy ----------------------------------------------------
def test_soft_cross_entropy_matches_plain_softmax(one_process):
    g = torch.Generator().manual_seed(0)
    n, vocab, draft, padded = 5, 40, 12, 16
    base = torch.randn(n, vocab, generator=g)
    target_ids = torch.randperm(vocab, generator=g)[:draft].sort().values
    logits = torch.randn(n, padded, generator=g).requires_grad_()
    masked = logits.masked_fill(torch.arange(padded) >= draft, float("-inf"))
    target = losses.draft_target_logits(base, target_ids, padded)
    got = losses.soft_cross_entropy(masked, losses.target_probs(target), draft)
    got.sum().backward()
    ref_logits = logits.detach()[:, :draft].clone().requires_grad_()
    p = torch.softmax(base[:, target_ids], -1)
    want = -(p * torch.log_softmax(ref_logits, -1)).sum(-1)
    want.sum().backward()
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(logits.grad[:, :draft], ref_logits.grad, atol=1e-6)
    assert (logits.grad[:, draft:] == 0).all()


# ---- the draft against a step-by-step reference -----------------------------------------
def _tiny_model(draft_layers=2, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_specdec.models.speculative import convert
    from megatron_specdec.loading.hf_conversion import load_hf_into_model
    from megatron_specdec.models.provider import build_model

    hf = LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                     max_position_embeddings=64, tie_word_embeddings=True, rope_theta=5000.0)
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(hf).eval()
    base = build_model(hf)
    load_hf_into_model(base, hf, hf_model.state_dict())
    model = convert(base, "eagle3", {"draft_vocab_size": 300, "ttt_steps": 3,
                                     "eagle_num_layers": draft_layers,
                                     "eagle_aux_hidden_state_layer_ids": [0, 2, 1], **config},
                    hf_config=hf)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.draft.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
        targets = torch.randperm(512, generator=g)[:300].sort().values
        t2d = torch.zeros(512, dtype=torch.bool)
        t2d[targets] = True
        model.draft.set_draft_vocab(targets - torch.arange(300), t2d)
    return model, hf, hf_model


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.cat([pos * inv, pos * inv])
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * ang.cos() + half * ang.sin()


class ReferenceDraft:
    """EAGLE3 from HF-layout tensors, one position at a time with a KV cache per layer."""

    def __init__(self, w, hf, num_layers):
        self.w, self.hf, self.n = w, hf, num_layers
        self.heads, self.groups = hf.num_attention_heads, hf.num_key_value_heads
        self.hd = hf.hidden_size // self.heads
        self.prefix = "midlayer." if num_layers == 1 else "layers.{}."

    def _layer(self, i, hidden, emb, pos, cache):
        w, p, eps = self.w, self.prefix.format(i), self.hf.rms_norm_eps
        if i == 0:
            x = torch.cat([_rms(emb, w[p + "input_layernorm.weight"], eps),
                           _rms(hidden, w[p + "hidden_norm.weight"], eps)])
        else:
            x = _rms(hidden, w[p + "input_layernorm.weight"], eps)
        q = (w[p + "self_attn.q_proj.weight"] @ x).view(self.heads, self.hd)
        k = (w[p + "self_attn.k_proj.weight"] @ x).view(self.groups, self.hd)
        v = (w[p + "self_attn.v_proj.weight"] @ x).view(self.groups, self.hd)
        theta = rope_settings(self.hf)["rotary_base"]
        cache.append((_rope(k, float(pos), theta), v))
        keys = torch.stack([c[0] for c in cache]).repeat_interleave(self.heads // self.groups, 1)
        vals = torch.stack([c[1] for c in cache]).repeat_interleave(self.heads // self.groups, 1)
        q = _rope(q, float(pos), theta)
        att = torch.softmax(torch.einsum("hd,thd->ht", q, keys) / self.hd ** 0.5, -1)
        hidden = hidden + w[p + "self_attn.o_proj.weight"] @ torch.einsum("ht,thd->hd", att, vals).reshape(-1)
        y = _rms(hidden, w[p + "post_attention_layernorm.weight"], eps)
        mlp = F.silu(w[p + "mlp.gate_proj.weight"] @ y) * (w[p + "mlp.up_proj.weight"] @ y)
        return hidden + w[p + "mlp.down_proj.weight"] @ mlp

    def step(self, hidden, emb, pos, caches):
        for i in range(self.n):
            hidden = self._layer(i, hidden, emb, pos, caches[i])
        logits = self.w["lm_head.weight"] @ _rms(hidden, self.w["norm.weight"], self.hf.rms_norm_eps)
        return hidden, logits


@pytest.mark.parametrize("draft_layers", [1, 2])
def test_aux_capture_and_ttt_match_stepwise_drafting(one_process, draft_layers):
    from megatron_specdec.methods.eagle3 import hf_weights as eagle3
    from megatron_specdec.checkpointing import hf_mapping as mapping

    model, hf, hf_model = _tiny_model(draft_layers)
    s = 10
    ids = torch.randint(0, 512, (1, s), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        state = model.run_base(ids)
        hf_hidden = hf_model(ids, output_hidden_states=True).hidden_states
        for slot, layer in enumerate(model.aux_layer_ids):  # output of layer k = HF hidden_states[k+1]
            assert torch.allclose(state.aux[slot][:, 0], hf_hidden[layer + 1][0], atol=1e-5)
        aux = torch.cat(state.aux, -1)
        embeds = torch.cat([state.embeds[1:], state.embeds[-1:]])
        ttt = model.draft.training_time_test(aux, embeds, model.rotary_pos_emb(s), None, 3)

        cfg = model.spec_config
        geo = eagle3.geometry(hf, model.base.padding, cfg)
        w = mapping.megatron_to_hf(eagle3.rules(cfg), model.draft.state_dict(), geo, cfg.eagle_num_layers)
        first = "midlayer." if draft_layers == 1 else "layers.0."
        assert w["lm_head.weight"].shape == (300, 64) and w[first + "self_attn.q_proj.weight"].shape == (64, 128)
        ref = ReferenceDraft(w, hf, cfg.eagle_num_layers)
        tok_emb = hf_model.model.embed_tokens.weight
        fc = w["fc.weight"] @ aux[:, 0].t()  # [h, s]
        caches = [[] for _ in range(cfg.eagle_num_layers)]
        prefix_out = []
        for t in range(s - 1):  # real pairs (fc(aux_t), embed(x_{t+1})) at position t
            prefix_out.append(ref.step(fc[:, t], tok_emb[ids[0, t + 1]], t, caches))
        for start in range(s - 1):
            chain = [c[: start + 1] for c in caches]
            hidden, logits = prefix_out[start]
            for k in range(3):
                u = start + k
                if u + 1 >= s:
                    break
                if k:
                    hidden, logits = ref.step(hidden, tok_emb[ids[0, u + 1]], u, chain)
                got = ttt[k][u, 0, :300]
                assert torch.allclose(got, logits, atol=2e-4), (start, k, (got - logits).abs().max())


def test_incremental_drafting_api_reproduces_training_time_test(one_process):
    """How an inference engine drafts: prefill the real pairs once, then one token per call,
    with the keys/values kept in `kv_blocks`. Each draft step equals the matching TTT step."""
    model, hf, hf_model = _tiny_model(2)
    draft, s, start = model.draft, 10, 5
    ids = torch.randint(0, 512, (1, s), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        state = model.run_base(ids)
        aux = torch.cat(state.aux, -1)
        embeds = torch.cat([state.embeds[1:], state.embeds[-1:]])  # embedding of token t+1 at t
        ttt = draft.training_time_test(aux, embeds, model.rotary_pos_emb(s), None, 3)
        rope = model.rotary_pos_emb(s)
        kv_blocks = [[] for _ in draft.layers]
        n = start + 1
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]
        hidden, logits = draft.step(embeds[:n], draft.project(aux[:n]), rope[:n], causal, kv_blocks)
        assert torch.allclose(logits[-1], ttt[0][start], atol=1e-5)
        for k in (1, 2):
            u = start + k
            seen = sum(block[0].shape[0] for block in kv_blocks[0]) + 1
            mask = torch.zeros(1, 1, 1, seen, dtype=torch.bool)  # the new token sees everything
            hidden, logits = draft.step(embeds[u:u + 1], hidden[-1:], rope[u:u + 1], mask, kv_blocks)
            assert torch.allclose(logits[0], ttt[k][u], atol=1e-5)
        top = logits[0, 0].argmax()
        assert draft.t2d[top + draft.d2t[top]]  # draft id -> target id


@pytest.mark.parametrize("draft_layers", [1, 2])
def test_parallel_drafting_trains_what_one_block_forward_drafts(one_process, draft_layers):
    """Parallel drafting (P-EAGLE): TTT step k at position u (fed the mask input) equals mask
    position k of the one forward that drafts after the real prefix ending at u - k, laid out
    as vLLM lays it out: the real positions, then the mask token's embedding with
    fc(mask_hidden), causal."""
    model, hf, hf_model = _tiny_model(draft_layers, parallel_drafting=True, mask_token_id=5)
    draft, s = model.draft, 10
    assert torch.equal(draft.mask_embed, hf_model.model.embed_tokens.weight[5].detach())
    ids = torch.randint(0, 512, (1, s), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        state = model.run_base(ids)
        aux = torch.cat(state.aux, -1)
        embeds = torch.cat([state.embeds[1:], state.embeds[-1:]])
        rope = model.rotary_pos_emb(s)
        ttt = draft.training_time_test(aux, embeds, rope, None, 3)
        for start in (0, 4, 7):
            n = start + 1
            mask_embeds, mask_hidden = draft.mask_input(2, 1)
            hidden = torch.cat([draft.project(aux[:n]), mask_hidden])
            causal = torch.ones(n + 2, n + 2, dtype=torch.bool).triu(1)[None, None]
            _, logits = draft.step(torch.cat([embeds[:n], mask_embeds]), hidden,
                                   rope[:n + 2], causal, [[] for _ in draft.layers])
            for k in range(3):
                assert torch.allclose(logits[start + k], ttt[k][start + k], atol=1e-5), (start, k)
        assert not torch.allclose(ttt[1], ttt[0], atol=1e-3)  # the mask input is its own


def test_packed_sequences_train_like_separate_ones(one_process):
    """Two conversations packed in one row with a block-diagonal mask give the per-step loss
    sums, counts and hits of the two run apart: no chain crosses a conversation boundary."""
    from megatron_specdec.data import packed_attention_mask

    model, hf, hf_model = _tiny_model(1)
    g = torch.Generator().manual_seed(5)
    lengths = (9, 7)
    ids = torch.randint(0, 512, (1, sum(lengths)), generator=g)
    loss_mask = torch.ones(1, sum(lengths))
    segments = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])[None]
    for start in (0, lengths[0]):
        loss_mask[0, start:start + 2] = 0  # a prompt opens each conversation
    with torch.no_grad():
        packed = model(ids, loss_mask, packed_attention_mask(segments))
        apart = [model(ids[:, a:b], loss_mask[:, a:b])
                 for a, b in ((0, lengths[0]), (lengths[0], sum(lengths)))]
    for key in ("step_loss", "step_count", "step_correct"):
        assert torch.allclose(packed[key], apart[0][key] + apart[1][key], atol=1e-4), key
    assert packed["step_count"][2] > 0


def test_modelopt_layernorm_switches(one_process):
    from megatron_specdec.models.speculative import convert
    from megatron_specdec.methods.eagle3 import hf_weights as eagle3
    from megatron_specdec.checkpointing import hf_mapping as mapping

    model, hf, _ = _tiny_model(1)
    model = convert(model.base, "eagle3", {"use_input_layernorm_in_first_layer": False,
                                           "use_last_layernorm": False, "ttt_steps": 2},
                    hf_config=hf)
    names = dict(model.draft.named_parameters())
    assert "layers.0.input_layernorm.weight" not in names and "final_layernorm.weight" not in names
    assert "layers.0.hidden_norm.weight" in names
    cfg = model.spec_config
    state = {k: v for k, v in model.draft.state_dict().items() if not k.endswith("_extra_state")}
    hf_state = mapping.megatron_to_hf(eagle3.rules(cfg), state,
                                      eagle3.geometry(hf, model.base.padding, cfg), 1)
    assert "midlayer.input_layernorm.weight" not in hf_state and "norm.weight" not in hf_state
    out = model(torch.randint(0, 512, (1, 8)), torch.ones(1, 8))
    assert torch.isfinite(out["loss_sum"]) and out["step_loss"].shape == (2,)


def test_lm_head_init_from_base_follows_the_draft_vocab(one_process):
    """lm_head_init="base": each draft row is the base's output row of its target id, and a
    calibrated vocabulary moves the rows with it; the final norm is the base's."""
    from megatron_specdec.loading.hf_conversion import load_hf_into_model
    from megatron_specdec.models.provider import build_model
    from megatron_specdec.models.speculative import convert, set_draft_vocab
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                     max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(hf).eval()
    with torch.no_grad():
        hf_model.model.norm.weight.uniform_(0.5, 2.0)
    base = build_model(hf)
    load_hf_into_model(base, hf, hf_model.state_dict())
    model = convert(base, "eagle3", {"draft_vocab_size": 300, "lm_head_init": "base"}, hf_config=hf)
    table = hf_model.model.embed_tokens.weight.detach()
    head = model.draft.lm_head.weight
    assert torch.equal(head[:300], table[:300]) and (head[300:] == 0).all()
    assert torch.equal(model.draft.final_layernorm.weight, hf_model.model.norm.weight.detach())
    targets = torch.randperm(512, generator=torch.Generator().manual_seed(3))[:300].sort().values
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[targets] = True
    set_draft_vocab(model, targets - torch.arange(300), t2d)
    assert torch.equal(model.draft.lm_head.weight[:300], table[targets])
    random = convert(build_model(hf), "eagle3", {"draft_vocab_size": 300}, hf_config=hf)
    assert not torch.equal(random.draft.lm_head.weight[:300], table[:300])
