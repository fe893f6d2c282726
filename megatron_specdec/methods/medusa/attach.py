"""Medusa's heads on a base GPT: identity residual blocks and lm_heads copied from the base's."""

from megatron_specdec.models.speculative import base_lm_head, draft_layer_config, seeded_draft


def attach(model, cfg, vocab_size, real_query_groups, seed, recompute, tokenizer_dir=None):
    """This stage's Medusa heads (None before the last stage)."""
    from megatron_specdec.methods.medusa.layers import MedusaHeads

    def build():
        draft = MedusaHeads(draft_layer_config(model.config, recompute), cfg.medusa_num_heads,
                            cfg.medusa_num_layers, vocab_size, model.vocab_size)
        draft.init_lm_heads(base_lm_head(model))
        return draft

    return seeded_draft(model, seed, build)
