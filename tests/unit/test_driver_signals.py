"""The driver's signals around a launch: SIGTERM with ranks in Spark tasks cancels their jobs and ends the launch as
Terminated; the SIGTERM grace timer ends with the launch; a Horovod launch on the main thread leaves SIGINT and
SIGTERM's handlers as they were."""
import os
import signal
import threading

import pytest

from pipeline.config import load_config
from pipeline.distributed import launcher, rank_signals
from pipeline.distributed.loop import RankResult, TrainJob
from pipeline.errors import Terminated


def _job(tmp_path, *overrides) -> TrainJob:
    cfg = load_config("conf/local.yaml", list(overrides))
    return TrainJob(cfg=cfg, data=None, delta_table="t", delta_version=0, job_dir=str(tmp_path / "job"))


def test_a_sigterm_while_ranks_run_in_spark_tasks_cancels_their_jobs_and_ends_the_launch_terminated(tmp_path,
                                                                                                     monkeypatch):
    cancelled = threading.Event()
    monkeypatch.setattr(launcher, "cancel_spark_jobs", cancelled.set, raising=False)

    def cluster_launch(job):  # ranks on executors: no process of the driver's to pass the signal on to
        os.kill(os.getpid(), signal.SIGTERM)
        cancelled.wait(10)  # the tasks end once their jobs are cancelled; these returned anyway
        return [RankResult(rank=r, world_size=2, host=f"executor{r}", pid=r) for r in (0, 1)]

    monkeypatch.setattr(launcher, "_launch", cluster_launch)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated, match="Spark jobs were cancelled"):
        launcher.launch(_job(tmp_path, "train.np=2", "train.stall_timeout_s=4"))
    assert cancelled.is_set(), "the ranks' Spark jobs were not cancelled"
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_sigterm_to_local_ranks_is_passed_on_and_nothing_is_cancelled_on_spark(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "cancel_spark_jobs", lambda: pytest.fail("no Spark job to cancel"), raising=False)
    got = []

    class Rank:
        pid = 12345

        def send_signal(self, sig):
            got.append(sig)

    monkeypatch.setattr(rank_signals, "rank_processes", lambda: [Rank()])

    def local_launch(job):
        os.kill(os.getpid(), signal.SIGTERM)
        return [RankResult(rank=0, world_size=2, host="h", pid=1, stop_reason="SIGTERM at step 3")]

    monkeypatch.setattr(launcher, "_launch", local_launch)
    with pytest.raises(Terminated, match="SIGTERM at step 3"):
        launcher.launch(_job(tmp_path, "train.np=-2", "train.backend=ddp"))
    assert got == [signal.SIGTERM]


def test_the_sigterm_grace_timer_ends_with_the_launch(monkeypatch):
    """A later launch in the same process (a sweep, a notebook) must not have its ranks killed by an earlier
    launch's grace period."""
    killed = []

    class Rank:
        pid = 12345

        def send_signal(self, sig):
            pass

        def kill(self):
            killed.append(self.pid)

    monkeypatch.setattr(rank_signals, "rank_processes", lambda: [Rank()])
    before = set(threading.enumerate())
    with rank_signals.forward_sigterm(grace_s=0.3) as term:
        os.kill(os.getpid(), signal.SIGTERM)
        assert term.terminated
    timers = [t for t in threading.enumerate() if t not in before and isinstance(t, threading.Timer)]
    assert timers, "no grace timer was started"
    for timer in timers:
        timer.join(5)  # a cancelled timer ends at once; a live one would kill the ranks after 0.3 s
        assert not timer.is_alive()
    assert killed == []


def test_after_a_horovod_launch_on_the_main_thread_the_driver_s_handlers_are_as_before():
    pytest.importorskip("horovod.runner.gloo_run")
    import horovod.runner.gloo_run as gloo_run

    from pipeline.distributed.backends.horovod import _signals_left_to_the_driver

    def driver_term(signum, frame):  # forward_sigterm's, during a launch
        pass

    int_before = signal.getsignal(signal.SIGINT)
    term_before = signal.signal(signal.SIGTERM, driver_term)
    try:
        with _signals_left_to_the_driver():
            event = gloo_run.register_shutdown_event()  # what horovod.run's gloo launch does first
            assert signal.getsignal(signal.SIGTERM) is driver_term  # SIGTERM stays the driver's during the run
            assert not event.is_set()
        assert signal.getsignal(signal.SIGINT) is int_before
        assert signal.getsignal(signal.SIGTERM) is driver_term
    finally:
        signal.signal(signal.SIGTERM, term_before)


def test_ctrl_c_during_a_horovod_launch_stops_its_ranks_then_interrupts_the_driver():
    pytest.importorskip("horovod.runner.gloo_run")
    import horovod.runner.gloo_run as gloo_run

    from pipeline.distributed.backends.horovod import _signals_left_to_the_driver

    int_before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with _signals_left_to_the_driver():
            event = gloo_run.register_shutdown_event()
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
            assert event.wait(5)  # horovod's launcher ends the ranks on it; the launch then returns
    assert signal.getsignal(signal.SIGINT) is int_before


def test_ranks_in_a_local_masters_tasks_are_signalled_first_and_their_jobs_cancelled_only_after_the_grace(
        monkeypatch):
    """train.np=N on a local master: the Spark tasks' ranks are this host's processes; cancelling their jobs at once
    would kill them before their last checkpoint, so they get the SIGTERM and the cancel waits for the grace."""
    events = []

    class Rank:
        pid = 12345

        def send_signal(self, sig):
            events.append("signalled")

        def kill(self):
            events.append("killed")

    alive = [Rank()]
    monkeypatch.setattr(rank_signals, "rank_processes", lambda: list(alive))
    cancelled = threading.Event()

    def cancel():
        events.append("cancelled")
        cancelled.set()

    with rank_signals.forward_sigterm(grace_s=0.5, remote=cancel):
        os.kill(os.getpid(), signal.SIGTERM)
        assert events == ["signalled"]  # not cancelled with the signal
        alive.clear()  # the rank stopped within the grace
        assert cancelled.wait(10), events
    assert events == ["signalled", "cancelled"]  # nothing left to kill; the jobs cancelled at the grace's end
