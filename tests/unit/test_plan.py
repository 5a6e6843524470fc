"""Split stability and shard-plan arithmetic (no Spark)."""
import random

import pytest

from pipeline.lakehouse.partition import PlanError, batch_for_min_steps, plan_shards, plan_split
from pipeline.lakehouse.split import is_validation, split_bucket


def test_split_is_stable_when_table_grows():
    paths = [f"/data/cls{i % 7}/{i}.png" for i in range(5000)]
    before = {p: is_validation(p, 0.2) for p in paths}
    grown = paths + [f"/data/new/{i}.png" for i in range(3000)]
    random.Random(0).shuffle(grown)
    after = {p: is_validation(p, 0.2) for p in grown}
    assert all(after[p] == before[p] for p in paths)


def test_split_fraction_is_close():
    paths = [f"/x/{i}.png" for i in range(20000)]
    frac = sum(is_validation(p, 0.25) for p in paths) / len(paths)
    assert 0.23 < frac < 0.27


def test_bucket_matches_crc32():
    import zlib

    assert split_bucket("abc") == zlib.crc32(b"abc") % 10000


def test_plan_round_robin_like_petastorm():
    # 6 row groups over 4 shards: petastorm gives row group i to shard i % 4
    plan = plan_split("train", [333, 334, 167, 166, 100, 100], world_size=4, batch_size=50)
    assert plan.rows_per_rank == [433, 434, 167, 166]
    assert plan.row_groups_per_rank == [2, 2, 1, 1]
    assert plan.steps_per_epoch == 166 // 50
    assert plan.rows_per_epoch_per_rank == 150


def test_plan_equal_steps_even_when_uneven():
    plan = plan_split("train", [1000, 10], world_size=2, batch_size=4)
    assert plan.steps_per_epoch == 2  # the smaller shard decides for everyone


def test_a_full_pass_has_the_same_batches_on_every_rank():
    # validation reads every row: the rank with the most rows sets the batches, the others pad with empty ones
    assert plan_split("val", [65, 64], world_size=2, batch_size=16).eval_steps == 5
    assert plan_split("val", [1000, 10], world_size=2, batch_size=4).eval_steps == 250
    assert plan_split("val", [32, 32], world_size=2, batch_size=16).eval_steps == 2


def test_plan_small_shard_still_gets_one_step():
    plan = plan_split("train", [3, 3], world_size=2, batch_size=64)
    assert plan.steps_per_epoch == 1


def test_more_ranks_than_row_groups_names_numbers():
    with pytest.raises(PlanError) as err:
        plan_split("train", [50, 50, 50], world_size=4, batch_size=8)
    msg = str(err.value)
    assert "150 rows" in msg and "3 row group" in msg and "4 ranks" in msg and "[3]" in msg
    assert "train.np" in msg and "partitions_per_worker" in msg


def test_empty_split():
    with pytest.raises(PlanError, match="empty"):
        plan_split("val", [], world_size=2, batch_size=8)


@pytest.mark.parametrize("budget_mb, train_kept, val_kept", [(0, False, False), (1, True, False), (2, True, True)])
def test_memory_budget_is_per_rank_train_first(budget_mb, train_kept, val_kept):
    """data.memory_cache_mb holds the train shard first, then the val shard if what is left holds it."""
    from pipeline.config import DataConfig
    from pipeline.data.convert import ConvertedData
    from pipeline.data.datamodule import make_datamodule
    from pipeline.lakehouse.partition import ShardPlan

    # 1,000 rows of 32x32x1 pixels + 12 bytes (label, row id) per rank and split: 0.99 MB each
    plan = ShardPlan(train=plan_split("train", [1000, 1000], 2, 10), val=plan_split("val", [1000, 1000], 2, 10))
    data = ConvertedData(train=None, val=None, plan=plan, class_names=["a", "b"], image_size=32, channels=1)
    dm = make_datamodule(data, 1, 2, DataConfig(memory_cache_mb=budget_mb))
    assert dm.train_loader.shard_mb() == pytest.approx(1000 * 1036 / 2 ** 20)
    assert (dm.train_loader.keeps_in_memory, dm.val_loader.keeps_in_memory) == (train_kept, val_kept)


def test_a_small_table_lowers_the_batch_to_give_the_minimum_steps():
    groups = [72, 71, 72, 71]  # 286 rows: 143 per rank on 2 ranks, 4 steps at 32
    assert plan_split("train", groups, 2, 32).steps_per_epoch == 4
    assert batch_for_min_steps(groups, 2, 32, 16) == 8
    plan = plan_shards(groups, [20, 20], 2, 32, min_steps=16)
    assert plan.train.batch_size == plan.val.batch_size == 8 and plan.train.steps_per_epoch >= 16


def test_a_large_enough_table_and_zero_keep_the_batch():
    assert batch_for_min_steps([400, 400], 2, 32, 16) == 25  # 400 // 32 = 12 < 16: lowered to 400 // 16 ...
    assert batch_for_min_steps([800, 800], 2, 32, 16) == 32  # ... 25 steps: kept
    assert batch_for_min_steps([10, 10], 2, 32, 0) == 32
    assert batch_for_min_steps([3, 3], 2, 32, 16) == 1  # never below 1
