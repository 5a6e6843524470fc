"""The registered weights and the reported metrics are one epoch's (issue 37, defect 2): a run resumed from another
run's checkpoint keeps that run's epochs in its history, but its best.ckpt holds only its own epochs' weights."""
import pytest
import torch

from pipeline.distributed.checkpoints.io import write_atomically
from pipeline.distributed.loop import weights_to_register

# the reproduction: the old run's epoch 1 has the best val_loss of the whole history, while the new run's
# folder holds a best.ckpt of epoch 4 (Lightning does not carry the old best score into a new folder)
HISTORY = [{"epoch": 0, "val_loss": 2.0, "val_acc": 0.05}, {"epoch": 1, "val_loss": 0.5, "val_acc": 0.10},
           {"epoch": 2, "val_loss": 1.4, "val_acc": 0.40}, {"epoch": 3, "val_loss": 1.1, "val_acc": 0.60},
           {"epoch": 4, "val_loss": 0.9, "val_acc": 0.70}]


def _checkpoint(path, epoch, value):
    write_atomically({"epoch": epoch, "global_step": 10 * epoch, "state_dict": {"network.w": torch.full((2,), value)}},
                     str(path))
    return str(path)


def test_the_metrics_reported_are_those_of_the_epoch_whose_weights_are_registered(tmp_path):
    best = _checkpoint(tmp_path / "best.ckpt", 4, 4.0)
    state, metrics, _ = weights_to_register(HISTORY, best)
    assert torch.equal(state["network.w"], torch.full((2,), 4.0))
    assert metrics["val_acc"] == 0.70 and metrics["val_loss"] == 0.9


def test_without_a_checkpoint_the_final_weights_go_with_the_last_epoch(tmp_path):
    state, metrics, _ = weights_to_register(HISTORY, None)
    assert state is None and metrics["val_acc"] == 0.70 and metrics["val_loss"] == 0.9
    state, metrics, _ = weights_to_register(HISTORY, str(tmp_path / "never-written.ckpt"))
    assert state is None


def test_a_checkpoint_of_an_epoch_the_history_lacks_is_refused(tmp_path):
    best = _checkpoint(tmp_path / "best.ckpt", 7, 7.0)
    with pytest.raises(RuntimeError, match="best.ckpt holds the weights of epoch 7"):
        weights_to_register(HISTORY, best)


def test_a_best_checkpoint_outside_the_runs_own_folder_is_not_registered(tmp_path):
    """Lightning restores best_model_path from a resumed checkpoint of another run's folder: that file is not this
    run's, so the final weights go with the last epoch, as when no checkpoint was written."""
    other = _checkpoint(tmp_path / "other-run" / "best.ckpt", 1, 1.0)
    (tmp_path / "this-run").mkdir()
    state, metrics, _ = weights_to_register(HISTORY, other, str(tmp_path / "this-run"))
    assert state is None and metrics["val_acc"] == 0.70 and metrics["val_loss"] == 0.9
    mine = _checkpoint(tmp_path / "this-run" / "best.ckpt", 4, 4.0)
    state, metrics, _ = weights_to_register(HISTORY, mine, str(tmp_path / "this-run"))
    assert torch.equal(state["network.w"], torch.full((2,), 4.0)) and metrics["val_acc"] == 0.70


def test_the_epoch_checkpoint_restores_what_a_plain_model_checkpoint_saved():
    """A checkpoint written before EpochCheckpoint (or by Lightning's own ModelCheckpoint) keeps its best score and
    best models under ModelCheckpoint's key: EpochCheckpoint reads them there. Under its own class's key Lightning
    would only warn and drop them, and the first validation after a resume would overwrite best.ckpt."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    from pipeline.distributed.callbacks import EpochCheckpoint

    for kwargs in ({"monitor": "val_loss", "mode": "min"}, {"every_n_epochs": 1}):
        assert EpochCheckpoint(**kwargs).state_key == ModelCheckpoint(**kwargs).state_key
    assert EpochCheckpoint(monitor="val_loss").state_key != EpochCheckpoint(monitor="val_acc").state_key


def test_a_checkpoints_own_record_of_its_epoch_goes_with_its_weights(tmp_path):
    """A rank killed between epoch 4's best.ckpt and its last.ckpt: the restart trains epoch 4 again (this run's
    history holds the retrained epoch 4) and, not improving on the restored best, leaves the first attempt's best.ckpt.
    Its weights go with the record of epoch 4 saved with them, and that epoch's confusion matrix."""
    own = [dict(h) for h in HISTORY[:4]] + [{"epoch": 4, "val_loss": 0.3, "val_acc": 0.9}]
    path = str(tmp_path / "best.ckpt")
    write_atomically({"epoch": 4, "global_step": 40, "state_dict": {"network.w": torch.full((2,), 4.0)},
                      "callbacks": {"EpochAccounting": {"history": own, "confusion": {4: [[9, 0], [1, 8]],
                                                                                      3: [[5, 4], [4, 5]]}}}}, path)
    out = weights_to_register(HISTORY, path, None, {4: [[1, 1], [1, 1]]})
    assert torch.equal(out[0]["network.w"], torch.full((2,), 4.0))
    assert out[1] == {"val_loss": 0.3, "val_acc": 0.9}  # not this run's retrained epoch 4 (0.9, 0.70)
    assert out[2] == [[9, 0], [1, 8]]
    # without a checkpoint: the last epoch of this run's history, with its own matrix
    assert weights_to_register(HISTORY, None, None, {4: [[1, 1], [1, 1]]})[2] == [[1, 1], [1, 1]]


def test_a_checkpoint_whose_own_history_lacks_its_epoch_is_refused(tmp_path):
    path = str(tmp_path / "best.ckpt")
    write_atomically({"epoch": 4, "global_step": 40, "state_dict": {"network.w": torch.zeros(2)},
                      "callbacks": {"EpochAccounting": {"history": HISTORY[:4]}}}, path)
    with pytest.raises(RuntimeError, match="best.ckpt holds the weights of epoch 4, which its own epoch history"):
        weights_to_register(HISTORY, path)
