"""A launch of ranks as Spark tasks, bounded: once a rank has failed, the launch returns within
`train.stall_timeout_s` or is given up on (its Spark jobs cancelled), whatever a lost host leaves waiting."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List

from pipeline.distributed.executors import cancel_spark_jobs, executor_addresses, unanswering_executors
from pipeline.distributed.loop import TrainJob
from pipeline.distributed.rank_failures import DistributedTrainingError, failures
from pipeline.log import get_logger

log = get_logger(__name__)

# Threads a launch that `bounded` gave up on left behind, still waiting on a lost host (Horovod's per-rank threads are
# not daemons: the interpreter would wait for them at exit). The CLI exits without them (`abandoned_threads`).
_ABANDONED: List[threading.Thread] = []


def abandoned_threads() -> List[threading.Thread]:
    """The threads of launches given up on (`bounded`) that are still alive."""
    return [t for t in _ABANDONED if t.is_alive()]


def bounded(job: TrainJob, call: Callable[[], Any]) -> Any:
    """`call()`, a launch of ranks as Spark tasks, with a bound: once a rank has reported an error, the launch must
    return within `train.stall_timeout_s`. When a host is gone, Horovod's driver and Spark wait on it for minutes (the
    task's executor is declared lost only after Spark's own timeouts); past the bound the application's Spark jobs are
    cancelled and DistributedTrainingError names each rank with its host, and the executors that do not answer."""
    box: Dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    before = set(threading.enumerate())
    thread = threading.Thread(target=target, name="launch-ranks", daemon=True)
    thread.start()
    grace = float(job.cfg.train.stall_timeout_s)
    failed_at = None
    seen: Dict[str, None] = {}  # the executors of the launch, in the order first seen
    while thread.is_alive():
        thread.join(timeout=1.0)
        seen.update(dict.fromkeys(executor_addresses()))
        if failed_at is None and job.folder.ranks_with("error"):
            failed_at = time.monotonic()
        if thread.is_alive() and failed_at is not None and time.monotonic() - failed_at > grace:
            lost = unanswering_executors(known=list(seen))
            _ABANDONED.extend(t for t in threading.enumerate() if t not in before and not t.daemon)
            cancel_spark_jobs()
            log.error("the ranks' launch did not return within %g s after a rank failed; cancelled its Spark jobs",
                      grace)
            raise DistributedTrainingError(
                f"training failed on {failures(job)}; the launch did not return within train.stall_timeout_s="
                f"{grace:g} s after the first rank failed"
                + (f"; executor(s) not answering (host lost?): {', '.join(lost)}" if lost else "")
                + "; its Spark jobs were cancelled", job.folder.error_classes())
    if "error" in box:
        raise box["error"]
    return box["value"]
