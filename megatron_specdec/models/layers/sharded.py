"""A ModuleList that dist checkpointing can see into.

megatron-core's default `sharded_state_dict` treats any child without that method as one
replicated leaf, so a plain ModuleList of tensor-parallel layers would be saved as if every
rank held the whole weights. This list hands each entry its own prefix instead.
"""

import torch

from megatron.core.transformer.utils import sharded_state_dict_default


class ShardedModuleList(torch.nn.ModuleList):
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        out = {}
        for i, module in enumerate(self):
            out.update(sharded_state_dict_default(module, f"{prefix}{i}.", sharded_offsets, metadata))
        return out
