"""Checkpoints hold no pickled objects and loading one never unpickles: a saved base checkpoint
has no `_extra_state` entries; one whose `_extra_state` is a crafted pickle (as a Megatron/NeMo
checkpoint written with TE holds them) loads without running it; an `_extra_state` holding
data (TE fp8 metadata) is refused on save by key; other key mismatches are still named."""

import dataclasses
import io

import pytest
import torch

from megatron_specdec.checkpointing import checkpoint, pickle_guard
from megatron_specdec import distributed

HF = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=128, vocab_size=300, max_position_embeddings=64,
          tie_word_embeddings=False)


class _Payload:
    """Unpickling it creates `marker` (what a hostile `_extra_state` would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig

    from megatron_specdec.loading.hf_conversion import base_meta
    from megatron_specdec.models.provider import build_model

    distributed.initialize(1, 1)
    config = LlamaConfig(**HF)

    def build(seed):
        torch.manual_seed(seed)
        return build_model(config, dtype=torch.float32, transformer_impl="local")

    model = build(0)
    yield build, model, base_meta(config, model, torch.float32, "local")
    distributed.destroy()


def _objects(path):
    return pickle_guard.pickled_objects(pickle_guard.dist_metadata(path))


def _extra_states(sharded_state_dict):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return [k for k, v in sharded_state_dict.items() if isinstance(v, ShardedObject)]


def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    names = [k for k in sa if not k.endswith("_extra_state")]
    assert names and names == [k for k in sb if not k.endswith("_extra_state")]
    for k in names:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


def test_saved_base_checkpoint_holds_no_pickles(tiny, tmp_path):
    build, model, meta = tiny
    assert len(_extra_states(model.sharded_state_dict())) == 8  # 4 linears x 2 layers
    checkpoint.save_checkpoint(model, tmp_path / "base", meta)
    assert _objects(tmp_path / "base") == []
    loaded = checkpoint.load_checkpoint(build(1), tmp_path / "base")
    _assert_same_weights(loaded, model)


def test_empty_te_extra_states_are_left_out(tiny, tmp_path):
    """TE's `_extra_state` without fp8: an empty byte tensor (TE >= 2.0) or a saved None."""
    _, model, meta = tiny
    sd = model.sharded_state_dict()
    keys = _extra_states(sd)
    none_buffer = io.BytesIO()
    torch.save(None, none_buffer)
    sd[keys[0]] = dataclasses.replace(sd[keys[0]], data=torch.empty(0, dtype=torch.uint8))
    sd[keys[1]] = dataclasses.replace(sd[keys[1]], data=none_buffer)
    checkpoint.save_checkpoint(None, tmp_path / "te", meta, sharded_state_dict=sd)
    assert _objects(tmp_path / "te") == []


def test_crafted_extra_state_pickle_is_never_unpickled(tiny, tmp_path):
    from megatron.core import dist_checkpointing

    build, model, meta = tiny
    marker = tmp_path / "payload_ran"
    sd = model.sharded_state_dict()
    for k in _extra_states(sd):
        sd[k] = dataclasses.replace(sd[k], data=_Payload(marker))
    # Written as Megatron writes it (every _extra_state a pickle), with this project's metadata.
    checkpoint.save_checkpoint(model, tmp_path / "clean", meta)
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    dist_checkpointing.save(sd, str(crafted))
    (crafted / checkpoint.META_FILE).write_bytes(
        (tmp_path / "clean" / checkpoint.META_FILE).read_bytes())
    assert len(_objects(crafted)) == 8 and not marker.exists()

    loaded = checkpoint.load_checkpoint(build(1), crafted)
    assert not marker.exists()
    _assert_same_weights(loaded, model)
    # The payload is live: megatron's own load of the full state dict runs it.
    dist_checkpointing.load(build(2).sharded_state_dict(), str(crafted))
    assert marker.exists()


def test_extra_state_holding_data_is_refused_on_save(tiny, tmp_path):
    _, model, meta = tiny
    sd = model.sharded_state_dict()
    key = _extra_states(sd)[3]
    sd[key] = dataclasses.replace(sd[key], data=torch.arange(5, dtype=torch.uint8))
    with pytest.raises(checkpoint.CheckpointError,
                       match=rf"{sd[key].unique_key} holds data \(Tensor\).*fp8 training state "
                             r"is not supported"):
        checkpoint.save_checkpoint(None, tmp_path / "fp8", meta, sharded_state_dict=sd)
    assert not (tmp_path / "fp8").exists()


def test_other_key_mismatches_are_named(tiny, tmp_path):
    build, model, _ = tiny
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    checkpoint.load_state(build(1), state, tmp_path)  # only _extra_state missing: fine
    state.pop("decoder.final_layernorm.weight")
    state["decoder.extra.weight"] = torch.zeros(1)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"missing from the checkpoint: \['decoder.final_layernorm.weight'\]"
                             r"; not in the model: \['decoder.extra.weight'\]"):
        checkpoint.load_state(build(1), state, tmp_path)
