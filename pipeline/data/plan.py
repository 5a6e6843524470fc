"""The training plan: one frozen RunPlan (ranks, per-rank batch, learning rate, steps, shards, restore point, attempt),
derived by `derive_plan` and re-derived by `RunPlan.relaunched` for an out-of-memory back-off or an elastic relaunch.

The rules it is made of live here too, each once:
- the per-rank batch a job starts with (`start_batch_size`: `data.batch_size`, or `data.auto_batch_start` for `auto`),
  lowered on a small table so an epoch has `data.min_steps_per_epoch` steps (pipeline.lakehouse.partition), halved
  on each out-of-memory when the job backs off (`backs_off`, `halved`);
- the learning rate: `model.lr` is for one rank at the starting per-rank batch; it follows the global batch by
  `train.lr_scaling` (`scaled_lr` for the number of ranks, `lr_batch_factor` for a batch other than the start);
- the Spark partitions a conversion writes (`partitions_for`: `data.partitions_per_worker` x the ranks).

Recognising an out-of-memory stays with the restart policy (pipeline.distributed.backoff); where a relaunch resumes
from (the checkpoint restated for the new batch and world size) is decided by the checkpoints package and handed in.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence, Tuple

from pipeline.config import Config, ConfigError, DataConfig, world_size_of
from pipeline.lakehouse.partition import ShardPlan, plan_shards

LR_RULES = ("linear", "sqrt", "none")


def start_batch_size(data: DataConfig) -> int:
    """The per-rank batch a job starts with: `data.batch_size`, or `data.auto_batch_start` when it is `auto`."""
    return int(data.auto_batch_start if data.batch_size == "auto" else data.batch_size)


def backs_off(data: DataConfig, oom_backoff: bool) -> bool:
    """Whether an out-of-memory halves the batch: always with `data.batch_size: auto`, else `train.oom_backoff`."""
    return data.batch_size == "auto" or bool(oom_backoff)


def halved(batch: int, cause: str = "out of memory") -> int:
    """The next per-rank batch after an out-of-memory at `batch` (floor 1).

    Raises:
        ConfigError: already at 1 per rank, naming `data.batch_size`.
    """
    if batch <= 1:
        raise ConfigError(f"config key 'data.batch_size': out of memory with 1 sample per rank, the smallest batch "
                          f"(after halving it on each out-of-memory); the model does not fit this device: {cause}")
    return batch // 2


def scaled_lr(base_lr: float, world_size: int, rule: str) -> float:
    """Learning rate for `world_size` ranks: linear (x size), sqrt (x sqrt(size)) or none."""
    if rule == "linear":
        return base_lr * world_size
    if rule == "sqrt":
        return base_lr * math.sqrt(world_size)
    if rule == "none":
        return base_lr
    raise ValueError(f"config key 'train.lr_scaling': {rule!r} is not linear, sqrt or none")


def lr_batch_factor(batch_used: int, batch_start: int, rule: str) -> float:
    """What the learning rate is multiplied by when the per-rank batch is `batch_used` instead of `batch_start`: the
    global batch changes by that ratio, and `train.lr_scaling` scales the rate with the global batch (linear: the
    ratio, sqrt: its square root, none: 1), as `scaled_lr` does for the number of ranks."""
    ratio = batch_used / batch_start
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    return 1.0


def plan_lr(base_lr: float, rule: str, world_size: int, batch: int, start_batch: int) -> float:
    """The rate for `world_size` ranks at `batch` per rank, `base_lr` being for one rank at `start_batch`."""
    return scaled_lr(base_lr, world_size, rule) * lr_batch_factor(batch, start_batch, rule)


def partitions_for(partitions_per_worker: int, world_size: int) -> int:
    """The Spark partitions a conversion for `world_size` ranks writes (one file each): a multiple of the ranks."""
    return partitions_per_worker * world_size


def _row_groups(rows: Any) -> Tuple[Sequence[int], Sequence[int]]:
    """(train, val) rows per row group of `rows`: a pair of sequences, or anything whose `train` and `val` have
    `row_group_rows` (a ConvertedData, a ShardPlan, a RunPlan's shards)."""
    if hasattr(rows, "train") and hasattr(rows, "val"):
        return rows.train.row_group_rows, rows.val.row_group_rows
    train, val = rows
    return train, val


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What one launch trains with, fixed before any rank starts; the config stays as the user gave it.

    `batch_size` is per rank, as trained (the start, lowered on a small table, halved by each back-off); `lr` is the
    rate the optimizer is built with for it on `world_size` ranks; `steps_per_epoch` the same on every rank;
    `shards` how the converted row groups fall on the ranks at that batch (ConvertedData.plan); `partitions` the
    Spark partitions a conversion for `world_size` ranks writes. `restore_from`: the checkpoint this launch resumes
    from, a path already resolved (and restated for this batch and world size) by the caller, or None: from the
    start. `attempt`: 0 the first launch, n the n-th relaunch. `start_batch`, `base_lr`, `lr_scaling` and
    `backs_off` are the rules' inputs from the config, kept so a relaunch re-derives the plan without it.
    """

    world_size: int
    batch_size: int
    lr: float
    steps_per_epoch: int
    shards: ShardPlan
    partitions: int
    start_batch: int
    base_lr: float
    lr_scaling: str
    backs_off: bool
    restore_from: Optional[str] = None
    attempt: int = 0

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def backed_off(self) -> bool:
        """Whether the batch in use is below the one the job started with (a back-off or a small table)."""
        return self.batch_size < self.start_batch

    def relaunched(self, *, restore_from: Optional[str], out_of_memory: bool = False,
                   world_size: Optional[int] = None, cause: str = "out of memory") -> "RunPlan":
        """The plan of the next launch: `out_of_memory`, half the per-rank batch (`halved`); `world_size`, that many
        ranks (an elastic relaunch on the task slots left, train.min_np). The shards are re-planned over the same
        row groups for equal steps at the batch as given (a small table's lowering was the first derivation's), and
        the rate follows the new global batch by `lr_scaling`. Resumes from `restore_from`; the attempt counts up.

        Raises:
            ConfigError: out of memory at 1 sample per rank, naming `data.batch_size`.
            PlanError: a rank would get no data on `world_size` ranks.
        """
        batch = halved(self.batch_size, cause) if out_of_memory else self.batch_size
        world = self.world_size if world_size is None else int(world_size)
        shards = self.shards
        if (batch, world) != (self.batch_size, self.world_size):
            shards = plan_shards(self.shards.train.row_group_rows, self.shards.val.row_group_rows, world, batch)
        return dataclasses.replace(
            self, world_size=world, batch_size=shards.train.batch_size, steps_per_epoch=shards.train.steps_per_epoch,
            lr=plan_lr(self.base_lr, self.lr_scaling, world, shards.train.batch_size, self.start_batch),
            shards=shards, restore_from=restore_from, attempt=self.attempt + 1)

    def describe(self) -> str:
        start = "" if self.batch_size == self.start_batch else f" (started at {self.start_batch})"
        return (f"{self.world_size} rank(s), batch {self.batch_size} per rank{start}, lr {self.lr:.4g} "
                f"({self.lr_scaling} scaling of {self.base_lr:.4g}), {self.steps_per_epoch} steps/epoch, attempt "
                f"{self.attempt}, from {self.restore_from or 'the start'}")


def derive_plan(cfg: Config, rows: Any, world_size: Optional[int] = None, batch: Optional[int] = None,
                restore_from: Optional[str] = None, attempt: int = 0, min_steps: Optional[int] = None) -> RunPlan:
    """The one derivation of a RunPlan from the validated config and the converted row groups `rows` (a
    ConvertedData, a ShardPlan or a (train, val) pair of rows-per-row-group lists).

    `world_size`: the ranks (None: the config's, `train.np`). `batch`: the per-rank batch to plan for (None: the
    start, `start_batch_size`); it is lowered so an epoch has `min_steps` steps (None: `data.min_steps_per_epoch`;
    0 plans the batch as given). `restore_from`: the resolved checkpoint path this launch resumes from, or None.

    Raises:
        PlanError: a rank would get no data (with rows, row groups and ranks named).
        ValueError: `train.lr_scaling` is not one of LR_RULES.
    """
    world = world_size_of(cfg) if world_size is None else int(world_size)
    start = start_batch_size(cfg.data)
    steps = cfg.data.min_steps_per_epoch if min_steps is None else min_steps
    train_rows, val_rows = _row_groups(rows)
    shards = plan_shards(list(train_rows), list(val_rows), world, start if batch is None else int(batch), steps)
    used = shards.train.batch_size
    return RunPlan(world_size=world, batch_size=used, steps_per_epoch=shards.train.steps_per_epoch,
                   lr=plan_lr(cfg.model.lr, cfg.train.lr_scaling, world, used, start), shards=shards,
                   partitions=partitions_for(cfg.data.partitions_per_worker, world), start_batch=start,
                   base_lr=cfg.model.lr, lr_scaling=cfg.train.lr_scaling,
                   backs_off=backs_off(cfg.data, cfg.train.oom_backoff), restore_from=restore_from, attempt=attempt)
