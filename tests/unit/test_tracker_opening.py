"""Rank 0's tracker opens on a thread (pipeline.distributed.loop): the rank goes on while MLflow loads, the first use
waits for it, and an opening that failed never hides training's own error."""
import threading
import time
from types import SimpleNamespace

import pytest

from pipeline.distributed import loop


class SlowTracker:
    """Stands in for RankZeroTracker: its constructor takes `delay_s` (MLflow's import and store)."""

    made = []

    def __init__(self, tracking_uri, run_id, local_dir=None, delay_s=0.3, fail=False):
        time.sleep(delay_s)
        if fail:
            raise RuntimeError("store unreachable: sqlite:///x.db")
        self.thread = threading.current_thread().name
        self.calls = [("init", tracking_uri, run_id, local_dir)]
        SlowTracker.made.append(self)

    def record_precision(self, precision):
        self.calls.append(("precision", precision))

    def start_telemetry(self, interval_s, resume=False):
        self.calls.append(("telemetry", interval_s, resume))


def _job(tracker, attempt=0):
    cfg = SimpleNamespace(mlflow=SimpleNamespace(system_metrics_interval_s=10.0))
    return SimpleNamespace(tracker=tracker, tracking_uri="sqlite:///x.db", run_id="r1", job_dir="/tmp/job", cfg=cfg,
                           attempt=attempt)


def test_the_rank_goes_on_while_the_tracker_opens_and_the_first_use_waits_for_it():
    t0 = time.monotonic()
    opening = loop._open_tracker(_job(SlowTracker, attempt=2), "bf16-mixed")
    returned_after = time.monotonic() - t0
    assert returned_after < 0.2, "the rank waited for MLflow before its own set-up"
    tracker = opening.result(timeout=10)
    assert time.monotonic() - t0 >= 0.3
    assert tracker.thread.startswith("lakehouse-tracker"), "opened on the caller's thread"
    # the same calls, in the same order, as when the rank opened it itself; a relaunch continues the run's series
    assert tracker.calls == [("init", "sqlite:///x.db", "r1", "/tmp/job"), ("precision", "bf16-mixed"),
                             ("telemetry", 10.0, True)]
    assert loop._opened(opening) is tracker


def test_an_opening_that_failed_is_none_for_the_cleanup_and_raises_at_its_first_use():
    def failing(*args, **kwargs):
        return SlowTracker(*args, delay_s=0.05, fail=True, **kwargs)

    opening = loop._open_tracker(_job(failing), "32-true")
    assert loop._opened(opening) is None  # training's own error (if any) is the one that propagates
    with pytest.raises(RuntimeError, match="store unreachable"):
        opening.result()
    assert loop._opened(None) is None
