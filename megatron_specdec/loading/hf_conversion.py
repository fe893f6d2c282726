"""Hugging Face <-> Megatron conversion of base models, through the declarative weight table.

Both directions stream: no process holds a second copy of the model. Import: every rank of a
TP x PP group builds its shard and fills it one HF tensor at a time (merged, sliced, copied,
dropped), then the group saves one dist checkpoint. Export: one process reads the dist
checkpoint (any saved layout) one tensor at a time and appends it to safetensors files
(sharded under a size limit, with an index) that `transformers` loads.
"""

import logging
from pathlib import Path

import torch

from megatron_specdec.checkpointing import checkpoint
from megatron_specdec import distributed
from megatron_specdec.models import families
from megatron_specdec.models.default_model import resolve_model_path
from megatron_specdec.models.provider import build_model, resolve_transformer_impl
from megatron_specdec.checkpointing import (
    hf_files as files,
    hf_llama as llama,
    hf_mapping as mapping,
    hf_moe as moe,
)

log = logging.getLogger(__name__)

# Exported base weights are split into files of at most this size, as transformers does.
DEFAULT_MAX_SHARD_MB = 5 * 1024


def read_hf_config(hf_dir):
    from transformers import AutoConfig

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir}/config.json not found: not a Hugging Face model directory")
    files.read_json(hf_dir / "config.json")  # a file that does not parse is named, as such
    config = AutoConfig.from_pretrained(hf_dir)
    families.family_of(config)  # refuse unsupported architectures before reading weights
    return config


def read_hf_state(hf_dir, dtype=None) -> dict:
    """All tensors of an HF checkpoint (single file or sharded with an index), in memory."""
    return dict(files.HFTensors(hf_dir, dtype))


def check_hf_state(hf_config, shapes: dict, hf_dir):
    """Every tensor the architecture defines is present with its shape ({name: shape}, checked
    against the transformers model built on the meta device), named with file, expected and
    found."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(hf_config)
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    family = families.family_of(hf_config)
    if family.moe:
        expected = moe.disk_shapes(family.name, expected)
    mapping.check_shapes(expected, shapes, hf_dir)


def weight_rules(hf_config):
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    family = families.family_of(hf_config)
    return moe.rules(family.name, tied) if family.moe else llama.rules(tied)


def load_hf_into_model(model, hf_config, hf_state):
    """Fill this rank's model shard from HF tensors (a dict, or files.HFTensors, which reads
    only this rank's slices): one tensor is merged and copied at a time, only this stage's."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    layers_per_stage = hf_config.num_hidden_layers // ps.get_pipeline_model_parallel_world_size()
    rules = weight_rules(hf_config)
    global_state = mapping.MergedTensors(
        rules, hf_state, mapping.Geometry.from_hf(hf_config, model.padding),
        hf_config.num_hidden_layers,
    )
    experts = (0, 0, 1)
    if families.family_of(hf_config).moe:  # this EP rank's experts, split over expert TP
        local = families.num_experts(hf_config) // ps.get_expert_model_parallel_world_size()
        experts = (ps.get_expert_model_parallel_rank() * local,
                   ps.get_expert_tensor_parallel_rank(),
                   ps.get_expert_tensor_parallel_world_size())
    mapping.load_into_model(
        model, rules, global_state, hf_config.num_hidden_layers, pp_rank * layers_per_stage,
        ps.get_tensor_model_parallel_rank(), tp, experts,
    )


def model_from_hf(hf_dir, dtype=torch.float32, transformer_impl="auto"):
    """This rank's shard of a Megatron GPTModel holding the weights of an HF directory, each
    rank reading only its slices, one tensor at a time (peak host memory: the shard plus about
    one slice). Built uninitialised: every parameter is overwritten (a missing one is an
    error), and megatron's CPU initialisation would build each global weight in fp32."""
    hf_dir = resolve_model_path(hf_dir)
    config = read_hf_config(hf_dir)
    state = files.HFTensors(hf_dir, dtype)
    check_hf_state(config, state.shapes(), hf_dir)
    model = build_model(config, dtype=dtype, transformer_impl=transformer_impl,
                        perform_initialization=False)
    load_hf_into_model(model, config, state)
    # Modules built later on this config (a Medusa draft's zero-initialised blocks) initialise.
    model.config.perform_initialization = True
    return model, config


def base_meta(hf_config, model, dtype, transformer_impl) -> dict:
    return {
        "hf_config": hf_config.to_dict(),
        "transformer_impl": transformer_impl,
        "dtype": checkpoint.dtype_name(dtype),
        "padding": model.padding,
    }


def _import_worker(hf_dir, out_dir, tp, pp, dtype_name, overwrite, transformer_impl, ep=1):
    distributed.initialize(tp, pp, ep=ep)
    dtype = checkpoint.dtype_from_name(dtype_name)
    model, config = model_from_hf(hf_dir, dtype, transformer_impl)
    checkpoint.save_checkpoint(
        model, out_dir, base_meta(config, model, dtype, resolve_transformer_impl(transformer_impl)),
        tokenizer_dir=hf_dir, overwrite=overwrite,
    )


def hf_to_megatron(hf_dir, out_dir, tp=1, pp=1, dtype="float32", overwrite=False,
                   transformer_impl="auto", ep=1):
    """Import an HF model directory (or 'default') into a dist checkpoint at TP x PP (x EP:
    the expert parallel size of an MoE family, each rank reading only its experts).

    Runs in the current process group when it has tp*pp*ep ranks (torchrun, or one process),
    else spawns tp*pp*ep local processes. The checkpoint loads at any TP/PP/EP:
    dist_checkpointing stores the experts on a global expert axis.
    """
    import torch.distributed as dist

    hf_dir = resolve_model_path(hf_dir)
    config = read_hf_config(hf_dir)
    # layout errors (an EP that does not divide the experts) before any process starts
    families.transformer_config(config, tp=tp, pp=pp, ep=ep)
    checkpoint.check_output_dir(out_dir, overwrite, "checkpoint directory")
    args = (str(hf_dir), str(out_dir), tp, pp, dtype, overwrite, transformer_impl, ep)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == tp * pp * ep:
        _import_worker(*args)
    else:
        distributed.spawn(_import_worker, tp * pp * ep, *args)
    return Path(out_dir)


def hf_config_for_export(config, dtype_name):
    config = type(config).from_dict(config.to_dict())
    if not getattr(config, "architectures", None):
        config.architectures = [
            arch for arch, fam in families.FAMILIES.items() if fam == families.family_of(config)
        ][:1]
    config.dtype = dtype_name
    return config


def megatron_to_hf(ckpt_dir, out_dir, overwrite=False, max_shard_mb=DEFAULT_MAX_SHARD_MB,
                   index=False):
    """Export the base model of a dist checkpoint to an HF directory (config, safetensors,
    tokenizer), streamed: one Megatron tensor (one layer's) is read, split and written at a
    time, so peak memory is about the largest tensor. Files of at most `max_shard_mb` (None:
    one file) with an index when there are several; `index`: write the index for one file too
    (the EAGLE reference runtime finds the base embedding through it)."""
    checkpoint.check_output_dir(out_dir, overwrite)
    meta = checkpoint.read_meta(ckpt_dir)
    config = checkpoint.hf_config_from_meta(meta)
    n = config.num_hidden_layers
    specs, stream = mapping.split_stream(
        weight_rules(config), files.CheckpointTensors(ckpt_dir),
        mapping.Geometry.from_hf(config, meta["padding"]), n,
        groups=[(None,)] + [(i,) for i in range(n)])  # non-layer tensors, then layer by layer
    limit = None if max_shard_mb is None else int(max_shard_mb * 2**20)
    with checkpoint.atomic_output(out_dir) as tmp:
        hf_config_for_export(config, meta["dtype"]).save_pretrained(tmp)
        files.write_sharded(tmp, specs, stream, limit, index=index, metadata={"format": "pt"})
        checkpoint.copy_tokenizer(Path(ckpt_dir) / checkpoint.TOKENIZER_DIR, tmp)
    return Path(out_dir)
