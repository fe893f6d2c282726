"""Base checkpoint -> speculative checkpoint (checkpoint_tools/convert_speculative.py): the
base loads through the front door (loading.source), the method's draft is attached and
initialised (models.speculative.attach), and both are saved as one checkpoint
(loading.speculative).
"""

from pathlib import Path

from megatron_specdec import registry
from megatron_specdec.checkpointing import checkpoint
from megatron_specdec.loading import source as loading
from megatron_specdec.loading.speculative import save_speculative
from megatron_specdec.models.speculative import attach, set_draft_vocab


def _base_checkpoint_meta(path) -> dict:
    meta = checkpoint.read_meta(path)
    if "draft" in meta:
        raise checkpoint.CheckpointError(
            f"{path} already holds a {meta['draft']['algo']} draft module; convert a base checkpoint"
        )
    return checkpoint.base_meta_of(meta)


def calibrate_draft_vocab(model_path, calibration_data, draft_vocab_size: int, vocab_size: int):
    """(d2t, t2d) from the token frequencies of conversation jsonl files, tokenized with the
    checkpoint's own tokenizer and chat template."""
    from megatron_specdec.data import calibrate, load_tokenizer

    tokenizer = load_tokenizer(str(Path(model_path) / checkpoint.TOKENIZER_DIR))
    vocab = calibrate(calibration_data, tokenizer, draft_vocab_size, vocab_size=vocab_size)
    return vocab.d2t, vocab.t2d


def _convert_worker(model_path, export_dir, cfg_entry, draft_vocab, tp, pp, overwrite):
    from megatron_specdec import distributed

    distributed.initialize(tp, pp)
    loaded = loading.load_model(model_path, with_draft=False)
    model = attach(loaded.model, registry.config_from_dict(cfg_entry), loaded.hf_config)
    if draft_vocab is not None:
        set_draft_vocab(model, *draft_vocab)
    save_speculative(model, export_dir, loaded.base_meta, loaded.tokenizer_dir, overwrite)


def convert_checkpoint(model_path, export_dir, algo, config=None, calibration_data=None,
                       tp=1, pp=1, overwrite=False):
    """Base dist checkpoint -> speculative dist checkpoint (draft initialised, base frozen).

    Everything that can be wrong with the inputs is checked before any process starts or
    any file is written. Runs in the current torchrun group if there is one, else spawns
    tp * pp local processes. Returns the validated draft config.
    """
    import torch.distributed as dist

    from megatron_specdec import distributed
    from megatron_specdec.models import families

    meta = _base_checkpoint_meta(model_path)
    hf_config = checkpoint.hf_config_from_meta(meta)
    cfg = registry.parse_config(algo, config, hf_config.num_hidden_layers, hf_config.vocab_size)
    families.transformer_config(hf_config, tp=tp, pp=pp, num_query_groups=meta["padding"]["query_groups"])
    checkpoint.check_output_dir(export_dir, overwrite, "export directory")
    draft_vocab = None
    calibrated = registry.get(cfg.algo).set_draft_vocab is not None
    if calibration_data:
        if not calibrated:
            raise ValueError(f"--calibration_data builds an EAGLE3 draft vocabulary; "
                             f"{cfg.algo} has none")
        draft_vocab = calibrate_draft_vocab(model_path, calibration_data, cfg.draft_vocab_size,
                                            hf_config.vocab_size)
    elif calibrated and cfg.draft_vocab_size < hf_config.vocab_size:
        raise ValueError(
            f"draft_vocab_size={cfg.draft_vocab_size} < vocabulary {hf_config.vocab_size}: a "
            f"reduced draft vocabulary needs --calibration_data to choose its tokens"
        )
    args = (str(model_path), str(export_dir), registry.config_to_dict(cfg), draft_vocab, tp, pp,
            overwrite)
    if (dist.is_initialized() and dist.get_world_size() == tp * pp) or tp * pp == 1:
        _convert_worker(*args)  # under torchrun, or a single process
    else:
        distributed.spawn(_convert_worker, tp * pp, *args)
    return cfg
