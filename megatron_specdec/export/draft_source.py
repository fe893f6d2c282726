"""The draft module of a speculative checkpoint as global tensors, read one at a time.

torch.distributed.checkpoint gathers the TP shards and PP stages of any saved layout, so
exporters never reshard to TP=1 first. Only the draft's keys are read (the base can be
gigabytes), and only when the writer asks for them: an export holds one draft tensor and its
HF pieces at a time.
"""

from dataclasses import dataclass

from megatron_specdec import registry
from megatron_specdec.checkpointing import checkpoint
from megatron_specdec.checkpointing import hf_files as files, hf_mapping as mapping


@dataclass
class DraftSource:
    meta: dict
    hf_config: object  # the base's transformers config
    cfg: object  # the method's config (registry.config_from_dict)
    tensors: object  # files.CheckpointTensors: global tensors by name relative to the module


def draft_meta(ckpt_dir) -> dict:
    """A checkpoint's metadata with its draft entry under `draft`: a trainer's checkpoint
    keeps it under `training_checkpoint` (its draft tensors are a speculative checkpoint's)."""
    meta = checkpoint.read_meta(ckpt_dir)
    if "training_checkpoint" in meta:
        meta = dict(meta, draft=meta["training_checkpoint"]["draft"])
    return meta


def read_draft(ckpt_dir, algo: str) -> DraftSource:
    """The `algo` draft of a speculative or training checkpoint (its tensors read lazily); a
    clear error for anything else."""
    meta = draft_meta(ckpt_dir)
    if "draft" not in meta:
        raise checkpoint.CheckpointError(
            f"{ckpt_dir} holds no draft module (a base checkpoint): add one with "
            f"checkpoint_tools/convert_speculative.py and train it before exporting")
    cfg = registry.config_from_dict(meta["draft"])
    if registry.get(cfg.algo) is not registry.get(algo):
        raise checkpoint.CheckpointError(
            f"{ckpt_dir} holds a {cfg.algo} draft module, not {algo}")
    tensors = files.CheckpointTensors(ckpt_dir, prefix=f"{algo}.")
    return DraftSource(meta, checkpoint.hf_config_from_meta(meta), cfg, tensors)


def hf_stream(rules, source: DraftSource, geo, num_layers: int, dtype_name=None, kept=()):
    """(specs, stream) of the draft's HF tensors (mapping.split_stream), floating ones cast to
    `dtype_name` (None: as saved; d2t/t2d keep their integer types). A checkpoint tensor that
    no rule consumes (a table gap, e.g. a bias the family adds) is an error, never dropped,
    unless `kept` names it (a buffer the draft sets itself when attached)."""
    consumed = {meg for _, _, meg, _ in mapping.expand_rules(rules, num_layers)}
    unmapped = sorted(set(source.tensors) - consumed - set(kept))
    if unmapped:
        raise mapping.WeightMappingError(
            f"draft tensor(s) {', '.join(unmapped)} have no HF name in the weight table; "
            f"exporting would drop them")
    dtype = None if dtype_name is None else checkpoint.dtype_from_name(dtype_name)
    return mapping.split_stream(rules, source.tensors, geo, num_layers, dtype=dtype)
