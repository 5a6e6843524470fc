"""The training loop's checkpoints against the epochs they hold, through `loop.train` itself (one CPU process, a tiny
network on random 8x8 images, a stand-in for the tracker): what rank 0 registers is always one epoch's weights,
metrics and confusion matrix, of one attempt; a checkpoint is never written where a resume would skip an epoch's
validation; each epoch writes last.ckpt once and no copy beside it."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, TensorDataset

from pipeline.config import load_config
from pipeline.data.convert import plan_data
from pipeline.data.shards import ConvertedData
from pipeline.distributed import loop
from pipeline.distributed.callbacks import AtomicCheckpointIO, StopSignals
from pipeline.model.module import ImageClassifier
from pipeline.tracking.rank_zero import RankZeroTracker

STEPS = 8  # per epoch: 64 rows in batches of 8 (plan_data below)


class Crash(RuntimeError):
    """A rank dying (in a test: an exception out of trainer.fit)."""


class Script:
    """What the network's validation reports, by (attempt, epoch): the monitored val_loss and the confusion matrix;
    and where it dies."""
    attempt = 0
    val_loss: dict = {}
    crash_in_validation = None  # (attempt, epoch)


def _confusion(attempt: int, epoch: int):
    return torch.tensor([[10 * attempt + epoch, 1], [2, 3]])


class Scripted(ImageClassifier):
    def validation_step(self, batch, batch_idx):
        if (Script.attempt, self.current_epoch) == Script.crash_in_validation:
            raise Crash(f"rank died validating epoch {self.current_epoch}")
        return super().validation_step(batch, batch_idx)

    def _log_epoch(self, prefix):
        if prefix == "val" and (Script.attempt, self.current_epoch) in Script.val_loss:
            self._reset_sums("val")
            self.log("val_loss", Script.val_loss[(Script.attempt, self.current_epoch)])
            self.log("val_acc", 0.5)
            return
        super()._log_epoch(prefix)

    def on_validation_epoch_end(self):
        super().on_validation_epoch_end()
        self.last_confusion = _confusion(Script.attempt, self.current_epoch)


class Loader(DataLoader):
    rows_read = 0
    wait_s = 0.0

    def __iter__(self):
        self.rows_read = 0
        for batch in super().__iter__():
            self.rows_read += len(batch[1])
            yield batch

    def check_rows(self):
        pass

    def resume_at(self, batches):
        pass


class DataModule(pl.LightningDataModule):
    decode_used = "cpu"

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        rows = TensorDataset(torch.randn(8 * STEPS, 1, 8, 8, generator=g), torch.randint(0, 2, (8 * STEPS,),
                                                                                          generator=g))
        self.train_loader, self.val_loader = Loader(rows, batch_size=8), Loader(rows, batch_size=32)

    def train_dataloader(self):
        return self.train_loader

    def val_dataloader(self):
        return self.val_loader


class Registered:
    """What rank 0's tracker was handed to log and register (the real RankZeroTracker's logging of the model and its
    plots, with MLflow left out)."""
    network = None
    confusion = None
    result = None


class Tracker(RankZeroTracker):
    def __init__(self, tracking_uri, run_id, local_dir=None):
        self.run_id = run_id
        self.client = SimpleNamespace(log_artifact=lambda *a: None)

    def record_precision(self, precision):
        pass

    def record_tag(self, key, value):
        pass

    def start_telemetry(self, interval_s, resume=False):
        pass

    def stop_telemetry(self):
        pass

    def log_epoch(self, metrics, step):
        pass

    def close(self):
        pass

    def finish(self, model, job, history, result, own=None):
        Registered.result = result
        return self._finish_online(model, job, history, result)


@pytest.fixture(autouse=True)
def _stand_ins(monkeypatch):
    """The loop's data module and network, and MLflow's model logging and plots: stand-ins recording what they get."""
    import pipeline.tracking.plots as plots
    import pipeline.tracking.pyfunc as pyfunc

    Script.attempt, Script.val_loss, Script.crash_in_validation = 0, {}, None
    Registered.network = Registered.confusion = Registered.result = None
    monkeypatch.setattr(loop, "_make_datamodule", lambda job, rank, world_size, normalize_on_device: DataModule())
    monkeypatch.setattr(loop, "model_for", lambda job, lr: Scripted.from_config(
        job.cfg.model, job.data.channels, len(job.data.class_names), lr, steps_per_epoch=STEPS,
        max_epochs=job.cfg.train.max_epochs))

    def log_model(network, meta, name, run_id=None, step=None):
        Registered.network = {k: v.detach().clone() for k, v in network.state_dict().items()}
        return "models:/m/1"

    def confusion_png(cm, class_names, path):
        Registered.confusion = [[int(v) for v in row] for row in cm.tolist()]
        open(path, "wb").close()

    monkeypatch.setattr(pyfunc, "log_model", log_model)
    monkeypatch.setattr(plots, "confusion_matrix_png", confusion_png)
    monkeypatch.setattr(plots, "learning_curves_png", lambda history, path: open(path, "wb").close())
    monkeypatch.setenv("LAKEHOUSE_PROGRESS", "0")


def _job(tmp_path, folder="ckpt", *overrides):
    cfg = load_config(None, [f"train.checkpoint_dir={tmp_path}/{folder}", "data.batch_size=8", "train.np=1",
                             "train.backend=single", "model.width=4", "train.max_epochs=3", "train.warmup_epochs=0",
                             "train.early_stopping.enabled=false", "train.threads_per_rank=1",
                             "mlflow.system_metrics_interval_s=0", *overrides])
    split = SimpleNamespace(row_group_rows=[8 * STEPS])
    data = ConvertedData(train=split, val=split, plan=plan_data(split, split, 1, 8), class_names=["a", "b"],
                         image_size=8, channels=1)
    assert data.plan.train.steps_per_epoch == STEPS
    return loop.TrainJob(cfg=cfg, data=data, delta_table="t", delta_version=0, job_dir=str(tmp_path / "job"),
                         run_id="run", tracker=Tracker, checkpoint_dir=str(tmp_path / folder))


def _read(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def _epochs(result):
    return [int(h["epoch"]) for h in result.history]


def _writes(monkeypatch):
    """(file name, global step) of every checkpoint file written, in order."""
    written = []
    real = AtomicCheckpointIO.save_checkpoint

    def save(self, checkpoint, path, storage_options=None):
        written.append((os.path.basename(os.fspath(path)), int(checkpoint["global_step"])))
        return real(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", save)
    return written


# ------------------------------------------------------------------------------- what is registered, and with what
def test_a_stale_best_ckpt_left_by_a_rank_killed_before_last_ckpt_is_registered_with_its_own_metrics(tmp_path,
                                                                                                   monkeypatch):
    """Epoch 2 writes best.ckpt, then the rank dies writing last.ckpt: the restart resumes epoch 1's last.ckpt and
    trains epoch 2 again, which scores worse than the restored best (epoch 1's), so the first attempt's best.ckpt of
    epoch 2 stays and is registered. Its weights go with the metrics and confusion matrix that attempt recorded for
    them (in the checkpoint), not with the retrained epoch 2's in the history."""
    Script.val_loss = {(0, 0): 1.0, (0, 1): 0.8, (0, 2): 0.5, (1, 2): 0.9}
    folder = tmp_path / "ckpt"

    lasts = []

    def die_writing_last(path):  # epoch 2's last.ckpt: the third (its bytes on disk, not renamed into place)
        if os.path.basename(path) == "last.ckpt" and Script.attempt == 0:
            lasts.append(path)
            if len(lasts) == 3:
                raise Crash("rank killed while writing last.ckpt")

    monkeypatch.setattr(AtomicCheckpointIO, "part_written", staticmethod(die_writing_last))
    with pytest.raises(Crash):
        loop.train(_job(tmp_path))
    assert _read(folder / "best.ckpt")["epoch"] == 2 and _read(folder / "last.ckpt")["epoch"] == 1

    Script.attempt = 1
    result = loop.train(_job(tmp_path, "ckpt", "train.ckpt_restore=last"))
    assert [(h["epoch"], h["val_loss"]) for h in result.history] == [(0, 1.0), (1, pytest.approx(0.8)),
                                                                     (2, pytest.approx(0.9))]
    best = _read(folder / "best.ckpt")
    assert best["epoch"] == 2  # the first attempt's: the retrained epoch 2 did not beat epoch 1
    assert all(torch.equal(Registered.network[k], best["state_dict"][f"network.{k}"]) for k in Registered.network)
    assert result.metrics["val_loss"] == pytest.approx(0.5)  # that attempt's epoch 2, not the retrained one's 0.9
    assert Registered.confusion == _confusion(0, 2).tolist()


def test_the_confusion_matrix_logged_is_the_registered_epochs(tmp_path):
    """best.ckpt is epoch 1's; the last validation is epoch 2's: the matrix logged with the model is epoch 1's."""
    Script.val_loss = {(0, 0): 1.0, (0, 1): 0.5, (0, 2): 0.9}
    result = loop.train(_job(tmp_path))
    assert _read(tmp_path / "ckpt" / "best.ckpt")["epoch"] == 1
    assert result.metrics["val_loss"] == pytest.approx(0.5) and Registered.result is result
    assert Registered.confusion == _confusion(0, 1).tolist() != _confusion(0, 2).tolist()


class ShardedOnOneDevice(SingleDeviceStrategy):
    """A strategy that says it shards the model (as fsdp.LakehouseFSDPStrategy does): the loop registers a
    checkpoint's weights, never the module in memory."""
    shards_the_model = True


def test_a_sharded_run_that_trains_no_epoch_registers_the_checkpoint_it_resumed_never_a_fresh_network(tmp_path):
    """train.ckpt_restore=<another run>/last of a run that reached train.max_epochs: no epoch is trained and this
    run's folder holds no checkpoint; what is registered is the resumed checkpoint's weights with its own last
    epoch's metrics, not a freshly initialised network."""
    Script.val_loss = {(0, 0): 1.0, (0, 1): 0.7}
    loop.train(_job(tmp_path, "first", "train.max_epochs=2"), strategy=ShardedOnOneDevice(torch.device("cpu")))
    resumed = tmp_path / "first" / "last.ckpt"

    Script.attempt, Registered.network = 1, None
    result = loop.train(_job(tmp_path, "second", "train.max_epochs=2", f"train.ckpt_restore={resumed}"),
                        strategy=ShardedOnOneDevice(torch.device("cpu")))
    second = tmp_path / "second"
    assert _epochs(result) == [0, 1]  # nothing trained, no checkpoint written
    assert not (second / "best.ckpt").exists() and not (second / "last.ckpt").exists()
    state = _read(resumed)["state_dict"]
    assert Registered.network is not None
    assert all(torch.equal(Registered.network[k], state[f"network.{k}"]) for k in Registered.network)
    assert result.metrics["val_loss"] == pytest.approx(0.7)
    assert Registered.confusion == _confusion(0, 1).tolist()


def test_a_sharded_run_with_no_checkpoint_to_register_refuses_naming_why(tmp_path, monkeypatch):
    """No checkpoint of its own and none resumed (here: its last.ckpt removed before registration): an error, and
    nothing registered."""
    from pipeline.distributed.checkpoints.io import CheckpointError

    real = loop.weights_to_register

    def after_losing_the_folder(history, best, *args):
        for name in os.listdir(tmp_path / "ckpt"):
            os.remove(tmp_path / "ckpt" / name)
        return real(history, best, *args)

    monkeypatch.setattr(loop, "weights_to_register", after_losing_the_folder)
    with pytest.raises(CheckpointError, match="no trained weights to register"):
        loop.train(_job(tmp_path, "ckpt", "train.max_epochs=1"), strategy=ShardedOnOneDevice(torch.device("cpu")))
    assert Registered.network is None


# --------------------------------------------------------------------------- no checkpoint that skips a validation
def test_a_step_checkpoint_never_lands_on_an_epochs_last_step_before_its_validation(tmp_path, monkeypatch):
    """train.checkpoint_every_n_steps=4 with 8 steps an epoch: last.ckpt mid-epoch at step 4, and at step 8 only the
    epoch-end one, after validation. A rank that dies validating epoch 1 leaves the mid-epoch last.ckpt of step 12
    (not one of step 16 that marks epoch 1 finished); the restart trains the rest of epoch 1 and validates it: every
    epoch is recorded."""
    written = _writes(monkeypatch)
    Script.crash_in_validation = (0, 1)
    with pytest.raises(Crash):
        loop.train(_job(tmp_path, "ckpt", "train.checkpoint_every_n_steps=4"))
    last = _read(tmp_path / "ckpt" / "last.ckpt")
    assert last["global_step"] == STEPS + STEPS // 2 and last["epoch"] == 1  # step 12: mid-epoch 1, not its end
    assert [s for name, s in written if name == "last.ckpt"] == [4, 8, 12]  # once each, none at step 16

    Script.attempt = 1
    result = loop.train(_job(tmp_path, "ckpt", "train.checkpoint_every_n_steps=4", "train.ckpt_restore=last"))
    assert _epochs(result) == [0, 1, 2]  # epoch 1 finished, validated and recorded
    assert _read(tmp_path / "ckpt" / "last.ckpt")["global_step"] == 3 * STEPS


def test_a_sigterm_at_an_epochs_last_step_leaves_no_checkpoint_that_skips_its_validation(tmp_path, monkeypatch):
    """SIGTERM decided at epoch 1's last step: no last.ckpt is written there, before validation (a resume would start
    epoch 2 and never validate epoch 1); the epoch is validated and its end-of-epoch checkpoint is the stop's. Killed
    during that validation (a launcher's grace period over), the run resumes epoch 0's last.ckpt and trains epoch 1
    again: every epoch is recorded."""
    real = StopSignals.on_train_batch_end

    def term_in_epoch_1(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 1 and Script.attempt == 0:
            self._term = True  # what the SIGTERM handler sets; decided at the epoch's last step (8 < check_every)
        return real(self, trainer, pl_module, outputs, batch, batch_idx)

    monkeypatch.setattr(StopSignals, "on_train_batch_end", term_in_epoch_1)
    written = _writes(monkeypatch)
    result = loop.train(_job(tmp_path))  # stopped, not killed: epoch 1 validated and checkpointed at its end
    assert result.stop_reason.startswith("SIGTERM") and _epochs(result) == [0, 1]
    assert [s for name, s in written if name == "last.ckpt"] == [STEPS, 2 * STEPS]
    assert _read(tmp_path / "ckpt" / "last.ckpt")["epoch"] == 1

    written.clear()
    Script.crash_in_validation = (0, 1)  # killed while it validates
    with pytest.raises(Crash):
        loop.train(_job(tmp_path, "killed"))
    assert [s for name, s in written if name == "last.ckpt"] == [STEPS]
    assert _read(tmp_path / "killed" / "last.ckpt")["global_step"] == STEPS  # epoch 0's end

    Script.attempt = 1
    result = loop.train(_job(tmp_path, "killed", "train.ckpt_restore=last"))
    assert _epochs(result) == [0, 1, 2]


def test_a_sigterm_before_an_epochs_last_step_still_checkpoints_that_step(tmp_path, monkeypatch):
    """The mid-epoch SIGTERM keeps its checkpoint of the step it stopped at (the resume finishes the epoch)."""
    real = StopSignals.on_train_batch_end

    def term_in_epoch_1(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 1:
            self._term = True
        self.check_every = 4
        return real(self, trainer, pl_module, outputs, batch, batch_idx)

    monkeypatch.setattr(StopSignals, "on_train_batch_end", term_in_epoch_1)
    result = loop.train(_job(tmp_path))
    assert result.stop_reason.startswith("SIGTERM") and _epochs(result) == [0]
    assert _read(tmp_path / "ckpt" / "last.ckpt")["global_step"] == STEPS + 4


# --------------------------------------------------------------------------------------- one full checkpoint less
@pytest.mark.parametrize("every", [None, 3])
def test_each_epoch_writes_last_ckpt_once_and_no_copy_beside_it(tmp_path, monkeypatch, every):
    """best.ckpt when the monitored metric improves and last.ckpt, nothing else (no latest.ckpt / step.ckpt, which
    nothing reads); with train.checkpoint_every_n_steps=3 also last.ckpt at steps 3, 6, 9, ... but not at an epoch's
    last step (the epoch-end one is written there)."""
    Script.val_loss = {(0, 0): 1.0, (0, 1): 0.5, (0, 2): 0.9}
    written = _writes(monkeypatch)
    extra = [f"train.checkpoint_every_n_steps={every}"] if every else []
    loop.train(_job(tmp_path, "ckpt", *extra))
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["best.ckpt", "last.ckpt"]
    steps = [s for name, s in written if name == "last.ckpt"]
    ends = [STEPS, 2 * STEPS, 3 * STEPS]
    expected = ends if every is None else sorted(set(range(every, 3 * STEPS + 1, every)) | set(ends))
    assert steps == expected
    assert [s for name, s in written if name == "best.ckpt"] == [STEPS, 2 * STEPS]
    assert {name for name, _ in written} == {"best.ckpt", "last.ckpt"}


def test_a_last_checkpoint_saved_per_epoch_only_skips_lightnings_per_step_hook():
    from pipeline.distributed.callbacks import LastCheckpoint, skip_idle_step_hooks

    epoch, steps = LastCheckpoint("x"), LastCheckpoint("x", every_n_train_steps=2)
    skipped = skip_idle_step_hooks([epoch, steps])
    assert epoch.on_train_batch_end is None and steps.on_train_batch_end is not None
    assert "LastCheckpoint.on_train_batch_end" in skipped
