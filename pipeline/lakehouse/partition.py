"""Shard planning: from a split's row groups, the rows, row groups and equal steps each rank gets."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

from pipeline.log import get_logger

log = get_logger(__name__)


class PlanError(ValueError):
    """The data cannot be spread over the ranks as asked; the message has the numbers and the fix."""


@dataclass
class SplitPlan:
    """How one split's row groups fall on the ranks (Petastorm gives row group i to shard i % shard_count)."""

    name: str
    world_size: int
    batch_size: int
    row_group_rows: List[int]
    rows_per_rank: List[int] = field(default_factory=list)
    row_groups_per_rank: List[int] = field(default_factory=list)
    steps_per_epoch: int = 0  # the same on every rank

    @property
    def total_rows(self) -> int:
        return sum(self.row_group_rows)

    @property
    def rows_per_epoch_per_rank(self) -> int:
        return self.steps_per_epoch * self.batch_size

    @property
    def eval_steps(self) -> int:
        """Batches of a full pass (validation) on EVERY rank: the most any rank needs. A rank with fewer rows pads
        its pass with empty batches, so all ranks run the same forwards: a sharded model (FSDP) gathers its
        parameters in each forward, a collective that every rank must join."""
        return max(-(-n // self.batch_size) for n in self.rows_per_rank) if self.rows_per_rank else 0

    def balance(self) -> float:
        """Most ÷ fewest rows per rank (1.0 is perfectly even)."""
        return max(self.rows_per_rank) / max(1, min(self.rows_per_rank))


def _rows_per_rank(row_group_rows: List[int], world_size: int) -> Tuple[List[int], List[int]]:
    """Rows and row groups of each rank when row group i goes to rank i mod world_size (Petastorm's sharding)."""
    rows = [0] * world_size
    groups = [0] * world_size
    for i, n in enumerate(row_group_rows):
        rows[i % world_size] += n
        groups[i % world_size] += 1
    return rows, groups


def batch_for_min_steps(row_group_rows: List[int], world_size: int, batch_size: int, min_steps: int) -> int:
    """The per-rank batch that gives every rank at least `min_steps` steps an epoch (`data.min_steps_per_epoch`):
    `batch_size`, or less on a small table, never below 1; `min_steps` 0 keeps `batch_size`.

    Why: a table of a few hundred rows at a batch of 32 on 2 ranks is 4 steps an epoch, a few dozen in a whole run,
    too few for a network to leave chance (a 360-image, 4-class table ended at val_acc 0.28-0.36 at 32, 1.00 at 8).
    The rate follows the smaller batch by `train.lr_scaling`, as after an out-of-memory back-off."""
    if min_steps <= 0 or world_size < 1:
        return batch_size
    fewest = min(_rows_per_rank(row_group_rows, world_size)[0])
    return max(1, min(batch_size, fewest // min_steps))


def plan_shards(train_rows: List[int], val_rows: List[int], world_size: int, batch_size: int,
                min_steps: int = 0) -> "ShardPlan":
    """The plan over the train and val row groups for `world_size` ranks at `batch_size` per rank, lowered by
    `batch_for_min_steps` so an epoch has at least `min_steps` steps (logged when it is)."""
    batch = batch_for_min_steps(train_rows, world_size, batch_size, min_steps)
    if batch != batch_size:
        log.warning("a small table: %d train rows over %d rank(s) would give fewer than %d steps an epoch at %d per "
                    "rank (data.min_steps_per_epoch); training at %d per rank, the learning rate scaled to match",
                    sum(train_rows), world_size, min_steps, batch_size, batch)
    return ShardPlan(train=plan_split("train", train_rows, world_size, batch),
                     val=plan_split("val", val_rows, world_size, batch))


def plan_split(name: str, row_group_rows: List[int], world_size: int, batch_size: int) -> SplitPlan:
    """Assign row groups to ranks as Petastorm's sharding does and derive equal steps per rank.

    Every rank runs `min(rows per rank) // batch_size` steps (at least 1), so no rank waits in a
    collective for another that ran out of batches.

    Raises:
        PlanError: when a rank would get no rows, with rows, row groups and ranks named.
    """
    if world_size < 1 or batch_size < 1:
        raise PlanError(f"{name}: world size {world_size} and batch size {batch_size} must be >= 1")
    rows, groups = _rows_per_rank(row_group_rows, world_size)
    total = sum(row_group_rows)
    if total == 0:
        raise PlanError(f"{name} split is empty: 0 rows in {len(row_group_rows)} row group(s); "
                        f"check delta.table / delta.version and data.val_fraction")
    empty = [r for r in range(world_size) if rows[r] == 0]
    if empty:
        raise PlanError(
            f"{name} split: {total} rows in {len(row_group_rows)} row group(s) cannot feed {world_size} ranks; "
            f"rank(s) {empty} would read no data. Use fewer ranks (train.np), raise "
            f"data.partitions_per_worker, or add data (need at least {world_size} non-empty row groups)")
    steps = max(1, min(rows) // batch_size)
    return SplitPlan(name=name, world_size=world_size, batch_size=batch_size, row_group_rows=list(row_group_rows),
                     rows_per_rank=rows, row_groups_per_rank=groups, steps_per_epoch=steps)


@dataclass
class ShardPlan:
    """The plan for a training job, fixed before any training process starts."""

    train: SplitPlan
    val: SplitPlan

    def describe(self) -> str:
        t, v = self.train, self.val
        return (f"train: {t.total_rows} rows in {len(t.row_group_rows)} row groups, rows per rank {t.rows_per_rank}, "
                f"{t.steps_per_epoch} steps/epoch of {t.batch_size}; val: {v.total_rows} rows, rows per rank "
                f"{v.rows_per_rank}")
