"""`export_draft --verify-with vllm`: prove an exported EAGLE3 draft serves before a user does.

Two stages. First the files (no engine): the draft must fit the base and hold every tensor of
its layout with its shape, d2t/t2d must agree, and the aux ids must name the same layers in
both numberings, the checks an import makes, so the fault is named by file, tensor or key.
Then vLLM serves the base with the draft on a few prompts: its speculative output must equal
its own greedy output token for token, and its acceptance length must clear a floor, because
vLLM serves a draft whose aux ids point at the wrong layers, or whose d2t is missing, without
complaint at AL ~1.0.
"""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from megatron_specdec import registry
from megatron_specdec.engines import vllm_client as vllm

log = logging.getLogger(__name__)

# Short questions of the kinds SmolLM2 answers predictably (arithmetic, lists, code).
PROMPTS = (
    "Tom has 3 boxes with 12 apples each. He gives away 9 apples. How many apples are left?",
    "A shirt costs $20 and is on sale for 25% off. What is the sale price?",
    "Write a Python function that returns the sum of a list of numbers.",
)
MIN_ACCEPTANCE_LENGTH = 1.02


class VerificationError(ValueError):
    """The export would not serve as trained."""


@dataclass
class Verification:
    greedy: vllm.RunResult
    speculative: vllm.RunResult

    @property
    def acceptance_length(self) -> float:
        return self.speculative.acceptance_length or 1.0


def check_files(draft_dir, base_dir):
    """The EAGLE3 import's checks on the exported files against the HF base (the method's
    check_export hook): returns the draft's config, or raises naming the file, tensor or key
    at fault."""
    from megatron_specdec.checkpointing.hf_mapping import WeightMappingError

    try:
        return registry.get("eagle3").check_export(draft_dir, base_dir)
    except (ValueError, WeightMappingError) as e:
        raise VerificationError(f"{draft_dir}: {e}") from None


def chat_prompts(base_dir, questions=PROMPTS) -> List[List[int]]:
    """Token ids of one-turn chats through the base tokenizer's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for q in questions]


def first_difference(a: List[int], b: List[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def verify_eagle3(draft_dir, base_dir, num_speculative_tokens: int = 3,
                  max_new_tokens: int = 32, min_acceptance_length: float = MIN_ACCEPTANCE_LENGTH,
                  prompts: Optional[List[List[int]]] = None) -> Verification:
    """Check the files, then serve `base_dir` + `draft_dir` in vLLM: greedy identity with
    vLLM's own greedy and acceptance length >= `min_acceptance_length` over the prompts."""
    cfg = check_files(draft_dir, base_dir)
    prompts = prompts or chat_prompts(base_dir)
    results = vllm.generate(base_dir, prompts, max_new_tokens, {
        "greedy": None, "eagle3": vllm.eagle3_config(draft_dir, num_speculative_tokens)})
    greedy, spec = results["greedy"], results["eagle3"]
    if greedy.error:
        raise VerificationError(f"vLLM could not serve the base {base_dir}: {greedy.error}")
    if spec.error:
        raise VerificationError(f"vLLM could not load the draft {draft_dir}: {spec.error}")
    for i, (want, got) in enumerate(zip(greedy.outputs, spec.outputs)):
        at = first_difference(want, got)
        if at is not None:
            raise VerificationError(
                f"prompt {i}: vLLM's EAGLE3 output leaves its greedy output at new token {at} "
                f"({got[at:at + 1]} instead of {want[at:at + 1]}): speculation is not lossless "
                f"with {draft_dir}")
    result = Verification(greedy, spec)
    if result.acceptance_length < min_acceptance_length:
        vllm_ids = [i + 1 for i in cfg.aux_layer_ids]
        raise VerificationError(
            f"{draft_dir}: vLLM accepted {spec.accepted} of {spec.draft_tokens} draft tokens "
            f"(acceptance length {result.acceptance_length:.3f} < {min_acceptance_length}): the "
            f"draft is dead as served. vLLM fed it the hidden states entering base layers "
            f"{vllm_ids} (= outputs of layers {cfg.aux_layer_ids}): check that these are the "
            f"layers it trained on, that d2t maps its ids to the right targets, and its weights")
    log.info("vLLM serves %s: greedy-identical on %d prompts, acceptance length %.3f at k=%d",
             Path(draft_dir).name, len(prompts), result.acceptance_length,
             num_speculative_tokens)
    return result
