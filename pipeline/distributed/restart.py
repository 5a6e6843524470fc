"""The restart policy: when a launch fails, whether and how every rank is relaunched (a restart from the last
checkpoint, an OOM back-off with half the per-rank batch, an elastic relaunch on the task slots left), and the
checkpoint each relaunch resumes from, restated for its batch and world size. A restore point in another run's folder
is taken once, whole, into this job's own folder before anything reads it, and checked there before the first
launch."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, List, Optional

from pipeline.data.plan import RunPlan, halved
from pipeline.data.source import data_for_launch
from pipeline.distributed.checkpoints.layout import (discard_snapshot, identity, last_checkpoint, resolve_restore_point,
                                                     settle, snapshot)
from pipeline.distributed.early_start import EarlyRanks
from pipeline.distributed.executors import cluster_slots
from pipeline.distributed.launcher import launch
from pipeline.distributed.loop import RankResult, TrainJob
from pipeline.distributed.rank_failures import DistributedTrainingError
from pipeline.log import get_logger

log = get_logger(__name__)


def _not_restartable() -> tuple:
    """The classes of failures a relaunch cannot get past: errors in the job's own inputs (configuration, data, plan,
    checkpoint), SIGTERM, Ctrl-C."""
    from pipeline.config import ConfigError
    from pipeline.data.shards import ConversionError
    from pipeline.distributed.checkpoints.io import CheckpointError
    from pipeline.lakehouse.partition import PlanError
    from pipeline.errors import Terminated

    return Terminated, ConfigError, ConversionError, PlanError, CheckpointError, KeyboardInterrupt


def is_restartable(exc: BaseException) -> bool:
    """Whether a relaunch from the last checkpoint can get past `exc`: a rank died, a collective timed out, a rank ran
    out of memory. Not when `exc`, or the exception any rank recorded (`DistributedTrainingError.rank_classes`: each
    rank's class and bases, so a rank's ConfigError counts as one), is of a `_not_restartable` class."""
    classes = _not_restartable()
    if isinstance(exc, classes):
        return False
    names = {f"{c.__module__}.{c.__qualname__}" for c in classes}
    return not any(names.intersection(found) for found in getattr(exc, "rank_classes", {}).values())


def _elastic_world(job: TrainJob, world: int, exc: BaseException) -> int:
    """The ranks a relaunch after `exc` gets: `world`, or with `train.min_np` set (ranks as Spark tasks) and fewer
    task slots left on the cluster, the slots left.

    Raises:
        DistributedTrainingError: fewer slots left than `train.min_np`."""
    min_np = job.cfg.train.min_np
    if not min_np or job.cfg.train.np <= 1:
        return world
    slots = cluster_slots()
    if slots >= world:
        return world
    if slots < min_np:
        raise DistributedTrainingError(f"{exc}; the cluster has {slots} task slot(s) left for the ranks, fewer than "
                                       f"train.min_np={min_np}", getattr(exc, "rank_classes", None)) from exc
    log.warning("elastic: %d task slot(s) left of the %d ranks; going on with %d (train.min_np=%d)", slots, world,
                slots, min_np)
    return slots


def _restated(job: TrainJob, path: str, plan: RunPlan, first: tuple) -> str:
    """Checkpoint `path` for a launch of `plan`: itself when it records that plan's per-rank batch and world size,
    else restated from what it records (`restate.restated`) into the job's own checkpoint folder (never beside another
    run's checkpoint); one that records neither is taken as trained like the job's first launch (`first`: its
    per-rank batch and world size)."""
    from pipeline.distributed.checkpoints.restate import restated

    return restated(path, plan.steps_per_epoch, plan.batch_size, plan.world_size, plan.lr_scaling, unrecorded=first,
                    folder=job.ckpt_dir)


def _first_restore_point(job: TrainJob, path: str) -> str:
    """The given restore point `path`, as every launch of the job resumes it: another run's checkpoint (which that run
    may be saving right now) taken once, whole, into this job's own folder (`layout.snapshot`: hard links where the
    file system allows, else a copy), so the driver's checks, every rank's and Lightning's load read the same step;
    then checked (`record.check_resume`: the train/validation split, the optimizer and its parameter groups) before
    any rank starts.

    Raises:
        CheckpointError: it cannot be taken, or this job's config cannot resume it; naming the file (not restartable).
    """
    from pipeline.distributed.checkpoints.io import CheckpointError
    from pipeline.distributed.checkpoints.record import check_resume

    try:
        taken = snapshot(path, job.ckpt_dir)
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be taken into this job's folder {job.ckpt_dir}: "
                              f"{exc}") from exc
    try:
        check_resume(taken, job.cfg, job.plan.lr)
    except CheckpointError as exc:
        if taken == path:
            raise
        discard_snapshot(taken, job.ckpt_dir)
        raise type(exc)(f"{exc} (the snapshot of train.ckpt_restore's {path} this job took as it started)") from exc
    return taken


def launch_with_restarts(job: TrainJob, on_restart: Optional[Callable[[int, str], None]] = None,
                         on_batch: Optional[Callable[[int, Any, str], None]] = None,
                         on_world: Optional[Callable[[int, str], None]] = None,
                         early: Optional[EarlyRanks] = None) -> List[RankResult]:
    """`launch`, and when it fails, stop every rank and relaunch all of them (same run, pinned version and data):

    - a rank died or a collective timed out: from the last checkpoint this job wrote, up to `train.max_restarts`
      times;
    - a rank ran out of memory with `data.batch_size: auto` or `train.oom_backoff: true` (pipeline/distributed/
      backoff.py): with half the per-rank batch, the plan re-made for equal steps, from where the job started when it
      had written no checkpoint yet (not a restart), else from the last checkpoint (a restart, within
      `train.max_restarts`);
    - elastic, with `train.min_np` (ranks as Spark tasks): a restart when fewer task slots are left than ranks (a host
      lost) goes on with the slots left, down to `train.min_np`: the plan re-made for the new world size (equal
      steps), the checkpoint restated for the smaller global batch (steps, schedule, rates).

    Every launch, the first included, resumes its checkpoint (the given one, or the job's own last one) restated
    when it records another per-rank batch, world size or number of steps per epoch than that launch's
    (`restate.restated`). A given one in another run's folder is taken into this job's folder once, before the first
    launch, and every launch resumes that snapshot (`_first_restore_point`). "The job's own last one" is a last.ckpt
    written since the job started: one that is not the file (or folder) that name held then (`layout.identity`: a
    save renames a new one in), whatever the file server's clock says against this machine's.
    `on_restart(n, cause)` is told of each restart, `on_batch(n, plan, cause)` of each back-off, with the new
    shard plan, and `on_world(ranks, cause)` of each elastic change (the driver records them in MLflow). `early`: the
    first launch's ranks, started before the job was made (pipeline/distributed/early_start.py); a relaunch starts its
    own.

    Raises:
        DistributedTrainingError: the failure that spent the last restart (with how many were made).
        ConfigError: out of memory at 1 sample per rank (`data.batch_size`).
    """
    from pipeline.distributed.backoff import is_out_of_memory

    limit = max(0, job.cfg.train.max_restarts)
    last = last_checkpoint(job.ckpt_dir)
    restarts = backoffs = 0
    first = (job.plan.batch_size, job.plan.world_size)  # taken for a given checkpoint that records neither
    # the checkpoint the first launch resumes from, as a path and settled; one that does not exist is left to the
    # ranks, which refuse it naming the key
    restore_first = resolve_restore_point(job.plan.restore_from, job.ckpt_dir, job.cfg.train.checkpoint_dir,
                                          required=False)
    before = identity(last)  # what last.ckpt was as the job started: another job's, or none
    if restore_first and os.path.exists(restore_first):  # taken and checked; restated when it records another plan
        restore_first = _first_restore_point(job, restore_first)
        job = dataclasses.replace(job, plan=dataclasses.replace(
            job.plan, restore_from=_restated(job, restore_first, job.plan, first)))
    while True:
        try:
            started_early, early = early, None  # only the first launch's ranks were started ahead
            return launch(job, started_early)
        except Exception as exc:
            cause = f"{type(exc).__name__}: {exc}"
            settle(last)  # a swap of FSDP's last checkpoint a killed rank interrupted is finished first
            # only a checkpoint this job wrote (another file than the name held as it started, by what the file
            # system says of it: no clock of this machine compared with the file server's)
            now = identity(last)
            fresh = now is not None and now != before
            oom = is_restartable(exc) and is_out_of_memory(exc) and job.plan.backs_off
            if oom:
                halved(job.plan.batch_size, cause)  # ConfigError at 1 per rank, before the restart limit is looked at
            if fresh or not oom:  # a relaunch from a checkpoint (or after a non-OOM failure) is a restart
                if restarts >= limit or not is_restartable(exc):
                    if restarts:
                        raise DistributedTrainingError(f"{exc} (after {restarts} restart(s) of train.max_restarts="
                                                       f"{limit})", getattr(exc, "rank_classes", None)) from exc
                    if oom:
                        raise DistributedTrainingError(
                            f"{exc} (out of memory after this job's first checkpoint: restarting from it with half "
                            f"the batch is a restart, and train.max_restarts={limit})",
                            getattr(exc, "rank_classes", None)) from exc
                    raise
                restarts += 1
                if on_restart is not None:
                    on_restart(restarts, cause)
            restore = last if fresh else restore_first
            was = job.plan
            new_world = was.world_size if oom else _elastic_world(job, was.world_size, exc)
            plan = was.relaunched(restore_from=None, out_of_memory=oom, world_size=new_world, cause=cause)
            # the user's config stays as it is; the job carries the re-derived plan and the data it reads, planned
            # again for it (direct data on fewer ranks: its pinned files shared out anew, data.source=direct)
            data, plan = data_for_launch(job.data, was, plan)
            if new_world != was.world_size and on_world is not None:
                on_world(new_world, cause)
            if restore and os.path.exists(restore):  # by the batch and world size IT records, not the last launch's
                restore = _restated(job, restore, plan, first)
            if oom:
                backoffs += 1
                log.warning("out of memory: relaunching every rank with %d samples per rank (was %d) from %s: %s",
                            plan.batch_size, was.batch_size, restore or "the start", cause)
                if on_batch is not None:
                    on_batch(backoffs, plan.shards, cause)
            else:
                log.warning("restart %d of %d (train.max_restarts) from %s after: %s", restarts, limit,
                            restore or "the start", cause)
            job = dataclasses.replace(job, plan=dataclasses.replace(plan, restore_from=restore or None), data=data)
