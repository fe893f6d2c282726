"""Counts the checkpoint tensors an export holds at once: every tensor
`files.CheckpointTensors.load` hands out is tracked until its storage's owner is freed (a
view keeps its base alive, so the pieces split from a tensor count as it)."""

import weakref

from megatron_specdec.checkpointing import hf_files as files


class LiveLoads:
    def __init__(self, monkeypatch):
        self.live = self.peak = self.loaded = 0
        original = files.CheckpointTensors.load

        def load(source, names):
            tensors = original(source, names)
            for tensor in tensors.values():
                owner = tensor if tensor._base is None else tensor._base
                self.live += 1
                self.loaded += 1
                weakref.finalize(owner, self._released)
            self.peak = max(self.peak, self.live)
            return tensors

        monkeypatch.setattr(files.CheckpointTensors, "load", load)

    def _released(self):
        self.live -= 1
