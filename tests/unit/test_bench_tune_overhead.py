"""Unit tests of the tune-overhead figure's pure parts: the bench's sweep, the spans charged to a run, the ratio and
its parts (registration left out of the train alone, the stricter ratio without its data preparation)."""
from __future__ import annotations

import pytest

from bench.tune_overhead import (EPOCHS, Pair, Spans, breakdown, from_parts_result, overhead_result,
                                 sweep_space)
from pipeline.config import Config
from pipeline.tune.space import space_from_text


def test_sweep_space_is_a_valid_space_with_every_trial_enqueued():
    text, fixed, trials = sweep_space(5)
    space = space_from_text(text, Config(), "<bench>")
    assert space.enqueue == trials and len(trials) == 5
    assert space.fixed == fixed == {"train.max_epochs": EPOCHS, "train.early_stopping.enabled": False}
    assert len({tuple(sorted(t.items())) for t in trials[:3]}) == 3  # a sweep, not one setting repeated
    assert not space.needs_conversion()  # every trial shares the one conversion


def test_spans_charge_each_call_to_the_run_that_contains_it():
    spans = Spans()
    calls = []
    timed = spans.timer("ranks")(lambda x: calls.append(x) or x * 2)
    assert timed(3) == 6 and calls == [3]
    (name, s, e), = spans.items
    assert name == "ranks" and e >= s
    spans.items = [("ranks", 1.0, 3.0), ("ranks", 5.0, 6.5), ("ask", 1.0, 1.25), ("ranks", 9.0, 11.0)]
    assert spans.within("ranks", 0.0, 7.0) == pytest.approx(3.5)
    assert spans.within("ranks", 4.0, 10.0) == pytest.approx(1.5)  # the one straddling the end belongs elsewhere
    assert spans.within("ask", 0.0, 7.0) == pytest.approx(0.25)


def _pair(trial_wall, alone_wall, register=2.0, prepare=1.0, order="trial first"):
    trial = {"wall": trial_wall, "run_trial": trial_wall - 0.5, "train_in_run": trial_wall - 1.0,
             "ranks": trial_wall - 2.0, "ask": 0.1, "tell": 0.1, "log_best": 0.2, "gate_wait": 0.3}
    alone = {"wall": alone_wall, "prepare": prepare, "train_in_run": alone_wall - register - prepare - 0.5,
             "ranks": alone_wall - register - prepare - 1.5, "register": register}
    return Pair(trial, alone, order)


def test_pair_leaves_registration_out_of_the_train_alone():
    p = _pair(22.0, 22.0)
    assert p.alone_s == 20.0
    assert p.overhead == pytest.approx(1.10)
    assert p.overhead_vs_training_only == pytest.approx(22.0 / 19.0)
    # measured directly: outside the trial's ranks 2.0 s + 0.3 s of verdict waits, outside the alone's ranks 2.5 s
    assert p.extra_s == pytest.approx(2.3 - 2.5)
    assert p.overhead_from_parts == pytest.approx(1.0 - 0.2 / 20.0)


def test_overhead_result_median_spread_verdict_and_parts():
    pairs = [_pair(21.0, 22.0), _pair(24.0, 22.0, order="alone first"), _pair(20.0, 22.0)]
    study = {"total": 9.0, "register_best": 2.0}
    r = overhead_result(pairs, "sample", study, {"world_size": 2})
    assert r.key == "tune_overhead/sample" and r.op == "<=" and r.target == 1.10
    assert r.per_repeat == pytest.approx([1.05, 1.2, 1.0])
    assert r.ratio == pytest.approx(1.05) and r.passed
    assert r.spread["min"] == pytest.approx(1.0) and r.spread["max"] == pytest.approx(1.2)
    assert r.repeats == 3
    assert r.parts["trial_s"] == 21.0 and r.parts["train_alone_s"] == 20.0
    assert r.parts["train_alone_with_registration_s"] == 22.0
    assert r.parts["per_trial_extra_s"] == pytest.approx(1.0)
    assert r.parts["overhead_vs_training_only"] == pytest.approx(21.0 / 19.0)
    assert r.parts["overhead_from_parts_per_pair"] == pytest.approx([0.99] * 3)  # the same parts in every pair
    assert r.parts["study_one_off_s"] == study and r.parts["world_size"] == 2
    assert r.parts["order"] == ["trial first", "alone first", "trial first"]
    slow = overhead_result([_pair(30.0, 22.0)], "sample", study, {})
    assert not slow.passed and slow.ratio == pytest.approx(1.5)
    assert "overhead from parts" in slow.note  # a miss says what the trial's own work was


def test_from_parts_variant_has_its_own_key_and_verdict():
    r = from_parts_result([_pair(21.0, 22.0), _pair(30.0, 22.0)], "sample")
    assert r.key == "tune_overhead/sample/from_parts" and r.target == 1.10
    assert r.per_repeat == pytest.approx([0.99, 0.99]) and r.passed  # the ranks' 8 s gap is not the trial's work
    assert r.parts["per_trial_extra_s"] == pytest.approx(-0.2)


def test_breakdown_splits_each_wall_into_its_parts():
    b = breakdown([_pair(21.0, 22.0)])
    t, a = b.trial, b.alone
    assert t["ranks"] == 19.0 and t["train_in_run_outside_ranks"] == 1.0
    assert t["child_run_outside_train_in_run"] == 0.5
    assert t["optuna_ask"] + t["optuna_tell"] + t["log_best"] + t["sweep_rest"] + 20.5 == pytest.approx(t["wall"])
    assert a["registration"] == 2.0 and a["prepare_data_cache_hit"] == 1.0
    assert a["ranks"] + a["train_in_run_outside_ranks"] + a["prepare_data_cache_hit"] + a["registration"] + \
        a["run_rest"] == pytest.approx(a["wall"])


def test_only_complete_timed_trials_make_pairs():
    from bench.tune_overhead import valid_pairs

    timed = {1: _pair(21.0, 22.0), 2: _pair(5.0, 22.0), 3: _pair(8.0, 22.0)}  # 2 pruned early, 3 failed: short walls
    pairs, dropped = valid_pairs(timed, {0: "COMPLETE", 1: "COMPLETE", 2: "PRUNED", 3: "FAIL"}, 4)
    assert pairs == [timed[1]]
    assert set(dropped) == {"pair 2", "pair 3", "pair 4"}
    assert "PRUNED" in dropped["pair 2"] and "FAIL" in dropped["pair 3"] and "not timed" in dropped["pair 4"]
    r = overhead_result(pairs, "sample", {}, {}, dropped)
    assert r.ratio == pytest.approx(1.05) and r.repeats == 1 and r.parts["dropped_pairs"] == dropped


def test_without_a_complete_trial_both_figures_are_nan_and_say_why():
    import math

    from bench.tune_overhead import valid_pairs

    pairs, dropped = valid_pairs({1: _pair(5.0, 22.0)}, {1: "PRUNED"}, 1)
    assert pairs == []
    for r in (overhead_result(pairs, "sample", {}, {}, dropped), from_parts_result(pairs, "sample", dropped)):
        assert math.isnan(r.ratio) and not r.passed and r.repeats == 0
        assert "no valid pair" in r.note and "PRUNED" in r.note
