"""The direct-source bench's order of jobs per round: the direct job's place rotates, the first conversion of a
round always comes before the warm run that needs its cache entry."""
from __future__ import annotations

from bench.direct_source import round_order

SAMPLE = ["converted_first", "converted_warm", "direct"]


def test_the_direct_job_moves_one_place_later_each_round():
    assert [round_order(SAMPLE, i) for i in range(4)] == [
        ["direct", "converted_first", "converted_warm"],
        ["converted_first", "direct", "converted_warm"],
        ["converted_first", "converted_warm", "direct"],
        ["direct", "converted_first", "converted_warm"]]
    assert [round_order(["converted_first", "direct"], i) for i in range(3)] == [
        ["direct", "converted_first"], ["converted_first", "direct"], ["direct", "converted_first"]]


def test_every_round_runs_each_kind_once_with_the_cold_conversion_before_the_warm_run():
    for i in range(6):
        order = round_order(SAMPLE, i)
        assert sorted(order) == sorted(SAMPLE)
        assert order.index("converted_first") < order.index("converted_warm")
    # over the full bench's 5 rounds the direct job is neither always last nor always right after a conversion
    places = [round_order(SAMPLE, i).index("direct") for i in range(5)]
    assert set(places) == {0, 1, 2}
