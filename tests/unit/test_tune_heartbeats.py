"""Sweeps with different `tune.heartbeat_s` on one study: each trial is judged stale by the interval its own sweep
beats at (recorded on the trial with its first beat), a trial that never beat by the largest interval the study knows
(the one it was created with among them), so a sweep with a short interval never fails a live trial of a sweep with a
long one, and a sweep with a long interval fails a dead trial of a short one without waiting its own grace period.

A heartbeat's age is set in the SQLite file (the database's clock decides, as in Optuna's rule): no test waits."""
from __future__ import annotations

import sqlite3
from datetime import datetime, timedelta

import pytest

from pipeline.config import Config, apply_overrides
from pipeline.tune.study import (INTERRUPTED, Heartbeat, StaleTrials, create_study, fail_stale, failure_reason,
                                 make_storage, quiet_optuna, running)

# kept in the study's storage (so spelled out here): the study's interval, and the one a trial's sweep beats at
STUDY_HEARTBEAT_S = "heartbeat_s"
TRIAL_HEARTBEAT_S = "lakehouse_heartbeat_s"


def _sweep(tmp_path, heartbeat_s, create=False):
    """One sweep's view of study `s`: its own storage object (Optuna's heartbeat on) and heartbeat settings."""
    import optuna

    quiet_optuna()
    url = f"sqlite:///{tmp_path}/optuna.db"
    stale = StaleTrials(heartbeat_s)
    storage = make_storage(url, stale)
    if create:
        cfg = apply_overrides(Config(), {"tune.heartbeat_s": heartbeat_s})
        study = create_study(cfg, "s", storage, url, 8, "params: {}\n", [])
    else:
        study = optuna.load_study(study_name="s", storage=storage)
    return study, storage, stale


def _age(tmp_path, trial, heartbeat_s=None, started_s=None):
    """Make `trial`'s last heartbeat `heartbeat_s` seconds old and its start `started_s` seconds ago."""
    with sqlite3.connect(tmp_path / "optuna.db") as db:
        if heartbeat_s is not None:
            db.execute("UPDATE trial_heartbeats SET heartbeat = datetime('now', ?) WHERE trial_id = ?",
                       (f"-{heartbeat_s} seconds", trial._trial_id))
        if started_s is not None:
            start = (datetime.now() - timedelta(seconds=started_s)).strftime("%Y-%m-%d %H:%M:%S.%f")
            db.execute("UPDATE trials SET datetime_start = ? WHERE trial_id = ?", (start, trial._trial_id))


@pytest.mark.timeout(60)
def test_a_sweep_with_a_short_heartbeat_never_fails_a_live_trial_of_a_sweep_with_a_long_one(tmp_path):
    from optuna.trial import TrialState

    slow, slow_storage, _ = _sweep(tmp_path, 30, create=True)  # tune.heartbeat_s=30: beats every 30 s
    fast, fast_storage, fast_stale = _sweep(tmp_path, 1)  # a `--resume` with tune.heartbeat_s=1 beside it
    live = slow.ask()
    dead = fast.ask()
    with Heartbeat(fast_storage, dead, 1):
        pass  # one beat, then its process "dies"
    young, old = fast.ask(), fast.ask()  # both asked by a sweep killed before their first beat
    with Heartbeat(slow_storage, live, 30):
        _age(tmp_path, live, heartbeat_s=10)  # its last beat 10 s ago: live (its next is due in 20 s)
        _age(tmp_path, dead, heartbeat_s=10)  # silent for 10 s > 3 x its own 1 s
        _age(tmp_path, young, started_s=10)  # 10 s: within 3 x 30 s, the study's largest interval
        _age(tmp_path, old, started_s=100)  # 100 s: beyond 3 x 30 s
        failed = fail_stale(fast, fast_stale)
        assert sorted(t.number for t in failed) == [dead.number, old.number]
        assert sorted(t.number for t in running(fast)) == [live.number, young.number]
        slow.tell(live, 0.5)  # the slow sweep tells its own trial: it was never taken from it
    states = {t.number: t.state for t in slow.get_trials()}
    assert states == {live.number: TrialState.COMPLETE, dead.number: TrialState.FAIL,
                      young.number: TrialState.RUNNING, old.number: TrialState.FAIL}
    assert failure_reason(slow.trials[dead.number]) == INTERRUPTED
    assert slow.user_attrs.get(STUDY_HEARTBEAT_S) == 30  # the interval the study was created with
    assert slow.trials[live.number].system_attrs.get(TRIAL_HEARTBEAT_S) == 30  # the one its sweep beat at
    assert slow.trials[dead.number].system_attrs.get(TRIAL_HEARTBEAT_S) == 1


@pytest.mark.timeout(60)
def test_a_sweep_with_a_long_heartbeat_fails_a_dead_trial_by_its_own_sweeps_interval(tmp_path):
    from optuna.trial import TrialState

    fast, fast_storage, _ = _sweep(tmp_path, 1, create=True)
    slow, _, slow_stale = _sweep(tmp_path, 30)
    dead, live = fast.ask(), fast.ask()
    with Heartbeat(fast_storage, dead, 1):
        pass
    with Heartbeat(fast_storage, live, 1) as beating:
        _age(tmp_path, dead, heartbeat_s=10)  # 10 s silent: stale for its 1 s sweep, though not 3 x 30 s old
        beating.beat()
        failed = fail_stale(slow, slow_stale)
        assert [t.number for t in failed] == [dead.number]
        assert fail_stale(fast, StaleTrials(1)) == []  # failed once, by one sweep
    assert {t.number: t.state for t in slow.get_trials()} == {dead.number: TrialState.FAIL,
                                                             live.number: TrialState.RUNNING}
