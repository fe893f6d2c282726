"""The draft module of a speculative checkpoint as global tensors, read in one process.

dist_checkpointing gathers the TP shards and PP stages of any saved layout, so exporters never
reshard to TP=1 first. Only the draft's keys are read (the base can be gigabytes).
"""

from dataclasses import dataclass

from megatron_specdec import checkpoint, spec_config
from megatron_specdec.weights import mapping


@dataclass
class DraftSource:
    meta: dict
    hf_config: object  # the base's transformers config
    cfg: object  # spec_config.Eagle3Config or MedusaConfig
    tensors: dict  # global tensors, names relative to the draft module (no `eagle3.` prefix)


def draft_meta(ckpt_dir) -> dict:
    """A checkpoint's metadata with its draft entry under `draft`: a trainer's checkpoint
    keeps it under `training_checkpoint` (its draft tensors are a speculative checkpoint's)."""
    meta = checkpoint.read_meta(ckpt_dir)
    if "training_checkpoint" in meta:
        meta = dict(meta, draft=meta["training_checkpoint"]["draft"])
    return meta


def read_draft(ckpt_dir, algo: str) -> DraftSource:
    """The `algo` draft of a speculative or training checkpoint; a clear error for anything
    else."""
    meta = draft_meta(ckpt_dir)
    if "draft" not in meta:
        raise checkpoint.CheckpointError(
            f"{ckpt_dir} holds no draft module (a base checkpoint): add one with "
            f"checkpoint_tools/convert_speculative.py and train it before exporting")
    cfg = spec_config.from_dict(meta["draft"])
    if cfg.algo != algo:
        raise checkpoint.CheckpointError(
            f"{ckpt_dir} holds a {cfg.algo} draft module, not {algo}")
    tensors = checkpoint.load_plain_tensors(ckpt_dir, prefix=f"{algo}.")
    return DraftSource(meta, checkpoint.hf_config_from_meta(meta), cfg, tensors)


def to_hf(rules, tensors: dict, geo, num_layers: int) -> dict:
    """Draft tensors -> HF tensors through the draft weight table; a checkpoint tensor that no
    rule consumes (a table gap, e.g. a bias the family adds) is an error, never dropped."""
    consumed = {meg for _, _, meg, _ in mapping.expand_rules(rules, num_layers)}
    unmapped = sorted(set(tensors) - consumed)
    if unmapped:
        raise mapping.WeightMappingError(
            f"draft tensor(s) {', '.join(unmapped)} have no HF name in the weight table; "
            f"exporting would drop them")
    return {k: v.contiguous() for k, v in
            mapping.megatron_to_hf(rules, tensors, geo, num_layers).items()}


def cast(hf_state: dict, dtype_name) -> dict:
    """Floating tensors to `dtype_name` (None: as saved); d2t/t2d keep their integer types."""
    if dtype_name is None:
        return hf_state
    dtype = checkpoint.dtype_from_name(dtype_name)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in hf_state.items()}
