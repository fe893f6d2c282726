"""Base model + draft module in one directory an engine can be pointed at:

    out/base/     the base model (hf_conversion.megatron_to_hf) with model.safetensors.index.json
    out/<algo>/   the draft (its method's export_hf hook, e.g. methods/eagle3/hf_export.py)

e.g. `vllm serve out/base --speculative-config '{"method": "eagle3", "model": "out/eagle3"}'`,
`sglang ... --model out/base --speculative-draft-model-path out/eagle3`. The index is written
because the EAGLE reference runtime finds the base embedding through it.
"""

from pathlib import Path

from megatron_specdec import registry
from megatron_specdec.checkpointing import checkpoint
from megatron_specdec.loading import hf_conversion

BASE_DIR = "base"


def export_full(ckpt_dir, out_dir, overwrite=False):
    """out/base and out/<algo> from one speculative checkpoint (any saved TP/PP). The draft
    is read and checked first, so a checkpoint without one writes nothing. Tensors keep the
    checkpoint's dtype."""
    checkpoint.check_output_dir(out_dir, overwrite)
    meta = checkpoint.read_meta(ckpt_dir)
    if "draft" not in meta:
        raise checkpoint.CheckpointError(
            f"{ckpt_dir} holds no draft module (a base checkpoint): add one with "
            f"checkpoint_tools/convert_speculative.py and train it before exporting")
    algo = meta["draft"]["algo"]
    export_hf = registry.get(algo).export_hf
    if export_hf is None:
        raise checkpoint.CheckpointError(f"{ckpt_dir}: a {algo} draft has no HF export")
    with checkpoint.atomic_output(out_dir) as tmp:
        export_hf(ckpt_dir, tmp / algo)
        hf_conversion.megatron_to_hf(ckpt_dir, tmp / BASE_DIR, index=True)
    return Path(out_dir)
