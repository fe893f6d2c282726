"""The commands in README.md, RESULTS.md, docs/, the cards and the recipes' headers name real
tools with real flags, and their recipe overrides load, so the documentation cannot drift from
the code unnoticed. Relative links between the documents resolve."""

import importlib
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", REPO / "RESULTS.md", REPO / "CHANGELOG.md",
               REPO / "data" / "README.md", REPO / "data" / "sources" / "README.md",
               *(REPO / "models").glob("*/README.md"),
               *(p for p in (REPO / "docs").rglob("*.md") if "reference" not in p.parts)])
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
LAUNCHERS = {"python", "python3", "torchrun"}


def _code_lines(text):
    """Lines of fenced or 4-space-indented code blocks, backslash continuations joined."""
    lines, fenced, joined = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not (fenced or line.startswith("    ")):
            continue
        joined += line.strip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        lines.append(joined)
        joined = ""
    return lines


def _comment_lines(text):
    """A YAML file's comment lines, as code lines (a recipe's header shows how to run it)."""
    comments = [line[1:] for line in text.splitlines() if line.startswith("#")]
    return _code_lines("\n".join("    " + line.strip() for line in comments))


def _command(line):
    """(argv after the launcher, the launcher) of a python/torchrun command line, else None."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return None
    while tokens and (re.fullmatch(r"[A-Z_]+=\S*", tokens[0]) or tokens[0] in ("nice", "-n", "10")
                      or tokens[0] in ("do", "then")):
        tokens = tokens[1:]
    if not tokens or Path(tokens[0]).name not in LAUNCHERS:
        return None
    launcher, args = Path(tokens[0]).name, tokens[1:]
    if launcher == "torchrun":
        while args and args[0].startswith("--") and args[0] != "-m":
            args = args[1:] if "=" in args[0] else args[2:]
    return [_unbracket(a) for a in args if _unbracket(a)], launcher


def _unbracket(arg):
    """`[--tp 2]` marks optional flags in the documents; `key=[a,b]` is a list value."""
    arg = arg[1:] if arg.startswith("[-") else arg
    return arg[:-1] if arg.endswith("]") and "=[" not in arg else arg


def _project_commands():
    found = []
    for doc in [*DOCS, *RECIPES]:
        lines = (_comment_lines if doc.suffix == ".yaml" else _code_lines)(doc.read_text())
        for line in lines:
            cmd = _command(line)
            if cmd is None:
                continue
            args, _ = cmd
            target = args[1] if args and args[0] == "-m" and len(args) > 1 else (args[0] if args else "")
            if target.startswith(("checkpoint_tools/", "megatron_specdec", "bench/")):
                found.append((doc.relative_to(REPO), args))
    return found


COMMANDS = _project_commands()


def _parser(args):
    """(argparse parser, remaining args) for a project command."""
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        mod = importlib.import_module(module)
        if not hasattr(mod, "build_parser"):
            mod = importlib.import_module(module + ".__main__")
        parser = mod.build_parser()
        if rest and not rest[0].startswith("-"):
            sub = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
            if sub:
                assert rest[0] in sub[0].choices, f"{module} has no command {rest[0]!r}"
                return sub[0].choices[rest[0]], rest[1:]
        return parser, rest
    path = REPO / args[0]
    assert path.is_file(), f"{args[0]} does not exist"
    return importlib.import_module("checkpoint_tools." + path.stem).build_parser(), args[1:]


def _flags(args):
    return sorted({a.split("=", 1)[0] for a in args if a.startswith("--")})


def test_the_documents_hold_commands():
    tools = {args[1] if args[0] == "-m" else args[0] for _, args in COMMANDS}
    assert len(COMMANDS) > 40 and {"checkpoint_tools/hf_to_megatron.py", "megatron_specdec.cli.train",
                                   "megatron_specdec.cli.validate"} <= tools, sorted(tools)


TOOL_COMMANDS = [(d, a) for d, a in COMMANDS if not a[0].startswith("bench/")]


@pytest.mark.parametrize("doc,args", TOOL_COMMANDS,
                         ids=[f"{d}:{' '.join(a[:3])}" for d, a in TOOL_COMMANDS])
def test_command_flags_exist(doc, args):
    parser, rest = _parser(args)
    known = parser._option_string_actions
    unknown = [f for f in _flags(rest) if f not in known]
    assert not unknown, f"{doc}: {' '.join(args[:2])}: no flag {unknown} (has {sorted(known)})"


def _declared_flags(script: Path) -> set:
    """The flags a bench script's source declares, with those of the bench modules it imports
    from (a parser shared by several benches)."""
    flag = r"add_argument\(\s*\"(--[\w-]+)\""
    text = script.read_text()
    declared = set(re.findall(flag, text))
    for module in re.findall(r"^from (bench_\w+) import", text, re.M):
        declared |= set(re.findall(flag, (REPO / "bench" / f"{module}.py").read_text()))
    return declared


def test_bench_flags_exist():
    """Bench scripts build their parsers inside main() and import heavy modules first: read
    the flags they declare from their source."""
    wanted = {}
    for doc, args in COMMANDS:
        if args[0].startswith("bench/"):
            wanted.setdefault(args[0], set()).update(_flags(args[1:]))
    assert wanted
    for script, flags in wanted.items():
        assert (REPO / script).is_file(), f"{script} does not exist"
        declared = _declared_flags(REPO / script)
        assert flags <= declared, f"{script} declares no {sorted(flags - declared)}"


def test_scripts_compile():
    """The bench and checkpoint scripts the documents run are not imported by any other test:
    each one at least compiles (a mis-indented import once left one unable to start)."""
    scripts = sorted([*(REPO / "bench").rglob("*.py"), *(REPO / "checkpoint_tools").glob("*.py")])
    assert scripts
    for script in scripts:
        compile(script.read_text(), str(script), "exec")


@pytest.mark.parametrize("doc,args", [(d, a) for d, a in COMMANDS
                                      if a[:2] == ["-m", "megatron_specdec.cli.train"]])
def test_train_commands_load_their_recipe(doc, args):
    from megatron_specdec.training import load_recipe

    parsed = importlib.import_module("megatron_specdec.cli.train").build_parser().parse_args(args[2:])
    assert parsed.config, f"{doc}: a train command without --config"
    load_recipe(REPO / parsed.config, parsed.overrides)


def test_relative_links_resolve():
    missing = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(REPO)} -> {target}")
    assert not missing, missing
