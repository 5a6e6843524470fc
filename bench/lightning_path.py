"""Timing the product's own training path: pipeline.distributed.loop.train() (Lightning, the given strategy, the
real ShardLoader or the same model on batches held in memory), step by step, without changing what it runs."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from typing import Any, Dict, List, Optional

from bench.core import patched
from pipeline.config import Config
from pipeline.log import get_logger

log = get_logger(__name__)


class MemoryLoader:
    """Stands in for a ShardLoader: the same batches, held in memory (on `device`), `steps` per pass."""

    keeps_in_memory = True

    def __init__(self, batches: List[Any], steps: int) -> None:
        self.batches = batches
        self.steps = steps
        self.rows_read = 0
        self.wait_s = 0.0
        self._i = 0

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        self.rows_read = 0
        for _ in range(self.steps):
            x, y = self.batches[self._i % len(self.batches)]
            self._i += 1
            self.rows_read += len(y)
            yield x, y

    def check_rows(self) -> None:
        pass

    def close(self) -> None:
        pass


def memory_datamodule(batches: List[Any], steps_per_epoch: int, val_steps: int = 2):
    """A LightningDataModule serving `batches` from memory: `steps_per_epoch` train batches, `val_steps` val ones."""
    import pytorch_lightning as pl

    class MemoryDataModule(pl.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.train_loader = MemoryLoader(batches, steps_per_epoch)
            self.val_loader = MemoryLoader(batches, min(val_steps, len(batches)))

        def train_dataloader(self):
            return self.train_loader

        def val_dataloader(self):
            return self.val_loader

        def teardown(self, stage: str) -> None:
            pass

    return MemoryDataModule()


def step_windows(stamps: List[tuple], warmup: int, steps: int, windows: int) -> Dict[str, Any]:
    """From (epoch, wall, process CPU, thread CPU) stamps taken at every training_step start: the intervals within an
    epoch (epoch ends run validation and checkpoints, which are not steps), the first `warmup` dropped, then
    `windows` windows of `steps` intervals: wall, process CPU and training-thread CPU seconds of each, and the wall
    seconds of the dropped warm-up intervals (`warmup_s`: a compiled network's compilation happens there)."""
    intervals = [(b[1] - a[1], b[2] - a[2], b[3] - a[3]) for a, b in zip(stamps, stamps[1:]) if a[0] == b[0]]
    timed = intervals[warmup:warmup + steps * windows]
    if len(timed) < steps * windows:
        raise RuntimeError(f"the train run gave {len(intervals)} step intervals, {warmup + steps * windows} needed")
    out: Dict[str, Any] = {"window_s": [], "cpu_s": [], "main_thread_cpu_s": [],
                           "warmup_s": sum(c[0] for c in intervals[:warmup])}
    for w in range(windows):
        chunk = timed[w * steps:(w + 1) * steps]
        out["window_s"].append(sum(c[0] for c in chunk))
        out["cpu_s"].append(sum(c[1] for c in chunk))
        out["main_thread_cpu_s"].append(sum(c[2] for c in chunk))
    return out


def timed_train(cfg: Config, data, rank: int, world: int, make_strategy, warmup: int, steps: int, windows: int,
                batches: Optional[List[Any]] = None, precision: Optional[str] = None,
                train_kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One call of the product's train() on shard `rank` of `world`, stopped once the windows are complete.

    `batches`: serve these (held in memory) instead of the real ShardLoader, through a data module that replaces
    make_datamodule for this call. `precision`: train.precision (None: the config's). `train_kwargs`: train()'s
    other arguments (DDP's `devices`, `local_rank`, `local_world_size`). Step times are taken
    at each ImageClassifier.training_step start; once enough steps ran, the wrapper sets trainer.should_stop (at the
    same step on every rank, since their epochs have the same steps). Checkpoints go to a temporary folder; no MLflow.
    """
    import pipeline.data.datamodule as datamodule
    from pipeline.distributed.loop import TrainJob, train
    from pipeline.model.module import ImageClassifier

    need = warmup + steps * windows
    spe = data.plan.train.steps_per_epoch
    epochs = need // max(1, spe - 1) + 2
    ckpt_dir = tempfile.mkdtemp(prefix=f"bench-train-r{rank}-")
    train_cfg = dataclasses.replace(
        cfg.train, max_epochs=epochs, checkpoint_dir=ckpt_dir, ckpt_restore=None, warmup_epochs=0,
        early_stopping=dataclasses.replace(cfg.train.early_stopping, enabled=False))
    if precision is not None:
        train_cfg = dataclasses.replace(train_cfg, precision=precision)
    bcfg = dataclasses.replace(cfg, train=train_cfg)
    stamps: List[tuple] = []
    counted = [0]
    import torch

    # On a GPU the queue is drained where a window starts or ends (never inside one), so a window's wall time is
    # the time its steps took on the device, not only their launch.
    boundaries = {warmup + k * steps for k in range(windows + 1)} if torch.cuda.is_available() else set()

    def stamping(original):
        def wrapper(self, batch, batch_idx):
            if stamps and stamps[-1][0] == self.current_epoch and counted[0] + 1 in boundaries:
                torch.cuda.synchronize()
            now = (self.current_epoch, time.perf_counter(), time.process_time(), time.thread_time())
            if stamps and stamps[-1][0] == now[0]:
                counted[0] += 1
            stamps.append(now)
            if counted[0] >= need:
                self.trainer.should_stop = True
            return original(self, batch, batch_idx)
        return wrapper

    job = TrainJob(cfg=bcfg, data=data, delta_table="bench", delta_version=0,
                   job_dir=os.path.join(ckpt_dir, ".job"))
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(ImageClassifier, "training_step", stamping))
        if batches is not None:
            dm = memory_datamodule(batches, spe)
            stack.enter_context(patched(datamodule, "make_datamodule", lambda original: lambda *a, **kw: dm))
        try:
            result = train(job, rank, world, make_strategy(), **(train_kwargs or {}))
        finally:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
    out = step_windows(stamps, warmup, steps, windows)
    waits = [h["data_wait_fraction"] for h in result.history if "data_wait_fraction" in h]  # the product's own
    out.update({"steps": steps, "batch_size": len(batches[0][1]) if batches else data.plan.train.batch_size,
                "wall_s": time.perf_counter() - t0, "epochs": result.epochs,
                "data_wait_fraction_per_epoch": waits})
    return out
