"""Library warnings a user can do nothing about, each seen on every run of a tool: megatron-core
on every absent optional accelerator; its dist_checkpointing loader, which still calls the
torch APIs torch has deprecated (ShardedTensor, `load_state_dict`); and its config upgrade of
the legacy `cuda_graph_scope="full"` default. The tools (cli/common.py) and the processes that
`distributed.spawn` forks (spawn_preload.py) quiet them before megatron-core is imported."""

import warnings

BENIGN_WARNINGS = (
    ".*(Apex|apex|Transformer Engine|TE).*",
    "Please use DTensor instead and we are deprecating ShardedTensor",
    "`load_state_dict` is deprecated",
    "full scope is deprecated",
)


def quiet_library_warnings():
    for message in BENIGN_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
