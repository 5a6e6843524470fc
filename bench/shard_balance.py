"""Shard balance: most / fewest rows each rank reads in one pass over its shard of a 2-rank plan (exact counts)."""
from __future__ import annotations

from bench.core import TARGETS, Result
from pipeline.config import Config


def measure_shard_balance(cfg: Config, prep) -> Result:
    """One full pass (num_epochs=1) of each rank's shard of the 2-rank train plan; counts are exact, no timing."""
    from pipeline.data.loader import ShardLoader

    data = prep.data
    plan = data.plan.train
    rows = []
    for rank in range(plan.world_size):
        loader = ShardLoader(data.train, plan, rank=rank, world_size=plan.world_size, channels=data.channels,
                             image_size=data.image_size, endless=False, workers=cfg.data.reader_workers,
                             shuffle_buffer=0, seed=cfg.data.seed, reader=cfg.data.reader)
        for _ in loader:
            pass
        rows.append(loader.rows_read)
        loader.close()
    ratio = max(rows) / max(1, min(rows))
    used = plan.rows_per_epoch_per_rank * plan.world_size
    return Result("shard_balance", prep.name, ratio,
                  {"rows_read_per_rank": rows, "planned_rows_per_rank": list(plan.rows_per_rank),
                   "row_groups_per_rank": list(plan.row_groups_per_rank),
                   "train_rows_per_epoch_per_rank": plan.rows_per_epoch_per_rank,
                   "rows_used_per_epoch_fraction": used / max(1, plan.total_rows),
                   "reader": cfg.data.reader},
                  1, [ratio], method=TARGETS["shard_balance"][2] + " (row counts: exact, one pass is enough)")

