"""Shared entry-point behaviour for the command-line tools: one flag convention (an argparse
parser that accepts the old spellings of renamed flags without showing them), logging set-up,
and user errors printed as one clear line (exit 2) instead of a traceback.

The convention: dashes (`--draft-vocab-size`); `--model` for the model a tool reads or runs
(checkpoint, HF directory or 'default'); `--draft` for a draft stored on its own; `--out` for
what a tool writes; `--data` for input data files.
"""

import argparse
import logging
import os
import sys

from megatron_specdec.checkpointing.checkpoint import CheckpointError
from megatron_specdec.models.families import UnsupportedModelError
from megatron_specdec.checkpointing.hf_files import FileFormatError
from megatron_specdec.checkpointing.hf_mapping import WeightMappingError
from megatron_specdec.library_warnings import quiet_library_warnings

USER_ERRORS = (CheckpointError, UnsupportedModelError, WeightMappingError, FileFormatError,
               FileNotFoundError, FileExistsError, ValueError)


# As a tool imports this module, before it imports the layers that import megatron-core (the
# imports above do not): those warnings are raised at import time, before setup_logging runs.
quiet_library_warnings()


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the tools' help layout (the module docstring as written) and `renamed`
    ({old flag: new flag}): old spellings still parse, so existing scripts keep working, but
    only the new ones are shown."""

    def __init__(self, *args, renamed=None, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self.renamed = dict(renamed or {})

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self._new_spellings(args), namespace)

    def _new_spellings(self, args):
        out, flags = [], True
        for arg in args:
            if flags and isinstance(arg, str):
                if arg == "--":
                    flags = False
                name, eq, value = arg.partition("=")
                if name in self.renamed:
                    arg = self.renamed[name] + eq + value
            out.append(arg)
        return out


def setup_logging(level=None):
    """One log format for every tool; `level` (a logging level name), else the environment's
    SPECDEC_LOG_LEVEL (`make demo` sets WARNING for the tools it runs), overrides INFO on rank
    0 and WARNING elsewhere."""
    rank = os.environ.get("RANK", "0")
    level = (level or os.environ.get("SPECDEC_LOG_LEVEL", "").upper()
             or (logging.INFO if rank == "0" else logging.WARNING))
    logging.basicConfig(level=level, format=f"%(asctime)s [rank{rank}] %(name)s: %(message)s")
    logging.getLogger().setLevel(level)  # also when an earlier call configured logging
    logging.getLogger("megatron").setLevel(logging.WARNING)
    quiet_library_warnings()


def run_cli(main) -> int:
    setup_logging()
    try:
        main()
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
