"""A separate draft GPT attached for distillation: read whole on every rank from its own
checkpoint (refused unless it is a plain GPT of the base's vocabulary and tokenizer), kept on
the last stage, trainable."""


def load_draft_gpt(path, dtype, vocab_size: int, tokenizer_dir=None):
    """The draft GPT of checkpoint `path` in `dtype`, whole on this rank, trainable, as a
    DraftGPT. Collective over the world: the checkpoint reader is."""
    from megatron_specdec.methods.draft_model.layers import DraftGPT
    from megatron_specdec.methods.draft_model.proposer import load_draft_model

    gpt = load_draft_model(path, vocab_size, tokenizer_dir, dtype)
    return DraftGPT(gpt.requires_grad_(True).train())


def attach(model, cfg, vocab_size, real_query_groups, seed, recompute, tokenizer_dir=None):
    """The draft GPT of `cfg.model` (read on every rank; None before the last stage)."""
    draft = load_draft_gpt(cfg.model, model.config.params_dtype, vocab_size, tokenizer_dir)
    return draft if model.post_process else None


def save_trained(model, path, base_meta: dict, tokenizer_dir=None, record=None):
    """The trained draft alone as a plain GPT checkpoint (what `--drafter draft_model` and
    megatron_to_hf read), its metadata the starting checkpoint's plus `distilled` (`record`)."""
    from megatron_specdec.checkpointing import checkpoint
    from megatron_specdec.methods.draft_model.layers import replicas

    meta = checkpoint.base_meta_of(checkpoint.read_meta(model.spec_config.model))
    meta.update(dtype=checkpoint.dtype_name(model.config.params_dtype), distilled=record or {})
    draft = model.draft  # the last stage's; other stages write nothing
    state = replicas(draft.gpt.sharded_state_dict()) if draft is not None else {}
    return checkpoint.save_checkpoint(None, path, meta, tokenizer_dir, overwrite=True,
                                      sharded_state_dict=state)
