"""The Megatron backend adapter on the embedded SmolLM2: its regenerated answer matches
Hugging Face greedy decoding of the same chat-templated prompt; with `dtype="bfloat16"` its
weights are bf16 and its first answer token to a short question is float32's."""

import json

import pytest
import torch

from megatron_specdec.data import PromptRow, regenerate


@pytest.mark.slow
def test_regenerated_answer_matches_hf_greedy(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_specdec.inference.data_backend import MegatronBackend
    from megatron_specdec.distributed import destroy

    backend = MegatronBackend("default")
    tokenizer = backend.tokenizer
    try:
        # SmolLM2 answers the first in 2 tokens + end of turn, the second at length.
        rows = [
            PromptRow("s:1", "s", ("Is the sky blue? Answer yes or no.",)),
            PromptRow("s:2", "s", ("Say OK.",)),
        ]
        regenerate(rows, backend, tokenizer, tmp_path / "o.jsonl", max_new_tokens=4, progress=False)
    finally:
        destroy()
    written = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]

    hf = AutoModelForCausalLM.from_pretrained(
        str(tokenizer.name_or_path), dtype=torch.float32
    ).eval()
    for row, out in zip(rows, written):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": row.turns[0]}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = hf.generate(
                ids, max_new_tokens=4, do_sample=False, eos_token_id=2, pad_token_id=2
            )
        gen = gen[0, ids.shape[1] :]
        stopped = bool((gen == 2).any())
        expected = tokenizer.decode(gen[gen != 2], skip_special_tokens=True)
        assert out["conversations"][1]["content"] == expected
        assert out["finish_reasons"] == ["stop" if stopped else "length"]
    assert [w["finish_reasons"][0] for w in written] == ["stop", "length"]


@pytest.mark.slow
def test_bfloat16_backend_holds_bfloat16_weights_and_answers_alike(tmp_path):
    from megatron_specdec.checkpointing.checkpoint import dtype_from_name
    from megatron_specdec.inference.data_backend import MegatronBackend
    from megatron_specdec.distributed import destroy

    rows = [PromptRow("s:1", "s", ("Is the sky blue? Answer yes or no.",))]
    answers = {}
    for dtype in ("float32", "bfloat16"):
        backend = MegatronBackend("default", dtype=dtype)
        try:
            assert {p.dtype for p in backend.model.parameters()} == {dtype_from_name(dtype)}
            regenerate(rows, backend, backend.tokenizer, tmp_path / f"{dtype}.jsonl",
                       max_new_tokens=1, progress=False)
        finally:
            destroy()
        answers[dtype] = json.loads((tmp_path / f"{dtype}.jsonl").read_text())["conversations"]
    # One token: past it greedy bf16 and fp32 may part at a near-tie, and where depends on the
    # CPU's bf16 kernels (on an Intel AMX CPU the second token here is "," in bf16, "." in fp32).
    assert answers["bfloat16"] == answers["float32"]
