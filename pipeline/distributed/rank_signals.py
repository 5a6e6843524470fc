"""The driver's hold on its rank processes: finding them among its descendants, and passing a SIGTERM on to them with
a grace period before the ones left are killed (ranks in Spark tasks: their Spark jobs cancelled)."""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from pipeline.log import get_logger

log = get_logger(__name__)


# Command-line markers of the processes that run a rank (horovod.run, horovod.spark.run in local mode, torchrun and
# its ranks: pipeline.distributed.backends.torchrun); their launchers' middlemen are left alone so they can clean up.
RANK_PROCESS_MARKERS = ("horovod.runner.run_task", "horovod.spark.task", "torch.distributed.run", "torchrun")


def rank_processes() -> list:
    """This process's descendants that run a training rank."""
    import psutil

    found, argvs = [], {}
    for proc in psutil.Process().children(recursive=True):
        try:
            argv = proc.cmdline()
            parent = proc.ppid()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        # the Python process itself, not the `sh -c` that started it (a signalled shell would make
        # Horovod's launcher treat the rank as failed and kill the others before they checkpoint)
        if argv and "python" in os.path.basename(argv[0]) and any(m in " ".join(argv) for m in RANK_PROCESS_MARKERS):
            found.append((proc, parent, argv))
            argvs[proc.pid] = argv
    # a rank's fork (a decode worker: the same command line as the rank it was forked from) is the rank's to end, not
    # a rank: a SIGTERM, its default action, killed it under the rank, which then failed on a dead worker instead of
    # stopping at its next step with a last checkpoint
    return [proc for proc, parent, argv in found if argvs.get(parent) != argv]


class _TermState:
    terminated = False


@contextmanager
def forward_sigterm(grace_s: float, remote: Optional[Callable[[], None]] = None) -> Iterator[_TermState]:
    """While ranks run, SIGTERM to the driver is passed on to them: each rank's StopSignals callback makes
    them agree to stop, rank 0 writes a last checkpoint, and they return. Ranks still alive after
    `grace_s` are killed. `remote`: how to stop ranks that are not this process's descendants (ranks in Spark tasks:
    their Spark jobs cancelled, `executors.cancel_spark_jobs`), called on a thread of its own when no rank runs on
    this host, else at the grace period's end (a local master's tasks are signalled first). The state says whether
    a SIGTERM came (the launcher then ends the launch as Terminated, whatever the ranks returned). The grace period's
    timer is cancelled when the block ends: it never kills the ranks of a later launch in the same process.
    """
    state = _TermState()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return
    timers: list = []

    def kill_leftovers(then_remote: bool) -> None:
        for proc in rank_processes():
            log.error("rank process %d did not stop within %.0f s of SIGTERM; killing it", proc.pid, grace_s)
            proc.kill()
        if then_remote:
            stop_remote()

    def stop_remote() -> None:
        try:
            remote()
        except Exception as exc:  # noqa: BLE001 - a context stopping: the launch's own error says the rest
            log.warning("SIGTERM: stopping the ranks' Spark jobs failed: %s: %s", type(exc).__name__, exc)

    def on_term(signum, frame) -> None:
        if state.terminated:
            return
        state.terminated = True
        ranks = rank_processes()
        log.warning("SIGTERM: asking %d rank process(es) to write a last checkpoint and stop", len(ranks))
        for proc in ranks:
            try:
                proc.send_signal(signal.SIGTERM)
            except Exception:
                pass
        # ranks in Spark tasks on other hosts: their Spark jobs cancelled now (not from the handler itself: it may
        # have interrupted a call into the JVM); on this host (a local master's tasks) they were just signalled and
        # write a last checkpoint first: cancelling their tasks now would kill them before it, so only at the grace
        # period's end
        later = remote is not None and bool(ranks)
        if remote is not None and not ranks:
            log.warning("SIGTERM: cancelling the Spark jobs of the ranks' tasks")
            threading.Thread(target=stop_remote, name="sigterm-cancel-ranks", daemon=True).start()
        timer = threading.Timer(grace_s, kill_leftovers, args=(later,))
        timer.daemon = True
        timers.append(timer)
        timer.start()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield state
    finally:
        signal.signal(signal.SIGTERM, old)
        for timer in timers:
            timer.cancel()
