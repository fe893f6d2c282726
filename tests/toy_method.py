"""A toy draft method from outside the package, as a plugin would be: one linear head on the
base's final hidden state predicting the token after next (a one-head Medusa without its
residual block). Every hook goes through
megatron_specdec.registry, so the trainer, generator and exporter reach it by name alone once
it is registered (`registry.register(METHOD)`)."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List

import torch

from megatron_specdec import registry

NAME = "toy_head"


@dataclass
class ToyConfig:
    init_std: float = 0.02

    algo = NAME

    @property
    def aux_layer_ids(self) -> List[int]:
        return []


def validate(cfg, num_layers, vocab_size):
    if not cfg.init_std > 0:
        raise registry.ConfigError(f"init_std={cfg.init_std} must be > 0")


def _head_class():
    from megatron.core.transformer.module import MegatronModule

    class ToyHead(MegatronModule):
        """Replicated Linear(h -> V): megatron's default sharded_state_dict stores it."""

        def __init__(self, config, vocab_size: int, init_std: float):
            super().__init__(config=config)
            self.proj = torch.nn.Linear(config.hidden_size, vocab_size, bias=False,
                                        dtype=config.params_dtype)
            torch.nn.init.normal_(self.proj.weight, std=init_std)

        def forward(self, hidden):
            return self.proj(hidden)

    return ToyHead


def attach(model, cfg, vocab_size, real_query_groups, seed, recompute, tokenizer_dir=None):
    from megatron_specdec.models.speculative import seeded_draft

    return seeded_draft(model, seed, lambda: _head_class()(model.config, vocab_size,
                                                           cfg.init_std))


def loss(model, state, input_ids, loss_mask, attention_mask) -> dict:
    """Cross-entropy of the head at position t against token t + 2 (TP=1: whole vocabulary)."""
    hidden, _ = model.base_head(state.residual)  # [s, b, h]
    logits = model.draft(hidden)[:-2].float()
    target, mask = input_ids.t()[2:], loss_mask.t()[2:].bool()
    logits, target = logits[mask], target[mask]
    ce = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
    n = torch.tensor(float(target.numel()), device=ce.device)
    return {"loss_sum": ce, "num_tokens": n, "step_loss": ce.detach()[None],
            "step_correct": (logits.argmax(-1) == target).sum()[None].float(),
            "step_count": n[None]}


class ToyProposer:
    """One draft a round: the head's argmax on the newest final hidden state of each row."""

    def __init__(self, model):
        self.head = model.draft
        self.hidden = None  # [1, b, h]

    def start(self, prompt, lengths, pending, out, max_length: int):
        self.hidden = out.hidden[-1:]

    def propose(self, k: int, policy):
        drafts = self.head(self.hidden)[0].argmax(-1)[:, None][:, :k]
        return drafts, torch.full((drafts.shape[0],), drafts.shape[1], dtype=torch.long,
                                  device=drafts.device)

    def accept(self, tokens, counts, out):
        self.hidden = out.hidden[-1:]

    def keep_rows(self, rows):
        self.hidden = self.hidden.index_select(1, rows.to(self.hidden.device))


def proposer(model, options):
    from megatron.core import parallel_state as ps

    return ToyProposer(model) if ps.is_pipeline_last_stage() else None


def export_hf(ckpt_dir, out_dir, dtype=None, overwrite=False, max_shard_mb=None):
    """The head as one safetensors file beside a config.json, written atomically."""
    from safetensors.torch import save_file

    from megatron_specdec.checkpointing import checkpoint
    from megatron_specdec.export import draft_source

    checkpoint.check_output_dir(out_dir, overwrite)
    source = draft_source.read_draft(ckpt_dir, NAME)
    with checkpoint.atomic_output(out_dir) as tmp:
        save_file({"lm_head.weight": source.tensors["proj.weight"].contiguous()},
                  str(tmp / "toy_head.safetensors"))
        (tmp / "config.json").write_text(json.dumps({"architectures": ["ToyHead"],
                                                     "hidden_size": source.hf_config.hidden_size}))
    return Path(out_dir)


METHOD = registry.DraftMethod(
    name=NAME, summary="test plugin: one linear head on the final hidden state",
    config_class=ToyConfig, validate=validate, attach=attach, on_base=True,
    captures_final=True, loss=loss, trainable=True, proposer=proposer,
    default_num_draft_tokens=lambda cfg: 1, draft_vocab_size=lambda model: model.vocab_size,
    export_hf=export_hf,
    engine_config=lambda draft_dir, k: registry.EngineConfig(vllm={"method": NAME}))


def train_worker(argv, result_file):
    """Spawned rank: the plugin registered, then a training run."""
    from megatron_specdec.training import load_recipe, train

    registry.register(METHOD, replace=True)
    torch.save(train(load_recipe(None, argv)), result_file)
