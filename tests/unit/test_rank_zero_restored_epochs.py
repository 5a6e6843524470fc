"""Rank 0 relaunched after a crash while the tracking server was away: the epochs the relaunch restores from its
checkpoint (the epoch history) reach the run's metric history, or the offline folder, each value once, against a
real SQLite MLflow store under tmp_path (no ranks: two trackers stand for the two attempts of rank 0)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from mlflow import MlflowClient

from pipeline.config import Config, apply_overrides
from pipeline.tracking.offline import OfflineRun, offline_folder
from pipeline.tracking.rank_zero import RankZeroTracker

KEYS = ("val_loss", "val_acc")


def _epoch(step: int):
    """EpochAccounting's record of epoch `step` (what the checkpoint's history holds)."""
    return {"epoch": step, "val_loss": 1.0 / (step + 1), "val_acc": 0.1 * step}


def _metrics(step: int):
    return {k: v for k, v in _epoch(step).items() if k != "epoch"}


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A run on a real SQLite store; MLflow's process-wide tracking URI put back afterwards."""
    from mlflow.tracking._tracking_service import utils as tracking_service

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setattr(tracking_service, "_tracking_uri", None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for key, value in {"MLFLOW_HTTP_REQUEST_TIMEOUT": "1", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                       "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0"}.items():
        monkeypatch.setenv(key, value)
    client = MlflowClient(uri)
    experiment = client.create_experiment("restored", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(experiment).info.run_id
    job = SimpleNamespace(job_dir=str(tmp_path / "job"), tracking_uri=uri,
                          cfg=apply_overrides(Config(), {"mlflow.reconnect_wait_s": 0.5, "mlflow.retry_wait_s": 0.1}))
    return SimpleNamespace(uri=uri, client=client, run_id=run_id, job=job)


def _away(tracker, monkeypatch, get_run: bool = False) -> None:
    """The server stops answering this tracker (its batches refused; `get_run`: its probes too)."""
    def refused(*args, **kwargs):
        raise ConnectionError("connection refused")

    monkeypatch.setattr(tracker.client, "log_batch", refused)
    if get_run:
        monkeypatch.setattr(tracker.client, "get_run", refused)
        monkeypatch.setattr(tracker.client, "get_metric_history", refused)


def _first_attempt(store, monkeypatch) -> None:
    """Epochs 0-1 taken; then the server goes away, 2-3 wait in rank 0's memory, and rank 0 crashes. Of them the
    server had got, unknown to rank 0, all of epoch 2 (a batch in flight) and val_loss of epoch 3 (a part of one)."""
    first = RankZeroTracker(store.uri, store.run_id, local_dir=store.job.job_dir)
    for step in (0, 1):
        first.log_epoch(_metrics(step), step)
    assert first.flush(timeout_s=30) and first.sent == {0, 1}
    _away(first, monkeypatch)
    for step in (2, 3):
        first.log_epoch(_metrics(step), step)
    assert [s for s, _ in first.pending] == [2, 3]
    from pipeline.tracking.sending import log_epoch_metrics

    log_epoch_metrics(store.client, store.run_id, _metrics(2), 2)
    log_epoch_metrics(store.client, store.run_id, {"val_loss": _metrics(3)["val_loss"]}, 3)
    # rank 0 crashes here: its pending epochs die with it; the relaunch restores epochs 0-3 from the checkpoint


def _steps(store, key):
    return [m.step for m in sorted(store.client.get_metric_history(store.run_id, key), key=lambda m: m.step)]


def test_a_relaunch_sends_the_restored_epochs_the_server_never_took_once(store, monkeypatch):
    _first_attempt(store, monkeypatch)
    second = RankZeroTracker(store.uri, store.run_id, local_dir=store.job.job_dir)
    monkeypatch.setattr(second, "_finish_online", lambda *a: "models:/m-1")
    for step in (4, 5):  # the relaunch's own epochs
        second.log_epoch(_metrics(step), step)
    history = [_epoch(step) for step in range(6)]  # restored 0-3, then 4-5
    assert second.finish(None, store.job, history, SimpleNamespace(epochs=6), own=set(range(6))) == "models:/m-1"
    for key in KEYS:  # every epoch once: no gap (3 of val_acc), no point twice (0-2, 3 of val_loss)
        assert _steps(store, key) == [0, 1, 2, 3, 4, 5], key
    values = {m.step: m.value for m in store.client.get_metric_history(store.run_id, "val_acc")}
    assert values == {step: pytest.approx(_metrics(step)["val_acc"]) for step in range(6)}
    assert second.pending == []


def test_a_relaunch_that_restored_nothing_asks_the_server_nothing_more(store, monkeypatch):
    tracker = RankZeroTracker(store.uri, store.run_id, local_dir=store.job.job_dir)
    monkeypatch.setattr(tracker, "_finish_online", lambda *a: "models:/m-1")
    monkeypatch.setattr(tracker.client, "get_metric_history",
                        lambda *a, **k: pytest.fail("a first attempt reported every epoch itself"))
    for step in range(3):
        tracker.log_epoch(_metrics(step), step)
    assert tracker.finish(None, store.job, [_epoch(s) for s in range(3)], SimpleNamespace(epochs=3),
                          own={0, 1, 2}) == "models:/m-1"
    assert _steps(store, "val_loss") == [0, 1, 2]


def test_a_run_resumed_from_another_runs_checkpoint_sends_none_of_that_runs_epochs(store, monkeypatch):
    """train.ckpt_restore=<run>/last: the history holds the other run's epochs 0-1 (its own run has them); the new run
    reports 2-3 itself and is sent nothing more."""
    tracker = RankZeroTracker(store.uri, store.run_id, local_dir=store.job.job_dir)
    monkeypatch.setattr(tracker, "_finish_online", lambda *a: "models:/m-1")
    for step in (2, 3):
        tracker.log_epoch(_metrics(step), step)
    assert tracker.finish(None, store.job, [_epoch(s) for s in range(4)], SimpleNamespace(epochs=4),
                          own={2, 3}) == "models:/m-1"
    for key in KEYS:
        assert _steps(store, key) == [2, 3], key


def test_a_relaunch_left_offline_sends_no_restored_epoch(store, monkeypatch):
    """The server away at the end: which restored epochs are this run's, and which it took, is not known; the folder
    keeps this attempt's epochs, none of the restored ones (no value twice, none of another run's)."""
    _first_attempt(store, monkeypatch)
    second = RankZeroTracker(store.uri, store.run_id, local_dir=store.job.job_dir)
    def log_model_online(*args):  # the server is away: logging the model fails so
        raise ConnectionError("connection refused")

    monkeypatch.setattr(second, "_finish_online", log_model_online)
    monkeypatch.setattr(second, "_finish_offline", lambda *a: None)  # the plots and model: not this test's
    for step in (4, 5):
        second.log_epoch(_metrics(step), step)
    assert second.flush(timeout_s=30) and second.sent == {4, 5}
    _away(second, monkeypatch, get_run=True)  # and it stays away to the end
    assert second.finish(None, store.job, [_epoch(step) for step in range(6)], SimpleNamespace(epochs=6),
                         own=set(range(6))) is None
    kept = OfflineRun(offline_folder(store.job.job_dir)).metrics()
    for key in KEYS:
        assert sorted((m["step"], m["sent"]) for m in kept if m["key"] == key) == [(4, True), (5, True)], key


def test_a_relaunch_sends_its_runs_epochs_that_never_reached_the_server(store, monkeypatch):
    """The server away for the whole first attempt (epochs 0-1 died in rank 0's memory): the relaunch sends them,
    as its run's own (EpochAccounting records which run trained each epoch), whatever the server holds."""
    first = RankZeroTracker(store.uri, store.run_id, local_dir=store.job.job_dir)
    _away(first, monkeypatch)
    for step in (0, 1):
        first.log_epoch(_metrics(step), step)
    second = RankZeroTracker(store.uri, store.run_id, local_dir=store.job.job_dir)
    monkeypatch.setattr(second, "_finish_online", lambda *a: "models:/m-1")
    for step in (2, 3):
        second.log_epoch(_metrics(step), step)
    assert second.finish(None, store.job, [_epoch(s) for s in range(4)], SimpleNamespace(epochs=4),
                         own={0, 1, 2, 3}) == "models:/m-1"
    for key in KEYS:
        assert _steps(store, key) == [0, 1, 2, 3], key


def test_the_epoch_accounting_records_which_run_trained_each_epoch_across_a_checkpoint():
    from pipeline.distributed.callbacks import EpochAccounting

    before = EpochAccounting(run_id="other")
    before.history, before.runs = [_epoch(0), _epoch(1)], {0: "other", 1: "other"}
    after = EpochAccounting(run_id="mine")
    after.load_state_dict(before.state_dict())
    assert after.own_epochs() == set() and after.runs == {0: "other", 1: "other"}
    after.runs[2] = "mine"
    again = EpochAccounting(run_id="mine")
    again.load_state_dict(after.state_dict())
    assert again.own_epochs() == {2}
    old = EpochAccounting(run_id="mine")
    old.load_state_dict({"history": [_epoch(0)]})  # a checkpoint of before the record: none known as its own
    assert old.own_epochs() == set()
