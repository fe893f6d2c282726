"""Magpie-style prompt synthesis on the embedded SmolLM2 through the Megatron backend: sampling
is reproducible per seed, a resumed run equals an uninterrupted one, foreign files are refused."""

import json

import pytest

from megatron_specdec.data import DataError, load_tokenizer
from megatron_specdec.data.synthesize import synthesize_prompts, user_turn_prefix


@pytest.fixture(scope="module")
def backend():
    from megatron_specdec.inference.data_backend import MegatronBackend
    from megatron_specdec.distributed import destroy

    backend = MegatronBackend("default")
    yield backend
    destroy()


def test_prefix_stops_where_the_user_text_starts():
    tokenizer = load_tokenizer("default")
    text = tokenizer.decode(user_turn_prefix(tokenizer))
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\n")
    assert "You are a pirate" in tokenizer.decode(user_turn_prefix(tokenizer, "You are a pirate."))


def test_sampling_is_reproducible_per_seed(backend):
    prefix = user_turn_prefix(backend.tokenizer)
    first = backend.sample([prefix, prefix], 12, 1.0, 1.0, seed=1)
    assert backend.sample([prefix, prefix], 12, 1.0, 1.0, seed=1) == first
    assert backend.sample([prefix, prefix], 12, 1.0, 1.0, seed=2) != first
    assert first[0] != first[1]  # rows of one batch draw different tokens


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


class _EchoBackend:
    """Continues every prompt with the same tokens and records what it was given."""

    def __init__(self, continuation):
        self.continuation, self.prompts = continuation, []

    def sample(self, prompts, max_new_tokens, temperature, top_p, seed):
        self.prompts += prompts
        return [list(self.continuation) for _ in prompts]


def test_user_prefixes_start_the_user_text_in_turn(tmp_path):
    tokenizer = load_tokenizer("default")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    backend = _EchoBackend(tokenizer(" reverses a list.", add_special_tokens=False)["input_ids"]
                           + [eos])
    starts = ["Write a Python function that", "Pretend you are"]
    synthesize_prompts(backend, tokenizer, tmp_path / "p.jsonl", 4, batch_size=4,
                       user_prefixes=starts, progress=False)
    template = user_turn_prefix(tokenizer)
    assert [tokenizer.decode(p[len(template):]) for p in backend.prompts] == starts * 2
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    # the same continuation after both prefixes: two distinct prompts, the repeats dropped
    assert [r["prompt"] for r in rows] == [s + " reverses a list." for s in starts]


def test_an_empty_user_prefix_is_refused(tmp_path):
    with pytest.raises(DataError, match="empty prefix"):
        synthesize_prompts(_EchoBackend([]), load_tokenizer("default"), tmp_path / "p.jsonl", 2,
                           user_prefixes=["Write", " "], progress=False)


def test_the_cli_names_a_prefix_file_without_prefixes(tmp_path):
    from megatron_specdec.cli.data import _read_prefixes

    path = tmp_path / "prefixes.txt"
    path.write_text("# only a comment\n\n")
    with pytest.raises(DataError, match=r"--user-prefixes .*prefixes\.txt: no prefixes"):
        _read_prefixes(path)
    with pytest.raises(DataError, match=r"--user-prefixes .*missing\.txt"):
        _read_prefixes(tmp_path / "missing.txt")
    assert len(_read_prefixes("data/synth_user_prefixes.txt")) == 60
