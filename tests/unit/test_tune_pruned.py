"""A trial counts as PRUNED only when rank 0 stopped on the driver's verdict: a verdict to prune that came after rank
0 stopped waiting for it (`tune.verdict_timeout_s`) stopped nothing, so the trial that trained to the end is COMPLETE
with its value. Both sides are real (`PruningGate` on the driver, `DriverVerdict` on rank 0, over files); the
training and the MLflow runs around `run_trial` are stand-ins."""
from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest

from pipeline.config import Config, apply_overrides


class _Trial:
    """The Optuna trial as the driver's gate sees it; `should_prune` waits for `answer` (the storage busy)."""

    number = 7

    def __init__(self, answer: threading.Event) -> None:
        self.answer = answer
        self.user_attrs = {}

    def set_user_attr(self, key, value):
        self.user_attrs[key] = value

    def report(self, value, step):
        pass

    def should_prune(self):
        assert self.answer.wait(30), "the test never let the driver answer"
        return True


class _Trainer:
    """What `DriverVerdict.on_train_epoch_end` reads of Lightning's trainer, for rank 0 of one rank."""

    def __init__(self, epoch: int, val_loss: float) -> None:
        import torch

        self.callbacks = []
        self.current_epoch = epoch
        self.is_global_zero = True
        self.callback_metrics = {"val_loss": torch.tensor(val_loss)}
        self.strategy = SimpleNamespace(root_device=torch.device("cpu"), reduce=lambda t, reduce_op: t)
        self.should_stop = False


class _Client:
    def __init__(self):
        self.tags = {}

    def log_batch(self, run_id, metrics=(), tags=(), synchronous=True):
        self.tags.update({t.key: t.value for t in tags})


def _run(tmp_path, monkeypatch, answer_in_time: bool):
    """run_trial with a 2-epoch training whose rank 0 asks the driver after each epoch; the driver answers `stop` to
    epoch 0 at once (rank 0 waits up to 30 s), or only once rank 0 has given up (after 0.2 s)."""
    from pipeline.distributed.callbacks import DriverVerdict
    from pipeline.tune.trial import run_trial

    answer = threading.Event()
    if answer_in_time:
        answer.set()
    client = _Client()

    @contextlib.contextmanager
    def tracked_run(cfg, run_name=None, tags=None, reopen=None):
        yield SimpleNamespace(run_id="child", client=client)

    def train_in_run(run, cfg, data, pinned, tags, epoch_gate=None, checkpoint_root=None):
        rank0 = DriverVerdict(epoch_gate.folder, cfg.tune.verdict_timeout_s)
        epochs = 0
        with epoch_gate:
            for epoch, val_loss in enumerate([0.5, 0.25]):
                trainer = _Trainer(epoch, val_loss)
                rank0.on_train_epoch_end(trainer, None)
                answer.set()  # after rank 0's wait: too late for epoch 0 unless it was answered already
                epochs += 1
                if trainer.should_stop:
                    break
        return SimpleNamespace(metrics={"val_loss": 0.25 if epochs == 2 else 0.5}, epochs=epochs, history=[],
                               model_uri="runs:/child/model", stop_reason=rank0.reason)

    monkeypatch.setattr("pipeline.tracking.runs.tracked_run", tracked_run)
    monkeypatch.setattr("pipeline.workflow.train_in_run", train_in_run)
    cfg = apply_overrides(Config(), {"train.checkpoint_dir": str(tmp_path),
                                     "tune.verdict_timeout_s": 30.0 if answer_in_time else 0.2})
    shared = SimpleNamespace(for_config=lambda c: (None, None))
    return run_trial(_Trial(answer), cfg, {}, shared, "parent", "s"), client


@pytest.mark.timeout(120)
def test_a_verdict_to_prune_after_rank_zero_stopped_waiting_leaves_the_trial_complete(tmp_path, monkeypatch):
    outcome, client = _run(tmp_path, monkeypatch, answer_in_time=False)
    assert (outcome.state, outcome.value, outcome.epochs) == ("COMPLETE", 0.25, 2)  # trained to the end
    assert client.tags == {"pruned": "false"}


@pytest.mark.timeout(120)
def test_a_verdict_to_prune_rank_zero_obeyed_prunes_the_trial(tmp_path, monkeypatch):
    outcome, client = _run(tmp_path, monkeypatch, answer_in_time=True)
    assert (outcome.state, outcome.value, outcome.epochs) == ("PRUNED", 0.5, 1)  # stopped after epoch 0
    assert outcome.reason.startswith("pruned by the median pruner after epoch 0")
    assert client.tags == {"pruned": "true", "pruned_at_epoch": "0"}
