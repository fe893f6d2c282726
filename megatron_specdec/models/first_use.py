"""A count of the one-time work calls do on first use: a kernel or run choice looked up or
timed, a weight's 16-bit or panel copy made, a greedy head's screen built.

Timings that feed a cost model (the draft policy's verify and draft steps,
inference/draft_policy.py) skip a call that did any. Such a call is no sample of the call's
cost: on a 2-core AMD EPYC Zen 4 the forward that first read a run's panel copies took 1.3-1.4
s against ~18 ms, and as the only timing of its width it made the policy's fitted base step
negative, so the measured threshold gave way to the configured one for a few hundred forwards
of every new process. The count is this process's: under pipeline parallelism the last stage,
which times the forwards, does not see an earlier stage's first-use work (a slow sample there
still ages out, StepCosts)."""

_done = 0


def note():
    """Count one piece of first-use work."""
    global _done
    _done += 1


def count() -> int:
    """The first-use work this process has done so far (compare before and after a call)."""
    return _done
