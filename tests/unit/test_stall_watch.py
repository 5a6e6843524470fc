"""A stuck rank is bounded by train.stall_timeout_s: Horovod's stall inspector is set so that it may shut down
(its check never after its shutdown time), and, since it does not fire on a gloo CPU build, the driver kills ranks
on this machine that stopped marking progress, failing the launch with the bound and each rank named."""
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from pipeline.config import load_config
from pipeline.distributed import launcher, progress
from pipeline.distributed.job_folder import JobFolder
from pipeline.distributed.loop import TrainJob
from pipeline.distributed.rank_env import rank_env
from pipeline.distributed.rank_failures import DistributedTrainingError


@pytest.mark.parametrize("stall", [1, 2, 3, 8, 20, 120, 121, 600])
def test_horovod_may_shut_a_stall_down_at_the_bound(stall):
    env = rank_env(load_config("conf/local.yaml", [f"train.stall_timeout_s={stall}"]))
    check, shutdown = int(env["HOROVOD_STALL_CHECK_TIME_SECONDS"]), int(env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"])
    assert shutdown == stall
    assert 1 <= check <= shutdown and check <= 60  # Horovod disables the shutdown when it is below the check time


def _mark(folder: JobFolder, rank: int, text: str, age_s: float) -> None:
    folder.write(rank, "progress", text)
    then = time.time() - age_s
    os.utime(folder.marker(rank, "progress"), (then, then))


def test_the_ranks_count_as_stalled_only_when_every_rank_still_training_is_silent_past_the_bound(tmp_path):
    folder = JobFolder(str(tmp_path))
    now = time.time()
    assert progress.stalled(folder, 10, now) is None  # no rank began training: the start is not this bound's
    _mark(folder, 0, "7", 30)
    _mark(folder, 1, "7", 2)
    assert progress.stalled(folder, 10, time.time()) is None  # rank 1 moves
    _mark(folder, 1, "6", 25)
    reason = progress.stalled(folder, 10, time.time())
    assert reason.startswith("no rank made progress for train.stall_timeout_s=10 s: ")
    assert "rank 0 (last at step 7, 30 s ago)" in reason and "rank 1 (last at step 6, 25 s ago)" in reason
    _mark(folder, 1, progress.END, 25)  # rank 1 left training (rank 0 logging the model is not a stall either)
    assert progress.stalled(folder, 10, time.time()).endswith("rank 0 (last at step 7, 30 s ago)")
    folder.write(0, "done")
    assert progress.stalled(folder, 10, time.time()) is None


def test_a_rank_before_its_first_batch_keeps_the_launch_unwatched(tmp_path):
    """A resumed rank skips the epochs already trained before its first batch (minutes on a large shard): that is
    not a stall, and the others wait for it in their first collective."""
    folder = JobFolder(str(tmp_path))
    _mark(folder, 0, "0", 300)
    _mark(folder, 1, progress.STARTING, 300)
    assert progress.stalled(folder, 10, time.time()) is None
    _mark(folder, 1, "0", 30)  # its first batch ended, long ago: both silent past the bound
    assert "rank 1 (last at step 0, 30 s ago)" in progress.stalled(folder, 10, time.time())


def test_a_rank_marks_its_progress_throttled_and_its_end(tmp_path):
    pytest.importorskip("pytorch_lightning")
    folder = JobFolder(str(tmp_path))
    beat = progress.heartbeat(folder, 1, interval_s=3600)
    trainer = SimpleNamespace(global_step=0)
    beat.on_train_start(trainer, None)
    assert folder.read(1, "progress") == progress.STARTING  # not watched before its first batch ended
    trainer.global_step = 1
    beat.on_train_batch_end(trainer, None, None, None, 0)  # the first batch's end: marked at once
    assert folder.read(1, "progress") == "1"
    trainer.global_step = 5
    beat.on_train_batch_end(trainer, None, None, None, 4)  # within the interval: not rewritten
    assert folder.read(1, "progress") == "1"
    beat.teardown(trainer, None, "fit")
    assert folder.read(1, "progress") == progress.END


def test_the_watchdog_kills_the_rank_processes_of_a_stalled_launch(tmp_path):
    """The real kill: a process of this driver whose command line is a rank's (horovod.run's run_task)."""
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "horovod.runner.run_task"])
    try:
        folder = JobFolder(str(tmp_path))
        _mark(folder, 0, "3", 60)
        watch = progress.StallWatch(folder, bound_s=5, poll_s=0.05).start()
        try:
            assert rank.wait(timeout=20) == -signal.SIGKILL
        finally:
            watch.close()
        assert watch.reason and "train.stall_timeout_s=5 s" in watch.reason and "rank 0" in watch.reason
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()


def test_a_local_horovod_launch_whose_ranks_stall_fails_naming_the_bound_and_the_ranks(tmp_path, monkeypatch):
    killed = threading.Event()
    monkeypatch.setattr(progress, "kill_rank_processes", killed.set)
    seen = {}

    def stuck_launch(job):  # both ranks began training, then neither moved: horovod.run waits on them
        seen["heartbeat_s"] = job.heartbeat_s
        for rank, step in ((0, "4"), (1, "3")):
            job.folder.write(rank, "started", f"localhost {1000 + rank}")
            _mark(job.folder, rank, step, 100)
        killed.wait(30)
        raise RuntimeError("Horovod detected that one or more processes exited with non-zero status")

    monkeypatch.setattr(launcher, "_launch", stuck_launch)
    cfg = load_config("conf/local.yaml", ["train.np=-2", "train.backend=horovod", "train.stall_timeout_s=2"])
    job = TrainJob(cfg=cfg, data=None, delta_table="t", delta_version=0, job_dir=str(tmp_path / "job"))
    with pytest.raises(DistributedTrainingError) as info:
        launcher.launch(job)
    assert killed.is_set()
    text = str(info.value)
    assert "train.stall_timeout_s=2 s" in text and "rank 0 (last at step 4" in text and "rank 1 (last at step 3" in text
    assert seen["heartbeat_s"] == progress.heartbeat_interval(2)  # the ranks were told to mark their progress
    assert not [t for t in threading.enumerate() if t.name == "lakehouse-stall-watch"]  # the watch ended with it


def test_ranks_that_the_driver_does_not_watch_mark_nothing(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(launcher, "_launch", lambda job: seen.append(job.heartbeat_s) or [])
    for overrides in (["train.np=-2", "train.backend=ddp"], ["train.np=2", "train.backend=horovod"]):
        cfg = load_config("conf/local.yaml", overrides)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(launcher, "cancel_spark_jobs", lambda: None)
            launcher.launch(TrainJob(cfg=cfg, data=None, delta_table="t", delta_version=0, job_dir=str(tmp_path)))
    assert seen == [None, None]
