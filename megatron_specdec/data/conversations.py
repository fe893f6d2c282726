"""Conversation rows and their tokenization with an assistant-only loss mask.

Row format (one JSON object per line, written by regeneration):
    {"id": "gsm8k:12", "source": "gsm8k",
     "conversations": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}
An optional leading system message and extra keys are allowed; turns alternate user/assistant.
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megatron_specdec.data.jsonl import BadRows, DataError, iter_jsonl

log = logging.getLogger(__name__)


def validate_messages(messages) -> Optional[str]:
    """None if `messages` is a well-formed conversation, else the reason it is not."""
    if not isinstance(messages, list) or not messages:
        return "'conversations' must be a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            return f"message {i} must be an object with a string 'content'"
    roles = [m.get("role") for m in messages]
    if roles[0] == "system":
        roles = roles[1:]
    expected = ["user", "assistant"] * ((len(roles) + 1) // 2)
    if roles != expected[: len(roles)]:
        return f"roles must alternate user/assistant (after an optional system), got {roles}"
    if "assistant" not in roles:
        return "no assistant message"
    return None


def read_conversations(paths: Sequence, on_error: str = "skip") -> list:
    """Conversation rows of one or more jsonl files (e.g. shard outputs), deduplicated by id."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    rows, seen = [], set()
    for path in paths:
        bad_rows, duplicates = BadRows(on_error), []
        for lineno, row in iter_jsonl(path, bad_rows):
            reason = validate_messages(row.get("conversations"))
            if reason is None and not isinstance(row.get("id"), str):
                reason = "missing string 'id'"
            if reason is not None:
                bad_rows.report(path, lineno, reason)
                continue
            if row["id"] in seen:
                duplicates.append(f"{lineno} ({row['id']!r})")
                continue
            seen.add(row["id"])
            rows.append(row)
        if duplicates:  # one line per file: a re-read of overlapping shards is routine
            log.warning("%s: %d row(s) repeat an earlier id and were skipped, keeping the first "
                        "(lines %s%s)", path, len(duplicates), ", ".join(duplicates[:3]),
                        ", ..." if len(duplicates) > 3 else "")
        bad_rows.summarize(path)
    return rows


def load_tokenizer(name_or_path="default"):
    """A Hugging Face tokenizer with a chat template; 'default' is the embedded SmolLM2."""
    from transformers import AutoTokenizer

    from megatron_specdec.models.default_model import resolve_model_path

    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if not tokenizer.chat_template:
        raise DataError(f"tokenizer {path} has no chat template")
    return tokenizer


def end_of_turn_ids(tokenizer) -> set:
    """Ids that end an assistant turn: the tokenizer's eos plus generation_config.json's eos ids.

    Instruct models often end turns with a token other than the pretraining eos (Llama 3's
    <|eot_id|>); generation_config.json lists every id generation stops on.
    """
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = Path(str(tokenizer.name_or_path)) / "generation_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if not ids:
        raise DataError(f"tokenizer {tokenizer.name_or_path} defines no eos token")
    return ids


@dataclass
class TokenizedConversation:
    input_ids: list
    loss_mask: list  # 1 on assistant tokens (incl. their end-of-turn token), else 0

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def tokenize_conversation(
    tokenizer, messages: list, max_length: Optional[int] = None, eos_ids: Optional[set] = None
) -> TokenizedConversation:
    """Token ids of the chat-templated conversation and a mask that is 1 only on assistant tokens.

    The rendered text is cut at assistant-reply boundaries (the rendering of the history with
    the generation prompt must be a prefix of the rendering with the reply) and each piece is
    tokenized on its own, so a reply's tokens are what the model emits after the generation
    prompt and never straddle template text. Within a reply the mask ends at its last
    end-of-turn token: template glue after it (ChatML's trailing newline) is never generated.
    Truncation keeps the first `max_length` tokens.
    """
    eos_ids = end_of_turn_ids(tokenizer) if eos_ids is None else eos_ids
    pieces, done = [], ""  # (text, is_assistant)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(
            messages[:i], tokenize=False, add_generation_prompt=True
        )
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise DataError(
                "the chat template does not render conversations incrementally (a rendered "
                "prefix changes when a message is added), so assistant tokens cannot be located"
            )
        pieces += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
        done = full
    rest = tokenizer.apply_chat_template(messages, tokenize=False)
    pieces.append((rest[len(done) :], False))

    input_ids, loss_mask = [], []
    for text, is_assistant in pieces:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        masked = 0
        if is_assistant:
            ends = [j for j, t in enumerate(ids) if t in eos_ids]
            masked = ends[-1] + 1 if ends else len(ids)
        mask = [1] * masked + [0] * (len(ids) - masked)
        input_ids += ids
        loss_mask += mask
    if max_length is not None:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return TokenizedConversation(input_ids, loss_mask)
