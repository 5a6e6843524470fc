"""Ranks started early take their job through a hand-off folder: only a job signed with the launch's key is loaded,
a start called off (or a folder removed) ends the wait with None, a driver that is gone ends it with an error, and the
import ahead never decides the outcome."""
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest

from pipeline.config import load_config
from pipeline.distributed.early_start import (CANCELLED, JOB_FILE, EarlyRanks, Handoff, HandoffError, job_of,
                                              ranks_started_early)
from pipeline.distributed.loop import TrainJob


def _handoff(tmp_path, pid=None):
    path = tmp_path / "start"
    path.mkdir()
    return Handoff(str(path), os.urandom(32), pid or os.getpid())


def _job():
    cfg = load_config("conf/local.yaml", ["train.np=-2"])
    return TrainJob(cfg=cfg, data=None, delta_table="t", delta_version=3, run_id="r1")


def test_a_rank_takes_the_job_the_driver_delivers_after_it_started_waiting(tmp_path):
    handoff = _handoff(tmp_path)
    warmed = []
    got = {}
    rank = threading.Thread(target=lambda: got.update(job=handoff.take(1, lambda: warmed.append(True))))
    rank.start()
    time.sleep(0.2)
    assert rank.is_alive(), "the rank must wait until a job is there"
    handoff.deliver(_job())
    rank.join(5)
    assert not rank.is_alive()
    assert warmed == [True]
    assert got["job"].run_id == "r1" and got["job"].delta_version == 3
    assert handoff.ranks_with("waiting") == 1 and handoff.ranks_with("taken") == 1


def test_a_job_not_signed_with_the_launchs_key_is_never_unpickled(tmp_path):
    handoff = _handoff(tmp_path)
    other = Handoff(handoff.path, os.urandom(32), os.getpid())
    other.deliver(_job())  # same folder, another key: what a stranger could write there
    with pytest.raises(HandoffError, match="not signed with this launch's key"):
        handoff.take(0, lambda: None)


def test_a_tampered_job_is_refused(tmp_path):
    handoff = _handoff(tmp_path)
    handoff.deliver(_job())
    path = os.path.join(handoff.path, JOB_FILE)
    blob = open(path, "rb").read()
    open(path, "wb").write(blob[:32] + pickle.dumps({"not": "the job"}))
    with pytest.raises(HandoffError, match=JOB_FILE):
        handoff.take(0, lambda: None)


def test_a_start_called_off_or_cleaned_up_ends_the_wait_with_none(tmp_path):
    handoff = _handoff(tmp_path)
    handoff.cancel()
    assert os.path.exists(os.path.join(handoff.path, CANCELLED))
    assert handoff.take(0, lambda: None) is None
    gone = Handoff(str(tmp_path / "removed"), os.urandom(32), os.getpid())
    assert gone.take(0, lambda: None) is None


def test_a_rank_whose_driver_is_gone_fails_naming_it(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    handoff = _handoff(tmp_path, pid=dead.pid)
    t0 = time.monotonic()
    with pytest.raises(HandoffError, match=f"driver \\(pid {dead.pid}\\) ended"):
        handoff.take(0, lambda: None)
    assert time.monotonic() - t0 < 10  # at once, not after the take's own timeout


def test_a_failing_import_ahead_is_left_to_the_rank_and_the_key_stays_out_of_repr(tmp_path):
    handoff = _handoff(tmp_path)
    handoff.deliver(_job())

    def broken():
        raise ImportError("no module named horovod.torch")

    assert handoff.take(0, broken).run_id == "r1"
    assert handoff.key.hex() not in repr(handoff) and str(handoff.key) not in repr(handoff)


def test_job_of_passes_a_job_through():
    job = _job()
    assert job_of(job, 0, lambda: None) is job


def test_the_early_start_hands_the_job_to_the_launch_and_removes_its_folder():
    cfg = load_config("conf/local.yaml", ["train.np=-2"])
    seen = {}

    def start_local(c, handoff):  # the launcher's part: each "rank" waits on the hand-off as a real one does
        seen["env"] = os.environ.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
        return [handoff.take(r, lambda: None) for r in range(1)]

    with ranks_started_early(cfg, start_local) as early:
        assert isinstance(early, EarlyRanks)
        folder = early.handoff.path
        assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
        results = early.run(_job())
    assert [r.run_id for r in results] == ["r1"]
    assert seen["env"] == str(cfg.train.stall_timeout_s)  # the ranks' environment while they started
    assert not os.path.exists(folder)


def test_an_early_start_never_handed_a_job_is_called_off():
    cfg = load_config("conf/local.yaml", ["train.np=-2"])
    ended, waiting = {}, threading.Event()

    def start_local(c, handoff):
        waiting.set()
        ended["result"] = handoff.take(0, lambda: None)
        return []

    with pytest.raises(RuntimeError, match="preparing failed"):
        with ranks_started_early(cfg, start_local) as early:
            thread = early._thread
            assert waiting.wait(5)
            raise RuntimeError("preparing failed")
    thread.join(5)
    assert ended == {"result": None}


def test_a_start_called_off_while_its_prerequisite_starts_starts_no_rank():
    cfg = load_config("conf/local.yaml", ["train.np=-2"])
    called, box = [], []

    def before_launch():  # the SparkSession TorchDistributor needs, still starting until the job called it off
        deadline = time.monotonic() + 30
        while not (box and box[0].handoff.cancelled) and time.monotonic() < deadline:
            time.sleep(0.01)

    with pytest.raises(RuntimeError, match="preparing failed"):
        with ranks_started_early(cfg, lambda c, h: called.append(h), before_launch=before_launch) as early:
            box.append(early)
            thread = early._thread
            raise RuntimeError("preparing failed")
    thread.join(30)
    assert not thread.is_alive() and called == []


@pytest.mark.parametrize("overrides", [["train.early_start=false"], ["train.np=1"], ["train.np=2"]])
def test_no_early_start_where_it_is_off_or_the_ranks_are_not_local(overrides):
    cfg = load_config("conf/local.yaml", overrides)
    with ranks_started_early(cfg, lambda c, h: []) as early:
        assert early is None


def test_a_torchrun_rank_takes_the_key_from_its_environment_and_rank_0_hands_its_result_back(tmp_path, monkeypatch):
    from pipeline.distributed.backends.torchrun import KEY_VAR, RESULT_FILE, rank_main

    handoff = _handoff(tmp_path)
    seen.clear()
    for rank in ("1", "0"):
        monkeypatch.setenv(KEY_VAR, handoff.key.hex())
        monkeypatch.setenv("RANK", rank)
        assert rank_main([f"{__name__}:_entry", handoff.path, str(os.getpid())]) == 0
        assert KEY_VAR not in os.environ  # dropped before the rank runs anything
        assert os.path.exists(os.path.join(handoff.path, RESULT_FILE)) is (rank == "0")  # rank 0's alone
    assert seen == [(handoff.path, handoff.key, None)] * 2
    assert handoff.get(RESULT_FILE) == {"took": handoff.path}


seen = []


def _entry(h):  # a rank entry, named to the rank by module and name as run_local names it
    from pipeline.distributed.backends.torchrun import KEY_VAR

    seen.append((h.path, h.key, os.environ.get(KEY_VAR)))
    return {"took": h.path}


class _Proc:
    def __init__(self):
        self.killed = False

    def kill(self):
        self.killed = True


@pytest.mark.parametrize("imported", [True, False])
def test_ranks_past_their_imports_leave_by_themselves_and_ranks_still_importing_are_killed_saying_so(
        monkeypatch, caplog, imported):
    """A job that fails before its ranks took it: ranks already done importing see the call-off within POLL_S and
    leave as ranks that ended (their launcher prints nothing); a rank still importing is killed, and a warning first
    says that the launcher's 'Killed' / 'exit status 137' lines that follow are that stop (they read like an OOM
    kill, before the job's own error). The rank processes stand in for the real ones (rank_signals.rank_processes)."""
    import logging

    from pipeline.distributed import early_start

    cfg = load_config("conf/local.yaml", ["train.np=-2"])
    procs, threads = [_Proc(), _Proc()], []
    # a rank's process is there while its thread runs (a rank that left is gone from the machine's processes)
    monkeypatch.setattr(early_start, "rank_processes", lambda: [p for p, t in zip(procs, threads) if t.is_alive()])
    release = threading.Event()  # a rank's imports, done or not
    if imported:
        release.set()
    results = {}

    def start_local(c, handoff):
        ranks = [threading.Thread(target=lambda r=r: results.update({r: handoff.take(r, release.wait)}))
                 for r in range(2)]
        threads.extend(ranks)
        for rank in ranks:
            rank.start()
        for rank in ranks:
            while rank.is_alive() and not any(p.killed for p in procs):
                rank.join(0.01)
        release.set()  # killed: its imports are cut short
        return []

    caplog.set_level(logging.WARNING, logger="pipeline.distributed.early_start")
    with pytest.raises(RuntimeError, match="preparing failed"):
        with ranks_started_early(cfg, start_local) as early:
            deadline, mark = time.monotonic() + 5, "ready" if imported else "waiting"
            while early.handoff.ranks_with(mark) < 2 and time.monotonic() < deadline:  # the ranks are there
                time.sleep(0.01)
            raise RuntimeError("preparing failed")
    said = [r.getMessage() for r in caplog.records if "started early took it" in r.getMessage()]
    if imported:
        assert results == {0: None, 1: None} and not any(p.killed for p in procs) and said == []
    else:
        assert all(p.killed for p in procs) and len(said) == 1 and "'Killed' / 'exit status 137'" in said[0]
