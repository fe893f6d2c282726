"""Freeze-and-train runs of EAGLE3/Medusa drafts from omegaconf recipes:
`python -m megatron_specdec.train --config recipes/<recipe>.yaml key=value ...` (or torchrun).

recipe: schema, overrides, validation; build: the speculative model a recipe names;
optimizer: AdamW, lr schedule, gradient averaging and clipping; checkpoints: verified, reshardable
training checkpoints; offline: stored base states; metrics: progress, TensorBoard, logs;
evaluation: periodic acceptance length; trainer: the loop.
"""

from megatron_specdec.training.recipe import Recipe, RecipeError, load_recipe
from megatron_specdec.training.trainer import train

__all__ = ["Recipe", "RecipeError", "load_recipe", "train"]
