"""Fault injection lives in the config's `debug:` section and a callback (pipeline/distributed/faults.py): none of it
reaches the LightningModule's hyperparameters or a checkpoint; each fault still happens where it is asked for."""
import dataclasses
import math
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from pipeline.config import ConfigError, DebugConfig, load_config
from pipeline.data.convert import plan_data
from pipeline.data.shards import ConvertedData
from pipeline.distributed.faults import InjectedFaults, wanted
from pipeline.distributed.loop import TrainJob, model_for

DEBUG = ["debug.fail_at_step=3", "debug.fail_rank=1", "debug.fail_with=oom", "debug.nan_at_step=2",
         "debug.kill_while_saving=4"]
DEBUG_NAMES = {f.name for f in dataclasses.fields(DebugConfig)} | {"debug"}


def _job(tmp_path, *overrides):
    cfg = load_config(None, [f"train.checkpoint_dir={tmp_path}/ckpt", "data.batch_size=8", "train.np=1",
                             "train.backend=single", "model.width=4", *overrides])
    split = SimpleNamespace(row_group_rows=[64])
    data = ConvertedData(train=split, val=split, plan=plan_data(split, split, 1, 8), class_names=["a", "b"],
                         image_size=8, channels=1)
    return TrainJob(cfg=cfg, data=data, delta_table="t", delta_version=0, job_dir=str(tmp_path / "job"))


def _keys(node):
    """Every key of a nested mapping."""
    if isinstance(node, dict):
        return set(node) | {k for v in node.values() for k in _keys(v)}
    return set()


def _fit(model, callbacks, steps=4, tmp_path=None):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8 * steps, 1, 8, 8), torch.randint(0, 2, (8 * steps,)))
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         limit_val_batches=0, default_root_dir=str(tmp_path) if tmp_path else None)
    trainer.fit(model, DataLoader(data, batch_size=8))
    return trainer


class Losses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_debug_keys_are_their_own_section_and_never_a_hyperparameter(tmp_path):
    job = _job(tmp_path, *DEBUG)
    assert job.cfg.debug == DebugConfig(fail_at_step=3, fail_rank=1, fail_with="oom", nan_at_step=2,
                                        kill_while_saving=4)
    model = model_for(job, 0.01)
    assert not _keys(dict(model.hparams)) & DEBUG_NAMES, dict(model.hparams)
    assert dict(model.hparams) == dict(model_for(_job(tmp_path), 0.01).hparams)  # the same model, faults or not

    # and a checkpoint of a model trained with the faults' callback records none of them either
    faults = InjectedFaults(dataclasses.replace(job.cfg.debug, fail_at_step=None, kill_while_saving=None,
                                                nan_at_step=1000))
    trainer = _fit(model, [faults], steps=2, tmp_path=tmp_path)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    saved = torch.load(tmp_path / "m.ckpt", weights_only=True)
    assert not _keys(saved["hyper_parameters"]) & DEBUG_NAMES
    assert not _keys(saved.get("callbacks", {})) & DEBUG_NAMES


@pytest.mark.parametrize("key", ["train.fail_at_step=3", "train.nan_at_step=2", "train.fail_with=oom"])
def test_the_old_train_fault_keys_are_refused_naming_the_key(key):
    with pytest.raises(ConfigError, match=rf"unknown config key '{key.split('=')[0]}'"):
        load_config(None, [key])


def test_fail_at_step_raises_on_its_step_on_the_first_attempt_only(tmp_path):
    job = _job(tmp_path, "debug.fail_at_step=2")
    losses = Losses()
    with pytest.raises(RuntimeError, match=r"injected failure at step 2 on rank 0 \(debug.fail_at_step\)"):
        _fit(model_for(job, 0.01), [InjectedFaults(job.cfg.debug), losses])
    assert len(losses.losses) == 2  # steps 0 and 1 ran
    oom = _job(tmp_path, "debug.fail_at_step=1", "debug.fail_with=oom").cfg.debug
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory: injected failure at step 1"):
        _fit(model_for(job, 0.01), [InjectedFaults(oom)])
    other_rank = dataclasses.replace(job.cfg.debug, fail_rank=1)
    _fit(model_for(job, 0.01), [InjectedFaults(other_rank)])  # this process is rank 0: nothing happens
    _fit(model_for(job, 0.01), [InjectedFaults(job.cfg.debug, first_attempt=False)])  # a relaunch runs clean


def test_nan_at_step_makes_the_training_loss_nan_from_its_step(tmp_path):
    job = _job(tmp_path, "debug.nan_at_step=2")
    losses = Losses()
    _fit(model_for(job, 0.01), [InjectedFaults(job.cfg.debug), losses])
    finite = [math.isfinite(v) for v in losses.losses]
    assert finite == [True, True, False, False]
    assert wanted(job.cfg.debug) and not wanted(DebugConfig())
