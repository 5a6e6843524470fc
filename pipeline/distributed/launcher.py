"""The launcher: one launch of every rank of a job with `train.backend`'s launcher (`train.np` with HorovodRunner's
meaning: -N local processes, N Spark tasks, 1 this process), and what the driver makes of a failed one. Whether and
how a failed launch is relaunched is the restart policy's (pipeline/distributed/restart.py)."""
from __future__ import annotations

from typing import List, Optional

from pipeline import preload
from pipeline.config import Config
from pipeline.distributed.backends import backend_of
from pipeline.distributed.early_start import EarlyRanks
from pipeline.distributed.loop import RankResult, TrainJob
from pipeline.distributed.rank_env import rank_environment
from pipeline.distributed.rank_failures import DistributedTrainingError, failures
from pipeline.distributed.rank_signals import forward_sigterm
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

    Raises:
        DistributedTrainingError: any rank failed, with the rank and its exception in the message.
    """
    job.folder.reset()
    with rank_environment(job.cfg), forward_sigterm(grace_s=float(job.cfg.train.stall_timeout_s) / 2) as term:
        try:
            return early.run(job) if early is not None else _launch(job)
        except DistributedTrainingError:
            raise  # already says what each rank reported (`backends.spark_tasks.bounded`)
        except Exception as exc:
            if term.terminated or job.folder.ranks_with("sigterm"):
                from pipeline.errors import Terminated

                raise Terminated(f"SIGTERM; the ranks stopped with: {exc}") from exc
            detail = failures(job)
            if detail:
                raise DistributedTrainingError(f"training failed on {detail}", job.folder.error_classes()) from exc
            raise


def _launch(job: TrainJob) -> List[RankResult]:
    preload.wait()  # the launch's background imports are done before any rank process starts (nothing half loaded)
    return backend_of(job.cfg).launch(job)
