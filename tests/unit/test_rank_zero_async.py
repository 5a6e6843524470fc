"""Rank 0's epoch metrics sent in the background (MLflow's asynchronous logging): the training thread never waits on
the server, one batch is in flight at a time, and the end of training waits for it at most one MLflow call's bound
(pure logic: a fake client whose answers the test gives, as MLflow's RunOperations futures)."""
import json
import logging
import time
from concurrent.futures import Future

import pytest
from mlflow.utils.async_logging.run_operations import RunOperations

from pipeline.tracking import rank_zero
from pipeline.tracking.sending import Sending, http_call_bound_s

FAST = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "1", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0"}


class AsyncClient:
    """log_batch(synchronous=False) queues the batch and returns at once; the test answers each one."""

    def __init__(self):
        self.calls = []  # (steps, future)
        self.tags = []

    def log_batch(self, run_id, metrics, synchronous=True):
        assert synchronous is False  # rank 0 never logs synchronously during training
        future = Future()
        self.calls.append(([(m.step, m.key, m.timestamp) for m in metrics], future))
        return RunOperations([future])

    def set_tag(self, run_id, key, value, synchronous=True):
        assert synchronous is False
        future = Future()
        self.tags.append((key, value, future))
        return RunOperations([future])

    def answer(self, index, error=None):
        future = self.calls[index][1]
        future.set_exception(error) if error else future.set_result(None)

    def steps(self, index):
        return sorted({step for step, _, _ in self.calls[index][0]})


@pytest.fixture
def tracker(tmp_path, monkeypatch):
    for key, value in FAST.items():
        monkeypatch.setenv(key, value)
    t = rank_zero.RankZeroTracker(None, "r1", local_dir=str(tmp_path))
    t.client = AsyncClient()
    return t


def test_the_bound_is_one_call_under_the_http_settings():
    # http_bounds' settings at the default mlflow.retries=3: 4 attempts of 30 s, backoffs 1+2+4 s (+ jitter 1 s each)
    assert http_call_bound_s({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
                              "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}) == 4 * 30 + (1 + 2 + 4) + 3 * 1.0 + 1
    assert http_call_bound_s(FAST) == 2.0
    assert http_call_bound_s({}) == 8 * 120 + sum(min(120, 2 * 2 ** n) + 1 for n in range(7)) + 1  # MLflow's own


def test_a_server_that_never_answers_costs_the_training_thread_nothing(tracker):
    t0 = time.monotonic()
    for step in range(5):
        tracker.log_epoch({"val_loss": 1.0 / (step + 1), "val_acc": 0.1 * step}, step)
    assert time.monotonic() - t0 < 1.5  # one blocked call would be 2 s (a loaded machine stalls a thread ~1 s)
    assert len(tracker.client.calls) == 1 and tracker.client.steps(0) == [0]  # one batch in flight, no pile-up
    assert [s for s, _ in tracker.pending] == [0, 1, 2, 3, 4] and tracker.sent == set()


def test_the_next_batch_carries_every_epoch_that_waited(tracker):
    tracker.log_epoch({"val_loss": 1.0}, 0)
    tracker.log_epoch({"val_loss": 0.9}, 1)
    tracker.log_epoch({"val_loss": 0.8}, 2)
    tracker.client.answer(0)  # the server took epoch 0, late
    tracker.log_epoch({"val_loss": 0.7}, 3)
    assert tracker.sent == {0} and tracker.client.steps(1) == [1, 2, 3]
    tracker.client.answer(1, ConnectionError("connection refused"))  # then went away
    tracker.log_epoch({"val_loss": 0.6}, 4)
    assert tracker.client.steps(2) == [1, 2, 3, 4] and [s for s, _ in tracker.pending] == [1, 2, 3, 4]
    # each value keeps its epoch's timestamp: sent twice, an SQL store keeps it once
    first = {(s, k): ts for s, k, ts in tracker.client.calls[1][0]}
    again = {(s, k): ts for s, k, ts in tracker.client.calls[2][0]}
    assert all(again[key] == ts for key, ts in first.items())
    tracker.client.answer(2)
    assert tracker.flush(timeout_s=1) and tracker.pending == [] and tracker.sent == {0, 1, 2, 3, 4}


def test_close_waits_at_most_one_call_then_keeps_the_metrics(tracker, tmp_path, caplog):
    for step in range(3):
        tracker.log_epoch({"val_loss": 1.0, "val_acc": 0.5}, step)
    caplog.set_level(logging.WARNING, logger="pipeline.tracking.rank_zero")
    t0 = time.monotonic()
    tracker.close()
    took = time.monotonic() - t0
    assert 1.9 < took < 3.9, took  # http_call_bound_s(FAST) = 2 s: one call's bound, not two (nor a hang)
    assert "6 metric value(s) of 3 epoch(s) of run r1 not sent" in caplog.text
    lines = [json.loads(x) for x in (tmp_path / "unsent_metrics_r1.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    assert [s for s, _ in tracker.pending] == [0, 1, 2]  # for finish(): the server waited for, else left offline


def test_close_sends_what_is_left_when_the_server_answers(tracker, tmp_path):
    tracker.log_epoch({"val_loss": 1.0}, 0)
    tracker.log_epoch({"val_loss": 0.9}, 1)
    tracker.client.answer(0)

    def answer_the_second_batch_soon():
        while len(tracker.client.calls) < 2:
            time.sleep(0.01)
        tracker.client.answer(1)

    import threading

    threading.Thread(target=answer_the_second_batch_soon, daemon=True).start()
    tracker.close()
    assert tracker.pending == [] and tracker.sent == {0, 1} and not list(tmp_path.iterdir())


def test_a_tag_that_never_arrived_is_sent_again_at_the_end(tracker, tmp_path, monkeypatch):
    from types import SimpleNamespace

    tracker.record_precision("32-true")
    assert tracker.tags == {"precision": "32-true"} and tracker.unsent_tags == {}
    sent = []
    tracker.client.set_tag = lambda run_id, key, value, synchronous=True: sent.append((key, value, synchronous))
    monkeypatch.setattr(tracker, "_finish_online", lambda *a: "models:/m-1")

    class _Job:
        cfg = SimpleNamespace(mlflow=SimpleNamespace(reconnect_wait_s=0.1, retry_wait_s=0.1))

    assert tracker.finish(None, _Job(), [], None) == "models:/m-1"
    assert sent == [("precision", "32-true", True)]


def test_sending_without_futures_waits_in_a_thread():
    class Opaque:  # an MLflow whose RunOperations hides its futures
        def wait(self):
            time.sleep(0.2)
            raise RuntimeError("refused")

    sending = Sending(Opaque())
    assert not sending.done() and sending.error() is None
    assert sending.wait(2.0) and isinstance(sending.error(), RuntimeError)
    assert Sending(None).done() and Sending(None).error() is None
