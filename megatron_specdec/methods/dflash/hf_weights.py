"""The DFlash draft in vLLM's `DFlashDraftModel` layout: tensor table, config.json, export,
import, and the TP-independent initial draft.

HF names carry no `model.` prefix (vLLM's `DFlashQwen3ForCausalLM.load_weights` adds it).
`embed_tokens` and `lm_head` are not written: vLLM shares the base's when the hidden sizes
match, as this draft does. The trained mask embedding goes to `mask_embedding.pt`
({"mask_token_id", "embedding"}), the file vLLM substitutes for embed_tokens[mask_token_id].
"""

import json
import math
import os
from pathlib import Path

import torch

from megatron_specdec.checkpointing import hf_mapping as mapping

MASK_EMBEDDING_FILE = "mask_embedding.pt"
WEIGHTS_FILE = "model.safetensors"
_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight")


def rules():
    L, M = "layers.{i}.", "layers.{i}."
    return [
        mapping.Rule("fc.weight", ("fc.weight",)),
        mapping.Rule("hidden_norm.weight", ("hidden_norm.weight",)),
        mapping.Rule(M + "input_layernorm.weight", (L + "input_layernorm.weight",)),
        mapping.Rule(M + "self_attention.linear_qkv.weight",
                     (L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight",
                      L + "self_attn.v_proj.weight"), "qkv", 0),
        mapping.Rule(M + "self_attention.q_layernorm.weight", (L + "self_attn.q_norm.weight",)),
        mapping.Rule(M + "self_attention.k_layernorm.weight", (L + "self_attn.k_norm.weight",)),
        mapping.Rule(M + "self_attention.linear_proj.weight", (L + "self_attn.o_proj.weight",),
                     "heads_in", 1),
        mapping.Rule(M + "pre_mlp_layernorm.weight", (L + "post_attention_layernorm.weight",)),
        mapping.Rule(M + "mlp.linear_fc1.weight",
                     (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), "gate_up", 0),
        mapping.Rule(M + "mlp.linear_fc2.weight", (L + "mlp.down_proj.weight",), tp_dim=1),
        mapping.Rule("final_layernorm.weight", ("norm.weight",)),
        mapping.Rule("mask_embedding", ("mask_embedding",)),
    ]


def geometry(config, real_query_groups: int) -> mapping.Geometry:
    """Heads of a draft built on a base whose megatron config may carry padded groups."""
    per_group = config.num_attention_heads // config.num_query_groups
    return mapping.Geometry(
        num_heads=real_query_groups * per_group, num_groups=real_query_groups,
        head_dim=config.kv_channels, vocab_size=0, padded_vocab_size=0,
        padded_groups=config.num_query_groups)


def tensor_shapes(hidden: int, inter: int, heads: int, groups: int, head_dim: int,
                  num_layers: int, num_aux: int) -> dict:
    """HF tensor name -> shape of every tensor of a draft (mask_embedding included)."""
    q, kv = heads * head_dim, groups * head_dim
    shapes = {"fc.weight": (hidden, num_aux * hidden), "hidden_norm.weight": (hidden,),
              "norm.weight": (hidden,), "mask_embedding": (hidden,)}
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
            p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
    return shapes


def initial_state(config, cfg, geo: mapping.Geometry, seed: int) -> dict:
    """HF-named initial tensors, drawn once from `seed` in the unpadded layout (so every TP
    layout starts from the same draft); norms 1, residual outputs get megatron's scaled init."""
    shapes = tensor_shapes(config.hidden_size, config.ffn_hidden_size, geo.num_heads,
                           geo.num_groups, geo.head_dim, cfg.num_layers, len(cfg.aux_layer_ids))
    generator = torch.Generator().manual_seed(seed)
    std = config.init_method_std
    state = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shapes[name])
            continue
        scale = std / math.sqrt(2.0 * cfg.num_layers) if name.endswith(_OUTPUT_PROJECTIONS) else std
        state[name] = torch.randn(shapes[name], generator=generator) * scale
    return state


def load_hf_state(draft, cfg, geo, hf_state: dict):
    """Copy HF-named tensors into this rank's draft module (TP slices, padded groups zero)."""
    from megatron.core import parallel_state as ps

    table = rules()
    merged = mapping.MergedTensors(table, hf_state, geo, cfg.num_layers)
    mapping.load_into_model(draft, table, merged, cfg.num_layers, 0,
                            ps.get_tensor_model_parallel_rank(),
                            ps.get_tensor_model_parallel_world_size())


def gather_hf_state(draft, cfg, geo, grads: bool = False) -> dict:
    """HF-named tensors of the whole draft (TP shards gathered, padding dropped); with
    `grads` their gradients. Collective over the TP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    table = rules()
    index = mapping.rule_index(table, cfg.num_layers)
    group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    meg = {}
    tensors = ({n: p.grad for n, p in draft.named_parameters()} if grads
               else {n: t for n, t in draft.state_dict().items() if not n.endswith("_extra_state")})
    for name, t in tensors.items():
        t = t.detach().contiguous()
        pieces = [t]
        if tp > 1 and index[name].tp_dim is not None:
            pieces = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(pieces, t, group=group)
        meg[name] = mapping.unshard(index[name], pieces)
    return mapping.megatron_to_hf(table, meg, geo, cfg.num_layers)


def hf_config(base_hf, cfg, geo, dtype: torch.dtype) -> dict:
    """config.json of the export: Qwen3 fields of the draft, DFlash's keys."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": base_hf.hidden_size,
        "intermediate_size": base_hf.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": geo.num_heads,
        "num_key_value_heads": geo.num_groups,
        "head_dim": geo.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": base_hf.rms_norm_eps,
        "rope_theta": getattr(base_hf, "rope_theta", None)
        or (getattr(base_hf, "rope_parameters", None) or {}).get("rope_theta", 10000.0),
        "max_position_embeddings": base_hf.max_position_embeddings,
        "vocab_size": base_hf.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
        "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id,
                          "target_layer_ids": list(cfg.target_layer_ids)},
    }


def _atomic(path: Path, write):
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def write_export(out_dir, config: dict, hf_state: dict, dtype: torch.dtype):
    """Write config.json, model.safetensors and mask_embedding.pt (each to a temp name,
    renamed)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in hf_state.items() if k != "mask_embedding"}
    _atomic(out / WEIGHTS_FILE, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    # A copy of its own: a view (of weights placed for decoding, models/weight_memory.py)
    # would pickle the whole buffer it views.
    mask = {"mask_token_id": config["dflash_config"]["mask_token_id"],
            "embedding": hf_state["mask_embedding"].to(dtype).clone(
                memory_format=torch.contiguous_format)}
    _atomic(out / MASK_EMBEDDING_FILE, lambda p: torch.save(mask, p))
    _atomic(out / "config.json", lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))


def read_export(in_dir) -> tuple:
    """(config dict, HF-named tensors incl. mask_embedding) of an export, every tensor checked
    against the shapes the config implies (one line naming the file and tensor)."""
    from safetensors.torch import load_file

    src = Path(in_dir)
    for name in ("config.json", WEIGHTS_FILE, MASK_EMBEDDING_FILE):
        if not (src / name).is_file():
            raise FileNotFoundError(f"{src / name}: missing (a DFlash export holds config.json, "
                                    f"{WEIGHTS_FILE} and {MASK_EMBEDDING_FILE})")
    config = json.loads((src / "config.json").read_text())
    if config.get("architectures") != ["DFlashDraftModel"]:
        raise ValueError(f"{src / 'config.json'}: architectures must be ['DFlashDraftModel'], "
                         f"got {config.get('architectures')!r}")
    state = load_file(str(src / WEIGHTS_FILE))
    mask = torch.load(src / MASK_EMBEDDING_FILE, weights_only=True)
    if not isinstance(mask, dict) or "embedding" not in mask:
        raise ValueError(f"{src / MASK_EMBEDDING_FILE}: expected a dict with 'embedding'")
    if mask.get("mask_token_id") != config["dflash_config"]["mask_token_id"]:
        raise ValueError(f"{src / MASK_EMBEDDING_FILE}: mask_token_id {mask.get('mask_token_id')} "
                         f"!= config.json dflash_config.mask_token_id "
                         f"{config['dflash_config']['mask_token_id']}")
    state["mask_embedding"] = mask["embedding"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    expected = tensor_shapes(config["hidden_size"], config["intermediate_size"],
                             config["num_attention_heads"], config["num_key_value_heads"],
                             head_dim, config["num_hidden_layers"],
                             len(config["dflash_config"]["target_layer_ids"]))
    mapping.check_shapes(expected, {k: v.shape for k, v in state.items()}, src)
    extra = sorted(set(state) - set(expected))
    if extra:
        raise mapping.WeightMappingError(f"tensor {extra[0]!r} in {src}: not part of a DFlash draft")
    return config, state


def export_model(model, base_hf, out_dir, dtype: torch.dtype = None):
    """Write the draft of a base + DFlash model (this layout's shards gathered) as vLLM's
    DFlashDraftModel. Collective over the TP group; the last stage's first TP rank writes."""
    from megatron.core import parallel_state as ps

    draft = model.draft
    if draft is None:
        return None
    dtype = dtype or model.config.params_dtype
    state = gather_hf_state(draft, model.spec_config, draft.geometry)
    if ps.get_tensor_model_parallel_rank() == 0:
        write_export(out_dir, hf_config(base_hf, model.spec_config, draft.geometry, dtype),
                     state, dtype)
    return Path(out_dir)


def import_into(model, in_dir):
    """Load an export into this rank's DFlash draft, refusing one that does not fit the
    model's draft config (block layers, mask token, target layers) or base shapes."""
    config, state = read_export(in_dir)
    draft, cfg = model.draft, model.spec_config
    dcfg = config["dflash_config"]
    for key, want, got in (("num_hidden_layers", cfg.num_layers, config["num_hidden_layers"]),
                           ("dflash_config.mask_token_id", cfg.mask_token_id, dcfg["mask_token_id"]),
                           ("dflash_config.target_layer_ids", list(cfg.target_layer_ids),
                            list(dcfg["target_layer_ids"]))):
        if want != got:
            raise ValueError(f"{Path(in_dir) / 'config.json'}: {key} is {got!r}, the model's "
                             f"draft has {want!r}")
    if draft is not None:
        load_hf_state(draft, cfg, draft.geometry, state)
