"""One CLI convention, checked on every tool's parser: dashed flags, one name for the model
flag, old spellings still parsed but not shown, a console entry point per tool, and
docs/reference/ equal to what the code generates (so a flag or recipe key added without help
or meaning, or without regenerating the reference, fails here)."""

import ast
import dataclasses
import importlib
from typing import Optional

import pytest

from conftest import REPO
from megatron_specdec.cli import reference_docs
from megatron_specdec.cli.reference_docs import TOOLS, flags, key_rows, parser_of, subcommands
from megatron_specdec.training.recipe import Recipe

# Spellings of the model flag before the convention; none may be a flag of any tool now.
OLD_MODEL_FLAGS = ("--hf_path", "--model_path", "--ckpt", "--checkpoint")


def _parsers():
    for tool in TOOLS:
        parser = parser_of(tool)
        yield tool.command, parser
        for name, sub in subcommands(parser).items():
            yield f"{tool.command} {name}", sub


def test_every_flag_is_dashed_and_documented():
    for tool in TOOLS:
        parser = parser_of(tool)
        assert (parser.description or "").strip(), f"{tool.command} has no description"
        for sub, text in reference_docs.subcommand_help(parser).items():
            assert text, f"{tool.command} {sub} has no help"
    for name, parser in _parsers():
        for names, action in flags(parser):
            for flag in names:
                assert "_" not in flag, f"{name}: {flag} is not dash style"
                assert flag not in OLD_MODEL_FLAGS, f"{name}: {flag}: the model flag is --model"
            assert action.help and action.help.strip(), f"{name}: {names[0]} has no help"


def test_the_model_flag_has_one_name():
    reads_a_model = {"specdec-import", "specdec-export-base", "specdec-convert",
                     "specdec-import-draft", "specdec-export", "specdec-prune",
                     "specdec-recalibrate-vocab", "specdec-validate", "specdec-chat",
                     "specdec-data regenerate", "specdec-data synthesize"}
    found = {name for name, parser in _parsers()
             if any("--model" in names for names, _ in flags(parser))}
    assert found == reads_a_model


def test_old_spellings_parse_to_the_new_flags_and_are_hidden():
    renamed_somewhere = 0
    for tool in TOOLS:
        parser = parser_of(tool)
        known = {f for _, p in _parsers() for names, _ in flags(p) for f in names}
        text = parser.format_help() + "".join(s.format_help()
                                               for s in subcommands(parser).values())
        for old, new in parser.renamed.items():
            renamed_somewhere += 1
            assert new in known, f"{tool.command}: {old} is renamed to {new}, not a flag"
            assert old not in text, f"{tool.command}: {old} is shown in --help"
            assert parser._new_spellings([old, "x", f"{old}=y"]) == [new, "x", f"{new}=y"]
            assert parser._new_spellings(["--", old]) == ["--", old]  # a value after --
    assert renamed_somewhere >= 15


def test_an_old_command_line_parses_as_the_new_one():
    from checkpoint_tools import convert_speculative

    old = ["--model_path", "base", "--specdec_algo", "eagle3", "--export_dir", "out",
           "--draft_vocab_size", "256", "--calibration_data", "a.jsonl", "b.jsonl",
           "--aux_layers", "1,2,3", "--ttt_steps=2", "--num_layers", "1"]
    new = ["--model", "base", "--algo", "eagle3", "--out", "out", "--draft-vocab-size", "256",
           "--calibration-data", "a.jsonl", "b.jsonl", "--aux-layers", "1,2,3", "--ttt-steps=2",
           "--num-layers", "1"]
    parser = convert_speculative.build_parser()
    assert parser.parse_args(old) == parser.parse_args(new)
    assert convert_speculative.draft_config(parser.parse_args(old)) == {
        "eagle_num_layers": 1, "draft_vocab_size": 256,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3], "ttt_steps": 2}


def _console_scripts() -> dict:
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            scripts = ast.literal_eval(node.value)["console_scripts"]
            return dict(tuple(part.strip() for part in s.split("=")) for s in scripts)
    raise AssertionError("setup.py declares no entry_points")


def test_each_tool_has_a_console_entry_point():
    scripts = _console_scripts()
    assert scripts == {t.command: f"{t.module}:cli" for t in TOOLS}
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), target


def test_reference_docs_are_generated_from_the_code():
    for path, text in reference_docs.documents().items():
        assert path.is_file() and path.read_text() == text, (
            f"{path.relative_to(REPO)} differs from the code: run "
            f"`python -m megatron_specdec.cli.reference_docs`")
    cli = (REPO / "docs" / "reference" / "cli.md").read_text()
    for name, parser in _parsers():
        for names, _ in flags(parser):
            assert f"`{names[0]}`" in cli, (name, names[0])


def test_every_recipe_and_draft_key_has_type_default_and_meaning():
    rows = key_rows(Recipe) + [row for algo, cls in reference_docs.draft_sections().items()
                               for row in key_rows(cls, "", algo + ".")]
    assert len(rows) > 50
    for key, type_name, default, meaning in rows:
        assert type_name and default and meaning, (key, type_name, default, meaning)
    recipes = (REPO / "docs" / "reference" / "recipes.md").read_text()
    for key in ("training.recompute", "data.calibration", "ttt_steps", "medusa_num_heads"):
        assert f"| `{key}` |" in recipes


def test_a_key_without_a_meaning_is_found():
    @dataclasses.dataclass
    class Section:
        said: int = 1  # what it is
        # what this one is
        above: Optional[str] = None
        bare: float = 0.5

    rows = {k: (t, d, m) for k, t, d, m in key_rows(Section, "s.")}
    assert rows["s.said"] == ("int", "`1`", "what it is")
    assert rows["s.above"] == ("str or null", "null", "what this one is")
    assert rows["s.bare"] == ("float", "`0.5`", "")  # the test above would fail on it


@pytest.mark.parametrize("tool", TOOLS, ids=lambda t: t.command)
def test_help_runs(tool, capsys):
    with pytest.raises(SystemExit) as e:
        importlib.import_module(tool.module).build_parser().parse_args(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out
