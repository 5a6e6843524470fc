"""The driver's view of its ranks (`rank_signals.rank_processes`): a rank's fork (a decode worker has the command
line of the rank it was forked from) is not a rank, so the graceful SIGTERM goes to the rank alone (it used to kill
the decode workers under a rank, which then failed on a dead worker instead of stopping with a last checkpoint)."""
import os
import signal
import subprocess
import sys
import time

from pipeline.distributed import rank_signals

# a stand-in rank: its command line carries a rank marker; it forks one child (as a decode pool does) and sleeps
RANK = """
import os, sys, time
child = os.fork()
if child == 0:
    time.sleep(120)
    os._exit(0)
print(os.getpid(), child, flush=True)
time.sleep(120)
"""


def test_a_ranks_fork_is_not_taken_for_a_rank():
    proc = subprocess.Popen([sys.executable, "-c", RANK, "horovod.runner.run_task"], stdout=subprocess.PIPE, text=True)
    try:
        rank, child = (int(x) for x in proc.stdout.readline().split())
        deadline = time.monotonic() + 30
        while True:  # the fork's command line is the rank's once psutil can read it
            found = sorted(p.pid for p in rank_signals.rank_processes())
            if found == [rank] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert found == [rank], (found, rank, child)  # the fork (child) left out
    finally:
        for pid in (locals().get("child"), proc.pid):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait(timeout=30)
