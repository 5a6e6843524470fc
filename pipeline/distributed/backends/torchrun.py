"""DDP's and FSDP's ranks on this machine (`train.np=-N`) started by torch's own launcher, torchrun, without Spark:
each rank runs its backend's entry on the job handed over through a hand-off folder (pipeline/distributed/
early_start.py), and rank 0 hands its result back the same way. TorchDistributor's local mode runs the same torchrun
but needs the driver's SparkSession (a JVM) first; ranks as Spark tasks (`train.np=N`) still go through it."""
from __future__ import annotations

import importlib
import os
import shutil
import signal
import subprocess
import sys
from typing import Any, Callable, List, Optional

from pipeline.data.leases import process_start
from pipeline.distributed.early_start import Handoff
from pipeline.distributed.loop import RankResult
from pipeline.distributed.rank_process import end_with_the_driver
from pipeline.log import get_logger

log = get_logger(__name__)

KEY_VAR = "LAKEHOUSE_HANDOFF_KEY"  # the hand-off's key reaches the ranks in their environment, never their argv
RESULT_FILE = "result.signed"


def run_local(entry: Callable[[Any], Any], arg: Any, ranks: int) -> List[RankResult]:
    """`ranks` processes on this machine through torchrun, each running the module-level `entry` (a backend's rank
    entry, named to the ranks by module and name) on `arg`: the job (handed
    over through a hand-off folder of its own), or the hand-off of ranks started before it was made. Returns rank 0's
    result, as TorchDistributor does.

    Raises:
        RuntimeError: torchrun ended with an error (a rank failed: its account is in the job folder), or rank 0 left
            no result."""
    handoff = arg if isinstance(arg, Handoff) else Handoff.new()
    own = handoff is not arg
    if own:
        handoff.deliver(arg)
    start = process_start(handoff.driver_pid)  # the ranks tell the driver from a process that took its pid later
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc_per_node={ranks}",
           "-m", __name__, f"{entry.__module__}:{entry.__qualname__}", handoff.path, str(handoff.driver_pid),
           "-" if start is None else str(start)]
    env = {**os.environ, KEY_VAR: handoff.key.hex()}
    try:
        done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, preexec_fn=dies_with_this_thread())
        if done.returncode != 0:
            raise RuntimeError(f"torchrun ({ranks} process(es) of {entry.__qualname__} on this machine) exited "
                               f"{done.returncode}")
        if not os.path.exists(os.path.join(handoff.path, RESULT_FILE)):
            raise RuntimeError(f"torchrun's rank 0 of {entry.__qualname__} left no result in {handoff.path}")
        return [handoff.get(RESULT_FILE)]
    finally:
        if own:
            shutil.rmtree(handoff.path, ignore_errors=True)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def dies_with_this_thread(sig: int = signal.SIGTERM) -> Optional[Callable[[], None]]:
    """A `preexec_fn` for torchrun's agent: the kernel sends it `sig` when the thread that started it ends, the
    driver killed with it (SIGKILL included); on SIGTERM the agent stops its ranks. The C function is looked up here,
    before the fork: the child runs only the call. None off Linux, or where libc has no prctl. (The ranks also end on
    their own once the driver is gone: `rank_process.end_with_the_driver`.)"""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the driver died before the call: no signal will come
            os.kill(os.getpid(), sig)

    return preexec


def rank_main(argv: List[str]) -> int:
    """A torchrun rank: `<module>:<entry> <hand-off folder> <driver pid> [<driver start> | -]`, the key in KEY_VAR
    (dropped from the environment at once). Ends on its own once the driver is gone (`end_with_the_driver`), runs the
    entry on the hand-off; rank 0 writes its result back."""
    where, path, driver_pid = argv[0], argv[1], int(argv[2])
    driver_start = int(argv[3]) if len(argv) > 3 and argv[3] != "-" else None
    handoff = Handoff(path, bytes.fromhex(os.environ.pop(KEY_VAR)), driver_pid)
    watching = end_with_the_driver(driver_pid, driver_start)
    try:
        module, name = where.split(":")
        result = getattr(importlib.import_module(module), name)(handoff)
        if result is not None and int(os.environ.get("RANK", "0")) == 0:
            handoff.put(RESULT_FILE, result)
    finally:
        watching.set()
    return 0


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
