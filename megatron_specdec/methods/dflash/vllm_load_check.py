"""Run by the vLLM env's interpreter (it imports vllm, not megatron_specdec): build vLLM's own
DFlash draft class for `base_dir` + `draft_dir` and run its `load_weights` on the export.

    python vllm_load_check.py BASE_DIR DRAFT_DIR OUT_JSON [PARITY_PT]

Every draft parameter starts as NaN; after loading, a parameter still holding a NaN was not
loaded (vLLM's loader does not complain about missing names). Each loaded parameter is also
compared with the tensors it was built from (q/k/v and gate/up stacked as vLLM stacks them),
and every tensor the export holds must have been handed to a parameter. `embed_tokens` and
`lm_head` are the base's (vLLM's runner shares them after this load), so they are reported,
not required.

With PARITY_PT ({"aux" [s, n*h], "pending" id, "k", "logits" [k, V]: the project's block
logits after context positions 0..s-1), the block is recomputed with the loaded vLLM
modules as qwen3_dflash.py composes them (fc, hidden_norm, each layer's k/v projection,
k_norm and neox RoPE for the context; the mask embedding, the layers, the final norm and the
base's tied lm_head for the block), attention written out (non-causal over context + block,
vLLM's Attention needs an engine's KV cache), and compared.
"""

import json
import sys


def vllm_block_logits(model, base_dir, parity):
    """Block logits [k, V] from the loaded vLLM modules (see the module notes)."""
    import torch
    from safetensors.torch import load_file

    m = model.model
    base = load_file(f"{base_dir}/model.safetensors")
    embed = base["model.embed_tokens.weight"].float()  # SmolLM2 ties lm_head to it
    with torch.no_grad():
        m.embed_tokens.weight.copy_(embed)
        aux, k = parity["aux"].float(), int(parity["k"])
        s = aux.shape[0]
        ctx = m.hidden_norm.forward_native(m.fc(aux))
        ids = torch.tensor([int(parity["pending"])] + [m.mask_token_id] * k)
        hidden = m.embed_input_ids(ids)
        ctx_pos, blk_pos = torch.arange(s), torch.arange(s, s + k + 1)
        residual = None
        for layer in m.layers:
            attn = layer.self_attn
            if residual is None:
                residual, x = hidden, layer.input_layernorm.forward_native(hidden)
            else:
                x, residual = layer.input_layernorm.forward_native(hidden, residual)
            d = attn.head_dim

            def heads(t, norm):
                return norm.forward_native(t.view(t.shape[0], -1, d)).view(t.shape)

            qkv, _ = attn.qkv_proj(x)
            q, kk, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            q, kk = heads(q, attn.q_norm), heads(kk, attn.k_norm)
            q, kk = attn.rotary_emb.forward_native(blk_pos, q, kk)
            cqkv, _ = attn.qkv_proj(ctx)
            ck, cv = cqkv[:, attn.q_size:].split([attn.kv_size, attn.kv_size], dim=-1)
            ck = heads(ck, attn.k_norm)
            _, ck = attn.rotary_emb.forward_native(ctx_pos, ck.clone(), ck)
            keys = torch.cat([ck, kk]).view(s + k + 1, attn.num_kv_heads, d)
            values = torch.cat([cv, v]).view(s + k + 1, attn.num_kv_heads, d)
            rep = attn.num_heads // attn.num_kv_heads
            qh = q.view(k + 1, attn.num_heads, d).transpose(0, 1)
            kh = keys.repeat_interleave(rep, dim=1).transpose(0, 1)
            vh = values.repeat_interleave(rep, dim=1).transpose(0, 1)
            weights = torch.softmax(qh @ kh.transpose(1, 2) * attn.scaling, dim=-1)
            out, _ = attn.o_proj((weights @ vh).transpose(0, 1).reshape(k + 1, -1))
            hidden, residual = layer.post_attention_layernorm.forward_native(out, residual)
            hidden = layer.mlp(hidden)
        hidden, _ = m.norm.forward_native(hidden, residual)
        return (hidden @ embed.T)[1:]


def main(base_dir, draft_dir, out_json, parity_file=None):
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
    from vllm.utils.network_utils import get_open_port

    args = EngineArgs(model=base_dir, dtype="float32", max_model_len=512, enforce_eager=True,
                      speculative_config={"method": "dflash", "model": draft_dir,
                                          "num_speculative_tokens": 7})
    vllm_config = args.create_engine_config()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
        initialize_model_parallel(1, 1)
        model = DFlashQwen3ForCausalLM(vllm_config=vllm_config)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        tensors = load_file(f"{draft_dir}/model.safetensors")
        handed = []

        def stream():
            for name, t in tensors.items():
                handed.append(name)
                yield name, t

        model.load_weights(stream())
    params = dict(model.named_parameters())
    shared = ("model.embed_tokens.weight", "lm_head.weight")
    unloaded = sorted(n for n, p in params.items() if torch.isnan(p).any() and n not in shared)
    mask = torch.load(f"{draft_dir}/mask_embedding.pt", weights_only=True)

    def expected(name):
        n = name.removeprefix("model.")
        if n.endswith("qkv_proj.weight"):
            p = n.removesuffix("qkv_proj.weight")
            return torch.cat([tensors[p + s + "_proj.weight"] for s in "qkv"])
        if n.endswith("gate_up_proj.weight"):
            p = n.removesuffix("gate_up_proj.weight")
            return torch.cat([tensors[p + "gate_proj.weight"], tensors[p + "up_proj.weight"]])
        if n == "mask_embedding":
            return mask["embedding"]
        return tensors.get(n)

    mismatched = []
    for name, p in params.items():
        if name in shared or name in unloaded:
            continue
        want = expected(name)
        if want is None or tuple(want.shape) != tuple(p.shape) or not torch.equal(want.to(p.dtype), p.data):
            mismatched.append(name)
    result = {
        "class": type(model).__name__, "parameters": sorted(params), "unloaded": unloaded,
        "mismatched": mismatched, "tensors": sorted(tensors), "handed": sorted(set(handed)),
        "shared_from_base": [n for n in shared if n in params],
        "separate_mask_embedding": bool(model.model.has_separate_mask_embedding),
        "causal": model.get_draft_attn_causal(),
    }
    if parity_file:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        parity = torch.load(parity_file, weights_only=True)
        ours = parity["logits"].float()
        with set_current_vllm_config(vllm_config):
            # what vLLM's loader does next: the CPU linears' runtime form
            process_weights_after_loading(
                model, vllm_config.speculative_config.draft_model_config, torch.device("cpu"))
            theirs = vllm_block_logits(model, base_dir, parity)
        result["parity"] = {
            "max_abs_diff": float((ours - theirs).abs().max()),
            "logit_scale": float(theirs.abs().max()),
            "same_argmax": bool(torch.equal(ours.argmax(-1), theirs.argmax(-1))),
        }
    with open(out_json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:5])
