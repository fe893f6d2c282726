"""The exported EAGLE3 draft means what the Megatron draft computes, on SmolLM2.

A SmolLM2 speculative checkpoint (random, active draft; 1024-id draft vocabulary calibrated
on GSM8K) is exported with the base (`export_full`: out/base + out/eagle3). An independent
plain-PyTorch EAGLE3 drafter that reads only those files (base embedding found through
model.safetensors.index.json, aux states from transformers' hidden_states[i + 1] = output of
layer i, fc, the 2h attention input with the embedding first, RoPE with the config's
rope_theta, GQA, d2t) drafts greedy chains; the
Megatron draft drafts the same chains through its own step() with the training-time-test
masks. Logits agree to 1e-4 (float32) and the drafted tokens are the same.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from megatron_specdec import distributed

STEPS = 4
DRAFT_VOCAB = 1024


def calibration_rows(shared_data, n=300):
    """GSM8K problems as conversations: enough distinct tokens for a 1024-id draft vocabulary."""
    rows = []
    with open(shared_data / "gsm8k_train.jsonl") as f:
        for i, line in zip(range(n), f):
            r = json.loads(line)
            rows.append({"id": str(i), "conversations": [
                {"role": "user", "content": r["question"]},
                {"role": "assistant", "content": r["answer"]}]})
    return rows


def _starts(n):
    return [n // 3, n // 2, n - 1 - STEPS]


def megatron_chains(model, prompt_ids):
    """Step-0 logits at every position, and greedy chains of STEPS draft tokens from each start
    (step k at position t0+k reads the embedding of the token drafted at step k-1)."""
    from megatron_specdec.methods.eagle3.layers import shift_right
    from megatron_specdec.methods.eagle3.ttt_attention import TTTMask

    draft, cfg = model.draft, model.spec_config
    ids = torch.tensor([prompt_ids])
    s = ids.shape[1]
    state = model.run_base(ids)
    aux, rope = torch.cat(state.aux, dim=-1), model.rotary_pos_emb(s)
    real_next = torch.cat([state.embeds[1:], state.embeds[-1:]])
    out = {"chains": {}}
    for t0 in [None] + _starts(s):
        embeds, hidden, kv = real_next.clone(), draft.project(aux), [[] for _ in draft.layers]
        tokens, logits = [], []
        for k in range(1 if t0 is None else STEPS):
            if k:
                hidden = shift_right(hidden)
            mask = TTTMask(None, k)
            hidden, step_logits = draft.step(embeds, hidden, rope, mask, kv)
            if t0 is None:
                out["step0"] = step_logits[: s - 1, 0, : cfg.draft_vocab_size].clone()
                break
            row = step_logits[t0 + k, 0, : cfg.draft_vocab_size]
            token = int(row.argmax()) + int(draft.d2t[int(row.argmax())])
            tokens.append(token)
            logits.append(row.clone())
            embeds[t0 + k + 1] = model.base.embedding(torch.tensor([[token]]), None)[0]
        if t0 is not None:
            out["chains"][t0] = (tokens, torch.stack(logits))
    return out


def _pipeline(root, calibration, prompt_ids, out_file):
    """SmolLM2 -> speculative checkpoint whose draft is random but active (weights ~ 1/sqrt(fan
    in), so drafted tokens depend on every input) with a calibrated draft vocabulary; then
    export_full and the Megatron draft's chains."""
    from megatron_specdec.export.full_export import export_full
    from megatron_specdec.loading.hf_conversion import hf_to_megatron
    from megatron_specdec.loading.source import load_model
    from megatron_specdec.loading.conversion import calibrate_draft_vocab
    from megatron_specdec.models.speculative import convert
    from megatron_specdec.loading.speculative import load_speculative, save_speculative

    hf_to_megatron("default", f"{root}/base")
    distributed.initialize(1, 1)
    loaded = load_model(f"{root}/base")
    model, hf_config = loaded.model, loaded.hf_config
    model = convert(model, "eagle3", {"draft_vocab_size": DRAFT_VOCAB, "ttt_steps": STEPS},
                    hf_config=hf_config)
    model.draft.set_draft_vocab(*calibrate_draft_vocab(f"{root}/base", [calibration],
                                                       DRAFT_VOCAB, hf_config.vocab_size))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.draft.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if p.dim() == 1 else noise / p.shape[1] ** 0.5)
    save_speculative(model, f"{root}/spec", loaded.base_meta)
    export_full(f"{root}/spec", f"{root}/out")
    model, _, _ = load_speculative(f"{root}/spec")
    with torch.no_grad():
        torch.save(megatron_chains(model.eval(), prompt_ids), out_file)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    angle = pos * (1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angle = torch.cat([angle, angle])
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * angle.cos() + rotated * angle.sin()


class HFDrafter:
    """One-layer EAGLE3 from an exported directory, one position at a time with a KV cache."""

    def __init__(self, draft_dir):
        self.c = json.loads((draft_dir / "config.json").read_text())
        self.w = load_file(str(draft_dir / "model.safetensors"))
        assert self.c["num_hidden_layers"] == 1
        self.heads, self.groups = self.c["num_attention_heads"], self.c["num_key_value_heads"]
        self.hd = self.c["hidden_size"] // self.heads  # as the EAGLE runtime: head_dim ignored

    def step(self, hidden, emb, pos, cache):
        w, c, eps, p = self.w, self.c, self.c["rms_norm_eps"], "midlayer."
        x = torch.cat([_rms(emb, w[p + "input_layernorm.weight"], eps),
                       _rms(hidden, w[p + "hidden_norm.weight"], eps)])  # embedding first, 2h
        q = (w[p + "self_attn.q_proj.weight"] @ x).view(self.heads, self.hd)
        k = (w[p + "self_attn.k_proj.weight"] @ x).view(self.groups, self.hd)
        v = (w[p + "self_attn.v_proj.weight"] @ x).view(self.groups, self.hd)
        cache.append((_rope(k, float(pos), c["rope_theta"]), v))
        rep = self.heads // self.groups
        keys = torch.stack([kk for kk, _ in cache]).repeat_interleave(rep, 1)
        values = torch.stack([vv for _, vv in cache]).repeat_interleave(rep, 1)
        q = _rope(q, float(pos), c["rope_theta"])
        att = torch.softmax(torch.einsum("hd,thd->ht", q, keys) / self.hd ** 0.5, dim=-1)
        context = torch.einsum("ht,thd->hd", att, values).reshape(-1)
        hidden = hidden + w[p + "self_attn.o_proj.weight"] @ context
        y = _rms(hidden, w[p + "post_attention_layernorm.weight"], eps)
        hidden = hidden + w[p + "mlp.down_proj.weight"] @ (
            F.silu(w[p + "mlp.gate_proj.weight"] @ y) * (w[p + "mlp.up_proj.weight"] @ y))
        return hidden, w["lm_head.weight"] @ _rms(hidden, w["norm.weight"], eps)

    def target_id(self, logits):
        d = int(logits.argmax())
        return d + int(self.w["d2t"][d])


def hf_reference(out_dir, prompt_ids):
    from transformers import AutoModelForCausalLM

    drafter = HFDrafter(out_dir / "eagle3")
    index = json.loads((out_dir / "base" / "model.safetensors.index.json").read_text())
    shard = out_dir / "base" / index["weight_map"]["model.embed_tokens.weight"]
    with safe_open(str(shard), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    base = AutoModelForCausalLM.from_pretrained(out_dir / "base", dtype=torch.float32,
                                                attn_implementation="eager").eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        states = base(ids, output_hidden_states=True).hidden_states
        layer_ids = drafter.c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        aux = torch.cat([states[i + 1][0] for i in layer_ids], dim=-1)  # output of layer i
        fc = aux @ drafter.w["fc.weight"].t()
        s, out = len(prompt_ids), {"chains": {}}
        cache, prefix = [], []
        for t in range(s - 1):
            prefix.append(drafter.step(fc[t], embed[prompt_ids[t + 1]], t, cache))
        out["step0"] = torch.stack([logits for _, logits in prefix])
        for t0 in _starts(s):
            chain = cache[: t0 + 1]
            hidden, logits = prefix[t0]
            tokens, rows = [], []
            for k in range(STEPS):
                if k:
                    hidden, logits = drafter.step(hidden, embed[tokens[-1]], t0 + k, chain)
                tokens.append(drafter.target_id(logits))
                rows.append(logits)
            out["chains"][t0] = (tokens, torch.stack(rows))
    return out


@pytest.mark.slow
def test_exported_draft_reproduces_megatron_draft(tmp_path, chat_prompt_ids, shared_data):
    calibration = tmp_path / "calib.jsonl"
    calibration.write_text("".join(json.dumps(r) + "\n" for r in calibration_rows(shared_data)))
    result = tmp_path / "megatron.pt"
    distributed.spawn(_pipeline, 1, str(tmp_path), str(calibration), chat_prompt_ids, str(result))
    meg = torch.load(result)
    out_dir = tmp_path / "out"
    assert sorted(p.name for p in out_dir.iterdir()) == ["base", "eagle3"]
    assert (out_dir / "base" / "model.safetensors.index.json").is_file()
    ref = hf_reference(out_dir, chat_prompt_ids)

    diff = (meg["step0"] - ref["step0"]).abs().max().item()
    assert ref["step0"].shape == (len(chat_prompt_ids) - 1, DRAFT_VOCAB) and diff <= 1e-4, diff
    assert torch.equal(meg["step0"].argmax(-1), ref["step0"].argmax(-1))
    for t0, (tokens, logits) in ref["chains"].items():
        meg_tokens, meg_logits = meg["chains"][t0]
        assert meg_tokens == tokens, (t0, meg_tokens, tokens)
        assert (meg_logits - logits).abs().max().item() <= 1e-4, t0
    print(f"\nSmolLM2 draft logits: max |megatron - hf| = {diff:.2e} over "
          f"{ref['step0'].numel()} step-0 logits; chains {[c[0] for c in ref['chains'].values()]}")
