"""megatron_specdec: EAGLE3 and Medusa speculative decoding for Megatron-Core GPT models."""

__version__ = "0.1.0"
def __getattr__(name): return __import__("megatron_specdec.speculative", fromlist=["convert"]).convert if name == "convert" else (_ for _ in ()).throw(AttributeError(f"module 'megatron_specdec' has no attribute {name!r}"))  # noqa: E501,E704 lazy: megatron-core takes seconds to import
