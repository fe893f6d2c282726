"""The prompt files `validate` reads: MT-bench's `turns`, a `prompt`, and the training data's
conversations (`.gz` too), so that a file of one's own data kept out of training serves as
the validation split a stage is chosen on; a record without a user turn is refused by line."""

import gzip
import json

import pytest

from megatron_specdec.evaluation.acceptance import read_prompts


class Echo:
    """A tokenizer whose chat template gives the user text's characters as ids."""

    def apply_chat_template(self, messages, **kwargs):
        assert kwargs["add_generation_prompt"] and len(messages) == 1
        assert messages[0]["role"] == "user"
        return [ord(c) for c in messages[0]["content"]]


def ids(text):
    return [ord(c) for c in text]


def test_every_record_kind_and_a_gzipped_conversation_file(tmp_path):
    plain = tmp_path / "mixed.jsonl"
    plain.write_text("\n".join(json.dumps(r) for r in [
        {"category": "math", "turns": ["first", "second"]},
        {"prompt": "asked", "kind": "qa", "category": "qa"},
        {"source": "steered11", "conversations": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "later"}]},
    ]) + "\n\n")
    assert read_prompts(plain, Echo()) == [("math", ids("first")), ("qa", ids("asked")),
                                           ("steered11", ids("hi"))]
    packed = tmp_path / "held_back.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        for n in range(5):
            f.write(json.dumps({"conversations": [{"role": "user", "content": f"q{n}"}]}) + "\n")
    assert read_prompts(packed, Echo(), num_prompts=2) == [("all", ids("q0")), ("all", ids("q1"))]


def test_a_record_without_a_user_turn_is_refused_by_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n"
                    + json.dumps({"conversations": [{"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: no `turns`, `prompt` or user message"):
        read_prompts(path, Echo())
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: invalid JSON"):
        (tmp_path / "bad.jsonl").write_text("{not json\n")
        read_prompts(path, Echo())
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_prompts(tmp_path / "missing.jsonl", Echo())
