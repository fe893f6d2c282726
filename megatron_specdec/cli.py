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


# Library warnings a user can do nothing about, each seen on every run of a tool: megatron-core
# on every absent optional accelerator; its dist_checkpointing loader, which still calls the
# torch APIs torch has deprecated (ShardedTensor, `load_state_dict`); and its config upgrade
# of the legacy `cuda_graph_scope="full"` default.
BENIGN_WARNINGS = (
    ".*(Apex|apex|Transformer Engine|TE).*",
    "Please use DTensor instead and we are deprecating ShardedTensor",
    "`load_state_dict` is deprecated",
    "full scope is deprecated",
)


def setup_logging(level=None):
    """One log format for every tool; `level` (a logging level name) overrides INFO on rank 0
    and WARNING elsewhere."""
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=level or (logging.INFO if rank == "0" else logging.WARNING),
        format=f"%(asctime)s [rank{rank}] %(name)s: %(message)s",
    )
    logging.getLogger("megatron").setLevel(logging.WARNING)
    for message in BENIGN_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def run_cli(main) -> int:
    setup_logging()
    try:
        main()
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
