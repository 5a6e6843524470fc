"""What every backend answers: its name, how the driver launches its ranks, each rank's entry and Lightning strategy,
whether the launch needs Spark, and what keeps it from running on a described machine (for `lakehouse doctor`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from pipeline.config import Config
from pipeline.distributed.loop import RankResult, TrainJob, train


@dataclass(frozen=True)
class MachineFacts:
    """What the doctor found on this machine, as far as a backend cares: torch's version (None: not importable), the
    visible GPUs, torch.distributed's NCCL and gloo, and whether Horovod imports (None: not judged here, as on a
    Databricks runtime, whose own check names a missing Horovod)."""

    torch: Optional[str] = None
    device_count: int = 0
    dist_nccl: bool = False
    gloo: bool = False
    horovod_installed: Optional[bool] = None


class Backend:
    """One value of `train.backend`: a launcher paired with the strategy its ranks train with."""

    name = ""

    def needs_spark(self, cfg: Config) -> bool:
        """Whether the launch needs the driver's SparkSession: ranks as Spark tasks (`train.np` > 1)."""
        return cfg.train.np > 1

    def launch(self, job: TrainJob) -> List[RankResult]:
        """Start the ranks of `job` (`train.np` with HorovodRunner's meaning) and return their results by rank."""
        raise NotImplementedError

    # whether `start_local` starts rank processes on this machine (what a start ahead of the job needs), and whether
    # its launcher forks the driver's Python to do so (pipeline/distributed/early_start.py waits for those forks)
    local_processes = False
    launcher_forks = False
    # whether the driver watches its ranks on this machine for a stall (pipeline/distributed/progress.py): where the
    # backend's own bound on a stuck rank may not fire (Horovod's stall shutdown on gloo)
    watches_progress = False

    def start_local(self, cfg: Config, arg: Any) -> List[RankResult]:
        """Start `-train.np` rank processes on this machine, each running this backend's entry on `arg`: the job, or,
        for ranks started before it exists, their hand-off (pipeline/distributed/early_start.py). Results by rank."""
        raise NotImplementedError

    def worker(self, job: TrainJob) -> RankResult:
        """The entry of one rank of this backend: its process group, then the super train loop."""
        raise NotImplementedError

    def strategy(self, job: TrainJob) -> Any:
        """The Lightning strategy a rank of this backend trains with, built in the rank (None: Lightning's own)."""
        return None

    def problems(self, facts: MachineFacts, np_: int) -> List[str]:
        """What keeps this backend from running `train.np=np_` ranks on the machine `facts` describes; empty: none."""
        return []


def in_this_process(job: TrainJob) -> List[RankResult]:
    """The one rank of `train.np=1` (or `train.backend=single`): the super train loop in the driver's process."""
    return [train(job)]
