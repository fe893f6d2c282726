"""Run a command and report its wall time and peak memory: the largest sum of RSS over the
process and all its descendants (spawned ranks included), and the largest RSS of any one of
them (a rank), sampled every 20 ms."""

import subprocess
import time

import psutil


def run_measured(cmd, env=None, cwd=None):
    """(seconds, peak MiB of the process tree)."""
    seconds, tree_mib, _ = measure(cmd, env, cwd)
    return seconds, tree_mib


def measure(cmd, env=None, cwd=None):
    """(seconds, peak MiB of the process tree, peak MiB of its largest process)."""
    start = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    peak = peak_one = 0
    while proc.poll() is None:
        try:
            tree = [root] + root.children(recursive=True)
            rss = [p.memory_info().rss for p in tree if p.is_running()]
            peak, peak_one = max(peak, sum(rss)), max([peak_one] + rss)
        except psutil.Error:
            pass
        time.sleep(0.02)
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{output[-3000:]}")
    return time.time() - start, peak / 2**20, peak_one / 2**20
