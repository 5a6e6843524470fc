"""The training plan (pipeline/data/plan.py): one derivation, its re-derivation for a back-off or an elastic relaunch,
and the split rule's one home (pipeline/lakehouse/split.py)."""
import dataclasses
import math
import pathlib

import pytest

from pipeline.config import Config, ConfigError, apply_overrides
from pipeline.data.plan import RunPlan, derive_plan
from pipeline.lakehouse.partition import PlanError

# odd row counts: 7 train row groups, 3 val ones; no rank gets the same rows as another
TRAIN = [101, 99, 37, 64, 63, 50, 11]
VAL = [13, 7, 5]


def _cfg(**over) -> Config:
    base = {"data.batch_size": 16, "data.min_steps_per_epoch": 0, "model.lr": 0.01, "train.lr_scaling": "linear",
            "data.partitions_per_worker": 2}
    return apply_overrides(Config(), {**base, **over})


def _rows_per_rank(groups, world):
    return [sum(groups[r::world]) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_derive_plans_equal_steps_the_scaled_rate_and_partitions_for_each_world_size(world):
    plan = derive_plan(_cfg(), (TRAIN, VAL), world, restore_from="/ckpt/last.ckpt", attempt=0)
    rows = _rows_per_rank(TRAIN, world)
    assert plan.shards.train.rows_per_rank == rows and plan.shards.val.rows_per_rank == _rows_per_rank(VAL, world)
    assert plan.world_size == world and plan.batch_size == 16 and plan.global_batch == 16 * world
    assert plan.steps_per_epoch == plan.shards.train.steps_per_epoch == min(rows) // 16
    assert all(r >= plan.steps_per_epoch * 16 for r in rows)  # every rank has the rows of every step
    assert plan.lr == pytest.approx(0.01 * world)  # linear: x ranks, at the starting batch
    assert plan.partitions == 2 * world and plan.partitions % world == 0
    assert (plan.restore_from, plan.attempt) == ("/ckpt/last.ckpt", 0)


def test_derive_takes_the_world_size_and_starting_batch_from_the_config_when_not_given():
    plan = derive_plan(_cfg(**{"train.np": -3, "data.batch_size": "auto", "data.auto_batch_start": 32}), (TRAIN, VAL))
    assert (plan.world_size, plan.batch_size, plan.start_batch) == (3, 32, 32)
    assert plan.backs_off and not plan.backed_off  # auto always backs off; nothing halved yet
    assert not derive_plan(_cfg(), (TRAIN, VAL), 1).backs_off
    assert derive_plan(_cfg(**{"train.oom_backoff": True}), (TRAIN, VAL), 1).backs_off


def test_a_small_table_lowers_the_batch_and_the_rate_follows_it():
    groups = [72, 71, 72, 71]  # 143 rows per rank on 2 ranks: 4 steps at 32, lowered to 8 for 16 steps
    plan = derive_plan(_cfg(**{"data.batch_size": 32, "data.min_steps_per_epoch": 16}), (groups, [20, 20]), 2)
    assert plan.batch_size == plan.shards.val.batch_size == 8 and plan.steps_per_epoch >= 16
    assert plan.lr == pytest.approx(0.01 * 2 * 8 / 32) and plan.backed_off
    exact = derive_plan(_cfg(**{"data.batch_size": 32, "data.min_steps_per_epoch": 16}), (groups, [20, 20]), 2,
                        min_steps=0)
    assert exact.batch_size == 32  # min_steps=0: the batch as given (the bench's)


@pytest.mark.parametrize("rule, factor", [("linear", 0.5), ("sqrt", 1 / math.sqrt(2)), ("none", 1.0)])
def test_an_out_of_memory_halves_the_batch_and_scales_the_rate_by_the_rule(rule, factor):
    plan = derive_plan(_cfg(**{"train.lr_scaling": rule, "data.batch_size": 32}), (TRAIN, VAL), 2)
    world_rate = {"linear": 2, "sqrt": math.sqrt(2), "none": 1}[rule] * 0.01
    assert plan.lr == pytest.approx(world_rate)
    after = plan.relaunched(restore_from="/run/last.ckpt", out_of_memory=True)
    assert (after.batch_size, after.world_size, after.attempt, after.restore_from) == (16, 2, 1, "/run/last.ckpt")
    assert after.lr == pytest.approx(world_rate * factor)
    assert after.steps_per_epoch == min(_rows_per_rank(TRAIN, 2)) // 16
    assert after.shards.train.row_group_rows == TRAIN and after.shards.val.batch_size == 16
    again = after.relaunched(restore_from=None, out_of_memory=True)  # from the start: no checkpoint written yet
    assert (again.batch_size, again.attempt, again.restore_from) == (8, 2, None)
    assert again.lr == pytest.approx(world_rate * factor ** 2)
    assert plan.batch_size == 32 and plan.attempt == 0  # the plan it came from is as it was


def test_halving_ends_at_one_sample_per_rank_naming_the_key():
    plan = derive_plan(_cfg(**{"data.batch_size": 2}), (TRAIN, VAL), 2)
    one = plan.relaunched(restore_from=None, out_of_memory=True)
    assert one.batch_size == 1
    with pytest.raises(ConfigError, match="data.batch_size"):
        one.relaunched(restore_from=None, out_of_memory=True, cause="OutOfMemoryError: injected")


def test_an_elastic_relaunch_on_fewer_ranks_keeps_the_batch_and_equal_steps():
    plan = derive_plan(_cfg(), (TRAIN, VAL), 3)
    fewer = plan.relaunched(restore_from="/run/last.ckpt", world_size=2)
    rows = _rows_per_rank(TRAIN, 2)
    assert (fewer.world_size, fewer.batch_size, fewer.attempt) == (2, 16, 1)
    assert fewer.shards.train.rows_per_rank == rows and fewer.shards.train.world_size == 2
    assert fewer.steps_per_epoch == min(rows) // 16 and all(r >= fewer.steps_per_epoch * 16 for r in rows)
    assert fewer.lr == pytest.approx(0.01 * 2)  # the rate follows the smaller global batch
    assert fewer.partitions == plan.partitions  # the same converted files
    both = plan.relaunched(restore_from=None, out_of_memory=True, world_size=1)
    assert (both.world_size, both.batch_size) == (1, 8) and both.lr == pytest.approx(0.01 * 8 / 16)


def test_a_plain_restart_keeps_the_plan_and_counts_the_attempt():
    plan = derive_plan(_cfg(), (TRAIN, VAL), 2)
    again = plan.relaunched(restore_from="/run/last.ckpt")
    assert again.shards is plan.shards and (again.batch_size, again.world_size, again.lr) == (16, 2, plan.lr)
    assert (again.attempt, again.restore_from) == (1, "/run/last.ckpt")


def test_a_relaunch_on_ranks_the_row_groups_cannot_feed_is_refused_with_the_numbers():
    plan = derive_plan(_cfg(), ([50, 50], [10, 10]), 2)
    with pytest.raises(PlanError, match="3 ranks"):
        plan.relaunched(restore_from=None, world_size=3)


def test_the_plan_is_frozen():
    plan = derive_plan(_cfg(), (TRAIN, VAL), 2)
    assert isinstance(plan, RunPlan)
    for field in ("batch_size", "lr", "world_size", "restore_from", "attempt"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(plan, field, None)


def test_derive_reads_the_row_groups_of_converted_data_or_a_shard_plan():
    plan = derive_plan(_cfg(), (TRAIN, VAL), 2)
    assert derive_plan(_cfg(), plan.shards, 2).shards == plan.shards  # a ShardPlan (or a ConvertedData: .train/.val)


def test_the_rules_have_one_home_and_the_old_names_are_the_same_functions():
    from pipeline.data import plan
    from pipeline.distributed import backoff
    from pipeline.lakehouse import partition, split
    from pipeline.model import module

    assert module.scaled_lr is plan.scaled_lr
    for name in ("start_batch_size", "backs_off", "halved", "lr_batch_factor"):
        assert getattr(backoff, name) is getattr(plan, name)
    for name in ("is_validation", "in_split", "held_out_by_all", "row_key", "split_bucket", "split_rule", "HoldOut"):
        assert callable(getattr(split, name)) and not hasattr(partition, name)  # the split rule is split.py's alone


def test_the_split_rule_is_written_only_in_its_home():
    """No module but pipeline/lakehouse/split.py computes a split bucket or a validation threshold."""
    root = pathlib.Path(__file__).resolve().parents[2] / "pipeline"
    home = root / "lakehouse" / "split.py"
    spelled = [str(p.relative_to(root)) for p in root.rglob("*.py") if p != home
               for text in [p.read_text()] if "crc32" in text or "* SPLIT_BUCKETS" in text]
    assert spelled == []
