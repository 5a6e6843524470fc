"""Checkpoint and tracking overhead: the share of the project's train loop's epochs spent writing checkpoints and
logging each epoch to MLflow (both timed in one single-process train() run)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from typing import List, Tuple

from bench.core import Result, Sizes, median, patched
from pipeline.config import Config
from pipeline.tracking.runs import temporary_env


def measure_train_overheads(cfg: Config, prep, sizes: Sizes, run) -> List[Result]:
    """The project's train loop (one process) for warm-up + `repeats` + 1 epochs, logging into `run`.

    Checkpoint writes (AtomicCheckpointIO.save_checkpoint) and RankZeroTracker.log_epoch are timed by wrappers;
    an epoch is the time between two epoch starts (steps, validation, checkpoints, logging). Epoch 0 is the
    warm-up and the last epoch (no next start) is not used.
    """
    from pipeline.distributed import callbacks as cb
    from pipeline.distributed.loop import TrainJob, train
    from pipeline.tracking.rank_zero import RankZeroTracker

    epochs = sizes.repeats + 2
    ckpt_dir = os.path.join(cfg.train.checkpoint_dir, "bench", prep.name)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    bcfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, max_epochs=epochs, checkpoint_dir=ckpt_dir, ckpt_restore=None,
                                  backend="single", np=1, warmup_epochs=0,
                                  early_stopping=dataclasses.replace(cfg.train.early_stopping, enabled=False)))
    starts: List[float] = []
    saves: List[Tuple[float, float]] = []
    logs: List[Tuple[float, float]] = []

    def timed(into):
        def make(original):
            def wrapper(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return original(*a, **kw)
                finally:
                    into.append((t0, time.perf_counter() - t0))
            return wrapper
        return make

    def epoch_start(original):
        def wrapper(self, trainer, pl_module):
            starts.append(time.perf_counter())
            return original(self, trainer, pl_module)
        return wrapper

    job = TrainJob(cfg=bcfg, data=prep.data1, delta_table=prep.table, delta_version=prep.version,
                   run_id=run.run_id, tracking_uri=run.tracking_uri, tracker=RankZeroTracker,
                   job_dir=os.path.join(ckpt_dir, ".job"))
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(cb.AtomicCheckpointIO, "save_checkpoint", timed(saves)))
        stack.enter_context(patched(RankZeroTracker, "log_epoch", timed(logs)))
        stack.enter_context(patched(RankZeroTracker, "finish", lambda original: lambda *a, **kw: None))
        stack.enter_context(patched(cb.EpochAccounting, "on_train_epoch_start", epoch_start))
        stack.enter_context(temporary_env({"LAKEHOUSE_PROGRESS": "0"}))
        train(job)
    ckpt_ratios, track_ratios, epoch_s, save_s, log_s = [], [], [], [], []
    for i in range(1, len(starts) - 1):
        a, b = starts[i], starts[i + 1]
        e = b - a
        s = sum(d for t, d in saves if a <= t < b)
        lg = sum(d for t, d in logs if a <= t < b)
        epoch_s.append(e)
        save_s.append(s)
        log_s.append(lg)
        ckpt_ratios.append(s / e)
        track_ratios.append(e / (e - lg))
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    steps = prep.data1.plan.train.steps_per_epoch
    return [
        Result("checkpoint_overhead", prep.name, median(ckpt_ratios),
               {"checkpoint_s_per_epoch": median(save_s), "epoch_s": median(epoch_s),
                "checkpoints_per_epoch": len(saves) / max(1, len(starts)), "steps_per_epoch": steps},
               len(ckpt_ratios), ckpt_ratios),
        Result("tracking_overhead", prep.name, median(track_ratios),
               {"step_s_with_logging": median(epoch_s) / steps,
                "step_s_without_logging": (median(epoch_s) - median(log_s)) / steps,
                "log_epoch_s": median(log_s), "tracking_uri": run.tracking_uri},
               len(track_ratios), track_ratios),
    ]

