"""The restart-cost figure: extra wall time over (epoch + process start), and the issue's wall-ratio form of it."""
import math
from types import SimpleNamespace

import pytest

from bench.restart_cost import cost_result, epoch_timing


def test_restart_cost_passes_when_only_an_epoch_and_a_start_are_lost():
    r = cost_result([100.0, 102.0], [110.0, 113.0], [5.0, 5.0], [6.0, 6.0], "sample", {})
    assert r.ratio == pytest.approx((10 / 11 + 11 / 11) / 2) and r.passed
    assert r.parts["wall_ratio"] == pytest.approx(111.5 / 101) and r.parts["wall_ratio"] <= r.parts["wall_ratio_bound"]


def test_restart_cost_fails_when_more_is_lost():
    r = cost_result([100.0], [125.0], [5.0], [6.0], "sample", {})
    assert r.ratio == pytest.approx(25 / 11) and not r.passed
    assert r.parts["wall_ratio"] > r.parts["wall_ratio_bound"]


def test_epoch_timing_from_the_epoch_metric():
    history = [SimpleNamespace(step=1, value=3.0, timestamp=1_000_020_000),
               SimpleNamespace(step=0, value=4.0, timestamp=1_000_016_000)]
    client = SimpleNamespace(get_metric_history=lambda run_id, key: history)
    epoch_s, start_s, epochs = epoch_timing(client, "run", launch_start=1_000_005.0)
    assert epochs == [4.0, 3.0] and epoch_s == 3.5 and start_s == pytest.approx(7.0)  # 1e6+16 - 4 - (1e6+5)


def test_attempts_split_a_run_with_a_failure():
    from bench.restart_cost import attempts

    history = [SimpleNamespace(step=0, value=4.0, timestamp=120_000),
               SimpleNamespace(step=1, value=4.0, timestamp=170_000)]
    client = SimpleNamespace(get_metric_history=lambda run_id, key: history)
    parts = attempts(client, "run", [[100.0, 140.0], [141.0, 200.0]])
    assert parts == {"failed_attempt_s": 40.0, "between_attempts_s": 1.0, "relaunch_start_s": 25.0,
                     "second_attempt_s": 59.0}
    assert attempts(client, "run", [[100.0, 200.0]]) == {}


def _cut(restarts, launches):
    return {"restarts": restarts, "launches": launches}


def test_a_run_with_the_failure_measures_a_restart_only_when_it_restarted_exactly_once():
    from bench.restart_cost import restart_problem

    assert restart_problem(_cut([1], 2)) is None
    for run in (_cut([], 1), _cut([1, 2], 3), _cut([1], 1), _cut([0], 2)):  # never fired, twice, ...
        assert "did not restart the run exactly once" in restart_problem(run)


def test_without_a_valid_pair_the_figure_is_nan_and_says_why():
    dropped = {"pair 1": "restarts metric [], 1 launch(es): the injected failure did not restart the run exactly once"}
    r = cost_result([], [], [], [], "sample", {}, dropped)
    assert math.isnan(r.ratio) and not r.passed and r.repeats == 0 and r.per_repeat == []
    assert "no valid pair" in r.note and "pair 1" in r.note and r.parts["dropped_pairs"] == dropped


def test_a_negative_figure_is_not_a_pass():
    r = cost_result([100.0], [97.0], [5.0], [6.0], "sample", {})  # the run with the failure was the faster
    assert r.ratio == pytest.approx(-3 / 11) and not r.passed and "noise" in r.note
    ok = cost_result([100.0, 100.0, 100.0], [97.0, 105.0, 106.0], [5.0] * 3, [6.0] * 3, "sample", {})
    assert ok.ratio == pytest.approx(5 / 11) and ok.passed  # one negative pair among positive ones: the median
