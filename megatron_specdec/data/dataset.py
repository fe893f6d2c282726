"""Fixed-shape training batches from tokenized conversations: padding or packing, seeded and resumable.

Packing puts several whole conversations into one `seq_length` row (greedily, in a seeded
order; a conversation that does not fit starts the next row, none is split, so none loses
its context). Boundaries are kept two ways: `position_ids` restart at 0 for each
conversation (RoPE sees the same positions as unpacked), and `segment_ids` number the
conversations 1..k so a trainer can reset attention at boundaries with `packed_attention_mask`
(local attention) or `packed_seq_params` (Transformer Engine's THD format).
Right padding is segment 0 (pad ids, loss_mask 0, positions restarting at 0). Without packing
each conversation is one padded row. loss_mask[t] = 1 marks token t as an assistant token, i.e.
a target to predict from positions < t: the trainer shifts it with the labels.
"""

import logging
from typing import Sequence

import torch

from megatron_specdec.data.conversations import read_conversations, tokenize_conversation
from megatron_specdec.data.jsonl import DataError

log = logging.getLogger(__name__)


class ConversationDataset(torch.utils.data.Dataset):
    """Rows of `seq_length` tokens: input_ids, loss_mask (float, 1 on assistant tokens),
    position_ids and segment_ids, each a tensor [seq_length]."""

    def __init__(
        self, samples: Sequence, seq_length: int, pad_id: int, pack: bool = False, seed: int = 0
    ):
        if seq_length <= 0:
            raise DataError(f"seq_length must be positive, got {seq_length}")
        self.seq_length = seq_length
        self.pad_id = pad_id
        truncated = [(s.input_ids[:seq_length], s.loss_mask[:seq_length]) for s in samples]
        self.samples = [s for s in truncated if any(s[1])]
        if len(self.samples) < len(truncated):
            log.warning(
                "dropped %d of %d conversations with no assistant token within seq_length=%d",
                len(truncated) - len(self.samples),
                len(truncated),
                seq_length,
            )
        if not self.samples:
            raise DataError("no conversation has an assistant token within seq_length")
        self.rows = self._pack(seed) if pack else [[i] for i in range(len(self.samples))]

    @classmethod
    def from_files(
        cls,
        paths,
        tokenizer,
        seq_length: int,
        pack: bool = False,
        seed: int = 0,
        on_error: str = "skip",
    ):
        """Read conversation jsonl file(s) and tokenize them with the tokenizer's chat template."""
        rows = read_conversations(paths, on_error)
        if not rows:
            raise DataError(f"no usable conversation rows in {paths}")
        samples = [tokenize_conversation(tokenizer, r["conversations"], seq_length) for r in rows]
        pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        return cls(samples, seq_length, pad_id, pack, seed)

    def _pack(self, seed: int) -> list:
        order = torch.randperm(len(self.samples), generator=torch.Generator().manual_seed(seed))
        rows, row, used = [], [], 0
        for i in order.tolist():
            n = len(self.samples[i][0])
            if used + n > self.seq_length:
                rows.append(row)
                row, used = [], 0
            row.append(i)
            used += n
        rows.append(row)
        return rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        input_ids = torch.full((self.seq_length,), self.pad_id, dtype=torch.long)
        loss_mask = torch.zeros(self.seq_length, dtype=torch.float32)
        position_ids = torch.arange(self.seq_length, dtype=torch.long)
        segment_ids = torch.zeros(self.seq_length, dtype=torch.long)
        start = 0
        for segment, i in enumerate(self.rows[index], start=1):
            ids, mask = self.samples[i]
            end = start + len(ids)
            input_ids[start:end] = torch.tensor(ids)
            loss_mask[start:end] = torch.tensor(mask, dtype=torch.float32)
            position_ids[start:end] = torch.arange(len(ids))
            segment_ids[start:end] = segment
            start = end
        position_ids[start:] = torch.arange(self.seq_length - start)
        return {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "position_ids": position_ids,
            "segment_ids": segment_ids,
        }


class BatchIterator:
    """Endless stream of micro-batches [micro_batch_size, seq_length] over `dataset`.

    Global sample position p maps to row permutation(seed, epoch = p // len(dataset))[p % len].
    `consumed_samples` counts samples taken by all data-parallel ranks; a trainer checkpoints
    it and passes it back to resume on exactly the next batch. Rank r of a global batch takes
    positions [consumed + r * mbs, consumed + (r + 1) * mbs).
    """

    def __init__(
        self,
        dataset,
        micro_batch_size: int,
        seed: int = 0,
        consumed_samples: int = 0,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
    ):
        if micro_batch_size <= 0:
            raise DataError(f"micro_batch_size must be positive, got {micro_batch_size}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise DataError(
                f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})"
            )
        if consumed_samples < 0:
            raise DataError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.consumed_samples = consumed_samples
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self._permutations = {}

    def _row(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.dataset))
        if epoch not in self._permutations:
            self._permutations = {
                epoch: torch.randperm(
                    len(self.dataset),
                    generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch),
                ).tolist()
            }
        return self._permutations[epoch][offset]

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        start = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        items = [self.dataset[self._row(p)] for p in range(start, start + self.micro_batch_size)]
        self.consumed_samples += self.micro_batch_size * self.data_parallel_size
        return {key: torch.stack([item[key] for item in items]) for key in items[0]}
