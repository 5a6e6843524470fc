"""What the driver does with a restore point before any rank starts, and what a checkpoint must hold to be read: the
split and the optimizer a checkpoint records are checked against the job's config; another run's checkpoint is taken
once, whole, into the job's own folder; another number of steps per epoch is restated; the job's own last checkpoint
is told by what the file system says of it, not by comparing clocks; a checkpoint missing what a reader needs is a
CheckpointError naming the file and the key. One process, small real checkpoint files."""
import dataclasses
import logging
import os
import pickle
import shutil
import time
from types import SimpleNamespace

import pytest
import torch

from pipeline.config import load_config
from pipeline.data.convert import plan_data
from pipeline.data.shards import ConvertedData
from pipeline.distributed import launcher, rank_failures, restart
from pipeline.distributed.checkpoints import (CheckpointError, check_checkpoint_lineage, check_sharded,
                                              classifier_from_checkpoint, consolidated_state, read_index,
                                              write_atomically, write_sharded)
from pipeline.distributed.checkpoints.record import (LINEAGE, TRAINED_WITH, CheckpointLineageError, CheckpointRecord)
from pipeline.distributed.checkpoints.restate import converted_position, restated

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, as meant

WORLD, ROWS_PER_RANK = 2, 320  # 10 steps per epoch at 32 per rank on 2 ranks


def _sgd_state(groups=("all",), lr=0.2):
    """A real SGD's state dict (momentum buffers after one step), its parameter groups named as the model names them."""
    params = [torch.nn.Parameter(torch.ones(2)) for _ in groups]
    opt = torch.optim.SGD([{"params": [p], "name": g} for p, g in zip(params, groups)], lr=lr, momentum=0.9)
    sum(p.sum() for p in params).backward()
    opt.step()
    state = opt.state_dict()
    for group in state["param_groups"]:
        group["initial_lr"] = lr
    return state


def _checkpoint(path, batch=32, world=WORLD, steps=10, total=13, current=3, lr=0.2, lineage=None, trained=None,
                optimizer=None):
    progress = {"total": {"ready": total, "completed": total}, "current": {"ready": current, "completed": current}}
    ckpt = {"global_step": total, "epoch": (total - current) // steps, "state_dict": {"w": torch.ones(2)},
            LINEAGE: {"delta_table": "t", "delta_version": 0, **(lineage or {})},
            TRAINED_WITH: {"batch_size": batch, "world_size": world, "steps_per_epoch": steps, "global_step": total,
                           "lr": lr, **(trained or {})},
            "loops": {"fit_loop": {"state_dict": {"combined_loader": [{"steps_per_epoch": steps, "world_size": world}]},
                                   "epoch_loop.state_dict": {"_batches_that_stepped": total},
                                   "epoch_loop.batch_progress": progress}},
            "optimizer_states": [optimizer or _sgd_state(lr=lr)],
            "lr_schedulers": [{"base_lrs": [lr], "_last_lr": [lr], "last_epoch": total, "_step_count": total + 1}]}
    write_atomically(ckpt, str(path))
    return ckpt


class OneRank:
    """The strategy a one-process write_sharded calls."""

    global_rank = 0

    def broadcast(self, obj):
        return obj

    def barrier(self, name=None):
        pass


def _sharded(path, step=13, steps=10, optimizer=None, lineage=None):
    """An FSDP-shaped checkpoint folder, written as FSDP writes it (write_sharded)."""
    progress = {"total": {"ready": step, "completed": step}, "current": {"ready": step % steps, "completed": 0}}
    checkpoint = {"global_step": step, "epoch": step // steps, "state_dict": {"w": torch.full((4, 3), float(step))},
                  "optimizer_states": [optimizer or _sgd_state()],
                  LINEAGE: {"delta_table": "t", "delta_version": 0, **(lineage or {})},
                  TRAINED_WITH: {"batch_size": 32, "world_size": WORLD, "steps_per_epoch": steps, "global_step": step,
                                 "lr": 0.2},
                  "loops": {"fit_loop": {"epoch_loop.batch_progress": progress,
                                         "state_dict": {"combined_loader": [{"steps_per_epoch": steps}]}}},
                  "lr_schedulers": [{"base_lrs": [0.2], "_last_lr": [0.2], "last_epoch": step,
                                     "_step_count": step + 1}]}
    write_sharded(OneRank(), checkpoint, str(path))


def _job(tmp_path, *overrides):
    cfg = load_config(None, [f"train.checkpoint_dir={tmp_path}/ckpt", "data.batch_size=32", "train.np=2",
                             "train.lr_scaling=linear", "train.max_restarts=2", *overrides])
    split = SimpleNamespace(row_group_rows=[ROWS_PER_RANK] * WORLD)
    data = ConvertedData(train=split, val=split, plan=plan_data(split, split, WORLD, 32), class_names=["a", "b"],
                         image_size=8, channels=1)
    return launcher.TrainJob(cfg=cfg, data=data, delta_table="t", delta_version=0, job_dir=str(tmp_path / "job"))


def _lost():
    return launcher.DistributedTrainingError("training failed on rank 1: " + rank_failures.SILENT_RANK)


def _given(tmp_path, **kw):
    given = tmp_path / "other-run" / "last.ckpt"
    given.parent.mkdir(exist_ok=True)
    _checkpoint(given, **kw)
    return given


def _never(job, early=None):
    pytest.fail(f"a launch started from {job.plan.restore_from}: the driver should have refused it")


# ------------------------------------------------------------------------------------------ 1: the split
@pytest.mark.parametrize("override,key", [("data.val_fraction=0.4", "data.val_fraction=0.2"),
                                          ("data.split_key=path", "data.split_key='content'")])
def test_a_resume_with_another_split_is_refused_before_any_rank_starts(tmp_path, monkeypatch, override, key):
    """A checkpoint trained with data.val_fraction=0.2 (split by content) resumed by a job splitting otherwise: rows it
    trained on would be validated and scored by the gate. Refused by the driver, naming the file and the key, not
    restartable; train.ckpt_allow_other_data=true resumes it with a warning."""
    given = _given(tmp_path, lineage={"val_fraction": 0.2, "split_key": "content"})
    monkeypatch.setattr(restart, "launch", _never)
    with pytest.raises(CheckpointLineageError, match=rf"checkpoint .*last.ckpt was trained with another "
                                                     rf"train/validation split: {key}") as err:
        restart.launch_with_restarts(_job(tmp_path, f"train.ckpt_restore={given}", override))
    assert not restart.is_restartable(err.value)

    monkeypatch.setattr(restart, "launch", lambda job, early=None: ["done"])
    assert restart.launch_with_restarts(_job(tmp_path, f"train.ckpt_restore={given}", override,
                                             "train.ckpt_allow_other_data=true")) == ["done"]


def test_a_checkpoint_of_the_same_split_resumes_and_one_recording_none_resumes_with_a_warning(tmp_path, monkeypatch,
                                                                                              caplog):
    given = _given(tmp_path, lineage={"val_fraction": 0.2, "split_key": "content"})
    monkeypatch.setattr(restart, "launch", lambda job, early=None: ["done"])
    assert restart.launch_with_restarts(_job(tmp_path, f"train.ckpt_restore={given}")) == ["done"]
    _checkpoint(given)  # written before checkpoints recorded the split
    with caplog.at_level(logging.WARNING):
        assert restart.launch_with_restarts(_job(tmp_path, f"train.ckpt_restore={given}")) == ["done"]
    assert "records no data.val_fraction or data.split_key" in caplog.text and "cannot be checked" in caplog.text


def test_every_rank_refuses_another_split_when_its_lineage_holds_one(tmp_path):
    path = tmp_path / "last.ckpt"
    _checkpoint(path, lineage={"val_fraction": 0.2, "split_key": "content"})
    lineage = {"delta_table": "t", "delta_version": 0, "val_fraction": 0.2, "split_key": "content"}
    assert check_checkpoint_lineage(str(path), lineage, False) == 13
    with pytest.raises(CheckpointLineageError, match=r"data.val_fraction=0.2 \(this job: 0.3\)"):
        check_checkpoint_lineage(str(path), {**lineage, "val_fraction": 0.3}, False)


def _fake_trainer(data, optimizer, step=7):
    return SimpleNamespace(datamodule=SimpleNamespace(data=data), optimizers=[optimizer], global_step=step)


def test_checkpoints_record_the_split_and_the_optimizer_they_were_trained_with(tmp_path):
    """Direct data knows its split; converted data's cache entry records it in its manifest (the key's inputs)."""
    from pipeline.lakehouse.split import split_rule

    net = torch.nn.Linear(2, 1)
    adam = torch.optim.Adam([{"params": [net.weight], "name": "backbone"}, {"params": [net.bias], "name": "head"}])
    direct = SimpleNamespace(val_fraction=0.25, split_key="content")
    record = CheckpointRecord({"delta_table": "t", "delta_version": 3}, batch_size=16, world_size=2,
                              steps_per_epoch=10, lr=0.1)
    ckpt = {}
    record.on_save_checkpoint(_fake_trainer(direct, adam), None, ckpt)
    assert ckpt[LINEAGE] == {"delta_table": "t", "delta_version": 3, "val_fraction": 0.25, "split_key": "content"}
    assert ckpt[TRAINED_WITH] == {"batch_size": 16, "world_size": 2, "steps_per_epoch": 10, "lr": 0.1,
                                  "global_step": 7, "optimizer": "adam", "param_groups": ["backbone", "head"]}

    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "manifest.json").write_text('{"inputs": {"val_fraction": 0.3, "split_rule": "%s"}}' % split_rule("path"))
    converted = SimpleNamespace(entry_url=str(entry))
    sgd = torch.optim.SGD([{"params": net.parameters(), "name": "all"}], lr=0.1, momentum=0.9)
    record = CheckpointRecord({"delta_table": "t", "delta_version": 3}, 16, 2, 10, 0.1)
    ckpt = {}
    record.on_save_checkpoint(_fake_trainer(converted, sgd), None, ckpt)
    assert ckpt[LINEAGE]["val_fraction"] == 0.3 and ckpt[LINEAGE]["split_key"] == "path"
    assert ckpt[TRAINED_WITH]["optimizer"] == "sgd" and ckpt[TRAINED_WITH]["param_groups"] == ["all"]


# ------------------------------------------------------------------------------ 1: another number of steps
def test_another_number_of_steps_per_epoch_at_the_same_batch_is_restated(tmp_path):
    """Same per-rank batch and world size, 10 steps per epoch recorded, 12 planned (the same rows planned otherwise):
    restated (the same epoch, the same samples into it), not resumed as it is with a first epoch cut short."""
    path = tmp_path / "last.ckpt"
    _checkpoint(path, steps=10, total=13, current=3)
    out = restated(str(path), 12, 32, WORLD, "linear", folder=str(tmp_path / "mine"))
    assert os.path.basename(out) == "last-batch32-steps12.ckpt" and os.path.dirname(out) == str(tmp_path / "mine")
    ckpt = torch.load(out, weights_only=True)
    assert ckpt["global_step"] == converted_position(13, 3, 10, 64, 12, 64)[0] == 15
    assert ckpt[TRAINED_WITH]["steps_per_epoch"] == 12
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["steps_per_epoch"] == 12
    assert ckpt["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.2)  # the same global batch
    assert restated(str(path), 10, 32, WORLD, "linear") == str(path)  # the same steps: the checkpoint itself


def test_a_sharded_checkpoint_with_another_number_of_steps_is_restated_with_its_shards_linked(tmp_path):
    src = tmp_path / "other" / "last.ckpt"
    _sharded(src, step=13, steps=10)
    out = restated(str(src), 12, 32, WORLD, "linear", folder=str(tmp_path / "mine"))
    assert os.path.isdir(out) and os.path.dirname(out) == str(tmp_path / "mine")
    meta = torch.load(os.path.join(out, "meta.pt"), weights_only=True)
    assert meta["global_step"] == 15 and meta[TRAINED_WITH]["steps_per_epoch"] == 12
    assert torch.load(src / "meta.pt", weights_only=True)["global_step"] == 13  # the source is as it was
    shard = next(f for f in os.listdir(src) if f.endswith(".distcp"))
    assert os.stat(src / shard).st_ino == os.stat(os.path.join(out, shard)).st_ino  # linked, not copied
    torch.testing.assert_close(consolidated_state(out)["w"], torch.full((4, 3), 13.0))


# ------------------------------------------------------------------------ 2: another run's checkpoint, once
def test_another_runs_checkpoint_is_taken_once_and_every_launch_resumes_that_snapshot(tmp_path, monkeypatch):
    """The other run saves a newer last.ckpt (renamed into place) while this job's first launch runs; the first launch
    fails before this job wrote a checkpoint: the relaunch resumes the step the job started from, from the job's own
    folder, never the other run's newer file."""
    given = _given(tmp_path, total=13)
    job = _job(tmp_path, f"train.ckpt_restore={given}")
    seen = []

    def fake_launch(job, early=None):
        restore = job.plan.restore_from
        seen.append((restore, torch.load(restore, weights_only=True)["global_step"]))
        if len(seen) == 1:
            _checkpoint(given, total=17, current=7)  # the other run's next save, renamed over its last.ckpt
            raise _lost()
        return ["done"]

    monkeypatch.setattr(restart, "launch", fake_launch)
    assert restart.launch_with_restarts(job) == ["done"]
    assert [step for _, step in seen] == [13, 13]
    for restore, _ in seen:
        assert os.path.realpath(restore).startswith(os.path.realpath(job.ckpt_dir) + os.sep)
    assert torch.load(given, weights_only=True)["global_step"] == 17
    assert sorted(os.listdir(given.parent)) == ["last.ckpt"]  # nothing written into the other run's folder


def test_a_sharded_checkpoint_swapped_while_it_is_taken_is_taken_again_whole(tmp_path, monkeypatch):
    """The other run swaps a new save in (the old folder renamed aside and removed) while the snapshot links the old
    one's files: the snapshot never mixes the two; it is taken again and holds one save whole."""
    from pipeline.distributed.checkpoints import layout

    given = tmp_path / "other-run" / "last.ckpt"
    _sharded(given, step=13)
    real, swapped = layout._link_or_copy, []

    def racing(name, dst, src_dir_fd=None):
        if not swapped:
            swapped.append(True)
            _sharded(given, step=17)  # the other run's next save: swapped in, the folder read so far removed
        return real(name, dst, src_dir_fd=src_dir_fd)

    monkeypatch.setattr(layout, "_link_or_copy", racing)
    out = layout.snapshot(str(given), str(tmp_path / "mine"), wait_s=0.01)
    assert out == str(tmp_path / "mine" / "restore-point" / "last.ckpt")
    assert torch.load(os.path.join(out, "meta.pt"), weights_only=True)["global_step"] == 17
    check_sharded(out)
    torch.testing.assert_close(consolidated_state(out)["w"], torch.full((4, 3), 17.0))
    assert os.listdir(tmp_path / "mine" / "restore-point") == ["last.ckpt"]  # no staged folder left


def test_a_sharded_checkpoint_half_removed_before_it_is_listed_is_never_taken_in_part(tmp_path, monkeypatch):
    """The other run swapped a new save in and is removing the old folder, some of whose shards are already gone, when
    the snapshot lists it: the files left (meta.pt and the index among them) are not taken as a checkpoint; the
    snapshot is taken again, of the save now in place, whole."""
    from pipeline.distributed.checkpoints import layout

    given, newer = tmp_path / "other-run" / "last.ckpt", tmp_path / "elsewhere" / "last.ckpt"
    _sharded(given, step=13)
    _sharded(newer, step=17)
    aside = tmp_path / "other-run" / "aside"
    real, raced = os.listdir, []

    def racing(target="."):
        if isinstance(target, int) and not raced:
            raced.append(True)
            os.rename(given, aside)  # the swap: the old folder aside, the new one in, the old one half removed
            os.rename(newer, given)
            for name in os.listdir(aside):
                if name.endswith(".distcp"):
                    os.remove(aside / name)
        return real(target)

    monkeypatch.setattr(layout.os, "listdir", racing)
    out = layout.snapshot(str(given), str(tmp_path / "mine"), wait_s=0.01)
    monkeypatch.undo()
    assert raced and torch.load(os.path.join(out, "meta.pt"), weights_only=True)["global_step"] == 17
    check_sharded(out)
    torch.testing.assert_close(consolidated_state(out)["w"], torch.full((4, 3), 17.0))


# ----------------------------------------------------------------------------------- 3: the optimizer
@pytest.mark.parametrize("override,match", [
    ("model.optimizer=adam", r"holds the state of another optimizer \(its parameter groups' keys in "
                             r"'optimizer_states': .*momentum.*\); this job's config builds adam .*need betas"),
    ("model.backbone_lr=0.001", r"holds 1 optimizer parameter group\(s\) \(all\) in 'optimizer_states'; this job's "
                                r"config builds 2 \(backbone, head: model.backbone_lr=0.001"),
    ("model.freeze_backbone=true", r"holds 1 optimizer parameter group\(s\) \(all\).*builds 2 \(backbone, head"),
])
def test_a_resume_with_another_optimizer_is_refused_before_any_rank_starts(tmp_path, monkeypatch, override, match):
    """SGD state resumed by a job building Adam (Lightning loads it; the first step fails with KeyError 'betas', a
    restartable failure that spends train.max_restarts), or other parameter groups: refused by the driver, naming the
    file and the keys, not restartable."""
    given = _given(tmp_path)
    monkeypatch.setattr(restart, "launch", _never)
    with pytest.raises(CheckpointError, match=match) as err:
        restart.launch_with_restarts(_job(tmp_path, f"train.ckpt_restore={given}", override))
    assert str(tmp_path / "ckpt" / "restore-point" / "last.ckpt") in str(err.value) and str(given) in str(err.value)
    assert not restart.is_restartable(err.value)
    assert not (tmp_path / "ckpt" / "restore-point" / "last.ckpt").exists()  # the refused snapshot is not kept


def test_the_optimizer_a_checkpoint_records_and_a_sharded_ones_state_are_checked_too(tmp_path, monkeypatch):
    monkeypatch.setattr(restart, "launch", _never)
    given = _given(tmp_path, trained={"optimizer": "adam", "param_groups": ["all"]})
    with pytest.raises(CheckpointError, match=r"holds the state of a adam optimizer .*builds sgd"):
        restart.launch_with_restarts(_job(tmp_path, f"train.ckpt_restore={given}"))
    sharded = tmp_path / "fsdp-run" / "last.ckpt"
    _sharded(sharded)
    with pytest.raises(CheckpointError, match=r"its shards' 'optimizer_0': .*momentum.*builds adam"):
        restart.launch_with_restarts(_job(tmp_path, f"train.ckpt_restore={sharded}", "model.optimizer=adam"))
    monkeypatch.setattr(restart, "launch", lambda job, early=None: ["done"])
    assert restart.launch_with_restarts(_job(tmp_path, f"train.ckpt_restore={sharded}")) == ["done"]
    net = torch.nn.Linear(2, 1)
    adam = torch.optim.Adam([{"params": net.parameters(), "name": "all"}])
    given = _given(tmp_path, optimizer=adam.state_dict())
    assert restart.launch_with_restarts(_job(tmp_path, f"train.ckpt_restore={given}", "model.optimizer=adam")) == \
        ["done"]


# ------------------------------------------------------------------------------------- 4: hostile checkpoints
def _file(tmp_path, name, obj):
    path = tmp_path / f"{name}.ckpt"
    write_atomically(obj, str(path))
    return str(path)


HOSTILE = {  # name: (the checkpoint's dict, the reader, the key its error names)
    "no_state_dict": ({"epoch": 0}, consolidated_state, "'state_dict'"),
    "state_not_a_dict": ({"epoch": 0, "state_dict": [1, 2]}, consolidated_state, "'state_dict'"),
    "no_steps": ({"trained_with": {"batch_size": 16, "world_size": 2}}, lambda p: restated(p, 10, 8, 2, "linear"),
                 "'trained_with.steps_per_epoch'"),
    "no_loops": ({"trained_with": {"batch_size": 16, "world_size": 2, "steps_per_epoch": 5}},
                 lambda p: restated(p, 10, 8, 2, "linear"), "'loops'"),
    "batch_not_a_number": ({"trained_with": {"batch_size": "sixteen", "steps_per_epoch": 5}},
                           lambda p: restated(p, 10, 8, 2, "linear"), "'trained_with.batch_size'"),
    "no_num_classes": ({"hyper_parameters": {"model": {"arch": "cnn", "width": 4}, "channels": 1}, "state_dict": {}},
                       classifier_from_checkpoint, "num_classes"),
    "model_not_a_dict": ({"hyper_parameters": {"model": "cnn", "channels": 1, "num_classes": 10}, "state_dict": {}},
                         classifier_from_checkpoint, "'hyper_parameters.model'"),
    "unknown_arch": ({"hyper_parameters": {"model": {"arch": "nope"}, "channels": 1, "num_classes": 10},
                      "state_dict": {}}, classifier_from_checkpoint, "'hyper_parameters'"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_checkpoint_missing_what_a_reader_needs_is_a_checkpoint_error_naming_the_file_and_the_key(tmp_path, case):
    obj, read, key = HOSTILE[case]
    path = _file(tmp_path, case, obj)
    with pytest.raises(CheckpointError, match=r"checkpoint \S+") as err:
        read(path)
    assert path in str(err.value) and key in str(err.value)
    assert not restart.is_restartable(err.value)


def test_a_sharded_folder_with_a_missing_or_truncated_shard_or_index_is_refused_saying_so(tmp_path):
    good = tmp_path / "good.ckpt"
    _sharded(good)
    check_sharded(str(good))
    shard = next(f for f in os.listdir(good) if f.endswith(".distcp"))

    missing = tmp_path / "missing.ckpt"
    shutil.copytree(good, missing)
    os.remove(missing / shard)
    with pytest.raises(CheckpointError, match=rf"{missing} is incomplete: shard {missing / shard}, which its index "
                                              rf"names .*cannot be read"):
        check_sharded(str(missing))

    for cut in (20, os.path.getsize(good / shard) - 1):  # a tensor's bytes cut short too, not only a pickled item's
        short = tmp_path / f"short{cut}.ckpt"
        shutil.copytree(good, short)
        with open(short / shard, "r+b") as fh:
            fh.truncate(cut)
        with pytest.raises(CheckpointError, match=rf"shard {short / shard} is truncated \({cut} bytes; its index "
                                                  rf"places item '.*' up to byte \d+\)"):
            check_sharded(str(short))
        with pytest.raises(CheckpointError, match="is truncated"):
            consolidated_state(str(short))

    for name, cut in (("half_index", 0.5), ("empty_index", 0.0)):
        bad = tmp_path / f"{name}.ckpt"
        shutil.copytree(good, bad)
        index = (bad / ".metadata").read_bytes()
        (bad / ".metadata").write_bytes(index[:int(len(index) * cut)])
        with pytest.raises(CheckpointError, match=r"cannot be read \(truncated or garbled\)") as err:
            read_index(str(bad))
        assert "could run code" not in str(err.value)

    index = read_index(str(good))  # an index whose offsets are not numbers
    key = next(iter(index.storage_data))
    index.storage_data[key] = dataclasses.replace(index.storage_data[key], offset="x")
    with open(good / ".metadata", "wb") as fh:
        pickle.dump(index, fh)
    with pytest.raises(CheckpointError, match=r"no readable offset and length"):
        check_sharded(str(good))


# ----------------------------------------------------------------------------------- 5: the job's own last
def test_the_jobs_own_checkpoint_is_resumed_whatever_the_file_servers_clock_says(tmp_path, monkeypatch):
    """The file server's clock an hour behind the driver's: the checkpoint this job wrote looks an hour old. The
    restart resumes it all the same (it is not the file that name held as the job started)."""
    job = _job(tmp_path)
    os.makedirs(job.ckpt_dir)
    last = os.path.join(job.ckpt_dir, "last.ckpt")
    seen = []

    def fake_launch(job, early=None):
        seen.append(job.plan.restore_from)
        if len(seen) == 1:
            _checkpoint(last, total=13)
            hour_ago = time.time() - 3600
            os.utime(last, (hour_ago, hour_ago))
            raise _lost()
        return ["done"]

    monkeypatch.setattr(restart, "launch", fake_launch)
    assert restart.launch_with_restarts(job) == ["done"]
    assert seen == [None, last]


def test_a_last_checkpoint_there_before_the_job_is_not_its_own_whatever_its_time(tmp_path, monkeypatch):
    """An earlier job's last.ckpt in the folder, its time an hour ahead of the driver's clock: a failure before this job
    wrote one relaunches from where the job started, not from it."""
    job = _job(tmp_path)
    os.makedirs(job.ckpt_dir)
    last = os.path.join(job.ckpt_dir, "last.ckpt")
    _checkpoint(last, total=99)
    ahead = time.time() + 3600
    os.utime(last, (ahead, ahead))
    seen = []

    def fake_launch(job, early=None):
        seen.append(job.plan.restore_from)
        if len(seen) == 1:
            raise _lost()
        return ["done"]

    monkeypatch.setattr(restart, "launch", fake_launch)
    assert restart.launch_with_restarts(job) == ["done"]
    assert seen == [None, None]


@pytest.mark.parametrize("overrides", [(), ("model.backbone_lr=0.001",), ("model.freeze_backbone=true",),
                                       ("model.backbone_lr=0.01",), ("model.optimizer=adam", "model.lr=0.3",
                                                                     "model.backbone_lr=0.1")])
def test_the_driver_expects_the_parameter_groups_and_optimizer_the_ranks_model_builds(overrides):
    """The driver's rule (no model built) and the LightningModule's own optimizer agree, so a checkpoint of this very
    config is never refused."""
    from pipeline.distributed.checkpoints.record import config_param_groups, optimizer_record
    from pipeline.model.module import ImageClassifier

    cfg = load_config(None, list(overrides))
    lr = 0.0123 * 3  # a rate scaled for the global batch, as the plan hands it to the ranks
    model = ImageClassifier.from_config(cfg.model, 1, 2, lr, warmup_epochs=0, steps_per_epoch=4, max_epochs=1)
    opt = model.configure_optimizers()["optimizer"]
    assert optimizer_record([opt]) == {"optimizer": cfg.model.optimizer,
                                       "param_groups": config_param_groups(cfg.model, lr)}
