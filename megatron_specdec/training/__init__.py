"""Freeze-and-train runs of EAGLE3/Medusa drafts from omegaconf recipes:
`python -m megatron_specdec.cli.train --config recipes/<recipe>.yaml key=value ...` (or torchrun).

recipe: schema, overrides, validation; build: the speculative model a recipe names;
batches: data batches in the model's terms; optimizer: AdamW on fp32 master weights, lr
schedule, gradient averaging and clipping; checkpoints: verified, reshardable, pickle-free
training checkpoints; base_fingerprint: what a resume checks the base against; offline: stored
base states; metrics: progress, TensorBoard, logs; evaluation: periodic acceptance length;
trainer: the loop.
"""

from megatron_specdec.training.recipe import Recipe, RecipeError, load_recipe
from megatron_specdec.training.trainer import train

__all__ = ["Recipe", "RecipeError", "load_recipe", "train"]
