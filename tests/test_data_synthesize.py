"""Magpie-style prompt synthesis on the embedded SmolLM2 through the Megatron backend: sampling
is reproducible per seed, a resumed run equals an uninterrupted one, foreign files are refused."""

import json

import pytest

from megatron_specdec.data import DataError, load_tokenizer
from megatron_specdec.data.synthesize import synthesize_prompts, user_turn_prefix


@pytest.fixture(scope="module")
def backend():
    from megatron_specdec.data.megatron_backend import MegatronBackend
    from megatron_specdec.distributed import destroy

    backend = MegatronBackend("default")
    yield backend
    destroy()


def test_prefix_stops_where_the_user_text_starts():
    tokenizer = load_tokenizer("default")
    text = tokenizer.decode(user_turn_prefix(tokenizer))
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\n")
    assert "You are a pirate" in tokenizer.decode(user_turn_prefix(tokenizer, "You are a pirate."))


@pytest.mark.slow
def test_sampling_is_reproducible_per_seed(backend):
    prefix = user_turn_prefix(backend.tokenizer)
    first = backend.sample([prefix, prefix], 12, 1.0, 1.0, seed=1)
    assert backend.sample([prefix, prefix], 12, 1.0, 1.0, seed=1) == first
    assert backend.sample([prefix, prefix], 12, 1.0, 1.0, seed=2) != first
    assert first[0] != first[1]  # rows of one batch draw different tokens


@pytest.mark.slow
def test_resumed_synthesis_equals_an_uninterrupted_one(backend, tmp_path):
    args = dict(batch_size=3, max_new_tokens=64, seed=5, min_chars=1, progress=False)
    whole = synthesize_prompts(backend, backend.tokenizer, tmp_path / "a.jsonl", 6, **args)
    synthesize_prompts(backend, backend.tokenizer, tmp_path / "b.jsonl", 3, **args)  # "killed"
    resumed = synthesize_prompts(backend, backend.tokenizer, tmp_path / "b.jsonl", 6, **args)
    a = (tmp_path / "a.jsonl").read_text()
    assert (tmp_path / "b.jsonl").read_text() == a
    rows = [json.loads(line) for line in a.splitlines()]
    assert whole.written == len(rows) > 0 and whole.written + whole.dropped == 6
    assert resumed.written + resumed.dropped == 3  # only the second batch was sampled again
    assert all(r["id"].startswith("synth-5-") and r["prompt"].strip() for r in rows)
    assert len({r["prompt"] for r in rows}) == len(rows)


def test_a_file_of_another_seed_is_refused(tmp_path):
    out = tmp_path / "p.jsonl"
    out.write_text(json.dumps({"id": "synth-1-0000000", "prompt": "hi there, how are you"}) + "\n")
    with pytest.raises(DataError, match=r"p\.jsonl.*seed 2"):
        synthesize_prompts(None, load_tokenizer("default"), out, 4, seed=2, progress=False)
