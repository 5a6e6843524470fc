"""`train.backend: ddp` and `fsdp`: torch.distributed ranks started by torchrun on this machine (pipeline/distributed/
backends/torchrun.py: no Spark) or by Spark's TorchDistributor as Spark tasks, training with Lightning's DDP strategy or, for fsdp, `LakehouseFSDPStrategy` (pipeline/distributed/
fsdp.py); each rank picks NCCL or gloo from its own CUDA."""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, List, Optional

from pipeline.config import Config
from pipeline.distributed.backends.base import Backend, MachineFacts
from pipeline.distributed.backends.spark_tasks import bounded
from pipeline.distributed.backends.torchrun import run_local
from pipeline.distributed.devices import ddp_backend
from pipeline.distributed.early_start import importer, job_of
from pipeline.distributed.loop import RankResult, TrainJob, train
from pipeline.distributed.rank_env import executor_env
from pipeline.distributed.rank_process import exit_fast_after_delivery, rank_record, with_env
from pipeline.log import get_logger, setup_logging

log = get_logger(__name__)


def spark_schedules_gpus() -> bool:
    """Whether TorchDistributor may ask Spark for GPUs for its tasks (`spark.task.resource.gpu.amount` >= 1). Its
    `use_gpu=True` fails without them, and `use_gpu=False` hides the executors' GPUs (CUDA_VISIBLE_DEVICES="") on a
    cluster. The driver's own CUDA decides nothing."""
    from pipeline.lakehouse.spark import active_session

    spark = active_session()  # started on another thread too (pipeline.lakehouse.spark.SparkOnDemand)
    if spark is None:
        return False
    try:
        return float(spark.conf.get("spark.task.resource.gpu.amount", "0") or 0) >= 1
    except ValueError:
        return False


def _rank(arg: Any, backend: "TorchDistributed") -> Optional[RankResult]:
    """A torchrun rank (here: backends/torchrun.py; as a Spark task: TorchDistributor's; torchrun's environment: RANK,
    WORLD_SIZE, LOCAL_*) training with `backend`'s
    strategy; always a process of its own, which ends at once once its result is delivered. `arg`: the job, or a rank
    started early's hand-off (`early_start.job_of`; None: called off)."""
    setup_logging()
    rank = int(os.environ.get("RANK", "0"))
    size = int(os.environ.get("WORLD_SIZE", "1"))
    job = job_of(arg, rank, importer(backend.strategy_modules))
    if job is None:  # called off: it ends as fast as a rank that trained (the driver waits only so long for it)
        exit_fast_after_delivery()
        return None
    with rank_record(job, rank):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
        result = train(job, rank, size, backend.strategy(job), devices=local,
                       num_nodes=max(1, size // local), local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                       local_world_size=local)
    exit_fast_after_delivery()  # always a process of its own (torchrun's)
    return result


def ddp_worker(arg: Any) -> Optional[RankResult]:
    """The DDP entry (torch.distributed: NCCL where this rank has a GPU, else gloo), launched by torchrun."""
    return _rank(arg, DDP)


def fsdp_worker(arg: Any) -> Optional[RankResult]:
    """The FSDP entry (train.backend=fsdp): launched like DDP, the model sharded over the ranks."""
    return _rank(arg, FSDP)


class TorchDistributed(Backend):
    """Lightning's DDP over torch.distributed, launched by torchrun here and by TorchDistributor as Spark tasks."""

    name = "ddp"
    local_processes = True
    strategy_modules = ("pytorch_lightning.strategies",)  # what a rank started early imports for its strategy

    def launch(self, job: TrainJob) -> List[RankResult]:
        cfg = job.cfg
        if cfg.train.np == 1:
            return [train(job)]
        if cfg.train.np < 0:
            return self.start_local(cfg, job)
        from pyspark.ml.torch.distributor import TorchDistributor

        # an elastic relaunch (train.min_np) runs fewer Spark tasks, one too, never in this process
        np_ = job.plan.world_size
        log.info("launching %d %s processes on the Spark cluster with TorchDistributor", np_, self.name.upper())
        # GPUs are asked of Spark only where Spark schedules them; each rank then picks NCCL or gloo from its own CUDA
        dist = TorchDistributor(num_processes=np_, local_mode=False, use_gpu=spark_schedules_gpus())
        # on the cluster a task's rank gets no environment of the driver's: what executor_env allows goes with it
        return [bounded(job, lambda: dist.run(with_env, self.entry(), job,
                                              executor_env(dict(os.environ), cfg.mlflow.tracking_uri)))]

    def start_local(self, cfg: Config, arg: Any) -> List[RankResult]:
        log.info("launching %d %s processes on this machine with torchrun", -cfg.train.np, self.name.upper())
        return run_local(self.entry(), arg, -cfg.train.np)

    def entry(self):
        """The module-level rank entry TorchDistributor pickles by reference."""
        return ddp_worker

    def worker(self, job: TrainJob) -> RankResult:
        return self.entry()(job)

    def strategy(self, job: TrainJob) -> Any:
        import torch
        from pytorch_lightning.strategies import DDPStrategy

        return DDPStrategy(**self._process_group(torch.cuda.is_available(), job))

    @staticmethod
    def _process_group(has_cuda: bool, job: TrainJob) -> dict:
        # decided in the rank, not on the driver; a collective that a rank cannot finish within
        # train.stall_timeout_s raises there (torch's default: 30 min)
        return {"process_group_backend": ddp_backend(has_cuda),
                "timeout": timedelta(seconds=job.cfg.train.stall_timeout_s)}

    def problems(self, facts: MachineFacts, np_: int) -> List[str]:
        if ddp_backend(facts.device_count > 0) == "nccl" and not facts.dist_nccl:
            return [f"train.backend=ddp on {facts.device_count} GPU(s) uses NCCL, but torch {facts.torch}'s "
                    "torch.distributed has no NCCL"]
        return []


class FullySharded(TorchDistributed):
    """Launched like DDP; the ranks shard the model with `LakehouseFSDPStrategy`."""

    name = "fsdp"
    strategy_modules = ("pipeline.distributed.fsdp",)

    def entry(self):
        return fsdp_worker

    def strategy(self, job: TrainJob) -> Any:
        import torch

        from pipeline.distributed.fsdp import LakehouseFSDPStrategy

        return LakehouseFSDPStrategy(**self._process_group(torch.cuda.is_available(), job))

    def problems(self, facts: MachineFacts, np_: int) -> List[str]:
        """Where Lightning's FSDP strategy cannot run: torch without torch.distributed, GPUs without NCCL, CPU ranks
        without gloo; one rank shards nothing."""
        if not facts.torch:
            return ["train.backend=fsdp needs torch, which is not importable"]
        out = []
        if facts.device_count and not facts.dist_nccl:
            out.append(f"train.backend=fsdp on {facts.device_count} GPU(s) uses NCCL, but torch {facts.torch}'s "
                       "torch.distributed has no NCCL")
        if not facts.device_count and not facts.gloo:
            out.append(f"train.backend=fsdp on CPU ranks uses gloo, but torch {facts.torch}'s torch.distributed has "
                       "no gloo: FSDP cannot run here")
        if abs(np_) == 1:
            out.append("train.backend=fsdp with train.np=1: one rank shards nothing (use train.np=-N or N)")
        return out


DDP = TorchDistributed()
FSDP = FullySharded()
