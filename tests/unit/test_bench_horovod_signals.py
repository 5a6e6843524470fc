"""The bench's Horovod launches leave the process's SIGINT/SIGTERM handlers as they were: horovod.run's
register_shutdown_event replaces them for good, and a bound's SIGTERM (`timeout` in scripts/device_gpu_run.sh) then
no longer ended a bench part that had launched ranks."""
from __future__ import annotations

import signal

import pytest

from pipeline.config import Config

gloo_run = pytest.importorskip("horovod.runner.gloo_run")


def _installs_like_horovod(fn, args=(), **kwargs):
    """horovod.run over gloo: its launch first calls register_shutdown_event (SIGINT/SIGTERM handlers that set an
    event), then returns the ranks' results."""
    gloo_run.register_shutdown_event()
    return [{"rank": 1}, {"rank": 0}]


def _installs_handlers_itself(fn, args=(), **kwargs):
    """A launch that installs its handlers without register_shutdown_event (what that function does inside)."""
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    return [{"rank": 1}, {"rank": 0}]


def _fails_after_installing(fn, args=(), **kwargs):
    gloo_run.register_shutdown_event()
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    raise RuntimeError("a rank failed")


@pytest.fixture
def driver_handlers():
    """SIGTERM set to a handler of the test's own (as a driver's), SIGINT as it is; both put back afterwards."""
    def driver_term(signum, frame):
        pass

    int_before = signal.getsignal(signal.SIGINT)
    term_before = signal.signal(signal.SIGTERM, driver_term)
    try:
        yield int_before, driver_term
    finally:
        signal.signal(signal.SIGTERM, term_before)
        signal.signal(signal.SIGINT, int_before)


@pytest.mark.parametrize("fake", [_installs_like_horovod, _installs_handlers_itself])
def test_after_the_bench_s_horovod_launch_the_handlers_are_as_before(monkeypatch, driver_handlers, fake):
    import horovod

    from bench.jobs import horovod_run

    seen = {}

    def run(fn, args=(), **kwargs):
        seen.update(kwargs)
        return fake(fn, args, **kwargs)

    monkeypatch.setattr(horovod, "run", run)
    assert horovod_run(lambda: None, (), 2, 30) == [{"rank": 1}, {"rank": 0}]
    assert seen["num_proc"] == 2 and seen["use_gloo"] and seen["hosts"] == "localhost:2"
    assert seen["start_timeout"] == 30
    int_before, driver_term = driver_handlers
    assert signal.getsignal(signal.SIGINT) is int_before
    assert signal.getsignal(signal.SIGTERM) is driver_term
    assert gloo_run.register_shutdown_event.__name__ == "register_shutdown_event"  # Horovod's own again


def test_a_failed_launch_also_leaves_the_handlers_as_before(monkeypatch, driver_handlers):
    import horovod

    from bench.jobs import horovod_run

    monkeypatch.setattr(horovod, "run", _fails_after_installing)
    with pytest.raises(RuntimeError, match="a rank failed"):
        horovod_run(lambda: None, (), 1, 30)
    int_before, driver_term = driver_handlers
    assert signal.getsignal(signal.SIGINT) is int_before
    assert signal.getsignal(signal.SIGTERM) is driver_term


def test_the_bench_jobs_and_the_step_overhead_launch_through_it(monkeypatch, driver_handlers):
    """bench.jobs.launch (the GPU photos, scaling, input-bound jobs) and bench.step_overhead.launch (its Horovod
    jobs): the results sorted by rank, the handlers as before."""
    import horovod

    from bench import jobs, step_overhead

    monkeypatch.setattr(horovod, "run", _installs_like_horovod)
    cfg = Config()
    assert [r["rank"] for r in jobs.launch(cfg, None, 2, [], steps=1, windows=1)] == [0, 1]
    int_before, driver_term = driver_handlers
    assert signal.getsignal(signal.SIGTERM) is driver_term and signal.getsignal(signal.SIGINT) is int_before
    results = step_overhead.launch(cfg, None, "horovod", 2, (1, 1), steps=1, windows=1)
    assert [r["rank"] for r in results] == [0, 1]
    assert signal.getsignal(signal.SIGTERM) is driver_term and signal.getsignal(signal.SIGINT) is int_before
