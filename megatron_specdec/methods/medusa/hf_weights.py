"""Megatron <-> HF tensor names of Medusa heads (FasterDecoding layout).

HF: `{i}.{j}.linear.weight/bias` for block j of head i and `{i}.{L}.weight` for its lm_head
([vocab, h]). Megatron names are relative to the heads module (checkpoint prefix `medusa.`);
`{i}` is the head index.
"""

from megatron_specdec.checkpointing.hf_mapping import Rule

CHECKPOINT_PREFIX = "medusa."


def rules(cfg):
    """`cfg`: a MedusaConfig. Expand with num_layers=cfg.medusa_num_heads."""
    table = []
    for j in range(cfg.medusa_num_layers):
        block = f"heads.{{i}}.blocks.{j}.linear."
        table += [
            Rule(block + "weight", (f"{{i}}.{j}.linear.weight",), tp_dim=0),
            Rule(block + "bias", (f"{{i}}.{j}.linear.bias",), tp_dim=0),
        ]
    table.append(Rule("heads.{i}.lm_head.weight", (f"{{i}}.{cfg.medusa_num_layers}.weight",),
                      "vocab", 0))
    return table
