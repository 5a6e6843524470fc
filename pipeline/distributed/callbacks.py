"""Lightning callbacks of the training loop: per-epoch accounting against the plan, stop signals, early stopping with
a minimum of epochs, atomic checkpoint writes (what a checkpoint records of its run, random states included:
pipeline/distributed/checkpoints/record.py)."""
from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any, Callable, Dict, List, Optional, Set

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

from pipeline.distributed.checkpoints.io import write_atomically
from pipeline.log import get_logger

log = get_logger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint to a temporary file in the same folder, fsyncs it, then renames it into place
    (`checkpoints.io.write_atomically`; FSDP's sharded folders: `checkpoints.io.write_sharded`).

    A crash during the write leaves the previous file under the final name intact.
    """

    # a test's fault hook (pipeline/distributed/faults.py): called with the checkpoint's path once its bytes are on
    # disk, before the rename
    part_written: Optional[Callable[[str], None]] = None

    def save_checkpoint(self, checkpoint: Dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        write_atomically(checkpoint, os.fspath(path), self.part_written)


class StopSignals(pl.Callback):
    """Every `check_every` steps, at each epoch's last step and at each epoch's end, the ranks agree (one small
    all-reduce) whether to stop: a non-finite loss on any rank in those steps, or SIGTERM received by any rank.
    On SIGTERM before the epoch's last step a last checkpoint of that step is written first. At the epoch's last step
    none is: written there, before the epoch's validation, a resume would take the epoch as finished (Lightning counts
    a checkpoint of an epoch's last step so) and it would never be validated, recorded, considered for best.ckpt or
    seen by early stopping; the epoch's validation and its end-of-epoch checkpoints run instead, and that last.ckpt is
    the stop's. (A resume cannot be made to validate such a checkpoint's epoch again: the epoch's training sums and
    row counts live in memory only.)

    Between decisions a step only keeps its (detached) loss tensor: no device op, no host-device sync and no
    collective per step; the window's losses are checked together when it is decided. The stop names the first step
    whose loss was non-finite.

    A SIGTERM stop decided before the epoch's last step (`mid_epoch`) ends the epoch where it is: its checkpoint is
    the mid-epoch one written here, which a resume continues at its step. What Lightning still runs once
    `should_stop` is set is held back for such an epoch: its validation (a partial epoch's, and time a launcher's
    grace period does not have), the epoch-end checkpoints (`EpochCheckpoint`: they would overwrite this one with one
    that marks the epoch finished), its record and report (`EpochAccounting`) and the driver's verdict.
    """

    def __init__(self, last_ckpt_path: Optional[str], check_every: int = 16) -> None:
        self.last_ckpt_path = last_ckpt_path
        self.check_every = max(1, int(check_every))
        self.reason: Optional[str] = None
        self.mid_epoch = False  # a SIGTERM stop decided before the epoch's last step (the same on every rank)
        self._term = False
        self._old_handler: Any = None
        self._losses: List[Optional[torch.Tensor]] = []  # this window's losses, as the steps left them (detached)
        self._steps: List[int] = []  # the global step of each loss

    def _on_term(self, signum, frame) -> None:
        self._term = True

    def on_train_start(self, trainer, pl_module) -> None:
        # After Lightning registered its own SIGTERM handler (which would raise SIGTERMException on each
        # rank at a different step, without a checkpoint), so this one replaces it for the run.
        import threading

        if threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGTERM, self._on_term)
        # Lightning 2.6 broadcasts its own SIGTERM flag from rank 0 and reads it on the host at EVERY step of a
        # torch.distributed run with several ranks (a collective and a host-device sync per step). The flag is set
        # by the handler replaced above, so it never rises: the broadcast is switched off for this run; SIGTERM is
        # decided here, once per window.
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if loop is not None and hasattr(loop, "_broadcast_sigterm_tensor"):
            loop._broadcast_sigterm_tensor = _nothing

    def on_fit_end(self, trainer, pl_module) -> None:
        self.restore()

    def restore(self) -> None:
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
            self._old_handler = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._losses.append(loss.detach() if isinstance(loss, torch.Tensor) else None)  # no op on the device
        # global_step already counts this step's optimizer update: the loss was computed at step - 1
        self._steps.append(trainer.global_step - 1)
        batches = trainer.num_training_batches
        last_of_epoch = isinstance(batches, int) and batch_idx + 1 >= batches
        if len(self._steps) >= self.check_every or last_of_epoch:
            self._decide(trainer, epoch_done=last_of_epoch)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._steps:  # a loader without a length: the epoch's last steps were not decided yet
            self._decide(trainer, epoch_done=True)

    def _decide(self, trainer, epoch_done: bool) -> None:
        """The one collective and host read of a window of steps; the same call on every rank (equal steps).
        `epoch_done`: the window ends with the epoch's last step."""
        steps, self._steps = self._steps, []
        losses, self._losses = self._losses, []
        device = trainer.strategy.root_device  # NCCL reduces device tensors only
        # slot i: 1 where this rank's loss of the window's i-th step was non-finite; the last slot: SIGTERM. Always
        # check_every + 1 long, so every window's collective has the same shape.
        flags = torch.zeros(max(self.check_every, len(steps)) + 1, dtype=torch.int32, device=device)
        kept = [(i, loss) for i, loss in enumerate(losses) if loss is not None]
        if kept:  # a sum is non-finite exactly when an element is (a loss is a scalar; a tensor one is summed)
            values = torch.stack([(loss if loss.dim() == 0 else loss.sum()).float().to(device) for _, loss in kept])
            bad = (~torch.isfinite(values)).int()
            if len(kept) == len(losses):  # every step had a loss: a slice, no index tensor sent to the device
                flags[:len(kept)] = bad
            else:
                flags[[i for i, _ in kept]] = bad
        flags[-1] = 1 if self._term else 0
        flags = trainer.strategy.reduce(flags, reduce_op="sum").cpu().tolist()
        bad = [step for step, flag in zip(steps, flags) if flag > 0]
        if bad:
            self.reason = f"non-finite training loss at step {bad[0]} (epoch {trainer.current_epoch})"
            log.error("stopping: %s", self.reason)
            trainer.should_stop = True
        elif flags[-1] > 0:
            self.reason = f"SIGTERM at step {trainer.global_step} (epoch {trainer.current_epoch})"
            if epoch_done:  # validated, then checkpointed at the epoch's end (see the class's docstring)
                log.warning("stopping: %s, the epoch's last step; its validation and end-of-epoch checkpoint follow",
                            self.reason)
            else:
                log.warning("stopping: %s; writing a last checkpoint", self.reason)
            if self.last_ckpt_path and not epoch_done:
                trainer.save_checkpoint(self.last_ckpt_path)
            trainer.should_stop = True
            if not epoch_done:
                self.mid_epoch = True
                # Lightning validates after a stop requested mid-epoch (`_should_check_val_fx`): not a partial epoch
                trainer.limit_val_batches = 0


def stopped_mid_epoch(trainer) -> bool:
    """Whether the run's StopSignals stopped it on SIGTERM before its epoch's last step (`StopSignals.mid_epoch`): the
    epoch is unfinished, and its mid-epoch checkpoint is the one to keep."""
    return any(isinstance(c, StopSignals) and c.mid_epoch for c in trainer.callbacks)


class EpochCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint that writes nothing at the end of an epoch stopped mid-way by SIGTERM
    (`stopped_mid_epoch`): StopSignals' mid-epoch `last.ckpt` stays, not one marking the partial epoch finished (a
    resume would skip the rest of that epoch and its validation), and no best.ckpt of a partial epoch is written.
    Its per-step hook is Lightning's own (`skip_idle_step_hooks` still skips it for a per-epoch checkpoint)."""

    @property
    def state_key(self) -> str:
        """ModelCheckpoint's own key (Lightning prefixes it with the class's name): a checkpoint written before this
        class, or by a plain ModelCheckpoint, restores its best score, best models and last path here too (under
        another key Lightning only warns and drops them, and the first validation after a resume would overwrite
        best.ckpt with a worse model)."""
        key = super().state_key
        own = type(self).__qualname__
        return ModelCheckpoint.__qualname__ + key[len(own):] if key.startswith(own) else key

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not stopped_mid_epoch(trainer):
            super().on_train_epoch_end(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not stopped_mid_epoch(trainer):
            super().on_validation_end(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if not stopped_mid_epoch(trainer):
            super().on_train_end(trainer, pl_module)


def last_batch_of_epoch(trainer, batch_idx: int) -> bool:
    """Whether batch `batch_idx` is its epoch's last: the same answer on every rank (equal steps per epoch)."""
    batches = trainer.num_training_batches
    if isinstance(batches, int):
        return batch_idx + 1 >= batches
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)  # a loader without a length
    return bool(getattr(getattr(loop, "batch_progress", None), "is_last_batch", False))


class LastCheckpoint(EpochCheckpoint):
    """`last.ckpt` alone, what a restart resumes from: after every epoch or, with `every_n_train_steps`, every N steps.
    No top-k copy beside it (save_top_k=0): Lightning's save_last goes with a top-k checkpoint, which wrote a full
    `latest.ckpt` / `step.ckpt` that nothing reads; so the epoch's last.ckpt is written here directly.

    A step checkpoint is not written at an epoch's last step: it would come before the epoch's validation, and a
    resume from it starts the next epoch (Lightning counts the epoch finished), so that epoch would never be
    validated, recorded, considered for best.ckpt or seen by early stopping. The epoch-end one follows the
    validation."""

    def __init__(self, dirpath: str, every_n_train_steps: Optional[int] = None) -> None:
        super().__init__(dirpath=dirpath, monitor=None, save_top_k=0, save_last=True,
                         every_n_train_steps=every_n_train_steps or None, enable_version_counter=False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not last_batch_of_epoch(trainer, batch_idx):  # the epoch-end checkpoint follows its validation
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _save_at_epoch_end(self, trainer) -> None:
        if (stopped_mid_epoch(trainer) or self._every_n_epochs < 1
                or (trainer.current_epoch + 1) % self._every_n_epochs != 0
                or self._should_skip_saving_checkpoint(trainer)):
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._should_save_on_train_epoch_end(trainer):
            self._save_at_epoch_end(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_at_epoch_end(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._every_n_epochs >= 1:  # a per-step one: the epoch-end one wrote the last.ckpt training ends with
            super().on_train_end(trainer, pl_module)


def _nothing() -> None:
    pass


class EpochAccounting(pl.Callback):
    """Counts the rows every rank read each epoch, checks them against the plan, and reports the epoch.

    `report(epoch_metrics, step)` runs on rank 0 only (MLflow logging); `history` keeps every epoch. `extra(trainer)`,
    a collective every rank calls at the epoch end (telemetry.RankResources.epoch_metrics), adds its fields.

    An epoch is recorded at its end (before the epoch-end checkpoints, which carry the history) and reported only once
    those checkpoints are written: at the next epoch's start, or at the end of training. A rank killed while writing
    them leaves the previous checkpoint, from which a restart trains the epoch again and reports it then, once: the
    metrics logged are always those of the epoch whose checkpoint the run continues from. An epoch stopped mid-way
    by SIGTERM (`stopped_mid_epoch`) is neither recorded nor reported: a resume from its mid-epoch checkpoint
    finishes it.

    Each epoch's confusion matrix (the model's `last_confusion` after the epoch's validation; rows = true class) is
    kept beside its record, in `confusion` by epoch: the registered epoch's is the one logged, not the last one's.
    """

    def __init__(self, report: Optional[Callable[[Dict[str, float], int], None]] = None,
                 extra: Optional[Callable[[Any], Dict[str, float]]] = None, run_id: Optional[str] = None) -> None:
        self.report = report
        self.extra = extra
        self.run_id = run_id  # the MLflow run this job trains in: each epoch recorded says so (`runs`)
        self.history: List[Dict[str, float]] = []
        self.runs: Dict[int, str] = {}  # epoch -> the run that trained it (a resumed run's history holds another's)
        self.confusion: Dict[int, List[List[int]]] = {}  # epoch -> its validation's confusion matrix
        self._unreported: List[Dict[str, float]] = []  # recorded epochs whose checkpoints are not written yet
        self._seen_confusion: Any = None  # the model's matrix last recorded (an epoch without validation keeps it)
        self._t0 = 0.0

    def state_dict(self) -> Dict[str, Any]:
        """Saved in every checkpoint: a run resumed from epoch k (a restart, an OOM back-off, train.ckpt_restore)
        keeps epochs 0..k-1 in its history, so its plots cover every epoch; and the checkpoint's own epoch is in it,
        recorded by the attempt that trained its weights (loop.weights_to_register reports that record, with its
        confusion matrix, never the history's best chosen again) (plain ints, floats and strings: loadable with
        weights_only)."""
        return {"history": [dict(h) for h in self.history],
                "confusion": {int(e): [list(row) for row in cm] for e, cm in self.confusion.items()},
                "runs": {int(e): str(r) for e, r in self.runs.items()}}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.history = [dict(h) for h in state_dict.get("history", [])]
        self.confusion = {int(e): [list(row) for row in cm] for e, cm in (state_dict.get("confusion") or {}).items()}
        runs = state_dict.get("runs")  # a checkpoint of before the record: whose its epochs were is not known
        self.runs = {int(e): str(r) for e, r in runs.items()} if isinstance(runs, dict) else {}

    def own_epochs(self) -> Set[int]:
        """The epochs of the history this job's run trained (an earlier attempt of it included), as recorded."""
        return {e for e, r in self.runs.items() if self.run_id is not None and r == self.run_id}

    @classmethod
    def recorded(cls, checkpoint: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """What a checkpoint (its dict, or an FSDP folder's meta.pt) records of this callback: {"history",
        "confusion"} as `state_dict` saved them; None when it records nothing of it."""
        state = (checkpoint.get("callbacks") or {}).get(cls.__qualname__)
        if not isinstance(state, dict):
            return None
        return {"history": [dict(h) for h in state.get("history", [])],
                "confusion": {int(e): cm for e, cm in (state.get("confusion") or {}).items()}}

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._report_written()  # the previous epoch's checkpoints were written after its end
        self._t0 = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        self._report_written()  # after the last epoch's checkpoints (Lightning runs them at the epoch end)

    def _report_written(self) -> None:
        unreported, self._unreported = self._unreported, []
        if self.report is not None:
            for epoch in unreported:
                self.report({k: v for k, v in epoch.items() if k != "epoch"}, int(epoch["epoch"]))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if stopped_mid_epoch(trainer):  # the same on every rank: no collective below is left half-called
            if trainer.is_global_zero:
                log.info("epoch %d stopped at step %d before its end: not recorded; a resume from its last checkpoint "
                         "continues it", trainer.current_epoch, trainer.global_step)
            return
        dm = trainer.datamodule
        elapsed = time.perf_counter() - self._t0
        train_loader, val_loader = dm.train_loader, dm.val_loader
        local = torch.tensor([float(train_loader.rows_read), float(val_loader.rows_read), train_loader.wait_s],
                             dtype=torch.float64, device=trainer.strategy.root_device)  # NCCL: device tensors only
        gathered = trainer.strategy.all_gather(local)
        gathered = (gathered.reshape(-1, 3) if gathered.dim() > 1 else gathered.reshape(1, 3)).cpu()
        train_rows = [int(v) for v in gathered[:, 0].tolist()]
        val_rows = [int(v) for v in gathered[:, 1].tolist()]
        wait = gathered[:, 2].tolist()
        if not trainer.should_stop:  # a stop mid-epoch (NaN, SIGTERM) reads less than planned, by design
            train_loader.check_rows()
            if val_loader.rows_read:
                val_loader.check_rows()
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.as_tensor(v).numel() == 1}
        epoch = {
            "epoch": trainer.current_epoch,
            "train_loss": metrics.get("train_loss", float("nan")),
            "train_acc": metrics.get("train_acc", float("nan")),
            "val_loss": metrics.get("val_loss", float("nan")),
            "val_acc": metrics.get("val_acc", float("nan")),
            "samples_per_sec": sum(train_rows) / elapsed if elapsed > 0 else 0.0,
            "data_wait_fraction": max(wait) / elapsed if elapsed > 0 else 0.0,
            "epoch_time_s": elapsed,
            "lr": float(trainer.optimizers[0].param_groups[0]["lr"]) if trainer.optimizers else float("nan"),
        }
        for r, n in enumerate(train_rows):
            epoch[f"rows_read_rank_{r}"] = float(n)
        for r, n in enumerate(val_rows):
            epoch[f"val_rows_read_rank_{r}"] = float(n)
        if self.extra is not None:
            epoch.update(self.extra(trainer))
        self.history.append(epoch)
        if self.run_id is not None:
            self.runs[int(trainer.current_epoch)] = self.run_id
        cm = getattr(pl_module, "last_confusion", None)
        if isinstance(cm, torch.Tensor) and cm is not self._seen_confusion:  # this epoch's validation made it
            self._seen_confusion = cm
            self.confusion[int(trainer.current_epoch)] = [[int(v) for v in row] for row in cm.cpu().tolist()]
        if trainer.is_global_zero:
            log.info("epoch %d: train_loss %.4f val_loss %.4f val_acc %.4f, %.0f samples/s, rows per rank %s",
                     epoch["epoch"], epoch["train_loss"], epoch["val_loss"], epoch["val_acc"],
                     epoch["samples_per_sec"], train_rows)
            self._unreported.append(epoch)  # reported once the epoch-end checkpoints are written


class DriverVerdict(pl.Callback):
    """At each epoch end rank 0 hands the epoch's metrics to the driver (`epoch-N.json` in `folder`) and waits, at
    most `timeout_s`, for its verdict (`verdict-N`: `continue`, or `stop: <why>`); one all-reduce shares a stop, so
    every rank ends at the same epoch boundary (a pruned trial of `lakehouse tune`). No verdict in time: training
    goes on, and rank 0 stops asking for the rest of the run (the driver cannot see the folder).
    """

    def __init__(self, folder: str, timeout_s: float) -> None:
        self.folder = folder
        self.timeout_s = float(timeout_s)
        self.reason: Optional[str] = None
        self._driver_answers = True

    def _ask(self, epoch: int, metrics: Dict[str, float]) -> Optional[str]:
        import json

        os.makedirs(self.folder, exist_ok=True)
        tmp = os.path.join(self.folder, f".epoch-{epoch}.json.tmp")
        with open(tmp, "w") as fh:
            json.dump({"epoch": epoch, "metrics": metrics}, fh)
        os.replace(tmp, os.path.join(self.folder, f"epoch-{epoch}.json"))
        path = os.path.join(self.folder, f"verdict-{epoch}")
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if os.path.exists(path):
                with open(path) as fh:
                    return fh.read().strip()
            time.sleep(0.01)
        log.warning("no verdict from the driver for epoch %d within %.0f s (%s); training goes on without asking",
                    epoch, self.timeout_s, self.folder)
        self._driver_answers = False
        return None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if stopped_mid_epoch(trainer):  # no verdict on a partial epoch (the same on every rank: no collective)
            return
        epoch = trainer.current_epoch
        verdict = None
        if trainer.is_global_zero and self._driver_answers:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.as_tensor(v).numel() == 1}
            verdict = self._ask(epoch, metrics)
        stop = 1.0 if verdict and verdict.startswith("stop") else 0.0
        device = trainer.strategy.root_device  # NCCL reduces device tensors only
        flags = trainer.strategy.reduce(torch.tensor([stop], device=device), reduce_op="sum")
        if float(flags[0]) > 0:
            why = verdict.split(":", 1)[1].strip() if verdict and ":" in verdict else "asked by the driver"
            self.reason = f"stopped by the driver after epoch {epoch}: {why}"
            if trainer.is_global_zero:
                log.warning("stopping: %s", self.reason)
            trainer.should_stop = True


class ResumedOptimizer(pl.Callback):
    """On a resume, says when the optimizer state restored from the checkpoint (rate, momentum or Adam's beta1, weight
    decay, per parameter group) differs from the one this job's config builds: Lightning restores the checkpoint's
    optimizer and schedule, so the checkpoint's values train and the config's (model.lr, model.momentum,
    model.weight_decay) are not applied. Logged as a warning on rank 0 naming both values, and handed to
    `on_mismatch(text)` (the run's tag) so the MLflow run does not show only the config's value.

    The config's optimizer is read at `on_fit_start` (built, not restored yet), the restored one at `on_train_start`.
    """

    KEYS = ("initial_lr", "momentum", "betas", "weight_decay")  # initial_lr: the rate before the schedule's factor

    def __init__(self, on_mismatch: Optional[Callable[[str], None]] = None) -> None:
        self.on_mismatch = on_mismatch
        self.differences: List[str] = []
        self._built: Optional[List[Dict[str, Any]]] = None

    @classmethod
    def _settings(cls, trainer) -> List[Dict[str, Any]]:
        settings = []
        for i, group in enumerate(trainer.optimizers[0].param_groups if trainer.optimizers else []):
            entry = {"name": group.get("name", str(i)), "initial_lr": group.get("initial_lr", group.get("lr"))}
            entry.update({k: group[k] for k in cls.KEYS[1:] if k in group})
            settings.append(entry)
        return settings

    def on_fit_start(self, trainer, pl_module) -> None:
        self._built = self._settings(trainer) if trainer.ckpt_path else None

    def on_train_start(self, trainer, pl_module) -> None:
        if not self._built:
            return
        restored = self._settings(trainer)
        for built, kept in zip(self._built, restored):
            for key in self.KEYS:
                ours, theirs = built.get(key), kept.get(key)
                if ours is None or theirs is None or _close(ours, theirs):
                    continue
                what = "lr (before the schedule)" if key == "initial_lr" else key
                self.differences.append(f"{what} of parameter group '{built['name']}': checkpoint {theirs!r}, "
                                        f"config {ours!r}")
        if self.differences and trainer.is_global_zero:
            text = "; ".join(self.differences)
            log.warning("resuming from %s: its optimizer state differs from this job's config (%s); the checkpoint's "
                        "values train (Lightning restores the optimizer and its schedule on resume; the config's "
                        "model.lr / model.momentum / model.weight_decay apply to a run started from scratch)",
                        trainer.ckpt_path, text)
            if self.on_mismatch is not None:
                self.on_mismatch(text)


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    try:
        return abs(float(a) - float(b)) <= 1e-9 + 1e-6 * abs(float(b))
    except (TypeError, ValueError):
        return a == b


def host_and_pid() -> Dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def min_epochs_of(min_epochs: Optional[int], patience: int, warmup_epochs: int, max_epochs: int) -> int:
    """The epochs early stopping must let run (`train.early_stopping.min_epochs`); null: the warm-up plus two
    patience windows (see the key's comment in pipeline/config.py), never more than `max_epochs`."""
    wanted = warmup_epochs + 2 * patience if min_epochs is None else min_epochs
    return max(0, min(int(wanted), int(max_epochs)))


class MinEpochsEarlyStopping(EarlyStopping):
    """Lightning's EarlyStopping that cannot stop before `min_epochs` epochs have run: before then a patience or
    threshold stop is held (counted, logged, not acted on), so at the first epoch allowed it stops if patience is
    still exhausted. A non-finite metric still stops at once.

    Not Trainer(min_epochs=...): Lightning's minimum holds back every `trainer.should_stop`, so a SIGTERM or a NaN
    loss (StopSignals) would keep training until the minimum; this holds back early stopping alone.
    """

    def __init__(self, *args: Any, min_epochs: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.min_epochs = int(min_epochs)
        self._epoch = 0
        self.held: List[int] = []  # the epochs whose early stop was held back by the minimum

    def _run_early_stopping_check(self, trainer: "pl.Trainer") -> None:
        self._epoch = trainer.current_epoch
        super()._run_early_stopping_check(trainer)

    def _evaluate_stopping_criteria(self, current: torch.Tensor):
        should_stop, reason = super()._evaluate_stopping_criteria(current)
        if should_stop and bool(torch.isfinite(current)) and self._epoch + 1 < self.min_epochs:
            self.held.append(self._epoch)
            if hasattr(self, "stopping_reason"):
                self.stopping_reason = type(self.stopping_reason).NOT_STOPPED
            log.info("early stopping held at epoch %d (train.early_stopping.min_epochs=%d): %s", self._epoch,
                     self.min_epochs, reason)
            return False, None
        return should_stop, reason


# The callback hooks Lightning calls in every training step, for every callback.
STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
              "on_before_zero_grad", "on_train_batch_end")


def skip_idle_step_hooks(callbacks: List[pl.Callback]) -> List[str]:
    """Lightning calls each of STEP_HOOKS on every callback in every step, each call inside a profiler context and
    with the callback's state key formatted (a dict's repr for a checkpoint or early-stopping callback): ~3 us a
    call, ~60 calls a step with the training loop's callbacks. A hook the callback does not override does nothing,
    so it is set to None on the instance, which Lightning skips (`callable(fn)` in trainer.call._call_callback_hooks);
    so is a ModelCheckpoint's on_train_batch_end when it saves per epoch only (no every_n_train_steps, no
    train_time_interval: the hook returns at once). Returns the hooks skipped, as `<class>.<hook>`."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    skipped = []
    for callback in callbacks:
        for name in STEP_HOOKS:
            idle = getattr(type(callback), name, None) is getattr(pl.Callback, name)
            if (not idle and name == "on_train_batch_end" and isinstance(callback, ModelCheckpoint)
                    and type(callback).on_train_batch_end in (ModelCheckpoint.on_train_batch_end,
                                                              LastCheckpoint.on_train_batch_end)):
                idle = not callback._every_n_train_steps and callback._train_time_interval is None
            if idle:
                setattr(callback, name, None)
                skipped.append(f"{type(callback).__name__}.{name}")
    return skipped


def progress_bar(interval_s: float = 0.5) -> pl.Callback:
    """Rank 0's progress bar: Lightning's tqdm bar, redrawn at most every `interval_s` seconds and at an epoch's
    last step, not at every step. Lightning's default (its Rich bar where rich is installed) redraws every step and
    runs a refresh thread beside: 0.3 ms a step on a 2-core CPU (`lakehouse bench --only step_overhead`)."""
    from pytorch_lightning.callbacks import TQDMProgressBar

    class ThrottledProgressBar(TQDMProgressBar):
        def __init__(self) -> None:
            super().__init__(refresh_rate=1)
            self._next_draw = 0.0

        def _should_update(self, current: int, total: int) -> bool:
            if not self.is_enabled:
                return False
            now = time.monotonic()
            if current == total or now >= self._next_draw:
                self._next_draw = now + interval_s
                return True
            return False

    return ThrottledProgressBar()


def quiet_profiler() -> Any:
    """Lightning's pass-through profiler without its cost: Lightning wraps every hook it calls (~40 a step) in
    `profiler.profile(name)`, a generator-based context manager even when nothing is recorded; this one hands back
    one reusable null context."""
    import contextlib

    from pytorch_lightning.profilers import PassThroughProfiler

    class QuietProfiler(PassThroughProfiler):
        _null = contextlib.nullcontext()

        def profile(self, action_name: str) -> Any:
            return self._null

    return QuietProfiler()
