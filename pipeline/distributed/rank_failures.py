"""What a failed launch says: `DistributedTrainingError`, and each rank's account of the attempt from the job folder."""
from __future__ import annotations

from typing import Dict, List, Optional

from pipeline.distributed.loop import TrainJob


class DistributedTrainingError(RuntimeError):
    """A rank failed; the message names the rank and its exception, `rank_classes` the classes each failed rank
    recorded (rank -> dotted class names, most specific first: `rank_process.error_classes`)."""

    def __init__(self, message: str, rank_classes: Optional[Dict[int, List[str]]] = None) -> None:
        super().__init__(message)
        self.rank_classes: Dict[int, List[str]] = dict(rank_classes or {})


# How a collective that ran past the process group's timeout reads (gloo; NCCL's watchdog)
COLLECTIVE_TIMEOUT_MARKS = ("Timed out waiting", "Watchdog caught collective operation timeout")


# A rank that started and left neither an error nor a result (rank_process.rank_record)
SILENT_RANK = ("ended without reporting an error: killed by a signal (SIGKILL, the kernel's OOM killer, a lost "
               "node) or stopped by the launcher after another rank failed")


def failures(job: TrainJob) -> str:
    """Each rank's account of the attempt, in rank order: its error's first line, or that it ended without one, and
    the host it ran on."""
    folder = job.folder
    errors, done, started = folder.ranks_with("error"), folder.ranks_with("done"), folder.ranks_with("started")
    parts = []
    for rank in sorted(set(errors) | set(started)):
        if rank in errors:
            first = folder.first_error_line(rank)
            if any(mark in first for mark in COLLECTIVE_TIMEOUT_MARKS):
                first += (f" (a collective did not finish within train.stall_timeout_s="
                          f"{job.cfg.train.stall_timeout_s} s: another rank is stuck or far slower)")
        elif rank not in done:
            first = SILENT_RANK
        else:
            continue
        host = folder.host(rank) if rank in started else ""
        parts.append(f"rank {rank}: {first}" + (f" (on host {host})" if host else ""))
    return "; ".join(parts)
