"""The launcher: one launch of every rank of a job with `train.backend`'s launcher (`train.np` with HorovodRunner's
meaning: -N local processes, N Spark tasks, 1 this process), and what the driver makes of a failed one. Whether and
how a failed launch is relaunched is the restart policy's (pipeline/distributed/restart.py)."""
from __future__ import annotations

import dataclasses
from typing import List, Optional

from pipeline import preload
from pipeline.config import Config
from pipeline.distributed.backends import backend_of
from pipeline.distributed.early_start import EarlyRanks
from pipeline.distributed.executors import cancel_spark_jobs
from pipeline.distributed.loop import RankResult, TrainJob
from pipeline.distributed.progress import heartbeat_interval, stall_watch
from pipeline.distributed.rank_env import rank_environment
from pipeline.distributed.rank_failures import DistributedTrainingError, failures
from pipeline.distributed.rank_signals import forward_sigterm
from pipeline.errors import Terminated
from pipeline.log import get_logger

log = get_logger(__name__)

__all__ = ["DistributedTrainingError", "launch", "launch_needs_spark"]  # the error: raised here, caught by callers


def launch_needs_spark(cfg: Config) -> bool:
    """Whether the launch needs the driver's SparkSession (the backend's answer): every launch on a cluster
    (`train.np` > 1, Spark tasks). Ranks on this machine (horovod.run, torchrun) and one process need none."""
    return backend_of(cfg).needs_spark(cfg)


def launch(job: TrainJob, early: Optional[EarlyRanks] = None) -> List[RankResult]:
    """Run the super train loop on `train.np` ranks with `train.backend`; results ordered by rank. `early`: the ranks
    of this launch, started before the job was made (pipeline/distributed/early_start.py), handed it now.

    SIGTERM to the driver stops the ranks (local ones: passed on; ranks in Spark tasks: their Spark jobs cancelled)
    and the launch ends as Terminated, whatever they returned. Where the backend asks for it (`watches_progress`:
    Horovod on this machine), the ranks mark their progress and the driver kills them once none made any for
    `train.stall_timeout_s` (pipeline/distributed/progress.py).

    Raises:
        DistributedTrainingError: any rank failed, with the rank and its exception in the message; or the ranks
            stalled, naming the bound and each rank with its last step.
        Terminated: SIGTERM reached the driver during the launch.
    """
    job.folder.reset()
    cfg = job.cfg
    stall_s = float(cfg.train.stall_timeout_s)
    watched = backend_of(cfg).watches_progress and cfg.train.np < 0
    if watched:
        job = dataclasses.replace(job, heartbeat_s=heartbeat_interval(stall_s))
    remote = cancel_spark_jobs if launch_needs_spark(cfg) else None  # ranks in Spark tasks: not this machine's
    with rank_environment(cfg), forward_sigterm(grace_s=stall_s / 2, remote=remote) as term, \
            stall_watch(job.folder, stall_s, enabled=watched) as watch:
        try:
            results = early.run(job) if early is not None else _launch(job)
        except DistributedTrainingError as exc:
            if term.terminated:
                raise Terminated(f"SIGTERM; the ranks stopped with: {exc}") from exc
            raise  # already says what each rank reported (`backends.spark_tasks.bounded`)
        except Exception as exc:
            if term.terminated or job.folder.ranks_with("sigterm"):
                raise Terminated(f"SIGTERM; the ranks stopped with: {exc}") from exc
            if watch is not None and watch.reason:
                raise DistributedTrainingError(f"training stalled: {watch.reason}; the driver killed the rank "
                                               f"processes", job.folder.error_classes()) from exc
            detail = failures(job)
            if detail:
                raise DistributedTrainingError(f"training failed on {detail}", job.folder.error_classes()) from exc
            raise
        if term.terminated:  # ranks in Spark tasks return normally when their jobs end first: the stop still holds
            stopped = next((r.stop_reason for r in results if (r.stop_reason or "").startswith("SIGTERM")), None)
            raise Terminated(stopped or "SIGTERM to the driver during the launch"
                             + ("; the ranks' Spark jobs were cancelled" if remote is not None else ""))
        return results


def _launch(job: TrainJob) -> List[RankResult]:
    preload.wait()  # the launch's background imports are done before any rank process starts (nothing half loaded)
    return backend_of(job.cfg).launch(job)
