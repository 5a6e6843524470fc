"""A rank's process, whatever its backend: what the launcher learns of a rank whatever becomes of it (the job folder's
markers), the environment it starts with (a Spark executor's; Horovod's repaired) and how the process ends. Each
backend's entry is its own (pipeline/distributed/backends/)."""
from __future__ import annotations

import contextlib
import os
import socket
import threading
import traceback
from typing import Callable, Dict, Iterator, Optional

from pipeline.distributed.loop import RankResult, TrainJob
from pipeline.log import flush_and_exit, get_logger

log = get_logger(__name__)


def error_classes(exc: BaseException) -> str:
    """`exc`'s class and its bases as dotted names, one a line, most specific first: how a rank tells the driver what
    failed (`restart.is_restartable` decides from them, not from the message)."""
    return "\n".join(f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__)


@contextlib.contextmanager
def rank_record(job: TrainJob, rank: int) -> Iterator[None]:
    """What the launcher learns of a rank whatever becomes of it, in the job folder: `rank<r>.started` when it starts,
    `rank<r>.error` (its exception and traceback) and `rank<r>.class` (its exception's classes, `error_classes`) when
    it fails, `rank<r>.done` when it returns. A rank that left only `.started` ended without a word: killed
    (`rank_failures.failures` says so). Ranks but 0 drop MLflow's credentials from their environment first: only rank 0
    writes to MLflow (pipeline.redact.TRACKING_CREDENTIALS)."""
    from pipeline.redact import TRACKING_CREDENTIALS, redact_url, without

    if rank != 0:
        without(os.environ, TRACKING_CREDENTIALS)
    job.folder.write(rank, "started", f"{socket.gethostname()} {os.getpid()}")  # the host the launcher names
    try:
        yield
    except BaseException as exc:
        # the records first, the log after: once a rank exits, the launcher may kill the others within moments
        # (horovod.run does), and the classes are what it decides a restart from
        job.folder.write(rank, "class", error_classes(exc))
        job.folder.write(rank, "error", redact_url(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}"))
        log.error("rank %d failed: %s: %s", rank, type(exc).__name__, redact_url(str(exc)))
        raise
    job.folder.write(rank, "done")


def repair_horovod_env() -> None:
    """Undo a horovod.run (0.28.1) bug before `hvd.init()`: a stray comma in its argument defaults hands every rank
    HOROVOD_CYCLE_TIME="(None,)" and HOROVOD_CACHE_CAPACITY="(None,)", which Horovod parses as 0: a background
    thread that negotiates without pause (measured: 20-65 % of a core per idle rank) and no response cache.
    The value set by the launcher (LAKEHOUSE_HOROVOD_CYCLE_TIME, ...) is restored, else Horovod's default.
    """
    for key in ("HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY"):
        if os.environ.get(key, "").startswith("("):
            wanted = os.environ.get(f"LAKEHOUSE_{key}")
            if wanted:
                os.environ[key] = wanted
            else:
                del os.environ[key]


def exit_fast_after_delivery() -> None:
    """A rank process whose rank function returned: once its launcher's code has handed the result over and the
    interpreter starts to shut down, end the process at once, as `exit_now(0)`, without the teardown of torch,
    Lightning, Horovod and MLflow's modules and threads: 1.2 s for the imports alone, measured; about 3 s between rank
    0's last word and the driver seeing the ranks gone in a 2-rank job. The three launchers (horovod.run's run_task,
    horovod.spark's task_exec, TorchDistributor's train script) all deliver the result before their script ends, so
    the first exit handler (atexit runs the last registered first) comes after it. An error in that delivery is left
    to the normal exit and its status (the interpreter records it in `sys.last_value` before the exit handlers)."""
    import atexit
    import sys

    def _now() -> None:
        if getattr(sys, "last_value", None) is None:
            exit_now(0)

    atexit.register(_now)


def exit_now(code: int) -> None:
    """Flush the logs and the standard streams, then end the process without the interpreter's teardown."""
    flush_and_exit(code)


# How a rank process ends when the driver that launched it is gone (`end_with_the_driver`): no one is left to take its
# result, and it would hold the machine's cores or GPUs for the rest of the job
DRIVER_GONE_EXIT = 75


def end_with_the_driver(driver_pid: int, driver_start: Optional[int], poll_s: float = 0.5) -> threading.Event:
    """In a rank process on the driver's machine: a daemon thread that ends this process (`exit_now`,
    `DRIVER_GONE_EXIT`, after a log line) once the driver, process `driver_pid` started at `driver_start` (clock ticks
    after boot, pipeline.data.leases.process_start; None: not compared), no longer runs: killed, even by SIGKILL,
    which no handler of the driver's sees, while torchrun starts the ranks in sessions of their own. A new process
    that took the driver's pid does not count as the driver (its start time differs). Set the returned event to stop
    watching."""
    from pipeline.data.leases import pid_alive

    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(poll_s):
            if not pid_alive(driver_pid, driver_start):
                log.error("the driver (pid %d) is gone: this rank process (pid %d) ends (exit %d)", driver_pid,
                          os.getpid(), DRIVER_GONE_EXIT)
                exit_now(DRIVER_GONE_EXIT)

    threading.Thread(target=watch, name="lakehouse-driver-watch", daemon=True).start()
    return stop


def with_env(worker: Callable[[TrainJob], RankResult], job: TrainJob, env: Dict[str, str]) -> RankResult:
    """A TorchDistributor rank on a Spark executor, which gets none of the driver's environment: the variables the
    launcher hands ranks (launcher.executor_env: tracking settings, and the credentials rank 0 needs, which the
    other ranks drop in `rank_record`) that this process lacks are set, then `worker` runs."""
    for key, value in env.items():
        os.environ.setdefault(key, value)
    return worker(job)
