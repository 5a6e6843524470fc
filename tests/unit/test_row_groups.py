"""How the converter sizes row groups (pure): enough per rank, bounded in bytes, equal within a partition."""
import math

import pytest

from pipeline.data.convert import group_rows_for


def _file_groups(n: int, g: int) -> list:
    """The groups the converter writes for a partition of n rows: whole groups, the last 1-2 groups' rows halved."""
    out = []
    while n >= 2 * g:
        out.append(g)
        n -= g
    if n > g:
        out += [(n + 1) // 2, n // 2]
    elif n:
        out.append(n)
    return out
from pipeline.lakehouse.partition import plan_split


@pytest.mark.parametrize("rows, world, parts", [(480, 2, 4), (1412, 2, 4), (50_000, 8, 16), (999, 3, 6)])
def test_round_robin_partitions_give_even_shards(rows, world, parts):
    g = group_rows_for(rows, world, 1024, 32, 32.0, parts)
    # Spark's round-robin repartition: partition sizes differ by at most one row
    sizes = [rows // parts + (1 if i < rows % parts else 0) for i in range(parts)]
    groups = [rows_ for n in sizes for rows_ in _file_groups(n, g)]
    plan = plan_split("train", groups, world, 16)
    assert plan.balance() <= 1.05, (g, plan.rows_per_rank)
    assert min(plan.row_groups_per_rank) >= min(32, math.ceil(rows / world) // g) - parts


def test_row_groups_stay_under_the_byte_bound():
    assert group_rows_for(10_000_000, 1, 3 * 64 * 64, 1, 32.0, 1) <= 32 * 2 ** 20 // (3 * 64 * 64)


@pytest.mark.parametrize("rows, world, parts", [(480, 2, 4), (1437, 1, 2), (1412, 2, 4), (50_000, 8, 16), (999, 3, 6)])
def test_the_floor_keeps_shards_even(rows, world, parts):
    g = group_rows_for(rows, world, 1024, 32, 32.0, parts, min_group_mb=1.0)
    sizes = [rows // parts + (1 if i < rows % parts else 0) for i in range(parts)]
    groups = [rows_ for n in sizes for rows_ in _file_groups(n, g)]
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
