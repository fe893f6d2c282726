"""What every process `distributed.spawn` starts imports before its function runs, imported once
in the forkserver those processes are forked from: torch and megatron-core take ~7 s to import
on 2 cores, a fork a fraction of a second, so a run of many spawns (a tool at TP=2 after
another, the test suite) pays for the imports once. megatron-core's import-time notices are
quieted first, as the tools quiet them; a spawned process then takes its parent's filters."""

from megatron_specdec.library_warnings import quiet_library_warnings

quiet_library_warnings()

import torch  # noqa: E402,F401
import megatron.core.dist_checkpointing  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.pipeline_parallel  # noqa: E402,F401
import megatron.core.tensor_parallel  # noqa: E402,F401
