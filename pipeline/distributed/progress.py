"""The ranks' progress and the driver's stall watchdog: each rank of a watched launch marks, at most once every
`TrainJob.heartbeat_s` seconds, the step it reached in the job folder (`rank<r>.progress`); the driver kills the rank
processes once no rank still training has marked any for `train.stall_timeout_s`. It bounds a stuck rank where the
backend's own bound does not fire: Horovod's stall shutdown does not on a gloo CPU build (measured: nothing within 75 s
for stall values of 3, 4, 8 and 20 s). The marks come after batches: one batch, or an epoch end's checkpoint write,
longer than the bound counts as a stall."""
from __future__ import annotations

import math
import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from pipeline.distributed.job_folder import JobFolder
from pipeline.distributed.rank_signals import rank_processes
from pipeline.log import get_logger

log = get_logger(__name__)

END = "end"  # what a rank's marker says once it left training (fit's teardown): not watched from then on
# what it says from the start of training until its first batch ended: the launch is not watched until every rank
# marked a step (a resumed rank skips the epochs already trained before its first batch: minutes on a large shard)
STARTING = "starting"


def heartbeat_interval(stall_timeout_s: float) -> float:
    """How often a watched rank marks its progress (and the watchdog looks): a tenth of the bound, 0.1 s to 1 s."""
    return min(1.0, max(0.1, float(stall_timeout_s) / 10))


def heartbeat(folder: JobFolder, rank: int, interval_s: float):
    """A Lightning callback that marks rank `rank`'s progress in `folder`: `STARTING` at the start of training (not
    watched until its first batch ended), its step after a training or validation batch (at most once every
    `interval_s` seconds: one small write) and `END` at fit's teardown (rank 0 may then log the model for minutes:
    not a stall)."""
    import pytorch_lightning as pl

    class Heartbeat(pl.Callback):
        def __init__(self) -> None:
            self._last = -math.inf

        def _beat(self, trainer, force: bool = False) -> None:
            now = time.monotonic()
            if force or now - self._last >= interval_s:
                self._last = now
                folder.write(rank, "progress", str(trainer.global_step))

        def on_train_start(self, trainer, pl_module) -> None:
            self._last = -math.inf  # the first batch's end is marked at once
            folder.write(rank, "progress", STARTING)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self._beat(trainer)

        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
            self._beat(trainer)

        def teardown(self, trainer, pl_module, stage: str) -> None:
            folder.write(rank, "progress", END)

    return Heartbeat()


def stalled(folder: JobFolder, bound_s: float, now: float) -> Optional[str]:
    """Why the launch of `folder`'s ranks counts as stalled at `now` (time.time()), or None: the ranks still training
    (a progress marker that is not `END`, no `done` or `error` marker) all marked none for more than `bound_s`. None
    before any rank began training (the start is `train.start_timeout_s`'s), and while any rank still says
    `STARTING` (its first batch not yet ended)."""
    ended = set(folder.ranks_with("done")) | set(folder.ranks_with("error"))
    silent = {}
    for rank, path in sorted(folder.ranks_with("progress").items()):
        if rank in ended:
            continue
        try:
            age = now - os.path.getmtime(path)
        except OSError:  # rewritten this moment: it is making progress
            return None
        step = folder.read(rank, "progress").strip()
        if step == END:
            continue
        if step == STARTING:  # before its first batch ended (a resume's skip, the loader's start): not yet watched
            return None
        if age <= bound_s:
            return None
        silent[rank] = (step, age)
    if not silent:
        return None
    ranks = ", ".join(f"rank {r} (last at step {step or '?'}, {age:.0f} s ago)" for r, (step, age) in silent.items())
    return f"no rank made progress for train.stall_timeout_s={bound_s:g} s: {ranks}"


def kill_rank_processes() -> None:
    """SIGKILL this process's rank processes (`rank_signals.rank_processes`); their launcher then reports them."""
    for proc in rank_processes():
        try:
            proc.kill()
        except Exception:  # noqa: BLE001 - gone already
            pass


class StallWatch:
    """The driver's watchdog over one launch: once `stalled`, it logs why, keeps it in `reason` and calls `stop_ranks`
    (once; None: `kill_rank_processes`)."""

    def __init__(self, folder: JobFolder, bound_s: float, stop_ranks: Optional[Callable[[], None]] = None,
                 poll_s: Optional[float] = None) -> None:
        self.folder = folder
        self.bound_s = float(bound_s)
        self.stop_ranks = stop_ranks if stop_ranks is not None else kill_rank_processes
        self.poll_s = heartbeat_interval(bound_s) if poll_s is None else poll_s
        self.reason: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lakehouse-stall-watch", daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            reason = stalled(self.folder, self.bound_s, time.time())
            if reason is not None:
                self.reason = reason
                log.error("%s; killing the rank processes", reason)
                self.stop_ranks()
                return

    def start(self) -> "StallWatch":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


@contextmanager
def stall_watch(folder: JobFolder, bound_s: float, enabled: bool) -> Iterator[Optional[StallWatch]]:
    """A `StallWatch` over the launch in the block (None when not `enabled`), stopped when the block ends."""
    if not enabled:
        yield None
        return
    watch = StallWatch(folder, bound_s).start()
    try:
        yield watch
    finally:
        watch.close()
