"""Tune's study rules without Spark: the metric must be the early-stopping monitor (both keys named), the trial's value
is read at the model's epoch, and Optuna's heartbeat on a real SQLite storage fails a trial whose sweep stopped beating
while a live one stays RUNNING and can still be told; a trial lost to another sweep ends the sweep's turn cleanly."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from pipeline.config import Config, ConfigError, apply_overrides
from pipeline.tune.space import space_from_text
from pipeline.tune.study import (INTERRUPTED, Heartbeat, StaleTrials, check_metric, fail_stale, failure_reason,
                                 make_storage, quiet_optuna, running)
from pipeline.tune.trial import TrialOutcome, trial_value


def _cfg(**values):
    return apply_overrides(Config(), values)


def test_default_metric_and_monitor_agree():
    check_metric(Config())  # val_loss / minimize against val_loss / min
    check_metric(_cfg(**{"tune.metric": "val_acc", "tune.direction": "maximize",
                         "train.early_stopping.monitor": "val_acc", "train.early_stopping.mode": "max"}))


def test_metric_other_than_the_monitor_is_refused_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        check_metric(_cfg(**{"tune.metric": "val_acc", "tune.direction": "maximize"}))
    msg = str(err.value)
    assert "'tune.metric' ('val_acc')" in msg and "'train.early_stopping.monitor' ('val_loss')" in msg


def test_direction_against_the_monitor_mode_is_refused_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        check_metric(_cfg(**{"tune.direction": "maximize"}))
    msg = str(err.value)
    assert "'tune.direction' ('maximize')" in msg and "'train.early_stopping.mode' ('min')" in msg


@pytest.mark.parametrize("key,value", [("train.early_stopping.monitor", "val_acc"),
                                       ("train.early_stopping.mode", "max")])
def test_space_may_not_search_the_monitor(key, value):
    with pytest.raises(ConfigError, match=f"config key '{key}' cannot be set per trial: the trial's value"):
        space_from_text(f"params:\n  model.lr: {{type: float, low: 0.01, high: 0.1}}\nfixed:\n  {key}: {value}\n",
                        Config(), "s.yaml")


def test_trial_value_is_read_at_the_models_epoch():
    # rank 0's metrics are those of the best epoch by the monitor (the checkpoint the model is taken from)
    assert trial_value({"val_loss": 0.4, "val_acc": 0.8}, "val_loss") == 0.4
    assert trial_value({"val_loss": float("nan")}, "val_loss") is None
    assert trial_value({"val_acc": 0.8}, "val_loss") is None


def test_failure_reason_of_a_trial_failed_by_heartbeat():
    assert failure_reason(SimpleNamespace(user_attrs={})) == INTERRUPTED
    assert failure_reason(SimpleNamespace(user_attrs={"error": "TrialFailed: x"})) == "TrialFailed: x"


def _study(tmp_path, heartbeat_s=2):
    """A study on a real SQLite storage with Optuna's heartbeat rule on. The tests' own heartbeats beat every second
    (a trial is judged by the interval its sweep records: 3 x 1 s), and each test beats a live trial just before it
    judges, so a loaded CI machine's late heartbeat thread does not count; a trial that never beat is judged by the
    largest interval known (3 x 2 s)."""
    import optuna

    quiet_optuna()
    stale = StaleTrials(heartbeat_s)
    storage = make_storage(f"sqlite:///{tmp_path}/optuna.db", stale)
    study = optuna.create_study(storage=storage, study_name="s", load_if_exists=True)
    return study, storage, stale


def test_heartbeat_fails_only_the_trial_whose_beat_stopped(tmp_path):
    from optuna.trial import TrialState

    study, storage, stale = _study(tmp_path)
    dead, live = study.ask(), study.ask()
    with Heartbeat(storage, dead, 1):
        pass  # one beat, then its process "dies"
    # another sweep on the same study (its own storage object and collector), opened before the clock matters
    other, other_storage, other_stale = _study(tmp_path)
    with Heartbeat(storage, live, 1) as beating:
        assert fail_stale(study, stale) == []  # both beat just now: nothing is stale
        time.sleep(stale.grace_s + 1.5)  # the dead one's last beat is now older than the grace period
        beating.beat()  # the live one's latest beat, whatever its thread's turn on a loaded machine
        failed = fail_stale(other, other_stale)  # fails the dead trial only
        assert [t.number for t in failed] == [dead.number]
        assert fail_stale(study, stale) == []  # failed once, by one sweep
        assert [t.number for t in running(other)] == [live.number]
        study.tell(live, 0.5)  # the live sweep tells its own trial: no crash
    states = {t.number: t.state for t in study.get_trials()}
    assert states == {dead.number: TrialState.FAIL, live.number: TrialState.COMPLETE}
    assert failure_reason(study.trials[dead.number]) == INTERRUPTED


class _Client:
    """Records what the sweep does to MLflow runs (unit test of the lost-trial rule only)."""

    def __init__(self):
        self.calls = []

    def get_run(self, run_id):
        return SimpleNamespace(info=SimpleNamespace(status="FINISHED"))

    def set_tag(self, run_id, key, value):
        self.calls.append(("tag", run_id, key, value))

    def set_terminated(self, run_id, status):
        self.calls.append(("end", run_id, status))


def test_a_trial_lost_to_another_sweep_becomes_a_failed_outcome(tmp_path):
    from optuna.trial import TrialState

    from pipeline.tune.sweep import Opened, _tell

    study, storage, stale = _study(tmp_path)
    mine = study.ask()
    mine.set_user_attr("mlflow_run_id", "run-1")
    other, _, _ = _study(tmp_path)
    other.tell(mine.number, state=TrialState.FAIL)  # another sweep failed it while it trained here
    op = Opened(study, storage, stale, "sqlite://", None, 1)
    client = _Client()
    out = _tell(op, client, mine, TrialOutcome(mine.number, "COMPLETE", 0.3, "run-1"), values=0.3)
    assert out.state == "FAIL" and out.value is None
    assert f"trial {mine.number} was marked FAIL by another sweep on study 's'" in out.reason
    assert ("end", "run-1", "FAILED") in client.calls
    assert any(c[0] == "tag" and c[2] == "error" and "its result is lost" in c[3] for c in client.calls)
    assert study.trials[mine.number].state == TrialState.FAIL


def test_a_trial_lost_before_its_first_heartbeat_is_failed_by_its_age(tmp_path):
    """Issue 37, defect 12: a sweep killed between `study.ask()` and its trial's first heartbeat leaves a RUNNING
    trial that Optuna's heartbeat rule never sees (it has no heartbeat at all), which would count toward n_trials for
    good. A later sweep fails it once it is older than the grace period; a trial just asked is left alone."""
    from optuna.trial import TrialState

    from pipeline.tune.study import counted

    study, storage, stale = _study(tmp_path)
    lost = study.ask()  # the sweep is killed here: no heartbeat was ever recorded
    assert fail_stale(study, stale) == []  # younger than the grace period: its sweep may be about to beat
    time.sleep(stale.grace_s + 1.5)
    beating = study.ask()
    with Heartbeat(storage, beating, 1) as beat:
        time.sleep(stale.grace_s + 1.5)  # a live trial older than the grace period, beating
        other, _, other_stale = _study(tmp_path)  # another sweep, opened before the trial below is asked
        just_asked = study.ask()  # a live sweep's trial between ask and its first beat
        asked_at = time.monotonic()
        beat.beat()  # the live one's latest beat, whatever its thread's turn on a loaded machine
        failed = fail_stale(other, other_stale)
        assert time.monotonic() - asked_at < stale.grace_s, "the check itself outlasted the grace period"
        assert [t.number for t in failed] == [lost.number]
        assert fail_stale(study, stale) == []  # failed once, by one sweep
    states = {t.number: t.state for t in study.get_trials()}
    assert states == {lost.number: TrialState.FAIL, beating.number: TrialState.RUNNING,
                      just_asked.number: TrialState.RUNNING}
    assert failure_reason(study.trials[lost.number]) == INTERRUPTED
    assert counted(study) == 3  # a failed trial took its slot, as one that failed by heartbeat does


class _LookupsDown:
    """The study's storage with its lookups failing (the database briefly locked): every call is recorded, and each
    `get_*` raises as SQLAlchemy would."""

    def __init__(self, storage):
        self.storage, self.calls = storage, []

    def __getattr__(self, name):
        import sqlalchemy

        method = getattr(self.storage, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            if name.startswith("get_"):
                raise sqlalchemy.exc.OperationalError("SELECT", {}, Exception("database is locked"))
            return method(*args, **kwargs)
        return call


def test_a_trials_heartbeat_is_the_first_thing_written_after_ask_and_needs_no_lookup(tmp_path):
    """Issue 37, defect 12: the heartbeat must exist from the moment the trial does. Setting it up looked up the study
    id by name and the trial id by number first; a lookup that failed raised out of the sweep and left the trial
    RUNNING with no heartbeat at all."""
    from pipeline.tune.study import ATTR_BEATING

    study, storage, stale = _study(tmp_path)
    trial = study.ask()
    down = _LookupsDown(storage)
    with Heartbeat(down, trial, 1):
        assert down.calls[0] == "record_heartbeat"
    assert study.trials[trial.number].system_attrs.get(ATTR_BEATING) is True  # Optuna's stale rule watches it now
