"""DDP's and FSDP's ranks on this machine (`train.np=-N`) started by torch's own launcher, torchrun, without Spark:
each rank runs its backend's entry on the job handed over through a hand-off folder (pipeline/distributed/
early_start.py), and rank 0 hands its result back the same way. TorchDistributor's local mode runs the same torchrun
but needs the driver's SparkSession (a JVM) first; ranks as Spark tasks (`train.np=N`) still go through it."""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from typing import Any, Callable, List

from pipeline.distributed.early_start import Handoff
from pipeline.distributed.loop import RankResult
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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc_per_node={ranks}",
           "-m", __name__, f"{entry.__module__}:{entry.__qualname__}", handoff.path, str(handoff.driver_pid)]
    env = {**os.environ, KEY_VAR: handoff.key.hex()}
    try:
        done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"torchrun ({ranks} process(es) of {entry.__qualname__} on this machine) exited "
                               f"{done.returncode}")
        if not os.path.exists(os.path.join(handoff.path, RESULT_FILE)):
            raise RuntimeError(f"torchrun's rank 0 of {entry.__qualname__} left no result in {handoff.path}")
        return [handoff.get(RESULT_FILE)]
    finally:
        if own:
            shutil.rmtree(handoff.path, ignore_errors=True)


def rank_main(argv: List[str]) -> int:
    """A torchrun rank: `<module>:<entry> <hand-off folder> <driver pid>`, the key in KEY_VAR (dropped from the
    environment at once). Runs the entry on the hand-off; rank 0 writes its result back."""
    where, path, driver_pid = argv[0], argv[1], int(argv[2])
    handoff = Handoff(path, bytes.fromhex(os.environ.pop(KEY_VAR)), driver_pid)
    module, name = where.split(":")
    result = getattr(importlib.import_module(module), name)(handoff)
    if result is not None and int(os.environ.get("RANK", "0")) == 0:
        handoff.put(RESULT_FILE, result)
    return 0


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
