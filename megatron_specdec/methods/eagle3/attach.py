"""EAGLE3's draft module on a base GPT: built from its ModuleSpec on the last stage, drawn in the
HF layout from one seed (init.py) so every TP layout starts from the same draft, its lm_head
rows and final norm taken from the base unless `lm_head_init="random"`."""

import torch
import torch.distributed as dist

from megatron_specdec.models.speculative import base_lm_head, draft_layer_config, seeded_draft


def init_output(base, draft, cfg):
    if cfg.lm_head_init == "base":
        draft.init_output_from_base(base_lm_head(base), base.decoder.final_layernorm.weight)


def attach(model, cfg, vocab_size, real_query_groups, seed, recompute, tokenizer_dir=None):
    """This stage's EAGLE3 draft module (None before the last stage)."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_specdec.methods.eagle3 import init, specs

    def build():
        config = draft_layer_config(model.config, recompute)
        draft = build_module(
            specs.eagle3_module_spec(cfg), config=config,  # HF EAGLE3 layers: no q/k norm
            num_aux=len(cfg.aux_layer_ids), draft_vocab_size=cfg.draft_vocab_size,
            padded_draft_vocab_size=cfg.padded_draft_vocab_size, vocab_size=vocab_size,
            parallel_drafting=cfg.parallel_drafting,
        )
        init.initialize_draft(draft, config, cfg, real_query_groups, vocab_size, seed)
        init_output(model, draft, cfg)
        return draft

    draft = seeded_draft(model, seed, build)
    if cfg.parallel_drafting:
        set_mask_embed(model, draft, cfg.mask_token_id)
    return draft


@torch.no_grad()
def set_mask_embed(base, draft, mask_token_id: int):
    """The draft's `mask_embed` := the base's embedding of the mask token, which its mask
    positions read (as the engines do, from the shared embedding). Collective over the
    pipeline: the first stage looks it up and sends it to the last."""
    from megatron.core import parallel_state as ps

    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    if first:
        ids = torch.tensor([[mask_token_id]], device=base.embedding.word_embeddings.weight.device)
        row = base.embedding.word_embeddings(ids)[0, 0].float()
    if first and last:
        draft.mask_embed.copy_(row)
    elif first:
        dist.send(row.contiguous(), dst=ps.get_pipeline_model_parallel_last_rank())
    elif last:
        row = torch.empty(draft.mask_embed.shape, dtype=torch.float32,
                          device=draft.mask_embed.device)
        dist.recv(row, src=ps.get_pipeline_model_parallel_first_rank())
        draft.mask_embed.copy_(row)


def set_draft_vocab(model, d2t, t2d):
    """Install a calibrated draft vocabulary in a fresh EAGLE3 draft (this stage's, if any);
    lm_head rows initialised from the base follow their new target ids."""
    if model.draft is not None:
        model.draft.set_draft_vocab(d2t, t2d)
        init_output(model.base, model.draft, model.spec_config)
