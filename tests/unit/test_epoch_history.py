"""The epoch history travels in the checkpoint: a run resumed from epoch k still knows epochs 0..k-1."""
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from pipeline.distributed.callbacks import EpochAccounting


class _History(EpochAccounting):
    """EpochAccounting's checkpointed state with a plain epoch end (no shard loaders to count)."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.history.append({"epoch": trainer.current_epoch, "train_loss": float(trainer.callback_metrics["loss"])})


class _Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _):
        loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, epochs, ckpt_path=None):
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)
    history = _History()
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[history],
                         enable_checkpointing=False)
    trainer.fit(_Tiny(), data, ckpt_path=ckpt_path, weights_only=True if ckpt_path else None)
    return trainer, history


def test_a_resumed_run_keeps_the_epochs_before_its_checkpoint(tmp_path):
    trainer, first = _fit(tmp_path, 2)
    path = str(tmp_path / "last.ckpt")
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=True)["callbacks"]  # the state is in the file, loadable with weights_only
    _, resumed = _fit(tmp_path, 4, ckpt_path=path)
    assert [h["epoch"] for h in resumed.history] == [0, 1, 2, 3]
    assert resumed.history[:2] == first.history
