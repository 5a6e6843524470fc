"""The launcher: `train.np` with HorovodRunner's meaning (-N local processes, N Spark tasks, 1 this process)."""
from __future__ import annotations

import glob
import os
import shutil
from typing import List

from pipeline.distributed.loop import RankResult, TrainJob, ddp_worker, horovod_worker, train
from pipeline.log import get_logger

log = get_logger(__name__)


class DistributedTrainingError(RuntimeError):
    """A rank failed; the message names the rank and its exception."""


def _rank_env(job: TrainJob) -> dict:
    cfg = job.cfg.train
    threads = str(max(1, cfg.threads_per_rank))
    return {
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        # A rank that stops taking part in collectives (dead peer, divergent code path) makes Horovod
        # shut the job down after this many seconds instead of hanging.
        "HOROVOD_STALL_CHECK_TIME_SECONDS": str(max(5, min(60, cfg.stall_timeout_s // 2))),
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(cfg.stall_timeout_s),
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(cfg.start_timeout_s),
        "LAKEHOUSE_PROGRESS": os.environ.get("LAKEHOUSE_PROGRESS", "1"),
        "PYTHONUNBUFFERED": "1",
    }


def _failures(job: TrainJob) -> str:
    parts = []
    for path in sorted(glob.glob(os.path.join(job.job_dir, "rank*.error"))):
        rank = os.path.basename(path)[4:-6]
        with open(path) as fh:
            first = fh.readline().strip()
        parts.append(f"rank {rank}: {first}")
    return "; ".join(parts)


def launch(job: TrainJob) -> List[RankResult]:
    """Run the super train loop on `train.np` ranks with `train.backend`; results ordered by rank.

    Raises:
        DistributedTrainingError: any rank failed, with the rank and its exception in the message.
    """
    cfg = job.cfg
    np_, backend = cfg.train.np, cfg.train.backend
    shutil.rmtree(job.job_dir, ignore_errors=True)
    os.makedirs(job.job_dir, exist_ok=True)
    os.environ.update(_rank_env(job))  # inherited by every rank process
    try:
        if backend == "single" or np_ == 1:
            if backend == "horovod":
                return [horovod_worker(job)]
            return [train(job)]
        if backend == "horovod":
            if np_ < 0:
                import horovod

                log.info("launching %d Horovod processes on this machine (gloo)", -np_)
                return list(horovod.run(horovod_worker, args=(job,), num_proc=-np_, use_gloo=True,
                                        start_timeout=cfg.train.start_timeout_s, hosts=f"localhost:{-np_}",
                                        verbose=0))
            import horovod.spark

            log.info("launching %d Horovod tasks on the Spark cluster (gloo)", np_)
            return list(horovod.spark.run(horovod_worker, args=(job,), num_proc=np_, use_gloo=True,
                                          start_timeout=cfg.train.start_timeout_s,
                                          env=dict(os.environ), verbose=0))
        if backend == "ddp":
            from pyspark.ml.torch.distributor import TorchDistributor

            log.info("launching %d DDP processes (%s) with TorchDistributor", abs(np_),
                     "on this machine" if np_ < 0 else "on the Spark cluster")
            dist = TorchDistributor(num_processes=abs(np_), local_mode=np_ < 0, use_gpu=False)
            result = dist.run(ddp_worker, job)
            return [result]
        raise ValueError(f"config key 'train.backend': {backend!r} is not horovod, ddp or single")
    except Exception as exc:
        detail = _failures(job)
        if detail:
            raise DistributedTrainingError(f"training failed on {detail}") from exc
        raise
