"""Draft methods by name: the one place a method's name is looked up.

Each method is one object, a `DraftMethod`, exported as `METHOD` by its folder
`megatron_specdec/methods/<name>/`. The built-in ones are imported on first use (vLLM's model
registry pattern), so `import megatron_specdec` stays cheap and the layers below the methods
(models, loading, inference, training, export, engines) reach a method through `get(name)`
and its hooks, never by importing it or comparing its name. Third-party methods `register`
an object of their own.

The lowest layer: this module imports nothing of megatron_specdec.
"""

import importlib
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Dict, Optional, Protocol, Tuple, runtime_checkable

_BUILTIN = {  # in the order they are listed to users
    "eagle3": "megatron_specdec.methods.eagle3",
    "medusa": "megatron_specdec.methods.medusa",
    "draft_model": "megatron_specdec.methods.draft_model",
    "ngram": "megatron_specdec.methods.ngram",
    "dflash": "megatron_specdec.methods.dflash",
}
# ModelOpt calls its EAGLE mode "eagle" (`mtsp.convert(model, [("eagle", cfg)])`): the one
# alias, kept for ModelOpt users' configs; only EAGLE3 is implemented.
_ALIASES = {"eagle": "eagle3"}
_REGISTERED: Dict[str, "DraftMethod"] = {}


class UnknownMethodError(ValueError):
    pass


class ConfigError(ValueError):
    """A draft config key or value that is wrong, named with what is valid."""


@dataclass(frozen=True)
class EngineConfig:
    """How the serving engines run a method's exported draft."""
    vllm: dict  # vLLM `speculative_config`
    sglang: Tuple[str, ...] = ()  # SGLang server flags
    trtllm: dict = field(default_factory=dict)  # TensorRT-LLM speculative fields


@dataclass
class ProposerOptions:
    """What the generator hands a method's `proposer` hook beside the model."""
    draft_model: Optional[str] = None  # checkpoint of a separate draft GPT
    dtype: Any = None  # torch dtype the proposer runs in (the target's)
    extra: dict = field(default_factory=dict)


@runtime_checkable
class Proposer(Protocol):
    """The generator's only view of a drafter (last pipeline stage). Tensors are per batch
    row b; a row's drafts may be fewer than k (its count). A class attribute
    `free_to_probe = True` says drafting costs nothing (prompt lookup): the draft policy then
    never backs off."""

    def start(self, prompt, lengths, pending, out, max_length: int) -> None:
        """prompt [b, P] left-padded, lengths [b], pending [b, 1], out: the prefill's
        BaseOutput (the base states the drafter reads), max_length: the longest a row gets."""

    def propose(self, k: int, policy) -> Tuple[Any, Any]:
        """(drafts [b, n] with n <= k, counts [b]); policy: an inference DraftPolicy."""

    def accept(self, tokens, counts, out) -> None:
        """The tokens each row kept since the last read, left-padded (the last counts[b] of
        row b are real), with the base states at the same positions."""

    def keep_rows(self, rows) -> None:
        """Finished rows leave the batch: keep these."""


@runtime_checkable
class SampledProposer(Proposer, Protocol):
    def propose_sampled(self, k: int, policy, sampling, rng) -> Tuple[Any, Any, Any]:
        """(drafts [b, n], counts [b], probs [b, n, V]): drafts drawn from the draft's
        distribution, which lossless rejection sampling needs."""


@runtime_checkable
class TreeProposer(Protocol):
    def propose_tree(self, depth: int, spec, floor: float, row: int):
        """Row `row`'s DraftTree of `depth` under TreeSpec `spec` (nodes below log-probability
        `floor` pruned)."""


@runtime_checkable
class SampledTreeProposer(Protocol):
    def propose_tree_sampled(self, depth: int, spec, floor: float, sampling, rng, row: int):
        """(DraftTree, the nodes' draft distributions): siblings i.i.d. draws from their
        parent's distribution, which lossless tree verification needs."""


def _no_aux(cfg) -> list:
    return []


def _three(cfg) -> int:
    return 3


def _one(cfg) -> int:
    return 1


@dataclass(frozen=True)
class DraftMethod:
    """One draft method: its config, how it attaches to a GPT and trains, how it drafts, and
    how it is exported, imported and served. Hooks a method does not need stay None."""
    name: str
    summary: str = ""
    # config: a dataclass with class attribute `algo = <name>` and an `aux_layer_ids`
    # property; validate(cfg, num_layers, vocab_size) fills base-dependent defaults and raises
    # ConfigError naming the key and what is valid
    config_class: Optional[type] = None
    validate: Optional[Callable] = None
    # on the base GPT, called on every rank: attach(model, cfg, vocab_size,
    # real_query_groups, seed, recompute, tokenizer_dir) -> this stage's draft module (None
    # before the last stage); errors of attach name the config key `attach_config_key`
    attach: Optional[Callable] = None
    attach_config_key: Optional[str] = None
    # the module is made on the base and stored in its speculative checkpoint (convert,
    # convert_speculative, export); False: e.g. a separate draft GPT read from its own checkpoint
    on_base: bool = False
    aux_layer_ids: Callable = _no_aux  # (cfg) -> base layers whose outputs the draft reads
    carries_embeds: bool = False  # the stage tensor carries the input embeddings
    captures_final: bool = False  # the base runner keeps the final hidden state for drafting
    set_draft_vocab: Optional[Callable] = None  # (spec_model, d2t, t2d): a calibrated vocabulary
    # loss(spec_model, state, input_ids, loss_mask, attention_mask) -> loss report dict
    loss: Optional[Callable] = None
    loss_steps: Callable = _one  # (cfg) -> per-step statistics its loss report holds
    trainable: bool = False
    supports_recompute: bool = False  # training.recompute recomputes its layers
    evaluated_in_training: bool = True  # evaluation.interval may measure it while training
    # generation: proposer(spec_model, ProposerOptions) -> Proposer (None before the last
    # stage), called on every rank of the model-parallel group
    proposer: Optional[Callable] = None
    needs_module: bool = True  # drafts only with its own module on the model (False: any model)
    needs_draft_checkpoint: bool = False  # ProposerOptions.draft_model names its draft GPT
    default_num_draft_tokens: Callable = _three  # (cfg) -> k
    check_num_draft_tokens: Optional[Callable] = None  # (cfg, k): refuse a k it cannot draft
    draft_vocab_size: Optional[Callable] = None  # (spec_model) -> V its drafts come from
    drafts_trees: bool = False
    typical_acceptance: bool = False  # its chains may be verified by typical acceptance
    # checkpoints, HF and engines
    save_trained: Optional[Callable] = None  # (model, path, base_meta, tokenizer_dir, record)
    export_hf: Optional[Callable] = None  # (ckpt_dir, out_dir, dtype, overwrite, max_shard_mb)
    import_hf: Optional[Callable] = None  # (draft_dir, base_ckpt, out_ckpt, tp, pp, overwrite)
    check_export: Optional[Callable] = None  # (draft_dir, base_hf_dir) -> cfg: the import's checks
    engine_config: Optional[Callable] = None  # (draft_dir, num_draft_tokens) -> EngineConfig


class lazy:
    """A hook named "package.module:function", imported on its first call, so a method's
    `__init__` declares every hook without importing megatron-core (which takes seconds)."""

    def __init__(self, target: str):
        self.target = target
        self._fn = None

    def __call__(self, *args, **kwargs):
        if self._fn is None:
            module, _, name = self.target.partition(":")
            self._fn = getattr(importlib.import_module(module), name)
        return self._fn(*args, **kwargs)

    def __repr__(self):
        return f"lazy({self.target!r})"


def names() -> Tuple[str, ...]:
    """Every method's name: the built-in ones, then those registered."""
    return tuple(_BUILTIN) + tuple(n for n in _REGISTERED if n not in _BUILTIN)


def _unknown(name) -> UnknownMethodError:
    return UnknownMethodError(f"draft method {name!r}; expected one of: {', '.join(names())}")


def canonical(name: str) -> str:
    """`name` if it is a method's, ModelOpt's 'eagle' as 'eagle3'; anything else refused with
    the valid names."""
    name = _ALIASES.get(name, name)
    if name not in _BUILTIN and name not in _REGISTERED:
        raise _unknown(name)
    return name


def get(name: str) -> DraftMethod:
    """The method called `name` (its module imported on first use)."""
    if not isinstance(name, str):
        raise _unknown(name)
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _BUILTIN:
        raise _unknown(name)
    method = importlib.import_module(_BUILTIN[name]).METHOD
    if method.name != name:
        raise RuntimeError(f"{_BUILTIN[name]}.METHOD is named {method.name!r}, not {name!r}")
    _REGISTERED[name] = method
    return method


def register(method: DraftMethod, replace: bool = False) -> DraftMethod:
    """Add a method (a plugin's, or a test's); a taken name is refused unless `replace`."""
    if not replace and method.name in names():
        raise ValueError(f"draft method {method.name!r} is already registered")
    _REGISTERED[method.name] = method
    return method


def unregister(name: str) -> None:
    """Remove a registered method (a built-in one is imported again on its next `get`)."""
    _REGISTERED.pop(name, None)


def attaching() -> Tuple[str, ...]:
    """The methods whose draft module is made on the base (convert, export)."""
    return tuple(n for n in names() if get(n).on_base)


def trainable() -> Tuple[str, ...]:
    return tuple(n for n in names() if get(n).trainable)


# ---- configs: generic over methods ---------------------------------------------------------
def user_keys(cls) -> list:
    """The keys a user may set (derived fields are stored, not set)."""
    return [f.name for f in fields(cls) if not f.metadata.get("derived")]


def resumable_keys(cls) -> list:
    """The keys a run may change on resume or over a trained draft (they shape no tensor)."""
    return [f.name for f in fields(cls) if f.metadata.get("resumable")]


def check_user_keys(name: str, cls, raw: dict) -> None:
    """Refuse keys of `raw` a user may not set in method `name`'s config, naming them."""
    keys = user_keys(cls)
    unknown = sorted(k for k in raw if k not in keys)
    if unknown:
        raise ConfigError(f"unknown {name} config key(s) {', '.join(map(repr, unknown))}; "
                          f"valid keys: {', '.join(keys)}")


def _split_form(algo, config, allowed):
    """(name, dict) from `convert`'s two call forms: `("eagle3", {...})` or ModelOpt's
    `[("eagle", {...})]`."""
    if isinstance(algo, (list, tuple)):
        if config is not None:
            raise ConfigError("pass either convert(model, [(mode, config)]) or "
                              "convert(model, algo, config), not both")
        if len(algo) != 1 or not isinstance(algo[0], (list, tuple)) or len(algo[0]) != 2:
            raise ConfigError(f"expected a list with one (mode, config) pair, got {algo!r}")
        algo, config = algo[0]
    name = _ALIASES.get(str(algo).lower(), str(algo).lower()) if isinstance(algo, str) else None
    if name not in allowed:
        raise ConfigError(f"unknown speculative algorithm {algo!r}; valid: {', '.join(allowed)}")
    return name, dict(config or {})


def parse_config(algo, config, num_layers: int, vocab_size: int, allowed=None):
    """A validated config of the method `algo` names for a base of `num_layers` layers and
    `vocab_size` tokens; `allowed`: the method names this caller takes (default: those that
    attach a module). Unknown keys are refused by name."""
    allowed = tuple(allowed or attaching())
    name, raw = _split_form(algo, config, allowed)
    method = get(name)
    check_user_keys(name, method.config_class, raw)
    cfg = method.config_class(**raw)
    if method.validate is not None:
        method.validate(cfg, num_layers, vocab_size)
    return cfg


def config_to_dict(cfg) -> dict:
    """A checkpoint's metadata `draft` entry."""
    return {"algo": cfg.algo, "config": asdict(cfg)}


def config_from_dict(entry: dict):
    """Inverse of `config_to_dict` (already validated when it was stored)."""
    return get(entry["algo"]).config_class(**entry["config"])
