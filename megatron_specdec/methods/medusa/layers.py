"""Medusa heads as megatron-core tensor-parallel layers.

Head i is L residual blocks `x + SiLU(W x + b)` followed by its own lm_head; at position t
it predicts token t+2+i from the base model's final (normed) hidden state.
TP layout: each block's W is a ColumnParallelLinear with gather_output=True (every rank
computes h/TP output features, the all-gather restores the full x, whose residual add needs
all of it); the lm_head is ColumnParallel over the (padded) vocabulary without gathering, so
the loss runs vocab-parallel on the shards. lm_heads start as copies of the base lm_head.
"""

from typing import List

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import parallel_state as ps
from megatron.core.transformer.module import MegatronModule

from megatron_specdec.models.layers.sharded import ShardedModuleList
from megatron_specdec.models.layers.small_rows_linear import SmallRowsColumnParallelLinear



class MedusaResBlock(MegatronModule):
    def __init__(self, config):
        super().__init__(config=config)
        h = config.hidden_size
        # Medusa starts each block as the identity map: W = 0 (the bias starts at 0 too).
        self.linear = SmallRowsColumnParallelLinear(
            h, h, config=config, init_method=torch.nn.init.zeros_, bias=True, gather_output=True,
        )

    def forward(self, x: Tensor) -> Tensor:
        y, _ = self.linear(x)
        return x + F.silu(y)


class MedusaHead(MegatronModule):
    def __init__(self, config, num_layers: int, padded_vocab_size: int):
        super().__init__(config=config)
        self.blocks = ShardedModuleList(MedusaResBlock(config) for _ in range(num_layers))
        self.lm_head = SmallRowsColumnParallelLinear(
            config.hidden_size, padded_vocab_size, config=config,
            init_method=config.init_method, bias=False, gather_output=False,
        )

    def forward(self, hidden: Tensor) -> Tensor:
        for block in self.blocks:
            hidden = block(hidden)
        logits, _ = self.lm_head(hidden)
        return logits


class MedusaHeads(MegatronModule):
    """K heads; `forward(hidden [s, b, h])` -> K logits over this rank's vocabulary slice
    [s, b, Vp/TP], ids past the real vocabulary masked to -inf."""

    def __init__(self, config, num_heads: int, num_layers: int, vocab_size: int,
                 padded_vocab_size: int):
        super().__init__(config=config)
        self.heads = ShardedModuleList(
            MedusaHead(config, num_layers, padded_vocab_size) for _ in range(num_heads)
        )
        per_rank = padded_vocab_size // ps.get_tensor_model_parallel_world_size()
        self.vocab_offset = ps.get_tensor_model_parallel_rank() * per_rank
        self.register_buffer(
            "_padded_ids",
            torch.arange(self.vocab_offset, self.vocab_offset + per_rank) >= vocab_size,
            persistent=False,
        )

    @torch.no_grad()
    def init_lm_heads(self, base_lm_head_shard: Tensor):
        """Copy this rank's shard of the base lm_head [Vp/TP, h] into every head."""
        for head in self.heads:
            head.lm_head.weight.copy_(base_lm_head_shard)

    def forward(self, hidden: Tensor) -> List[Tensor]:
        return [head(hidden).masked_fill(self._padded_ids, float("-inf")) for head in self.heads]
