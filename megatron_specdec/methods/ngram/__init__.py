"""Prompt lookup (n-gram): drafts the continuation of the latest earlier match of the last
tokens; no draft module, so any model drafts with it."""

from megatron_specdec.registry import DraftMethod, lazy

_P = "megatron_specdec.methods.ngram"

METHOD = DraftMethod(
    name="ngram",
    summary="prompt lookup: no draft module",
    proposer=lazy(f"{_P}.proposer:make_proposer"),
    needs_module=False,
    engine_config=lazy(f"{_P}.engines:engine_config"),
)
