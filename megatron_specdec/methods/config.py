"""Checks the draft methods' configs share (each method's config dataclass and validation live
in methods/<name>/config.py; parsing by name is registry.parse_config)."""

from megatron_specdec.registry import ConfigError


def check_int(name, value, low, high=None):
    """`value` is an int in [low, high] (no upper bound when None); else a ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        hi = f"..{high}" if high is not None else " or more"
        raise ConfigError(f"{name}={value} is out of range (valid: {low}{hi})")


