"""Train a draft module from a recipe.

    python -m megatron_specdec.train --config recipes/eagle3_smollm2.yaml training.steps=100
    torchrun --nproc-per-node 8 -m megatron_specdec.train --config recipes/eagle3_llama31_8b.yaml \\
        model.path=/models/llama31_8b data.train=[/data/regen.jsonl]

Any recipe key can be overridden as `section.key=value` (omegaconf dotlist). Without torchrun
it runs as one process (tp*pp must then be 1). Outputs under `output_dir`: checkpoints/,
final/ (speculative checkpoint), train_log.jsonl, tensorboard/, summary.json, recipe.yaml.
"""

import json
import sys

from megatron_specdec.cli import ArgumentParser, run_cli


def build_parser():
    p = ArgumentParser(description=__doc__)
    p.add_argument("--config", help="recipe YAML file")
    p.add_argument("overrides", nargs="*", help="key=value overrides (e.g. optimizer.lr=3e-4)")
    return p


def main(argv=None):
    from megatron_specdec import distributed
    from megatron_specdec.training import load_recipe, train

    args = build_parser().parse_args(argv)
    recipe = load_recipe(args.config, args.overrides)
    try:
        summary = train(recipe)
        if distributed.is_rank0():
            print(json.dumps(summary, indent=2))
    finally:
        distributed.destroy()


def cli() -> int:
    """Console entry point (setup.py)."""
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
