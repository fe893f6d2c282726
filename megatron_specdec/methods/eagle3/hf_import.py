"""Import a Hugging Face EAGLE3 draft (the LlamaForCausalLMEagle3 layout published by EAGLE,
SpecForge and ModelOpt, or written by eagle3_hf) into a Megatron speculative checkpoint at any
TP/PP, on top of a base checkpoint, to continue training.

Everything is checked in the calling process before any process starts or anything is
written: the draft must fit the base (hidden size, heads, MLP width, vocabulary, norm epsilon,
rope), every tensor the layout defines must be present with its shape, and d2t/t2d must agree.
"""

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import torch

from megatron_specdec.checkpointing import checkpoint
from megatron_specdec.models import families
from megatron_specdec import registry
from megatron_specdec.methods.eagle3 import hf_export as eagle3_hf
from megatron_specdec.methods.eagle3 import hf_weights as eagle3
from megatron_specdec.checkpointing import hf_files as files, hf_mapping as mapping

log = logging.getLogger(__name__)

ARCHITECTURES = (eagle3_hf.ARCHITECTURE, "Eagle3LlamaForCausalLM")
_IGNORED = ("embed_tokens.weight",)  # the draft shares the base's embedding


class DraftMismatchError(ValueError):
    pass


def read_hf_draft(draft_dir):
    """(config dict, tensors) of an HF EAGLE3 draft directory."""
    from megatron_specdec.loading.hf_conversion import read_hf_state

    draft_dir = Path(draft_dir)
    if not (draft_dir / eagle3_hf.CONFIG).is_file():
        raise FileNotFoundError(
            f"{draft_dir}/{eagle3_hf.CONFIG} not found: not an HF draft directory")
    config = files.read_json(draft_dir / eagle3_hf.CONFIG)
    tensors = read_hf_state(draft_dir)
    if config.get("num_hidden_layers", 1) == 1:  # ModelOpt 0.47 writes layers.0.*, as vLLM reads
        tensors = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                   for k, v in tensors.items()}
    return config, tensors


def _aux_layer_ids(config: dict):
    """Output-of-layer ids from `eagle_config` (ModelOpt/SGLang), else from vLLM's top-level
    key (one higher); None: the default for the base."""
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if nested is not None and top is not None and list(top) != eagle3_hf.vllm_layer_ids(nested):
        raise DraftMismatchError(
            f"eagle_config.eagle_aux_hidden_state_layer_ids={nested} (output of layer) and "
            f"vLLM's eagle_aux_hidden_state_layer_ids={top} name different layers")
    if nested is not None:
        return list(nested)
    return [i - 1 for i in top] if top is not None else None


def check_fits(config: dict, base) -> None:
    """The draft layer is built from the base's TransformerConfig: its shape must be the base's."""
    archs = config.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        raise DraftMismatchError(f"architectures={archs}: not an EAGLE3 draft "
                                 f"(expected one of {', '.join(ARCHITECTURES)})")
    target_h = config.get("target_hidden_size", base.hidden_size)
    rope_theta = families.rope_settings(base)["rotary_base"]
    expected = {
        "hidden_size": base.hidden_size, "target_hidden_size": base.hidden_size,
        "vocab_size": base.vocab_size, "num_attention_heads": base.num_attention_heads,
        "num_key_value_heads": families.query_groups(base),
        "intermediate_size": base.intermediate_size, "rms_norm_eps": base.rms_norm_eps,
        "rope_theta": rope_theta,
    }
    found = dict(config, target_hidden_size=target_h)
    found.setdefault("num_key_value_heads", config.get("num_attention_heads"))
    found.setdefault("rope_theta", 10000.0)  # what the EAGLE runtime assumes when it is absent
    for key, want in expected.items():
        if key in ("rms_norm_eps", "rope_theta"):
            same = abs(float(found.get(key, want)) - float(want)) <= 1e-12 * max(1.0, abs(want))
        else:
            same = found.get(key) == want
        if not same:
            raise DraftMismatchError(
                f"draft {key}={found.get(key)!r} does not match the target model's {want!r}")
    _check_rope_scaling(config, base)
    if config.get("head_dim") not in (None, families.head_dim(base)):
        raise DraftMismatchError(f"draft head_dim={config['head_dim']} does not match the "
                                 f"target model's {families.head_dim(base)}")


def _check_rope_scaling(config: dict, base) -> None:
    """The draft runs with the base's RoPE (model_provider builds both from the base config);
    a draft that says it was trained with another scaling would be run wrongly, so it is
    refused rather than ignored."""
    want = {k: v for k, v in families.rope_settings(base).items() if k != "rotary_base"}
    draft = SimpleNamespace(**{k: config[k] for k in ("rope_scaling", "rope_parameters")
                               if config.get(k)})
    try:
        found = {k: v for k, v in families.rope_settings(draft).items() if k != "rotary_base"}
    except families.UnsupportedModelError as e:
        found = {"rope_scaling": f"unsupported ({e})"}
    if found != want:
        raise DraftMismatchError(
            f"draft rope_scaling={config.get('rope_scaling', config.get('rope_parameters'))!r} "
            f"does not match the target model's RoPE ({want}); if the draft was trained with the "
            f"base's RoPE and only its config says otherwise, correct the config")


def draft_config(config: dict, tensors: dict, base):
    """The validated Eagle3Config the HF draft describes."""
    layers = config.get("num_hidden_layers", 1)
    first = eagle3.layer_prefix(layers, 0)
    raw = {
        "eagle_num_layers": layers,
        "draft_vocab_size": config.get("draft_vocab_size") or base.vocab_size,
        "eagle_aux_hidden_state_layer_ids": _aux_layer_ids(config),
        "use_input_layernorm_in_first_layer": first + "input_layernorm.weight" in tensors,
        "use_last_layernorm": "norm.weight" in tensors,
    }
    if config.get("parallel_drafting"):
        positions = (config.get("eagle_config") or {}).get("parallel_draft_positions")
        raw.update(parallel_drafting=True, mask_token_id=config.get("mask_token_id"),
                   **({} if positions is None else {"ttt_steps": positions}))
    return registry.parse_config("eagle3", raw, base.num_hidden_layers, base.vocab_size)


def start_parallel_drafting(config: dict, tensors: dict, base, layers=None, seed=1234):
    """A chain EAGLE3 draft as the start of a parallel-drafting one: the same weights, the
    base's last vocabulary id as mask token, mask_hidden zero until the import worker starts
    it from the base's states (mask_init.start_mask_hidden). `layers` > the draft's: the
    layers added after it start as the identity (attention and MLP outputs zero, the rest
    drawn from `seed`), so the draft starts drafting as the chain draft did; the mask
    positions, which see the context through attention alone, get layers whose queries
    depend on what the first layer read."""
    if config.get("parallel_drafting"):
        raise DraftMismatchError("the draft already drafts in parallel (config.json "
                                 "parallel_drafting: true)")
    num_aux = len(_aux_layer_ids(config) or [0, 0, 0])
    dtype = next(v.dtype for v in tensors.values() if v.is_floating_point())
    have = config.get("num_hidden_layers", 1)
    if layers is not None and layers != have:
        if layers < have:
            raise DraftMismatchError(f"--draft-layers {layers}: the draft has {have} layers "
                                     f"(layers can be added, not removed)")
        tensors = _with_identity_layers(config, tensors, have, layers, base, dtype, seed)
        config = dict(config, num_hidden_layers=layers)
    config = dict(config, parallel_drafting=True, mask_token_id=base.vocab_size - 1)
    return config, dict(tensors, mask_hidden=torch.zeros(1, num_aux * base.hidden_size,
                                                         dtype=dtype))


def _with_identity_layers(config, tensors, have, layers, base, dtype, seed):
    """`tensors` renamed to the layers.{i} layout with layers have..layers-1 added as the
    identity (o_proj and down_proj zero, norms one, other weights drawn at the base's
    initializer_range)."""
    if have == 1:
        tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
                   for k, v in tensors.items()}
    shapes = eagle3.tensor_shapes(dict(config, num_hidden_layers=layers,
                                       draft_vocab_size=tensors["lm_head.weight"].shape[0]))
    generator = torch.Generator().manual_seed(seed)
    std = float(getattr(base, "initializer_range", 0.02))
    added = dict(tensors)
    for name in sorted(shapes):
        if name in tensors or not name.startswith("layers."):
            continue
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            value = torch.zeros(shapes[name])
        elif name.endswith("norm.weight"):
            value = torch.ones(shapes[name])
        else:
            value = torch.randn(shapes[name], generator=generator) * std
        added[name] = value.to(dtype)
    return added


def check_tensors(config: dict, cfg, tensors: dict, draft_dir) -> dict:
    """Every tensor present with its shape, no unknown ones, d2t/t2d agreeing; missing
    d2t/t2d mean the identity vocabulary. Returns the tensors to import."""
    shape_config = dict(config, draft_vocab_size=cfg.draft_vocab_size,
                        num_hidden_layers=cfg.eagle_num_layers,
                        eagle_config={"eagle_aux_hidden_state_layer_ids": cfg.aux_layer_ids,
                                      "use_last_layernorm": cfg.use_last_layernorm,
                                      "use_input_layernorm_in_first_layer":
                                          cfg.use_input_layernorm_in_first_layer})
    expected = eagle3.tensor_shapes(shape_config)
    tensors = {k: v for k, v in tensors.items() if k not in _IGNORED}
    full_vocab = cfg.draft_vocab_size == config["vocab_size"]
    if "d2t" not in tensors and "t2d" not in tensors and full_vocab:
        tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
        tensors["t2d"] = torch.ones(config["vocab_size"], dtype=torch.bool)
    if "d2t" in tensors and "t2d" not in tensors:  # ModelOpt writes d2t alone (engines skip t2d)
        targets = torch.arange(tensors["d2t"].numel()) + tensors["d2t"].long()
        if targets.min() < 0 or targets.max() >= config["vocab_size"]:
            raise DraftMismatchError(f"{draft_dir}: d2t maps outside the vocabulary "
                                     f"[0, {config['vocab_size']})")
        tensors["t2d"] = torch.zeros(config["vocab_size"], dtype=torch.bool)
        tensors["t2d"][targets] = True
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise mapping.WeightMappingError(f"{draft_dir}: unexpected tensor(s) {', '.join(unknown)}")
    mapping.check_shapes(expected, {k: tuple(v.shape) for k, v in tensors.items()}, draft_dir)
    d2t, t2d = tensors["d2t"].long(), tensors["t2d"].bool()
    targets = torch.arange(d2t.numel()) + d2t
    if not torch.equal(t2d.nonzero().flatten(), targets):
        raise DraftMismatchError(f"{draft_dir}: d2t and t2d disagree (t2d must mark exactly "
                                 f"draft_id + d2t[draft_id], in increasing order)")
    return dict(tensors, d2t=d2t, t2d=t2d)


def check_export(draft_dir, base_dir):
    """An exported draft directory checked against the HF base `base_dir` as an import checks
    it: its config, or an error naming the file, tensor or key at fault."""
    from transformers import AutoConfig

    base = AutoConfig.from_pretrained(base_dir)
    config, tensors = read_hf_draft(draft_dir)
    check_fits(config, base)
    cfg = draft_config(config, tensors, base)
    check_tensors(config, cfg, tensors, draft_dir)
    return cfg


def _import_worker(base_ckpt, out_ckpt, cfg_entry, global_draft, tp, pp, overwrite,
                   mask_sequences=None):
    from megatron.core import parallel_state as ps

    from megatron_specdec import distributed
    from megatron_specdec.loading.base import load_base_model
    from megatron_specdec.loading.speculative import save_speculative
    from megatron_specdec.models.speculative import attach

    distributed.initialize(tp, pp)
    meta = checkpoint.base_meta_of(checkpoint.read_meta(base_ckpt))
    base, hf_config = load_base_model(base_ckpt, meta)
    cfg = registry.config_from_dict(cfg_entry)
    model = attach(base, cfg, hf_config)
    if model.draft is not None:
        mapping.load_into_model(model.draft, eagle3.rules(cfg), global_draft, cfg.eagle_num_layers,
                                0, ps.get_tensor_model_parallel_rank(),
                                ps.get_tensor_model_parallel_world_size(), kept=eagle3.KEPT)
    if mask_sequences is not None:
        from megatron_specdec.methods.eagle3.mask_init import start_mask_hidden

        start_mask_hidden(model, mask_sequences)
    save_speculative(model, out_ckpt, meta, Path(base_ckpt) / checkpoint.TOKENIZER_DIR, overwrite)


def import_eagle3(draft_dir, base_ckpt, out_ckpt, tp=1, pp=1, overwrite=False,
                  parallel_drafting=None, draft_layers=None):
    """HF EAGLE3 draft + base (or speculative) checkpoint -> speculative checkpoint at TP x PP;
    `parallel_drafting`: a chain draft imported as the start of a parallel-drafting one
    (`start_parallel_drafting`), its mask_hidden started from the base's states over these
    token id lists (mask_init; the base runs whole: pp 1), with `draft_layers` layers (those
    added start as the identity).

    Runs in the current process group when it has tp*pp ranks, else spawns tp*pp local
    processes. Returns the draft's Eagle3Config."""
    import torch.distributed as dist

    from megatron_specdec import distributed

    meta = checkpoint.base_meta_of(checkpoint.read_meta(base_ckpt))
    base = checkpoint.hf_config_from_meta(meta)
    config, tensors = read_hf_draft(draft_dir)
    check_fits(config, base)
    if parallel_drafting is not None:
        if pp != 1:
            raise ValueError(f"--parallel-drafting: import at --pp 1 (mask_hidden starts from "
                             f"the whole base's states; got --pp {pp}), then train at any layout")
        config, tensors = start_parallel_drafting(config, tensors, base, draft_layers)
    elif draft_layers is not None:
        raise ValueError("--draft-layers: read only with --parallel-drafting")
    cfg = draft_config(config, tensors, base)
    tensors = check_tensors(config, cfg, tensors, draft_dir)
    families.transformer_config(base, tp=tp, pp=pp,
                                num_query_groups=meta["padding"]["query_groups"])
    checkpoint.check_output_dir(out_ckpt, overwrite, "checkpoint directory")
    dtype = checkpoint.dtype_from_name(meta["dtype"])
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    global_draft = mapping.hf_to_megatron(eagle3.rules(cfg), tensors,
                                          eagle3.geometry(base, meta["padding"], cfg),
                                          cfg.eagle_num_layers)
    args = (str(base_ckpt), str(out_ckpt), registry.config_to_dict(cfg), global_draft, tp, pp,
            overwrite, parallel_drafting)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == tp * pp and (dist.is_initialized() or tp * pp == 1):
        _import_worker(*args)
    else:
        distributed.spawn(_import_worker, tp * pp, *args)
    log.info("imported %s onto %s: %s (TP=%d, PP=%d)", draft_dir, base_ckpt, out_ckpt, tp, pp)
    return cfg
