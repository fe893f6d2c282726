"""megatron_specdec: EAGLE3 and Medusa speculative decoding for Megatron-Core GPT models."""

__version__ = "0.1.0"
