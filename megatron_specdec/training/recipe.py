"""Training recipes: an omegaconf structured schema, so a YAML file plus command-line
`key=value` overrides is checked key by key against the types below before anything runs.

An unknown key or a value of the wrong type is a `RecipeError` naming the full key
(`training.stepz`, `optimizer.lr`); range and consistency checks (`validate`) name it too.
The draft module's own keys (`draft.config`) are checked by `registry.parse_config` (the method's config class), which also
names unknown keys, once the base model's size is known.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_specdec import registry


class RecipeError(ValueError):
    pass


@dataclass
class ModelConfig:
    # An HF model directory, 'default' (the embedded SmolLM2), a base megatron_specdec
    # checkpoint, or a speculative one (then `draft` must describe the same algorithm).
    path: str = MISSING
    dtype: str = "float32"
    transformer_impl: str = "auto"


@dataclass
class ParallelismConfig:
    tp: int = 1
    pp: int = 1  # data parallel = world size / (tp * pp)
    ep: int = 1  # expert parallel (MoE bases): carved out of data parallel


@dataclass
class DraftConfig:
    algo: str = "eagle3"
    # config keys of the method `algo` (e.g. draft_vocab_size, ttt_steps, medusa_num_heads).
    config: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    train: List[str] = MISSING  # conversation jsonl files (megatron_specdec.data format)
    seq_length: int = 2048
    pack: bool = True
    seed: int = 0
    # A step computes up to its last real position, and the loss over its scored positions,
    # each rounded up to a multiple of this (1 = no rounding): bounded shapes keep per-shape
    # kernel caches (oneDNN, bf16) from growing.
    length_bucket: int = 64
    on_error: str = "skip"  # a bad jsonl row: skip (reported with file:line) or fail
    tokenizer: Optional[str] = None  # default: the model's tokenizer and chat template
    # EAGLE3 draft vocabulary from token counts of these files (default: `train`).
    calibration: Optional[List[str]] = None


@dataclass
class OptimizerConfig:
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # global L2 norm over the draft parameters; 0 = off
    warmup_steps: int = 0
    decay: str = "cosine"  # cosine (to min_lr at training.steps) | constant


@dataclass
class TrainingConfig:
    steps: int = MISSING
    micro_batch_size: int = 1
    global_batch_size: int = 1  # micro_batch_size * data_parallel * micro-batches per step
    seed: int = 1234
    mode: str = "online"  # online: base states computed each step; offline: dumped once
    offline_dir: Optional[str] = None  # default: <output_dir>/offline_states
    # EAGLE3: recompute each draft layer in backward (megatron's recompute_granularity=full
    # on the draft's config): activations per TTT step drop to the layer's inputs.
    recompute: bool = False
    # Megatron's --exit-duration-in-mins: past this many minutes of this run's wall time,
    # checkpoint the current step and stop (then the usual final export); 0 = off.
    exit_duration_mins: float = 0.0
    # Megatron's --exit-interval: checkpoint and stop after a step that is a multiple of this,
    # the lr schedule still that of training.steps (then the usual final export); 0 = off.
    exit_interval: int = 0
    # Megatron's --profile-step-start/-end: steps [start, end) run under torch.profiler and
    # rank 0 writes the ops that took the most time (device time on a GPU) to
    # <output_dir>/profile.txt; empty = off.
    profile_steps: List[int] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    interval: int = 500  # steps between checkpoints; 0 = only at the end
    directory: Optional[str] = None  # default: <output_dir>/checkpoints
    keep_last: int = 2
    resume: bool = True  # continue from the newest good checkpoint in `directory`


@dataclass
class EvaluationConfig:
    interval: int = 0  # steps between acceptance-length evaluations; 0 = off
    prompts: Optional[str] = None  # jsonl prompt file (e.g. mt_bench.jsonl)
    num_prompts: int = 8
    max_new_tokens: int = 64
    draft_tokens: int = 7  # chain length
    prompt_bucket: Optional[int] = None  # prompts padded to a multiple (None: generation's)


@dataclass
class LoggingConfig:
    interval: int = 1  # steps between log records / TensorBoard points
    tensorboard: bool = True
    progress_bar: bool = True


@dataclass
class Recipe:
    output_dir: str = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpointing: CheckpointConfig = field(default_factory=CheckpointConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def _omegaconf_error(source: str, e: OmegaConfBaseException) -> RecipeError:
    key = getattr(e, "full_key", None) or "?"
    reason = str(getattr(e, "msg", e)).split("\n")[0]
    return RecipeError(f"{source}: key '{key}': {reason}")


def load_recipe(path=None, overrides=()) -> Recipe:
    """The validated recipe of a YAML file (optional) with `key=value` overrides applied."""
    schema = OmegaConf.structured(Recipe)
    parts = [schema]
    source = "recipe"
    try:
        if path is not None:
            source = f"recipe {path}"
            if not Path(path).is_file():
                raise RecipeError(f"recipe file {path} does not exist")
            parts.append(OmegaConf.load(path))
        merged = OmegaConf.merge(*parts)
        source = "command-line override"
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise RecipeError(f"recipe: required key(s) not set: {', '.join(missing)}")
        recipe = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _omegaconf_error(source, e) from None
    validate(recipe)
    return recipe


def _check(ok: bool, key: str, message: str):
    if not ok:
        raise RecipeError(f"recipe key '{key}': {message}")


def validate(r: Recipe):
    """Ranges and choices, each error naming its key."""
    _check(r.model.dtype in ("float32", "bfloat16", "float16", "auto"), "model.dtype",
           f"{r.model.dtype!r}; expected float32, bfloat16, float16 or auto")
    _check(r.parallelism.tp >= 1, "parallelism.tp", "must be >= 1")
    _check(r.parallelism.pp >= 1, "parallelism.pp", "must be >= 1")
    _check(r.parallelism.ep >= 1, "parallelism.ep", "must be >= 1")
    _check(r.draft.algo in registry.trainable(), "draft.algo",
           f"{r.draft.algo!r}; expected one of {registry.trainable()}")
    _check(len(r.data.train) > 0, "data.train", "needs at least one jsonl file")
    _check(r.data.seq_length >= 4, "data.seq_length", "must be >= 4")
    _check(r.data.length_bucket >= 1, "data.length_bucket", "must be >= 1 (1 = no rounding)")
    _check(r.data.on_error in ("skip", "fail"), "data.on_error", "expected skip or fail")
    _check(r.optimizer.lr > 0, "optimizer.lr", "must be > 0")
    _check(0 <= r.optimizer.min_lr <= r.optimizer.lr, "optimizer.min_lr", "must be in [0, lr]")
    _check(r.optimizer.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
    _check(r.optimizer.clip_grad >= 0, "optimizer.clip_grad", "must be >= 0 (0 = off)")
    _check(r.optimizer.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0")
    _check(r.optimizer.decay in ("cosine", "constant"), "optimizer.decay",
           f"{r.optimizer.decay!r}; expected cosine or constant")
    _check(r.training.steps >= 0, "training.steps", "must be >= 0")
    _check(r.training.micro_batch_size >= 1, "training.micro_batch_size", "must be >= 1")
    _check(r.training.global_batch_size % r.training.micro_batch_size == 0,
           "training.global_batch_size", "must be a multiple of training.micro_batch_size")
    _check(r.training.exit_duration_mins >= 0, "training.exit_duration_mins",
           f"{r.training.exit_duration_mins}; must be >= 0 (0 = off)")
    _check(r.training.exit_interval >= 0, "training.exit_interval",
           f"{r.training.exit_interval}; must be >= 0 (0 = off)")
    _check(not r.training.profile_steps or (
        len(r.training.profile_steps) == 2 and 0 <= r.training.profile_steps[0]
        < r.training.profile_steps[1]), "training.profile_steps",
        f"{list(r.training.profile_steps)}; expected [start, end) with 0 <= start < end, or []")
    _check(r.training.mode in ("online", "offline"), "training.mode",
           f"{r.training.mode!r}; expected online or offline")
    _check(r.training.mode == "online" or r.parallelism.pp == 1, "training.mode",
           "offline training reads dumped last-stage states: it needs parallelism.pp=1")
    method = registry.get(r.draft.algo)
    _check(not r.training.recompute or method.supports_recompute, "training.recompute",
           f"recomputes the EAGLE3 draft layer; draft.algo {r.draft.algo!r} has none (set false)")
    _check(r.checkpointing.interval >= 0, "checkpointing.interval", "must be >= 0")
    _check(r.checkpointing.keep_last >= 1, "checkpointing.keep_last", "must be >= 1")
    _check(r.evaluation.interval >= 0, "evaluation.interval", "must be >= 0")
    _check(r.evaluation.interval == 0 or r.evaluation.prompts is not None, "evaluation.prompts",
           "needed when evaluation.interval > 0")
    _check(r.evaluation.interval == 0 or method.evaluated_in_training, "evaluation.interval",
           f"must be 0 for draft.algo {r.draft.algo} (measure the final draft GPT with "
           f"`cli.validate --drafter {r.draft.algo} --draft-model <output_dir>/final`)")
    _check(r.logging.interval >= 1, "logging.interval", "must be >= 1")


def data_parallel_size(r: Recipe, world_size: int) -> int:
    model_parallel = r.parallelism.tp * r.parallelism.pp
    _check(world_size % model_parallel == 0, "parallelism",
           f"world size {world_size} is not divisible by tp*pp = {model_parallel}")
    dp = world_size // model_parallel
    per_step = r.training.micro_batch_size * dp
    _check(r.training.global_batch_size % per_step == 0, "training.global_batch_size",
           f"{r.training.global_batch_size} is not a multiple of micro_batch_size x data "
           f"parallel = {per_step}")
    return dp


def checkpoint_dir(r: Recipe) -> Path:
    return Path(r.checkpointing.directory or Path(r.output_dir) / "checkpoints")


def offline_dir(r: Recipe) -> Path:
    return Path(r.training.offline_dir or Path(r.output_dir) / "offline_states")


def to_yaml(r: Recipe) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(r))
