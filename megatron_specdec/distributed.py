"""Process-group set-up: the same code runs NCCL on GPUs and gloo on CPUs.

Use `initialize(tp, pp)` inside a torchrun process (or a process started by `spawn`), and
`spawn(fn, world_size, *args)` to run a function on N local processes from plain Python
(tests, command-line tools that were not launched with torchrun).
"""

import importlib
import os
import socket
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_specdec import cpu_compat


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def initialize(tp: int = 1, pp: int = 1, seed: int = 1234, ep: int = 1, etp=None):
    """Initialise torch.distributed (from torchrun's env, or as a single process) and Megatron's
    tensor/pipeline groups. Data parallel size is world_size / (tp * pp). `ep`: expert parallel
    size, carved out of data parallelism (world size divisible by etp x ep x pp); `etp`: expert
    tensor parallel size (None: tp)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cpu_compat.apply()
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = timedelta(minutes=30)
        if "RANK" in os.environ:  # torchrun or `spawn`: rendezvous from the environment
            dist.init_process_group(backend(), timeout=timeout)
        else:  # a plain single process: a private address, leaving os.environ untouched
            dist.init_process_group(backend(), init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1, timeout=timeout)
    world = dist.get_world_size()
    if world % (tp * pp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by tensor_parallel ({tp}) x pipeline_parallel ({pp})"
        )
    etp = tp if etp is None else etp
    if world % (etp * ep * pp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by expert_tensor_parallel ({etp}) x "
            f"expert_parallel ({ep}) x pipeline_parallel ({pp})"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
    )
    model_parallel_cuda_manual_seed(seed)


def destroy():
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(local_rank, world_size, port, filters, target, args):
    # The parent's warning filters before `fn`'s module is imported: a child re-imports
    # megatron-core, whose import-time warnings the tools quiet (library_warnings.py).
    warnings.filters[:] = filters
    module, name = target
    fn = getattr(importlib.import_module(module), name)
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        fn(*args)
    finally:
        destroy()


def spawn(fn, world_size: int, *args):
    """Run `fn(*args)` on `world_size` local processes with torch.distributed env set and this
    process's warning filters.

    `fn` must be importable (a module-level function) and call `initialize` itself.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    # Forked from a forkserver that imported torch and megatron-core once (spawn_preload.py),
    # not started afresh: ~7 s of imports a process on 2 cores. The server holds no threads, and
    # each process still starts from its imports alone, as a spawned one does.
    multiprocessing.set_forkserver_preload(["megatron_specdec.spawn_preload"])
    target = (fn.__module__, fn.__qualname__)
    mp.start_processes(_spawned, args=(world_size, free_port(), list(warnings.filters), target, args),
                       nprocs=world_size, join=True, start_method="forkserver")


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
