"""The training step reads nothing back to the host: metric sums, the confusion matrix and the finite-loss flag stay
on the model's device until the epoch's one reduction; uint8 batches are normalised by the model like the loader does."""
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.config import ModelConfig
from pipeline.data.batches import PixelsToTensor
from pipeline.distributed.callbacks import StopSignals
from pipeline.model.module import ImageClassifier, normalize_pixels

# Every way a tensor's value reaches Python: each is a host-device synchronisation on a GPU.
_HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


class HostRead(AssertionError):
    pass


@contextmanager
def no_host_reads(monkeypatch):
    """Make every tensor-to-Python read raise while the block runs (CPU stands in for the device here)."""
    with monkeypatch.context() as m:
        for name in _HOST_READS:
            def refuse(self, *args, _name=name, **kwargs):
                raise HostRead(f"Tensor.{_name}() read a tensor's value on the host inside the step")
            m.setattr(torch.Tensor, name, refuse)
        yield


def _model(num_classes=3):
    torch.manual_seed(0)
    return ImageClassifier.from_config(ModelConfig(arch="cnn", width=8), channels=1, num_classes=num_classes, lr=0.01)


def _batch(seed, n=6, num_classes=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 1, 16, 16), generator=g, dtype=torch.uint8)
    y = torch.randint(0, num_classes, (n,), generator=g)
    return x, y


def test_the_guard_itself_catches_a_host_read(monkeypatch):
    with no_host_reads(monkeypatch):
        with pytest.raises(HostRead):
            float(torch.ones(1).sum())
        with pytest.raises(HostRead):
            torch.ones(1).item()


def test_training_and_validation_steps_do_not_read_tensors_on_the_host(monkeypatch):
    model = _model()
    batches = [model.on_after_batch_transfer(_batch(seed), 0) for seed in range(4)]
    losses, correct = [], []
    real_forward = model.forward

    def forward(x):  # keeps the logits each step used, to check the sums against
        logits = real_forward(x)
        correct.append(logits.detach().argmax(1))
        return logits

    model.forward = forward
    with no_host_reads(monkeypatch):
        for i, batch in enumerate(batches[:3]):
            loss = model.training_step(batch, i)
            loss.backward()
            losses.append(loss.detach())
        model.validation_step(batches[3], 0)
    # what was accumulated on the device is exact
    expected_loss = sum(float(loss) * 6 for loss in losses)
    expected_correct = sum(int((pred == y).sum()) for pred, (_, y) in zip(correct, batches[:3]))
    y, pred = batches[3][1], correct[3]
    train = model._sums("train").tolist()
    assert train[2] == 18.0 and train[1] == expected_correct
    assert train[0] == pytest.approx(expected_loss, rel=1e-12)
    confusion = model._confusion.reshape(3, 3)
    expected = torch.zeros(3, 3, dtype=torch.float64)
    for t, p in zip(y.tolist(), pred.tolist()):
        expected[t, p] += 1
    assert torch.equal(confusion, expected) and confusion.sum() == 6


def test_stop_signals_decide_once_per_window_with_no_host_read_in_between(monkeypatch):
    reduces = []

    def reduce(tensor, reduce_op):
        reduces.append(tensor.clone())
        return tensor  # one rank: the sum is the tensor itself

    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"), reduce=reduce),
                              global_step=0, current_epoch=0, num_training_batches=100, should_stop=False)
    stop = StopSignals(None, check_every=4)
    losses = [torch.tensor(0.5), torch.tensor(float("nan")), torch.tensor(0.3)]
    for i, loss in enumerate(losses):
        trainer.global_step = i + 1
        with no_host_reads(monkeypatch):
            stop.on_train_batch_end(trainer, None, {"loss": loss}, None, i)
    assert reduces == [] and not trainer.should_stop and stop.reason is None
    trainer.global_step = 4
    stop.on_train_batch_end(trainer, None, {"loss": torch.tensor(0.1)}, None, 3)  # the 4th step: the decision
    assert len(reduces) == 1
    assert trainer.should_stop and stop.reason == "non-finite training loss at step 1 (epoch 0)"


def test_stop_signals_decide_at_the_epochs_last_step():
    reduces = []
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cpu"), reduce=lambda t, reduce_op: reduces.append(1) or t),
        global_step=1, current_epoch=2, num_training_batches=2, should_stop=False)
    stop = StopSignals(None, check_every=16)
    stop.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, 0)
    assert reduces == []
    trainer.global_step = 2
    stop.on_train_batch_end(trainer, None, {"loss": torch.tensor(float("inf"))}, None, 1)
    assert reduces == [1] and trainer.should_stop and stop.reason == "non-finite training loss at step 1 (epoch 2)"
    stop.on_train_epoch_end(trainer, None)  # already decided: no second collective
    assert reduces == [1]


def test_uint8_batch_normalised_on_the_device_equals_the_loaders_normalisation():
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, size=(5, 3 * 8 * 8), dtype=np.uint8)
    loader = PixelsToTensor(channels=3, size=8).normalize(rows)
    on_device = normalize_pixels(torch.from_numpy(rows).view(5, 3, 8, 8))
    assert on_device.dtype == torch.float32 and on_device.shape == (5, 3, 8, 8)
    torch.testing.assert_close(on_device, loader, rtol=0, atol=1e-6)
    assert on_device.min() >= -1.0 and on_device.max() <= 1.0


def test_on_after_batch_transfer_converts_uint8_only():
    model = _model()
    x, y = _batch(0)
    out_x, out_y = model.on_after_batch_transfer((x, y), 0)
    assert out_x.dtype == torch.float32 and out_y is y
    floats = (torch.zeros(2, 1, 16, 16), y[:2])
    assert model.on_after_batch_transfer(floats, 0) is floats
    listed = model.on_after_batch_transfer([x, y], 0)
    assert isinstance(listed, list) and listed[0].dtype == torch.float32


def test_no_step_of_train_reads_a_tensor_on_the_host(monkeypatch, tmp_path):
    """The product's train() (Lightning's loop, the strategy, every callback, the progress bar, the LR schedule) with
    host reads refused in every step but an epoch's last, where the stop decision of the window reads its flags: a
    new `.item()`, `float(tensor)`, `.cpu()` or metric computed on the host in a step fails here (on a GPU each is a
    sync that leaves the device idle)."""
    import dataclasses

    from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop

    from bench.lightning_path import timed_train
    from pipeline.config import Config
    from pipeline.lakehouse.partition import ShardPlan, plan_split

    monkeypatch.setenv("LAKEHOUSE_PROGRESS", "1")  # rank 0's progress bar too
    plan = ShardPlan(train=plan_split("train", [40, 40], 1, 8), val=plan_split("val", [16], 1, 8))  # 10 steps
    data = SimpleNamespace(plan=plan, channels=1, image_size=16, class_names=[str(i) for i in range(3)])
    batches = [_batch(seed, n=8) for seed in range(3)]  # uint8: normalised on the device each step
    cfg = Config()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, threads_per_rank=1,
                                                              checkpoint_dir=str(tmp_path / "ckpt")),
                              model=dataclasses.replace(cfg.model, width=8))
    guarded = []
    original = _TrainingEpochLoop.advance

    def advance(self, data_fetcher):
        step = self.batch_idx + 1  # the batch this call runs
        if step + 1 >= self.trainer.num_training_batches:  # the epoch's last step decides the window: reads
            return original(self, data_fetcher)
        guarded.append(step)
        with no_host_reads(monkeypatch):
            return original(self, data_fetcher)

    monkeypatch.setattr(_TrainingEpochLoop, "advance", advance)
    out = timed_train(cfg, data, 0, 1, lambda: None, warmup=2, steps=5, windows=3, batches=batches)
    assert len(out["window_s"]) == 3 and len(guarded) >= 17  # 9 guarded steps per epoch, two epochs at least


def test_stop_signals_name_the_first_bad_step_when_some_steps_had_no_loss():
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"), reduce=lambda t, reduce_op: t),
                              global_step=0, current_epoch=1, num_training_batches=100, should_stop=False)
    stop = StopSignals(None, check_every=4)
    for i, out in enumerate([None, {"loss": torch.tensor(0.2)}, None, {"loss": torch.tensor([1.0, float("inf")])}]):
        trainer.global_step = i + 1
        stop.on_train_batch_end(trainer, None, out, None, i)  # a step without a loss (manual optimisation) is fine
    assert trainer.should_stop and stop.reason == "non-finite training loss at step 3 (epoch 1)"
