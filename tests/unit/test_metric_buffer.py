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
