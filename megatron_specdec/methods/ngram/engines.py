"""How the engines run prompt lookup (n-gram): no draft model."""

from megatron_specdec.engines import vllm_client
from megatron_specdec.registry import EngineConfig


def engine_config(draft_dir, num_draft_tokens: int, lookup_max: int = 3,
                  lookup_min: int = 2) -> EngineConfig:
    return EngineConfig(
        vllm=vllm_client.ngram_config(num_draft_tokens, lookup_max, lookup_min),
        sglang=("--speculative-algorithm", "NGRAM",
                "--speculative-num-draft-tokens", str(num_draft_tokens)),
        trtllm={"decoding_type": "NGram", "max_draft_len": num_draft_tokens,
                "max_matching_ngram_size": lookup_max})
