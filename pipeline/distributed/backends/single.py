"""`train.backend: single`: one process, the driver's own, with Lightning's single-device strategy; no Spark."""
from __future__ import annotations

from typing import List

from pipeline.config import Config
from pipeline.distributed.backends.base import Backend, in_this_process
from pipeline.distributed.loop import RankResult, TrainJob, train


class Single(Backend):
    name = "single"

    def needs_spark(self, cfg: Config) -> bool:
        return False  # always one process (config validation: train.np=1)

    def launch(self, job: TrainJob) -> List[RankResult]:
        return in_this_process(job)

    def worker(self, job: TrainJob) -> RankResult:
        return train(job)


SINGLE = Single()
