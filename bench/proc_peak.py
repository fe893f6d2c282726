"""Run a command and report its wall time and peak memory: the largest sum of RSS over the
process and all its descendants (spawned ranks included), sampled every 20 ms."""

import subprocess
import time

import psutil


def run_measured(cmd, env=None, cwd=None):
    start = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            tree = [root] + root.children(recursive=True)
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{output[-3000:]}")
    return time.time() - start, peak / 2**20
