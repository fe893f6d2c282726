"""Data pipeline: prompt sources, self-distillation regeneration, chat tokenization with an
assistant-only loss mask, fixed-shape resumable batches, and draft-vocabulary calibration.
CLI: `python -m megatron_specdec.cli.data {regenerate,calibrate,sources} --help`."""

from megatron_specdec.data.conversations import (
    TokenizedConversation,
    end_of_turn_ids,
    load_tokenizer,
    read_conversations,
    tokenize_conversation,
    validate_messages,
)
from megatron_specdec.data.dataset import BatchIterator, ConversationDataset
from megatron_specdec.data.draft_vocab import DraftVocab, build_draft_vocab, calibrate, count_tokens
from megatron_specdec.data.jsonl import DataError
from megatron_specdec.data.regenerate import regenerate, select_shard, shard_output_path
from megatron_specdec.models.packing import (packed_attention_mask, packed_seq_params,
                                              packed_seq_params_of_mask)
from megatron_specdec.data.sources import PRESETS, PromptRow, SourceSpec, read_source, read_sources

__all__ = [
    "BatchIterator",
    "ConversationDataset",
    "DataError",
    "DraftVocab",
    "PRESETS",
    "PromptRow",
    "SourceSpec",
    "TokenizedConversation",
    "build_draft_vocab",
    "calibrate",
    "count_tokens",
    "end_of_turn_ids",
    "load_tokenizer",
    "packed_attention_mask",
    "packed_seq_params",
    "packed_seq_params_of_mask",
    "read_conversations",
    "read_source",
    "read_sources",
    "regenerate",
    "select_shard",
    "shard_output_path",
    "tokenize_conversation",
    "validate_messages",
]
