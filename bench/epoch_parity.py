"""Epoch parity: the Horovod backend's steady epoch time over DDP's, same table, plan, batch and rows, on the synthetic
table's long epochs (hundreds of steps), where a per-step cost shows and the jobs' fixed costs do not."""
from __future__ import annotations

from typing import List

from bench.core import Result, Sizes, median, ratio
from bench.job_phases import run_jobs
from pipeline.config import Config
from pipeline.log import get_logger

log = get_logger(__name__)

EPOCHS = 3  # the first epoch carries the ranks' warm-up (the shard's first read); the later ones are compared
ROUNDS = 3  # each round is a job per backend: ~100 s each on 50,000 rows and 2 CPU cores
BATCH = 32  # per rank: the comparison (249 steps of 2 x 32 on 20,000 rows); 623 on the 50,000-row table


def measure_epoch_parity(cfg: Config, prep, sizes: Sizes, work_dir: str, quick: bool = False) -> List[Result]:
    """`ROUNDS` rounds (`quick`: one) of a 2-rank `lakehouse train` of `prep` (the synthetic table) per backend, the
    order alternating, batch `BATCH`, `EPOCHS` epochs. `horovod_epoch_over_ddp`: per round, Horovod's steady epoch
    (rank 0's `epoch_time_s`, the first epoch left out, median) ÷ DDP's; the median over rounds."""
    runs = run_jobs(cfg, prep, work_dir, "epoch_parity", EPOCHS, 1 if quick else ROUNDS, warm_up=False,
                    extra=[f"data.batch_size={BATCH}", "data.min_steps_per_epoch=0"])
    per = [ratio(h["steady_epoch_s"], d["steady_epoch_s"]) for h, d in zip(runs["horovod"], runs["ddp"])]
    parts = {"horovod_epoch_s": median([r["steady_epoch_s"] for r in runs["horovod"]]),
             "ddp_epoch_s": median([r["steady_epoch_s"] for r in runs["ddp"]]),
             "horovod_per_run_s": [r["steady_epoch_s"] for r in runs["horovod"]],
             "ddp_per_run_s": [r["steady_epoch_s"] for r in runs["ddp"]],
             "epochs": EPOCHS, "batch_per_rank": BATCH, "world_size": 2, "rows": prep.rows}
    log.info("epoch parity on %s: horovod %.2f s, ddp %.2f s per steady epoch", prep.name, parts["horovod_epoch_s"],
             parts["ddp_epoch_s"])
    return [Result("horovod_epoch_over_ddp", prep.name, median(per), parts, len(per), per)]
