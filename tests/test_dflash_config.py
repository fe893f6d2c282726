"""A DFlash config that cannot work is refused in one line naming the key."""

import pytest

from megatron_specdec import registry
from megatron_specdec.methods.dflash import config


@pytest.mark.parametrize("key,value", [
    ("block_size", 0), ("block_size", -3), ("block_size", 1),
    ("mask_token_id", 500), ("mask_token_id", -1),
    ("target_layer_ids", [0, 4]), ("target_layer_ids", []), ("target_layer_ids", [-1]),
    ("num_layers", 0), ("anchors_per_sequence", 0), ("loss_decay_gamma", 0.0),
    ("k_norm_trainable", "no"),
])
def test_bad_value_refused_by_name(key, value):
    with pytest.raises(config.DFlashConfigError) as err:
        registry.parse_config("dflash", {key: value}, num_layers=4, vocab_size=500)
    message = str(err.value)
    assert key in message and "\n" not in message


def test_unknown_key_refused_by_name():
    with pytest.raises(registry.ConfigError, match="blok_size"):
        registry.parse_config("dflash", {"blok_size": 8}, 4, 500)


def test_defaults_fit_the_base():
    cfg = registry.parse_config("dflash", None, num_layers=30, vocab_size=49152)
    assert cfg.mask_token_id == 49151
    assert len(cfg.target_layer_ids) == 5 and all(0 <= i < 30 for i in cfg.target_layer_ids)
    assert registry.config_from_dict(registry.config_to_dict(cfg)) == cfg
