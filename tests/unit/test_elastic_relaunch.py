"""Elastic relaunch rules (train.min_np): a restart with fewer task slots left goes on with them, the plan re-made
for the new world size and the checkpoint restated for the smaller global batch; below train.min_np it fails."""
import os
import time
from types import SimpleNamespace

import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.data.convert import plan_data
from pipeline.data.shards import ConvertedData
from pipeline.distributed import launcher, rank_failures, restart
from pipeline.distributed.checkpoints.record import TRAINED_WITH
from pipeline.distributed.checkpoints.restate import converted_position, restated

WORLD, ROWS_PER_RANK = 2, 320  # 10 steps per epoch at 32 per rank on 2 ranks, 20 on 1


def _checkpoint(path, batch, world, steps, total, current, lr):
    progress = {"total": {"ready": total, "completed": total}, "current": {"ready": current, "completed": current}}
    torch.save({"global_step": total, "state_dict": {"w": torch.ones(2)},
                "lakehouse": {"delta_table": "t", "delta_version": 0},
                TRAINED_WITH: {"batch_size": batch, "world_size": world, "steps_per_epoch": steps,
                               "global_step": total, "lr": lr},
                "loops": {"fit_loop": {"state_dict": {"combined_loader": [{"steps_per_epoch": steps,
                                                                           "world_size": world}]},
                                       "epoch_loop.state_dict": {"_batches_that_stepped": total},
                                       "epoch_loop.batch_progress": progress}},
                "optimizer_states": [{"param_groups": [{"lr": lr, "initial_lr": lr, "momentum": 0.9}]}],
                "lr_schedulers": [{"base_lrs": [lr], "_last_lr": [lr], "last_epoch": total,
                                   "_step_count": total + 1}]}, path)


def _job(tmp_path, *overrides):
    cfg = load_config(None, [f"train.checkpoint_dir={tmp_path}/ckpt", "data.batch_size=32", "train.np=2",
                             "train.lr_scaling=linear", "train.max_restarts=2", *overrides])
    split = SimpleNamespace(row_group_rows=[ROWS_PER_RANK] * WORLD)
    data = ConvertedData(train=split, val=split, plan=plan_data(split, split, WORLD, 32), class_names=["a", "b"],
                         image_size=8, channels=1)
    return launcher.TrainJob(cfg=cfg, data=data, delta_table="t", delta_version=0, job_dir=str(tmp_path / "job"))


def _lost():
    return launcher.DistributedTrainingError("training failed on rank 1: " + rank_failures.SILENT_RANK)


def test_fewer_slots_go_on_with_the_ranks_left_from_the_restated_checkpoint(tmp_path, monkeypatch):
    job = _job(tmp_path, "train.min_np=1")
    os.makedirs(job.cfg.train.checkpoint_dir)
    last = os.path.join(job.cfg.train.checkpoint_dir, "last.ckpt")
    seen, worlds = [], []

    def fake_launch(job, early=None):
        plan = job.data.plan.train
        restore = job.plan.restore_from
        seen.append((job.plan.attempt, job.plan.world_size, plan.world_size, plan.steps_per_epoch,
                     restore and os.path.basename(restore), restore and torch.load(restore, weights_only=True)))
        time.sleep(0.05)
        if job.plan.attempt == 0:  # 13 steps on 2 ranks (epoch 1, step 3 of 10), then a host lost
            _checkpoint(last, 32, 2, 10, 13, 3, lr=0.2)
            raise _lost()
        return ["done"]

    monkeypatch.setattr(restart, "launch", fake_launch)
    monkeypatch.setattr(restart, "cluster_slots", lambda: 1)
    assert restart.launch_with_restarts(job, on_world=lambda n, cause: worlds.append((n, cause))) == ["done"]
    assert [s[:4] for s in seen] == [(0, 2, 2, 10), (1, 1, 1, 20)]  # the plan says its ranks on every launch
    assert worlds == [(1, f"DistributedTrainingError: {_lost()}")]
    name, ckpt = seen[1][4], seen[1][5]
    assert name == "last-batch32-np1.ckpt"
    # the global batch halves (64 -> 32): the same epoch, the batch covering the same samples, half the rate
    assert ckpt["global_step"] == converted_position(13, 3, 10, 64, 20, 32)[0] == 26
    assert ckpt["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.1)
    assert ckpt[TRAINED_WITH]["world_size"] == 1 and ckpt[TRAINED_WITH]["steps_per_epoch"] == 20
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0] == {"steps_per_epoch": 20, "world_size": 1}
    assert job.cfg.train.np == 2  # the user's config is as it was


def test_a_given_restore_point_is_restated_on_every_relaunch_by_the_world_size_it_records(tmp_path, monkeypatch):
    """train.ckpt_restore names another run's checkpoint (trained on 2 ranks); the job fails twice before writing one
    of its own, and both relaunches go on with 1 rank: each resumes the given checkpoint restated for 1 rank, the
    second as well as the first (it still records 2 ranks, whatever the world size of the launch before)."""
    given = tmp_path / "other-run" / "last.ckpt"
    given.parent.mkdir()
    _checkpoint(str(given), 32, 2, 10, 13, 3, lr=0.2)
    job = _job(tmp_path, "train.min_np=1", f"train.ckpt_restore={given}")
    seen = []

    def fake_launch(job, early=None):
        restore = job.plan.restore_from
        ckpt = torch.load(restore, weights_only=True)
        seen.append((job.plan.attempt, job.data.plan.train.world_size, os.path.basename(restore), ckpt["global_step"],
                     ckpt["optimizer_states"][0]["param_groups"][0]["lr"]))
        if job.plan.attempt < 2:
            raise _lost()  # before this job wrote a checkpoint of its own
        return ["done"]

    monkeypatch.setattr(restart, "launch", fake_launch)
    monkeypatch.setattr(restart, "cluster_slots", lambda: 1)
    assert restart.launch_with_restarts(job) == ["done"]
    assert seen == [(0, 2, "last.ckpt", 13, pytest.approx(0.2)),
                    (1, 1, "last-batch32-np1.ckpt", 26, pytest.approx(0.1)),
                    (2, 1, "last-batch32-np1.ckpt", 26, pytest.approx(0.1))]
    assert torch.load(given, weights_only=True)["global_step"] == 13  # the given checkpoint itself is as it was


def test_the_first_launch_restates_a_given_checkpoint_recorded_at_another_world_size(tmp_path, monkeypatch):
    """A checkpoint trained on 4 ranks of 32 (global 128, 5 steps per epoch) resumed by a job of 2 ranks of 32: the
    first launch already resumes it restated for the global batch of 64 (10 steps per epoch, half the rate)."""
    given = tmp_path / "other-run" / "last.ckpt"
    given.parent.mkdir()
    _checkpoint(str(given), 32, 4, 5, 13, 3, lr=0.2)
    job = _job(tmp_path, f"train.ckpt_restore={given}")
    seen = []

    def fake_launch(job, early=None):
        restore = job.plan.restore_from
        seen.append((os.path.basename(restore), torch.load(restore, weights_only=True)))
        return ["done"]

    monkeypatch.setattr(restart, "launch", fake_launch)
    assert restart.launch_with_restarts(job) == ["done"]
    [(name, ckpt)] = seen
    assert name == "last-batch32-np2.ckpt"
    assert ckpt["global_step"] == converted_position(13, 3, 5, 128, 10, 64)[0] == 26
    assert ckpt["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.1)
    assert ckpt[TRAINED_WITH]["world_size"] == 2 and ckpt[TRAINED_WITH]["steps_per_epoch"] == 10

    # recorded at this launch's batch and world size: the checkpoint itself
    _checkpoint(str(given), 32, 2, 10, 13, 3, lr=0.2)
    seen.clear()
    assert restart.launch_with_restarts(job) == ["done"] and seen[0][0] == "last.ckpt"
    # one that records nothing (written before checkpoints recorded their batch) is resumed as it is
    torch.save({"global_step": 3, "state_dict": {"w": torch.ones(2)}}, given)
    seen.clear()
    assert restart.launch_with_restarts(job) == ["done"] and seen[0][0] == "last.ckpt"


def test_fewer_slots_than_min_np_fail_saying_so(tmp_path, monkeypatch):
    job = _job(tmp_path, "train.np=3", "train.min_np=2")
    monkeypatch.setattr(restart, "launch", lambda job: (_ for _ in ()).throw(_lost()))
    monkeypatch.setattr(restart, "cluster_slots", lambda: 1)
    with pytest.raises(launcher.DistributedTrainingError, match=r"1 task slot\(s\) left .* train.min_np=2"):
        restart.launch_with_restarts(job)


def test_without_min_np_the_same_world_is_relaunched(tmp_path, monkeypatch):
    job = _job(tmp_path)
    worlds = []

    def fake_launch(job, early=None):
        worlds.append(job.data.plan.train.world_size)
        if len(worlds) == 1:
            raise _lost()
        return ["done"]

    monkeypatch.setattr(restart, "launch", fake_launch)
    monkeypatch.setattr(restart, "cluster_slots", lambda: pytest.fail("slots counted without train.min_np"))
    assert restart.launch_with_restarts(job) == ["done"] and worlds == [2, 2]


def test_restated_for_the_same_batch_and_world_is_the_checkpoint_itself(tmp_path):
    path = str(tmp_path / "last.ckpt")
    _checkpoint(path, 32, 2, 10, 13, 3, lr=0.2)
    assert restated(path, 10, 32, 2, "linear") == path


@pytest.mark.parametrize("np_,min_np", [(2, 3), (2, 0), (-2, 1), (1, 1)])
def test_min_np_must_fit_a_cluster_job(np_, min_np):
    with pytest.raises(ConfigError, match="train.min_np"):
        load_config(None, [f"train.np={np_}", f"train.min_np={min_np}"])


def test_two_jobs_resuming_one_given_checkpoint_at_once_each_resume_their_own_restated_copy(tmp_path, monkeypatch):
    """Two jobs (train.lr_scaling linear and none) resume the same checkpoint of another run, trained on 4 ranks, on 2
    ranks each, at the same time: each resumes a copy restated by its own rule, in its own checkpoint folder (the
    other run's folder is left as it was), never the copy the other job restated meanwhile."""
    given = tmp_path / "other-run" / "last.ckpt"
    given.parent.mkdir()
    _checkpoint(str(given), 32, 4, 5, 13, 3, lr=0.2)
    first = _job(tmp_path / "a", f"train.ckpt_restore={given}", "train.lr_scaling=linear")
    second = _job(tmp_path / "b", f"train.ckpt_restore={given}", "train.lr_scaling=none")
    seen = {}

    def fake_launch(job, early=None):
        which = "a" if job.cfg.train.lr_scaling == "linear" else "b"
        if which == "a":  # the second job restates and starts while the first one's ranks are starting
            restart.launch_with_restarts(second)
        restore = job.plan.restore_from
        seen[which] = (restore, torch.load(restore, weights_only=True))
        return ["done"]

    monkeypatch.setattr(restart, "launch", fake_launch)
    assert restart.launch_with_restarts(first) == ["done"]
    assert seen["a"][1]["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.1)  # linear: 0.2 x 64/128
    assert seen["b"][1]["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.2)  # none: as it was
    assert os.path.dirname(seen["a"][0]) == first.ckpt_dir and os.path.dirname(seen["b"][0]) == second.ckpt_dir
    assert os.listdir(given.parent) == ["last.ckpt"]  # nothing written into the other run's folder
