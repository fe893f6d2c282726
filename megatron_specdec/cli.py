"""Shared entry-point behaviour for the command-line tools: logging set-up, and user errors
printed as one clear line (exit 2) instead of a traceback."""

import logging
import os
import sys
import warnings

from megatron_specdec.checkpoint import CheckpointError
from megatron_specdec.families import UnsupportedModelError
from megatron_specdec.weights.mapping import WeightMappingError

USER_ERRORS = (CheckpointError, UnsupportedModelError, WeightMappingError, FileNotFoundError,
               FileExistsError, ValueError)


def setup_logging():
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO if rank == "0" else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(name)s: %(message)s",
    )
    logging.getLogger("megatron").setLevel(logging.WARNING)
    # megatron-core warns about every absent optional accelerator; once is plenty.
    warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine|TE).*")


def run_cli(main) -> int:
    setup_logging()
    try:
        main()
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
