"""Fault injection for tests (the config's `debug:` section), as a Lightning callback: nothing of it reaches the model.

`debug.fail_at_step` raises on a rank (`debug.fail_rank`) from a global step on (`debug.fail_with`: an error, a CUDA
out-of-memory, or a rank that hangs), `debug.nan_at_step` makes the training loss NaN, `debug.kill_while_saving`
SIGKILLs a rank while it writes `last.ckpt` (its part on disk, the checkpoint not yet complete). The LightningModule
never sees these keys, so no checkpoint's hyperparameters and no registered model carry them. Every fault hits a job's
first attempt only: a relaunch (train.max_restarts, an OOM back-off) runs clean.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, List, Optional

import pytorch_lightning as pl
import torch

from pipeline.config import DebugConfig
from pipeline.distributed.checkpoints.layout import is_last
from pipeline.log import get_logger

log = get_logger(__name__)

def wanted(debug: DebugConfig) -> bool:
    """Whether `debug` asks for any fault."""
    return any(v is not None for v in (debug.fail_at_step, debug.nan_at_step, debug.kill_while_saving))


class InjectedFaults(pl.Callback):
    """The faults `debug` asks for, on this launch when `first_attempt` (none on a relaunch)."""

    def __init__(self, debug: DebugConfig, first_attempt: bool = True) -> None:
        self.debug = debug
        self.active = bool(first_attempt)
        self._trainer: Optional[pl.Trainer] = None
        self._hooks: List[Any] = []

    def _on_this_rank(self, trainer) -> bool:
        return self.debug.fail_rank in (None, trainer.global_rank)

    # -------------------------------------------------------------------------------------------- set up, torn down
    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.active:
            return
        self._trainer = trainer
        if self.debug.nan_at_step is not None:
            self._hooks.append(pl_module.register_forward_hook(self._nan_output))
        if self.debug.kill_while_saving is not None and self._on_this_rank(trainer):
            # FSDP's strategy writes its shards itself; other strategies write through their checkpoint IO
            for writer in (trainer.strategy, getattr(trainer.strategy, "checkpoint_io", None)):
                if writer is not None and hasattr(writer, "part_written"):
                    writer.part_written = self._part_written

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for writer in (trainer.strategy, getattr(trainer.strategy, "checkpoint_io", None)):
            if getattr(writer, "part_written", None) == self._part_written:
                writer.part_written = None

    # ------------------------------------------------------------------------------------------------------- faults
    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        """debug.fail_at_step, after the step's forward and before its backward: where a step really fails (a rank
        stuck there has taken part in the forward's collectives, DDP's buffer broadcast, FSDP's gathers)."""
        step, at = trainer.global_step, self.debug.fail_at_step
        if not self.active or at is None or step < at or not self._on_this_rank(trainer):
            return
        what = f"injected failure at step {step} on rank {trainer.global_rank} (debug.fail_at_step)"
        if self.debug.fail_with == "oom":  # what a CUDA out-of-memory raises (debug.fail_with=oom)
            raise torch.OutOfMemoryError(f"CUDA out of memory: {what}")
        if self.debug.fail_with == "hang":  # a stuck rank (a deadlock, a hung kernel): alive, never reaching a collective
            log.warning("%s: this rank stops answering (debug.fail_with=hang)", what)
            deadline = time.monotonic() + 3600
            while time.monotonic() < deadline:
                time.sleep(1)
        raise RuntimeError(what)

    def _nan_output(self, module, inputs, output):
        """A forward hook on the LightningModule: from debug.nan_at_step on, training outputs (so the loss) are NaN."""
        trainer = self._trainer
        if trainer is None or not trainer.training or trainer.global_step < self.debug.nan_at_step:
            return None
        return output * float("nan")

    def _part_written(self, path: str) -> None:
        trainer = self._trainer
        if (trainer is None or not is_last(path)  # the checkpoint a restart resumes from
                or trainer.global_step < self.debug.kill_while_saving):
            return
        log.warning("injected kill of rank %d while writing %s at step %d (debug.kill_while_saving): its part is on "
                    "disk, the checkpoint is not complete", trainer.global_rank, path, trainer.global_step)
        for handler in logging.getLogger().handlers:  # its last words reach the job's log before the kill
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
