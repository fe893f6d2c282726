"""Train a draft module from a recipe.

    python -m megatron_specdec.cli.train --config recipes/eagle3_smollm2.yaml training.steps=100
    torchrun --nproc-per-node 8 -m megatron_specdec.cli.train --config recipes/eagle3_llama31_8b.yaml \\
        model.path=/models/llama31_8b data.train=[/data/regen.jsonl]

Any recipe key can be overridden as `section.key=value` (omegaconf dotlist). Without torchrun
it runs as one process (tp*pp must then be 1). Outputs under `output_dir`: checkpoints/,
final/ (speculative checkpoint), train_log.jsonl, tensorboard/, summary.json, recipe.yaml.
"""

import json
import sys
from pathlib import Path

from megatron_specdec.cli.common import ArgumentParser, run_cli


def build_parser():
    p = ArgumentParser(description=__doc__)
    p.add_argument("--config", help="recipe YAML file")
    p.add_argument("overrides", nargs="*", help="key=value overrides (e.g. optimizer.lr=3e-4)")
    return p


def format_summary(summary: dict, output_dir) -> str:
    """The run in three lines; the full summary is output_dir/summary.json."""
    loss, accuracy = summary["final_loss"], summary["final_accuracy"]
    lines = [f"trained the {summary['algo']} draft to step {summary['steps']} "
             f"({summary['steps_this_run']} steps this run, {summary['seconds_this_run']:.0f} s, "
             f"{summary['scored_tokens']} scored tokens, TP={summary['tp']} PP={summary['pp']} "
             f"DP={summary['dp']}, {summary['mode']})",
             "final loss " + ("-" if loss is None else f"{loss:.3f}")
             + ", accuracy per draft position " + _numbers(accuracy)
             + ("" if summary["acceptance"] is None
                else f", acceptance length {summary['acceptance']['acceptance_length']:.2f} at "
                     f"step {summary['acceptance']['step']}"),
             f"final checkpoint {summary['final_checkpoint']}; summary "
             f"{Path(output_dir) / 'summary.json'}"]
    return "\n".join(lines)


def _numbers(values) -> str:
    if values is None:
        return "-"
    return "/".join(f"{v:.2f}" for v in (values if isinstance(values, list) else [values]))


def main(argv=None):
    from megatron_specdec import distributed
    from megatron_specdec.training import load_recipe, train

    args = build_parser().parse_args(argv)
    recipe = load_recipe(args.config, args.overrides)
    try:
        summary = train(recipe)
        if distributed.is_rank0():
            print(format_summary(summary, recipe.output_dir))
    finally:
        distributed.destroy()


def cli() -> int:
    """Console entry point (setup.py)."""
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
