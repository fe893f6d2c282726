"""Periodic acceptance-length evaluation of the draft being trained, through the decoding
package's `evaluate_acceptance` (greedy chains of fixed length on the recipe's prompt file).
Each evaluation's full report goes to `<output_dir>/evaluation/step_<n>/acceptance.json`;
the acceptance length and per-position acceptance go to the log and TensorBoard."""

from pathlib import Path


def due(recipe, step: int) -> bool:
    interval = recipe.evaluation.interval
    return bool(interval) and (step % interval == 0 or step == recipe.training.steps)


def run(recipe, model, tokenizer, step: int, reporter) -> dict:
    """Collective over the model-parallel group; every rank gets the overall summary."""
    from megatron_specdec.evaluation.acceptance import evaluate_acceptance

    e = recipe.evaluation
    report = evaluate_acceptance(
        model, e.prompts, tokenizer, max_new_tokens=e.max_new_tokens,
        num_draft_tokens=e.draft_tokens, num_prompts=e.num_prompts,
        out_dir=Path(recipe.output_dir) / "evaluation" / f"step_{step:07d}",
        compare_greedy=False, progress=False, prompt_bucket=e.prompt_bucket,
        policy="fixed")  # a learning curve measures the draft at every position, not the policy
    model.train()
    overall = report["overall"]
    reporter.scalar("eval/acceptance_length", overall["acceptance_length"], step)
    for j, rate in enumerate(overall["position_acceptance"], start=1):
        if rate is not None:
            reporter.scalar(f"eval/position{j}_acceptance", rate, step)
    summary = {"step": step, "acceptance_length": overall["acceptance_length"],
               "position_acceptance": overall["position_acceptance"],
               "categories": {c: s["acceptance_length"] for c, s in report["categories"].items()}}
    reporter.event({"event": "evaluation", **summary})
    return summary
