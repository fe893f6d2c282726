"""training.profile_steps (Megatron's --profile-step-start/-end): a window of optimizer steps
under torch.profiler, to see where a step's time goes before tuning it. Rank 0 writes the ops
that took the most time (device time on a GPU, host time on a CPU) to <output_dir>/profile.txt."""

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger(__name__)

ROWS = 30


class StepProfiler:
    """`before(step)` with the number of steps done so far, `after(step)` once a step ends,
    `close(step)` after the loop (a run that stops inside the window still writes its table).
    The window is steps [start, end) of the run's count; a run resumed past start skips it."""

    def __init__(self, recipe):
        self.window = list(recipe.training.profile_steps)
        self.out = Path(recipe.output_dir) / "profile.txt"
        self._cuda = torch.cuda.is_available()
        self._profiler = None
        self._first = None

    def before(self, step: int):
        if self.window and step == self.window[0]:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
            self._profiler = profile(activities=activities)
            self._profiler.__enter__()
            self._first = step

    def after(self, step: int):
        if self._profiler is not None and step >= self.window[1]:
            self.close(step)

    def close(self, step: int):
        if self._profiler is None:
            return
        if self._cuda:
            torch.cuda.synchronize()
        self._profiler.__exit__(None, None, None)
        profiler, self._profiler = self._profiler, None
        if dist.get_rank() != 0:
            return
        key = "self_cuda_time_total" if self._cuda else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=key, row_limit=ROWS)
        steps = f"steps {self._first + 1}-{step}"
        self.out.write_text(f"# torch.profiler, {steps}, sorted by {key}\n{table}\n")
        log.info("profile of %s -> %s", steps, self.out)
