"""Periodic acceptance-length evaluation, through `megatron_specdec.decoding`'s
`evaluate_acceptance` (the generation/validation package). Until that package exists a
recipe asking for evaluation is refused at start-up rather than silently not evaluated."""

import logging

from megatron_specdec.training.recipe import RecipeError

log = logging.getLogger(__name__)


def _evaluator():
    try:
        from megatron_specdec.decoding import evaluate_acceptance
    except ImportError:
        return None
    return evaluate_acceptance


def check_available(recipe):
    if recipe.evaluation.interval and _evaluator() is None:
        raise RecipeError(
            "recipe key 'evaluation.interval': acceptance evaluation needs "
            "megatron_specdec.decoding.evaluate_acceptance, which this install lacks; "
            "set evaluation.interval=0")


def due(recipe, step: int) -> bool:
    interval = recipe.evaluation.interval
    return bool(interval) and (step % interval == 0 or step == recipe.training.steps)


def run(recipe, model, tokenizer, step: int, reporter):
    """Acceptance length of the current draft on the recipe's prompt file (all ranks)."""
    e = recipe.evaluation
    result = _evaluator()(model, tokenizer, e.prompts, num_prompts=e.num_prompts,
                          max_new_tokens=e.max_new_tokens, draft_tokens=e.draft_tokens)
    reporter.scalar("eval/acceptance_length", float(result["acceptance_length"]), step)
    reporter.event({"event": "evaluation", "step": step, **result})
    model.train()
    return result
