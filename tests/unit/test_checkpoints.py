"""The checkpoint module's rules: a restart after OOM back-offs restates from the batch the checkpoint records, a
checkpoint whose pickle would run code is refused, and a rank's error class decides whether the job restarts."""
import io
import os
import random
import re
import time
import zipfile
from types import SimpleNamespace

import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.data.convert import plan_data
from pipeline.data.shards import ConvertedData
from pipeline.distributed import launcher, rank_failures, restart
from pipeline.distributed.checkpoints import (TRAINED_WITH, CheckpointError, check_checkpoint_lineage,
                                              checkpoint_meta, classifier_from_checkpoint, consolidated_state,
                                              recorded_training, trained_with)
from pipeline.distributed.checkpoints.restate import converted_position, rescale_checkpoint, restated
from pipeline.distributed.rank_process import rank_record

WORLD, ROWS_PER_RANK = 2, 320  # steps per epoch: 5 at 64 per rank, 10 at 32, 20 at 16


def _progress(total, current):
    return {"total": {"ready": total, "completed": total, "started": total, "processed": total},
            "current": {"ready": current, "completed": current, "started": current, "processed": current},
            "is_last_batch": False}


def _checkpoint(path, batch, steps, total, current, lr):
    """A Lightning-shaped checkpoint at (total, current) batches, trained with `batch` per rank at rate `lr`."""
    torch.save({"global_step": total, "epoch": (total - current) // steps, "state_dict": {"w": torch.ones(2)},
                "lakehouse": {"delta_table": "t", "delta_version": 0},
                TRAINED_WITH: {"batch_size": batch, "world_size": WORLD, "steps_per_epoch": steps,
                               "global_step": total, "lr": lr},
                "loops": {"fit_loop": {"state_dict": {"combined_loader": [{"steps_per_epoch": steps}]},
                                       "epoch_loop.state_dict": {"_batches_that_stepped": total},
                                       "epoch_loop.batch_progress": _progress(total, current),
                                       "epoch_loop.scheduler_progress": _progress(total, current),
                                       "epoch_progress": _progress(total // steps, total // steps)}},
                "optimizer_states": [{"param_groups": [{"lr": lr, "initial_lr": lr, "momentum": 0.9}]}],
                "lr_schedulers": [{"base_lrs": [lr], "_last_lr": [lr], "last_epoch": total,
                                   "_step_count": total + 1}]}, path)


def _job(tmp_path, *overrides):
    cfg = load_config(None, [f"train.checkpoint_dir={tmp_path}/ckpt", "data.batch_size=auto",
                             "data.auto_batch_start=64", "train.lr_scaling=linear", "train.np=-2",
                             "train.max_restarts=2", *overrides])
    split = SimpleNamespace(row_group_rows=[ROWS_PER_RANK] * WORLD)
    data = ConvertedData(train=split, val=split, plan=plan_data(split, split, WORLD, 64), class_names=["a", "b"],
                         image_size=8, channels=1)
    return launcher.TrainJob(cfg=cfg, data=data, delta_table="t", delta_version=0, job_dir=str(tmp_path / "job"))


def _oom(rank=1):
    return launcher.DistributedTrainingError(f"training failed on rank {rank}: OutOfMemoryError: CUDA out of memory")


def test_two_backoffs_then_a_kill_restate_from_the_batch_each_checkpoint_records(tmp_path, monkeypatch):
    """64 -> OOM -> 32 -> OOM -> 16 -> a rank killed: each relaunch resumes from the checkpoint restated from the
    batch IT was trained with (64, then 32, then none: it was trained at 16), never from the job's first batch."""
    job = _job(tmp_path, "train.max_restarts=3")
    os.makedirs(job.cfg.train.checkpoint_dir)
    last = os.path.join(job.cfg.train.checkpoint_dir, "last.ckpt")
    seen = []
    users_config = job.cfg

    def fake_launch(job, early=None):
        assert job.cfg is users_config  # a relaunch changes the job, never the user's config
        batch, steps = job.data.plan.train.batch_size, job.data.plan.train.steps_per_epoch
        restore = job.plan.restore_from
        seen.append((job.plan.attempt, batch, steps, restore and os.path.basename(restore),
                     restore and torch.load(restore, weights_only=True)))
        time.sleep(0.05)  # the checkpoint's mtime after the job's start, whatever the file system's clock
        if job.plan.attempt == 0:  # 7 steps of 64 (1 epoch of 5, then 2), then an out-of-memory
            _checkpoint(last, 64, 5, 7, 2, lr=0.4)
            raise _oom()
        if job.plan.attempt == 1:  # resumed at 32 from step 14, 3 more steps (17: epoch 1, step 7 of 10), then OOM
            _checkpoint(last, 32, 10, 17, 7, lr=0.2)
            raise _oom()
        if job.plan.attempt == 2:  # resumed at 16 from step 34, 2 more steps, then rank 1 killed
            _checkpoint(last, 16, 20, 36, 16, lr=0.1)
            raise launcher.DistributedTrainingError("training failed on rank 1: " + rank_failures.SILENT_RANK)
        return ["done"]

    monkeypatch.setattr(restart, "launch", fake_launch)
    restarts, backoffs = [], []
    assert restart.launch_with_restarts(job, lambda n, c: restarts.append(n),
                                         lambda n, plan, c: backoffs.append(plan.train.batch_size)) == ["done"]
    assert [(a, b, s) for a, b, s, _, _ in seen] == [(0, 64, 5), (1, 32, 10), (2, 16, 20), (3, 16, 20)]
    assert backoffs == [32, 16] and restarts == [1, 2, 3]

    _, _, _, name1, ckpt1 = seen[1]  # trained at 64: restated for 32
    assert name1 == "last-batch32.ckpt" and ckpt1["global_step"] == converted_position(7, 2, 5, 64, 10, 32)[0] == 14
    assert ckpt1["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.2)
    _, _, _, name2, ckpt2 = seen[2]  # trained at 32 (not 64, the job's first batch): restated from 32 for 16
    assert name2 == "last-batch16.ckpt"
    assert ckpt2["global_step"] == converted_position(17, 7, 10, 32, 20, 16)[0] == 34
    assert ckpt2["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.1)
    assert ckpt2["lr_schedulers"][0]["base_lrs"] == [pytest.approx(0.1)]
    assert ckpt2[TRAINED_WITH] == {"batch_size": 16, "world_size": WORLD, "steps_per_epoch": 20, "global_step": 34,
                                   "lr": pytest.approx(0.1)}
    _, _, _, name3, ckpt3 = seen[3]  # trained at 16, resumed at 16: the checkpoint itself, not restated again
    assert name3 == "last.ckpt" and ckpt3["global_step"] == 36
    assert ckpt3["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.1)


def test_restated_keeps_a_checkpoint_of_this_batch_and_refuses_what_it_cannot_restate(tmp_path):
    path = str(tmp_path / "last.ckpt")
    _checkpoint(path, 32, 10, 17, 7, lr=0.2)
    assert restated(path, 10, 32, WORLD, "linear") == path
    assert trained_with(path)["batch_size"] == 32
    # another world size (an elastic relaunch): restated by the global batch, here the same 64 (16 x 4): same rate
    other = restated(path, 10, 16, 4, "linear")
    assert os.path.basename(other) == "last-batch16-np4.ckpt"
    assert trained_with(other) == {"batch_size": 16, "world_size": 4, "steps_per_epoch": 10, "global_step": 17,
                                   "lr": pytest.approx(0.2)}
    old = str(tmp_path / "old.ckpt")
    torch.save({"global_step": 3, "state_dict": {}}, old)
    with pytest.raises(CheckpointError, match=rf"checkpoint {old} does not record the batch"):
        restated(old, 10, 16, WORLD, "linear")


def test_rescaled_checkpoint_records_its_new_batch(tmp_path):
    src, dst = str(tmp_path / "last.ckpt"), str(tmp_path / "out.ckpt")
    _checkpoint(src, 64, 5, 7, 2, lr=0.4)
    assert rescale_checkpoint(src, dst, 5, 64, 10, 32, 0.5) == 14
    assert trained_with(dst) == {"batch_size": 32, "world_size": WORLD, "steps_per_epoch": 10, "global_step": 14,
                                 "lr": pytest.approx(0.2)}


# ------------------------------------------------------------------------------- checkpoints that would run code
class _Payload:
    """Unpickling it opens (creates) the marker file: what any code in a pickle could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_checkpoint_whose_pickle_would_run_code_is_refused_naming_it(tmp_path):
    marker = tmp_path / "ran"
    evil = str(tmp_path / "evil.ckpt")
    torch.save({"global_step": 1, "state_dict": {"w": torch.ones(1)}, "lakehouse": {}, "x": _Payload(marker)}, evil)
    for read in (checkpoint_meta, consolidated_state, trained_with, classifier_from_checkpoint,
                 lambda p: check_checkpoint_lineage(p, {"delta_table": "t", "delta_version": 0}, False),
                 lambda p: rescale_checkpoint(p, str(tmp_path / "out.ckpt"), 5, 64, 10, 32, 0.5)):
        with pytest.raises(CheckpointError, match=rf"checkpoint {evil} holds objects other than tensors"):
            read(evil)
    assert not marker.exists() and not (tmp_path / "out.ckpt").exists()
    torch.load(evil, weights_only=False)  # the control: read without the restriction, the file does run code
    assert marker.exists()


def _torch_file(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _byteorder_garbled() -> bytes:
    """A torch zip file whose `byteorder` record is garbage (torch raises ValueError on it)."""
    src = zipfile.ZipFile(io.BytesIO(_torch_file({"global_step": 1, "state_dict": {"w": torch.zeros(3)}})))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for name in src.namelist():
            dst.writestr(name, b"ZZ\n" if name.endswith("/byteorder") else src.read(name))
    return out.getvalue()


GARBLED = {  # what torch's reader raises on these bytes (weights_only=True), besides the refusals it always had
    "truncated": lambda: _torch_file({"global_step": 1, "state_dict": {"w": torch.ones(8)}})[:-40],  # RuntimeError
    "empty": lambda: b"",  # EOFError
    "pop_from_empty_stack": lambda: bytes.fromhex("800265"),  # IndexError
    "undecodable_string": lambda: bytes.fromhex("8002638f7c"),  # UnicodeDecodeError
    "missing_memo": lambda: bytes.fromhex("8002684e"),  # KeyError
    "short_int": lambda: bytes.fromhex("80024a"),  # struct.error
    "byteorder": _byteorder_garbled,  # ValueError
    "random": lambda: bytes(random.Random(7).getrandbits(8) for _ in range(300)),
    "a_list": lambda: _torch_file([1, 2, 3]),  # a valid torch file, not a checkpoint's dict
    "a_tensor": lambda: _torch_file(torch.ones(2)),
    # a checkpoint's dict whose records are not (read by their readers, not by checkpoint_meta)
    "lineage_a_string": lambda: _torch_file({"global_step": 1, "state_dict": {}, "lakehouse": "t", "trained_with": 3}),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's note on an unknown pickle protocol in garbage
@pytest.mark.parametrize("case", sorted(GARBLED))
def test_a_garbled_checkpoint_is_a_checkpoint_error_naming_it_and_not_restartable(tmp_path, case):
    path = tmp_path / f"{case}.ckpt"
    path.write_bytes(GARBLED[case]())
    lineage = {"delta_table": "t", "delta_version": 0}
    readers = [trained_with, lambda p: check_checkpoint_lineage(p, lineage, False), recorded_training,
               lambda p: restated(p, 10, 32, 1, "linear", unrecorded=(32, 1), folder=str(tmp_path / "out"))]
    if case != "lineage_a_string":
        readers += [checkpoint_meta, consolidated_state, classifier_from_checkpoint]
    for read in readers:
        with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {path} ")) as err:
            read(str(path))
        assert not restart.is_restartable(err.value)
        assert not restart.is_restartable(launcher.DistributedTrainingError(
            str(err.value), {0: [f"{c.__module__}.{c.__qualname__}" for c in type(err.value).__mro__]}))
    assert not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, as meant here
def test_a_sharded_checkpoint_is_read_only_when_its_index_and_meta_are_plain(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "last.ckpt"
    dcp.save({"model": {"w": torch.arange(6.0).reshape(3, 2)}}, checkpoint_id=str(folder), no_dist=True)
    torch.save({"global_step": 4, "lakehouse": {"delta_table": "t", "delta_version": 0}}, folder / "meta.pt")
    assert checkpoint_meta(str(folder))["global_step"] == 4
    torch.testing.assert_close(consolidated_state(str(folder))["w"], torch.arange(6.0).reshape(3, 2))

    marker = tmp_path / "ran"
    torch.save({"global_step": 4, "x": _Payload(marker)}, folder / "meta.pt")
    with pytest.raises(CheckpointError, match=rf"checkpoint {folder / 'meta.pt'} holds objects other than tensors"):
        consolidated_state(str(folder))
    torch.save({"global_step": 4}, folder / "meta.pt")
    import pickle

    with open(folder / ".metadata", "wb") as fh:  # torch.distributed.checkpoint reads this with plain pickle
        pickle.dump(_Payload(marker), fh)
    for read in (checkpoint_meta, consolidated_state):
        with pytest.raises(CheckpointError, match=rf"checkpoint {folder / '.metadata'} holds objects other than"):
            read(str(folder))
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_whose_shard_would_run_code_is_refused_naming_the_shard(tmp_path):
    """torch.distributed.checkpoint stores a sharded folder's non-tensor items (an optimizer's param groups) as pickles
    inside the shard files and reads them back with torch.load(weights_only=False): every read here refuses a shard
    item that is more than tensors and plain values, naming the shard file, before anything in it runs."""
    import torch.distributed.checkpoint as dcp
    from lightning_fabric.utilities.load import _load_distributed_checkpoint

    meta = {"global_step": 4, "lakehouse": {"delta_table": "t", "delta_version": 0},
            TRAINED_WITH: {"batch_size": 32, "world_size": 2, "steps_per_epoch": 10, "global_step": 4, "lr": 0.1}}

    def write(folder, param_group):
        dcp.save({"model": {"w": torch.arange(6.0).reshape(3, 2)},
                  "optimizer_0": {"state": {}, "param_groups": [param_group]}}, checkpoint_id=str(folder), no_dist=True)
        torch.save(meta, folder / "meta.pt")
        return folder

    plain = write(tmp_path / "plain.ckpt", {"lr": 0.1, "momentum": 0.9, "params": [0]})  # plain values: read as before
    assert checkpoint_meta(str(plain))["global_step"] == 4 and trained_with(str(plain))["batch_size"] == 32
    torch.testing.assert_close(consolidated_state(str(plain))["w"], torch.arange(6.0).reshape(3, 2))

    marker = tmp_path / "ran"
    folder = write(tmp_path / "last.ckpt", {"lr": 0.1, "params": [0], "x": _Payload(marker)})
    [shard] = [f for f in os.listdir(folder) if f.endswith(".distcp")]
    for read in (checkpoint_meta, consolidated_state, trained_with, classifier_from_checkpoint,
                 lambda p: check_checkpoint_lineage(p, {"delta_table": "t", "delta_version": 0}, False)):
        with pytest.raises(CheckpointError, match=rf"checkpoint {folder / shard} holds objects other than tensors "
                                                  rf"and plain values \(item 'optimizer_0\.param_groups\.0\.x'\)"):
            read(str(folder))
    assert not marker.exists()
    _load_distributed_checkpoint(folder)  # the control: torch's own reader of the folder does run the shard's code
    assert marker.exists()

    import dataclasses
    import pickle

    with open(plain / ".metadata", "rb") as fh:  # an index that sends a read outside the folder is refused too
        index = pickle.load(fh)
    index.storage_data = {k: dataclasses.replace(v, relative_path="../elsewhere.distcp")
                          for k, v in index.storage_data.items()}
    with open(plain / ".metadata", "wb") as fh:
        pickle.dump(index, fh)
    with pytest.raises(CheckpointError, match=r"places item .* outside its folder \('../elsewhere.distcp'\)"):
        consolidated_state(str(plain))


# ------------------------------------------------------------------- the FSDP strategy's own read of a checkpoint
class _TinyClassifier(__import__("pytorch_lightning").LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 3)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # momentum: the optimizer has state (tensors) and param groups (non-tensor items)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _same(a, b):
    """Equal nested state: tensors bit for bit, other values by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture
def one_fsdp_rank(monkeypatch):
    """Lightning's FSDP strategy in this process: one CPU rank over gloo (the process group and the environment
    Lightning sets up are undone afterwards)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    saved = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def _fsdp_fit(steps, ckpt_path=None, save=None, weights_only=None):
    """A fresh model fitted `steps` steps with LakehouseFSDPStrategy on one CPU rank (resumed from `ckpt_path` when
    given: Lightning's resume, which reads the checkpoint through the strategy's load_checkpoint only), then saved
    to `save` (a sharded folder) when given."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from pipeline.distributed.fsdp import LakehouseFSDPStrategy

    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)),
                      batch_size=4)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, strategy=LakehouseFSDPStrategy("gloo"),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(_TinyClassifier(), data, ckpt_path=ckpt_path, weights_only=weights_only)
    if save is not None:
        trainer.save_checkpoint(save)
    return trainer


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
def test_the_fsdp_strategy_resumes_only_what_it_reads_as_plain_and_refuses_a_hostile_shard_naming_it(
        tmp_path, one_fsdp_rank):
    """The loop checks a sharded folder (checkpoint_meta) before Lightning's resume reads it; that read itself, the
    strategy's load_checkpoint, must be as safe (torch's distributed-checkpoint loader unpickles every non-tensor item
    with torch.load(weights_only=False), and a shard swapped between the check and the read would run): fed to the
    strategy directly, with the check bypassed, a shard item that is more than tensors and plain values is refused
    naming the shard and nothing in it runs; a whole .ckpt file likewise. A plain folder or file resumes exactly."""
    import shutil

    import torch.distributed.checkpoint as dcp

    from pipeline.distributed.checkpoints.io import sharded_state

    clean = tmp_path / "clean.ckpt"
    _fsdp_fit(2, save=str(clean))
    saved = sharded_state(str(clean))
    assert saved["optimizer_0"]["state"] and saved["optimizer_0"]["param_groups"][0]["momentum"] == 0.9

    # a plain folder resumes its weights and optimizer state exactly (no step left to train: saved again as read)
    again = tmp_path / "again.ckpt"
    assert _fsdp_fit(2, ckpt_path=str(clean), save=str(again)).global_step == 2
    assert _same(sharded_state(str(again)), saved)
    # ... and so does a whole file (the strategy's other branch)
    whole = tmp_path / "whole.ckpt"
    torch.save({**torch.load(clean / "meta.pt", weights_only=True), "state_dict": saved["model"],
                "optimizer_states": [saved["optimizer_0"]]}, whole)
    _fsdp_fit(2, ckpt_path=str(whole), save=str(again))
    assert _same(sharded_state(str(again)), saved)

    marker = tmp_path / "ran"

    def hostile(name, plant):
        state = sharded_state(str(clean))
        plant(state)
        folder = tmp_path / name
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
        shutil.copy(clean / "meta.pt", folder / "meta.pt")
        [shard] = [f for f in os.listdir(folder) if f.endswith(".distcp")]
        return folder, folder / shard

    # an optimizer's param group (read by the optimizer load) and a weight stored as a pickle (read by the model load)
    for name, plant, item in (
            ("group.ckpt", lambda s: s["optimizer_0"]["param_groups"][0].update(x=_Payload(marker)),
             "optimizer_0.param_groups.0.x"),
            ("weight.ckpt", lambda s: s["model"].update({"net.weight": _Payload(marker)}), "model.net.weight")):
        folder, shard = hostile(name, plant)
        with pytest.raises(CheckpointError, match=rf"checkpoint {shard} holds objects other than tensors and plain "
                                                  rf"values \(item '{item}'\)"):
            _fsdp_fit(3, ckpt_path=str(folder), weights_only=False)  # even where the caller would allow more
        assert not marker.exists(), name

    evil = tmp_path / "evil.ckpt"  # a whole file: Lightning reads it with an unpickler that admits anything
    torch.save({**torch.load(whole, weights_only=True), "x": _Payload(marker)}, evil)
    with pytest.raises(CheckpointError, match=rf"checkpoint {evil} holds objects other than tensors"):
        _fsdp_fit(3, ckpt_path=str(evil), weights_only=False)
    assert not marker.exists()


# --------------------------------------------------------------------------- restartability from a rank's class
def _ranks_failing(job_dir_errors):
    """A stand-in for the launchers: every rank runs under rank_record and raises its error; the launcher itself
    then fails with a text that names no class (as horovod.run and TorchDistributor do)."""
    launches = []

    def fake_launch(job, early=None):
        launches.append(job.plan.attempt)
        for rank, exc in job_dir_errors.items():
            with pytest.raises(type(exc)):
                with rank_record(job, rank):
                    raise exc
        raise RuntimeError("Horovod detected that one or more processes exited with non-zero status")
    return launches, fake_launch


@pytest.mark.parametrize("error", [ConfigError("config key 'data.reader': 'parquet-magic' is not a reader"),
                                   CheckpointError("checkpoint /x/last.ckpt cannot be read")])
def test_a_rank_error_of_a_class_not_restartable_fails_the_job_at_once(tmp_path, monkeypatch, error):
    job = _job(tmp_path, "data.batch_size=16")
    launches, fake = _ranks_failing({0: RuntimeError("Timed out waiting 60000ms"), 1: error})
    monkeypatch.setattr(launcher, "_launch", fake)
    with pytest.raises(launcher.DistributedTrainingError) as err:
        restart.launch_with_restarts(job)
    assert launches == [0]  # one launch, no restart, though train.max_restarts=2
    assert f"rank 1: {type(error).__name__}: {error}" in str(err.value)
    assert f"{type(error).__module__}.{type(error).__qualname__}" in err.value.rank_classes[1]
    assert not restart.is_restartable(err.value)


def test_a_rank_that_died_of_a_restartable_error_is_relaunched(tmp_path, monkeypatch):
    job = _job(tmp_path, "data.batch_size=16")
    launches, fake = _ranks_failing({1: RuntimeError("injected failure at step 3 on rank 1")})
    monkeypatch.setattr(launcher, "_launch", fake)
    with pytest.raises(launcher.DistributedTrainingError, match=r"after 2 restart\(s\)") as err:
        restart.launch_with_restarts(job)
    assert launches == [0, 1, 2] and err.value.rank_classes[1][0] == "builtins.RuntimeError"


def test_restartability_is_decided_by_class_not_text():
    text_only = launcher.DistributedTrainingError("training failed on rank 0: ConfigError: config key 'x'")
    assert restart.is_restartable(text_only)  # a message that merely mentions a class decides nothing
    recorded = launcher.DistributedTrainingError("training failed on rank 0: bad",
                                                 {0: [f"{ConfigError.__module__}.{ConfigError.__qualname__}"]})
    assert not restart.is_restartable(recorded)
    assert not restart.is_restartable(ConfigError("config key 'x'"))
    assert restart.is_restartable(launcher.DistributedTrainingError("x", {0: ["builtins.RuntimeError"]}))
