"""Rank 0's epoch metrics while the tracking server is away: buffered in order, sent when it is back, kept in a local
file when it never comes back (pure logic: a fake client stands in for the server)."""
import json

import pytest

from pipeline.tracking import rank_zero


class FlakyClient:
    def __init__(self):
        self.up = True
        self.logged = []

    def log_batch(self, run_id, metrics, synchronous=True):
        if not self.up:
            raise ConnectionError("server down")
        self.logged.extend((m.step, m.key, m.value) for m in metrics)


def _tracker(tmp_path):
    tracker = rank_zero.RankZeroTracker(None, "r1", local_dir=str(tmp_path))
    tracker.client = FlakyClient()
    return tracker


def test_metrics_wait_for_the_server_and_go_in_order(tmp_path):
    t = _tracker(tmp_path)
    t.log_epoch({"val_loss": 1.0}, 0)
    t.client.up = False
    t.log_epoch({"val_loss": 0.9}, 1)
    t.log_epoch({"val_loss": 0.8}, 2)
    assert [s for s, _ in t.pending] == [1, 2]
    t.client.up = True
    t.log_epoch({"val_loss": 0.7}, 3)
    assert [s for s, _, _ in t.client.logged] == [0, 1, 2, 3] and t.pending == []
    t.close()
    assert not list(tmp_path.iterdir())


def test_metrics_of_a_server_that_never_returns_are_kept_locally(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_zero, "MAX_PENDING_EPOCHS", 2)
    t = _tracker(tmp_path)
    t.client.up = False
    for step in range(4):
        t.log_epoch({"val_acc": step / 10}, step)
    assert [s for s, _ in t.pending] == [2, 3]  # the bound: the oldest went to the file
    t.close()
    lines = [json.loads(x) for x in (tmp_path / "unsent_metrics_r1.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3] and lines[3]["metrics"] == {"val_acc": pytest.approx(0.3)}
    assert [s for s, _ in t.pending] == [2, 3]  # still pending: finish() waits for the server, else leaves them offline
    assert [s for s, _, _ in t.epochs] == [0, 1, 2, 3] and t.sent == set()  # what a run left offline keeps


class _Job:
    """What finish() reads of a TrainJob."""

    def __init__(self, tmp_path):
        from types import SimpleNamespace

        from pipeline.config import Config, apply_overrides

        self.cfg = apply_overrides(Config(), {"mlflow.reconnect_wait_s": 0.3, "mlflow.retry_wait_s": 0.1})
        self.job_dir, self.tracking_uri = str(tmp_path), "http://127.0.0.1:9"
        self.data = SimpleNamespace(channels=1, image_size=16, class_names=["a", "b"])


class _Model:
    def __init__(self):
        import torch

        self.network = torch.nn.Linear(2, 2)

    def eval(self):
        return self


def _finishing_tracker(tmp_path, monkeypatch, online):
    t = _tracker(tmp_path)
    t.client.get_run = lambda run_id: None if t.client.up else (_ for _ in ()).throw(ConnectionError("down"))
    monkeypatch.setattr(t, "_finish_online", online)
    return t


def test_finish_leaves_the_run_offline_when_the_server_stays_away(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from pipeline.tracking.offline import left_offline

    t = _finishing_tracker(tmp_path, monkeypatch, lambda *a: pytest.fail("no server: nothing is logged online"))
    t.log_epoch({"val_loss": 1.0}, 0)
    t.client.up = False
    t.log_epoch({"val_loss": 0.5}, 1)
    t.close()
    assert t.finish(_Model(), _Job(tmp_path), [], SimpleNamespace(epochs=2)) is None
    off = left_offline(str(tmp_path))
    assert off is not None and [(m["step"], m["sent"]) for m in off.metrics()] == [(0, True), (1, False)]


def test_finish_sends_what_waited_when_the_server_is_back(tmp_path, monkeypatch):
    from types import SimpleNamespace

    t = _finishing_tracker(tmp_path, monkeypatch, lambda *a: "models:/m-1")
    t.client.up = False
    t.log_epoch({"val_loss": 1.0}, 0)
    t.close()
    assert (tmp_path / "unsent_metrics_r1.jsonl").exists()
    t.client.up = True
    assert t.finish(_Model(), _Job(tmp_path), [], SimpleNamespace(epochs=1)) == "models:/m-1"
    assert [s for s, _, _ in t.client.logged] == [0] and not list(tmp_path.iterdir())  # the file went with them


def test_finish_raises_a_failure_that_is_not_the_server_being_away(tmp_path, monkeypatch):
    from types import SimpleNamespace

    def broken(*args):
        raise ValueError("a real error")

    t = _finishing_tracker(tmp_path, monkeypatch, broken)
    with pytest.raises(ValueError, match="a real error"):
        t.finish(_Model(), _Job(tmp_path), [], SimpleNamespace(epochs=1))
    assert not list(tmp_path.iterdir())
