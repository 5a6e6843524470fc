"""How the converter sizes row groups (pure): enough per rank, bounded in bytes, equal within a partition."""
import math

import pytest

from pipeline.data.convert import LAST_GROUP_SLACK, group_rows_for, groups_to_write, tail_groups_for


from pipeline.lakehouse.partition import plan_split


def _file_groups(n: int, g: int, world: int = 2) -> list:
    """The groups the converter's writer writes for a partition of n rows (buffered as the writer does)."""
    tail = tail_groups_for(world, g, 1024)
    out, pending = [], 0
    for _ in range(n):
        pending += 1
        if pending >= 2 * g:  # as the writer: it asks after each batch once two groups wait
            now = groups_to_write(pending, g, final=False, tail_groups=tail)
            out, pending = out + now, pending - sum(now)
    return out + groups_to_write(pending, g, final=True, tail_groups=tail)


@pytest.mark.parametrize("rows, world, parts", [(480, 2, 4), (1412, 2, 4), (50_000, 8, 16), (999, 3, 6)])
def test_round_robin_partitions_give_even_shards(rows, world, parts):
    g = group_rows_for(rows, world, 1024, 32, 32.0, parts)
    # Spark's round-robin repartition: partition sizes differ by at most one row
    sizes = [rows // parts + (1 if i < rows % parts else 0) for i in range(parts)]
    groups = [rows_ for n in sizes for rows_ in _file_groups(n, g, world)]
    plan = plan_split("train", groups, world, 16)
    assert plan.balance() <= 1.05, (g, plan.rows_per_rank)
    assert min(plan.row_groups_per_rank) >= min(32, math.ceil(rows / world) // g) - parts


def test_row_groups_stay_under_the_byte_bound():
    assert group_rows_for(10_000_000, 1, 3 * 64 * 64, 1, 32.0, 1) <= 32 * 2 ** 20 // (3 * 64 * 64)


@pytest.mark.parametrize("rows, world, parts", [(480, 2, 4), (1437, 1, 2), (1412, 2, 4), (50_000, 8, 16), (999, 3, 6)])
def test_the_floor_keeps_shards_even(rows, world, parts):
    g = group_rows_for(rows, world, 1024, 32, 32.0, parts, min_group_mb=1.0)
    sizes = [rows // parts + (1 if i < rows % parts else 0) for i in range(parts)]
    groups = [rows_ for n in sizes for rows_ in _file_groups(n, g, world)]
    assert plan_split("train", groups, world, 16).balance() <= 1.05, (g, groups)
    # at least 1 MiB per row group (1024 rows of 1 KiB) unless a whole partition is smaller
    assert min(groups) >= min(1024 // 2, max(sizes) // 2), groups


def test_the_floor_makes_one_row_group_per_partition_of_a_small_table():
    # the 1.4k-row sample's train split on one rank: 32 row groups of 45 rows without a floor, 2 of ~719 with it
    assert group_rows_for(1437, 1, 1024, 32, 32.0, 2) == 45
    assert group_rows_for(1437, 1, 1024, 32, 32.0, 2, min_group_mb=1.0) == 719


def test_the_floor_changes_nothing_on_a_large_table():
    for world in (1, 2, 8):
        assert (group_rows_for(2_000_000, world, 1024, 32, 32.0, 2 * world, min_group_mb=1.0)
                == group_rows_for(2_000_000, world, 1024, 32, 32.0, 2 * world))


def test_a_writer_ends_each_file_on_even_groups():
    assert groups_to_write(260, 100, final=False) == [100]  # two groups and the slack wait for the end
    assert groups_to_write(250, 100, final=False) == []
    assert groups_to_write(0, 100, final=True) == []
    assert groups_to_write(90, 100, final=True) == [90]  # a file smaller than a group
    assert groups_to_write(125, 100, final=True) == [125]  # within the slack: still one group
    assert groups_to_write(126, 100, final=True) == [63, 63]  # beyond it: two, never a short last group
    assert groups_to_write(351, 100, final=True) == [100, 100, 76, 75]
    assert groups_to_write(205, 100, final=True) == [103, 102]  # the last groups share the excess
    assert groups_to_write(430, 100, final=True, tail_groups=4) == [108, 108, 107, 107]
    assert sum(groups_to_write(12345, 100, final=True)) == 12345


def test_the_even_tail_is_one_group_per_rank_within_a_memory_bound():
    assert tail_groups_for(1, 100, 1024) == 2
    assert tail_groups_for(4, 100, 1024) == 4
    assert tail_groups_for(64, 8192, 4096) == 6  # 32 MiB groups: 256 MiB held back at most
    assert tail_groups_for(64, 10 ** 6, 4096) == 2


@pytest.mark.parametrize("rows, world, parts", [(480, 2, 4), (1437, 1, 2), (1412, 2, 4), (1500, 3, 6), (7000, 2, 4), (9000, 3, 6), (30000, 4, 8)])
@pytest.mark.parametrize("scale", [0.8, 0.97, 1.0, 1.01, 1.05, 1.2])
@pytest.mark.parametrize("floor_mb", [0.0, 1.0])
def test_partitions_larger_or_smaller_than_the_estimate_keep_shards_even(rows, world, parts, scale, floor_mb):
    """The converter sizes groups from an estimate of the split's rows; the split by path hash and Spark's
    repartition make partitions a few rows (here up to a fifth) off it. Each file then keeps the groups it was
    sized for, and shards stay even (in a CI run without the slack: one group in some files, two halves in others,
    five groups on two ranks, balance 1.65)."""
    g = group_rows_for(rows, world, 1024, 32, 32.0, parts, min_group_mb=floor_mb)
    actual = round(rows * scale)
    even = [actual // parts + (1 if i < actual % parts else 0) for i in range(parts)]
    for sizes in ([n + (2 if i % 2 else -2) for i, n in enumerate(even)], [n + (3 if i == 0 else -1) for i, n in enumerate(even)]):
        groups = [n for size in sizes for n in _file_groups(size, g, world)]
        assert plan_split("train", groups, world, 16).balance() <= 1.05, (g, sizes, groups)
        assert max(groups) <= math.ceil(g * (1 + LAST_GROUP_SLACK))
