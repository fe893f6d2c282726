"""docs/reference/ written from the code, so it cannot drift from it: cli.md from each tool's
argparse parser (every flag with its type, default and help), recipes.md from the training
recipe's schema and the draft modules' configs (every key with its type, default and the
comment beside it in the code, or MEANINGS below where the code has none).

    python -m megatron_specdec.cli.reference_docs          # rewrite docs/reference/*.md
    python -m megatron_specdec.cli.reference_docs --check  # exit 1 when they are stale

tests/test_reference_docs.py fails when a flag or key has no help or meaning, or when the
committed files differ from what this writes.
"""

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
import typing
from pathlib import Path

from omegaconf import MISSING

from megatron_specdec.cli.common import setup_logging

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "reference"


@dataclasses.dataclass(frozen=True)
class Tool:
    command: str  # the console entry point (setup.py)
    module: str  # the module with build_parser() and cli()
    run_as: str  # the same tool without installing the entry point


TOOLS = (
    Tool("specdec-import", "checkpoint_tools.hf_to_megatron",
         "python checkpoint_tools/hf_to_megatron.py"),
    Tool("specdec-export-base", "checkpoint_tools.megatron_to_hf",
         "python checkpoint_tools/megatron_to_hf.py"),
    Tool("specdec-convert", "checkpoint_tools.convert_speculative",
         "python checkpoint_tools/convert_speculative.py"),
    Tool("specdec-import-draft", "checkpoint_tools.import_draft",
         "python checkpoint_tools/import_draft.py"),
    Tool("specdec-export", "checkpoint_tools.export_draft",
         "python checkpoint_tools/export_draft.py"),
    Tool("specdec-prune", "checkpoint_tools.prune_depth",
         "python checkpoint_tools/prune_depth.py"),
    Tool("specdec-recalibrate-vocab", "checkpoint_tools.recalibrate_draft_vocab",
         "python checkpoint_tools/recalibrate_draft_vocab.py"),
    Tool("specdec-data", "megatron_specdec.cli.data", "python -m megatron_specdec.cli.data"),
    Tool("specdec-train", "megatron_specdec.cli.train", "python -m megatron_specdec.cli.train"),
    Tool("specdec-validate", "megatron_specdec.cli.validate",
         "python -m megatron_specdec.cli.validate"),
    Tool("specdec-chat", "megatron_specdec.cli.chat", "python -m megatron_specdec.cli.chat"),
    Tool("specdec-demo", "megatron_specdec.cli.demo", "python -m megatron_specdec.cli.demo"),
)

# Meanings of the recipe and draft keys whose definition carries no comment, or one that
# says only part (a default, not what the key is).
MEANINGS = {
    "output_dir": "where checkpoints/, final/, train_log.jsonl, tensorboard/, summary.json and "
                  "recipe.yaml are written",
    "model.dtype": "parameter dtype: float32, bfloat16, float16, or auto (bfloat16 on a GPU; on "
                   "a CPU the faster of bfloat16 and float32 for a training-sized linear, "
                   "measured at start: training/dtype_choice.py)",
    "model.transformer_impl": "layer implementation: auto (Transformer Engine when it imports "
                              "on a GPU, else local), local or transformer_engine",
    "parallelism.tp": "tensor parallel size",
    "parallelism.pp": "pipeline parallel size (data parallel = world size / (tp * pp))",
    "data.tokenizer": "HF tokenizer directory (default: the model's tokenizer and chat "
                      "template)",
    "training.offline_dir": "where training.mode=offline stores the base's hidden states "
                            "(default: <output_dir>/offline_states)",
    "checkpointing.directory": "where checkpoints are written and resumed from (default: "
                               "<output_dir>/checkpoints)",
    "evaluation.draft_tokens": "chain length k of the evaluation's speculative decoding",
    "eagle3.draft_vocab_size": "tokens the draft predicts over, the most frequent in the "
                               "calibration data (default: the base vocabulary)",
    "medusa.medusa_head_weights": "loss weight of head i (default 0.8**i, as Medusa-1)",
    "draft.algo": "what is trained: eagle3, medusa or draft_model",
    "data.seq_length": "tokens per training sequence (longer conversations are cut)",
    "data.pack": "pack several conversations into one sequence",
    "data.seed": "seed of the data order",
    "optimizer.lr": "peak learning rate (Adam)",
    "optimizer.min_lr": "learning rate the decay ends at",
    "optimizer.weight_decay": "decoupled weight decay",
    "optimizer.adam_beta1": "Adam beta1",
    "optimizer.adam_beta2": "Adam beta2",
    "optimizer.adam_eps": "Adam epsilon",
    "optimizer.warmup_steps": "steps of linear warmup from 0 to lr",
    "training.steps": "optimizer steps to train to (a resumed run counts from its checkpoint)",
    "training.micro_batch_size": "sequences per forward on each data-parallel rank",
    "training.seed": "seed of the draft's initialisation and dropout",
    "checkpointing.keep_last": "checkpoints kept in `directory` (older ones are removed)",
    "evaluation.num_prompts": "prompts of `prompts` each evaluation generates",
    "evaluation.max_new_tokens": "tokens generated per prompt in an evaluation",
    "evaluation.prompt_bucket": "an evaluation batch's prompts are left-padded to a multiple "
                                "of this many tokens, so few prefill shapes occur (default: "
                                "generation.PROMPT_BUCKET)",
    "logging.tensorboard": "write TensorBoard scalars to output_dir/tensorboard",
    "logging.progress_bar": "show a progress bar on rank 0",
    "eagle3.eagle_num_layers": "draft decoder layers",
    "eagle3.use_input_layernorm_in_first_layer": "apply the input layernorm in the first "
                                                 "draft layer",
    "eagle3.use_last_layernorm": "apply a final norm before the draft's lm_head",
    "eagle3.eagle_aux_hidden_state_layer_ids": "base layers whose outputs the draft reads, "
                                               "0-based output-of-layer ids (default: 1, "
                                               "N//2-1, N-4 of an N-layer base)",
    "eagle3.ttt_steps": "training-time-test steps: draft positions trained per token (and "
                        "the default chain length k at decoding)",
    "eagle3.ttt_decay": "loss weight of TTT step i is ttt_decay**i",
    "medusa.medusa_num_heads": "Medusa heads (draft positions)",
    "medusa.medusa_num_layers": "residual blocks per head",
    "draft_model.model": "starting checkpoint of the separate draft GPT (e.g. "
                         "checkpoint_tools/prune_depth.py's output)",
}


# --- CLI ---------------------------------------------------------------------------------

def parser_of(tool: Tool) -> argparse.ArgumentParser:
    return importlib.import_module(tool.module).build_parser()


def flags(parser) -> list:
    """[(names, action)] of a parser's arguments, help excluded, in definition order."""
    return [(a.option_strings or [a.dest], a) for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def subcommands(parser) -> dict:
    """{name: parser} of a parser's subcommands (empty for a tool without any)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def subcommand_help(parser) -> dict:
    """{name: the help given to add_parser} of a parser's subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {choice.dest: choice.help for choice in action._choices_actions}
    return {}


def _type_of(action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "switch"
    name = getattr(action.type, "__name__", "str") if action.type else "str"
    name = {"_layer_ids": "int list (comma-separated)"}.get(name, name)
    if action.choices is not None:
        name = " \\| ".join(f"`{c}`" for c in action.choices)
    if action.nargs in ("+", "*"):
        name = f"{name}, one or more" if action.nargs == "+" else f"{name}, any number"
    if isinstance(action, argparse._AppendAction):
        name += ", repeatable"
    return name


def _default_of(action) -> str:
    if action.required:
        return "required"
    if (isinstance(action, argparse._StoreTrueAction) or action.default is None
            or action.default is False or action.default == []):
        return ""
    # a default inside the checkout is shown relative to it: the page is the same in any clone
    return f"`{str(action.default).replace(str(REPO) + '/', '')}`"


def _help_of(action) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % {"default": action.default, "prog": ""}
    return _cell(text)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _flag_table(parser) -> list:
    lines = ["| flag | type | default | meaning |", "| --- | --- | --- | --- |"]
    for names, action in flags(parser):
        lines.append(f"| {', '.join(f'`{n}`' for n in names)} | {_type_of(action)} | "
                     f"{_default_of(action)} | {_help_of(action)} |")
    return lines


def _summary(parser) -> str:
    """The first paragraph of a tool's description (its module docstring)."""
    return _cell((parser.description or "").strip().split("\n\n")[0])


def cli_markdown() -> str:
    out = ["# Command-line tools", "",
           "Generated by `python -m megatron_specdec.cli.reference_docs` from the tools' parsers; "
           "do not edit by hand.", "",
           "Every tool follows one convention: dashed flags; `--model` is the model a tool reads "
           "or runs (a Megatron checkpoint, an HF directory, or `default` for the embedded "
           "SmolLM2-135M-Instruct: each tool says which it takes); `--draft` is a draft stored "
           "on its own in the HF layout; `--out` is what a tool writes; `--data` its input data. "
           "Each tool is installed as a console command (`pip install -e .`, `make install`) "
           "and also runs without it as shown. Bad input ends in one line on stderr naming the "
           "file, flag or key and what was expected, with a non-zero exit code. "
           "`SPECDEC_LOG_LEVEL` (e.g. `WARNING`) sets the tools' log level.", "",
           "| command | same as | what it does |", "| --- | --- | --- |"]
    for tool in TOOLS:
        out.append(f"| [`{tool.command}`](#{tool.command}) | `{tool.run_as}` | "
                   f"{_summary(parser_of(tool))} |")
    for tool in TOOLS:
        parser = parser_of(tool)
        out += ["", f"## {tool.command}", "", f"`{tool.command}` or `{tool.run_as}`", "",
                "```text", (parser.description or "").strip(), "```", ""]
        renamed = getattr(parser, "renamed", {})
        if flags(parser):
            out += _flag_table(parser)
        helps = subcommand_help(parser)
        for name, sub in subcommands(parser).items():
            out += ["", f"### {tool.command} {name}", "", _cell(helps.get(name) or ""),
                    ""] + _flag_table(sub)
        if renamed:
            old = ", ".join(f"`{a}` → `{b}`" for a, b in renamed.items())
            out += ["", f"Older spellings still accepted (not shown in `--help`): {old}."]
    return "\n".join(out) + "\n"


# --- recipes -----------------------------------------------------------------------------

def field_comments(cls) -> dict:
    """{field name: the comment beside its definition, or the comment lines just above it}."""
    comments, above = {}, []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
            continue
        found = re.match(r"(\w+)\s*:[^#]*?(?:#\s*(.*))?$", stripped)
        if found and not stripped.startswith(("def ", "@", "return")):
            text = " ".join(above + ([found.group(2)] if found.group(2) else []))
            comments[found.group(1)] = text
        above = []
    return comments


def _type_name(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union and type(None) in args:
        return f"{_type_name(next(a for a in args if a is not type(None)))} or null"
    if origin in (list, typing.List):
        return f"list of {_type_name(args[0])}"
    if origin in (dict, typing.Dict):
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def _default(f) -> str:
    if f.default is MISSING:
        return "required"
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def key_rows(cls, prefix: str = "", meanings_under: str = "") -> list:
    """[(key, type, default, meaning)] of a dataclass schema, nested sections flattened to
    `section.key`; fields marked derived (stored, not set by users) are left out. A meaning is
    MEANINGS[meanings_under + key] where it says more, else the code's comment."""
    rows, comments = [], field_comments(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("derived"):
            continue
        key = prefix + f.name
        if dataclasses.is_dataclass(f.type):
            rows += key_rows(f.type, key + ".", meanings_under)
            continue
        meaning = MEANINGS.get(meanings_under + key) or comments.get(f.name, "")
        rows.append((key, _type_name(f.type), _default(f), meaning))
    return rows


def draft_sections() -> dict:
    """{algo: its config dataclass}: the keys `draft.config` takes for each algorithm."""
    from megatron_specdec import registry

    return {name: registry.get(name).config_class for name in registry.trainable()}


def recipes_markdown() -> str:
    from megatron_specdec.training.recipe import Recipe

    out = ["# Recipe keys", "",
           "Generated by `python -m megatron_specdec.cli.reference_docs` from "
           "`megatron_specdec/training/recipe.py` and `megatron_specdec/methods/config.py`; do not "
           "edit by hand.", "",
           "A recipe is a YAML file (see `recipes/`) read by `specdec-train --config FILE`; any "
           "key can be overridden on the command line as `section.key=value`. Unknown keys and "
           "values of the wrong type are refused by name before anything runs.", "",
           "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    out += [f"| `{k}` | {t} | {d} | {_cell(m)} |" for k, t, d, m in key_rows(Recipe)]
    out += ["", "## draft.config", "",
            "The keys of `draft.config` depend on `draft.algo` (the same keys "
            "`specdec-convert` sets from its flags). A speculative checkpoint given as "
            "`model.path` brings its own draft config, and `draft.config` is then ignored."]
    for algo, cls in draft_sections().items():
        out += ["", f"### draft.algo: {algo}", "", "| key | type | default | meaning |",
                "| --- | --- | --- | --- |"]
        out += [f"| `{k}` | {t} | {d} | {_cell(m)} |" for k, t, d, m in key_rows(cls, "", algo + ".")]
    return "\n".join(out) + "\n"


# --- files -------------------------------------------------------------------------------

def documents() -> dict:
    return {REFERENCE / "cli.md": cli_markdown(), REFERENCE / "recipes.md": recipes_markdown()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when a file differs from the code")
    args = p.parse_args(argv)
    setup_logging("WARNING")  # the tools' imports would print megatron-core's notices
    stale = []
    for path, text in documents().items():
        if path.is_file() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(text)
            tmp.replace(path)
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'} {path.relative_to(REPO)}",
              file=sys.stderr if args.check else sys.stdout)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
