"""Early stopping cannot stop before train.early_stopping.min_epochs (a real Lightning Trainer on CPU), while other
stops (a non-finite metric, another callback's stop such as SIGTERM or a NaN loss) are not held back."""
from __future__ import annotations

import math

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from pipeline.config import Config, ConfigError, validate
from pipeline.distributed.callbacks import MinEpochsEarlyStopping, min_epochs_of


class _Worsening(pl.LightningModule):
    """val_loss given per epoch by `curve` (default: rises every epoch, so patience runs out at once)."""

    def __init__(self, curve=None):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.curve = curve or (lambda epoch: 1.0 + epoch)

    def training_step(self, batch, _):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, _):
        self.log("val_loss", torch.tensor(float(self.curve(self.current_epoch))))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(min_epochs: int, patience: int = 1, max_epochs: int = 10, curve=None, extra=()):
    data = DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2)
    es = MinEpochsEarlyStopping(monitor="val_loss", mode="min", min_delta=0.0, patience=patience, check_finite=True,
                                min_epochs=min_epochs)
    trainer = pl.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, callbacks=[es, *extra], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(_Worsening(curve), data, data)
    return trainer, es


def test_early_stopping_does_not_stop_before_the_minimum_and_stops_at_it():
    trainer, es = _fit(min_epochs=5)  # patience 1 is exhausted at epoch 1; held until 5 epochs ran
    assert trainer.current_epoch == 5 and es.stopped_epoch == 4
    assert es.held == [1, 2, 3]
    plain, plain_es = _fit(min_epochs=0)  # no minimum: stops where Lightning's EarlyStopping would
    assert plain.current_epoch == 2 and plain_es.stopped_epoch == 1 and plain_es.held == []


def test_an_improvement_after_the_minimum_keeps_training():
    # worse for 3 epochs after the first (BatchNorm settling), then better every epoch: the stop held at epochs 2
    # and 3 never happens, it runs max_epochs and does not report an early stop
    trainer, es = _fit(min_epochs=5, patience=2, max_epochs=8, curve=lambda e: 1.0 + e if e < 4 else 1.0 / e)
    assert trainer.current_epoch == 8 and es.stopped_epoch == 0 and es.held == [2, 3]


def test_non_finite_metric_and_other_stops_are_not_held():
    trainer, es = _fit(min_epochs=8, curve=lambda e: math.nan if e == 1 else 1.0)
    assert trainer.current_epoch == 2 and es.stopped_epoch == 1  # NaN stops at once

    class StopNow(pl.Callback):  # like StopSignals on SIGTERM
        def on_train_epoch_end(self, trainer, pl_module):
            trainer.should_stop = True

    trainer, es = _fit(min_epochs=8, patience=100, extra=[StopNow()])
    assert trainer.current_epoch == 1


def test_default_minimum_is_warmup_plus_two_patience_windows_capped_by_max_epochs():
    assert min_epochs_of(None, patience=3, warmup_epochs=1, max_epochs=8) == 7  # conf/local.yaml
    assert min_epochs_of(None, patience=10, warmup_epochs=1, max_epochs=10) == 10
    assert min_epochs_of(2, patience=10, warmup_epochs=1, max_epochs=10) == 2
    assert min_epochs_of(0, patience=3, warmup_epochs=1, max_epochs=8) == 0
    assert Config().train.early_stopping.min_epochs is None


def test_negative_minimum_names_the_key():
    import dataclasses

    cfg = Config()
    bad = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, early_stopping=dataclasses.replace(cfg.train.early_stopping, min_epochs=-1)))
    with pytest.raises(ConfigError, match="train.early_stopping.min_epochs"):
        validate(bad)
