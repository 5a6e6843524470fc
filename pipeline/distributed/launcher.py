"""The launcher: `train.np` with HorovodRunner's meaning (-N local processes, N Spark tasks, 1 this process)."""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

from pipeline import preload
from pipeline.config import Config
from pipeline.distributed.checkpoints.layout import last_checkpoint, resolve_restore_point, settle
from pipeline.distributed.loop import RankResult, TrainJob, train
from pipeline.distributed.rank_process import (ddp_worker, fsdp_worker, horovod_rank_process, horovod_worker,
                                               with_env)
from pipeline.distributed.executors import (cluster_slots, driver_nics, executor_addresses, spark_context,
                                            unanswering_executors)
from pipeline.distributed.rank_env import executor_env, rank_environment
from pipeline.distributed.rank_signals import forward_sigterm
from pipeline.log import get_logger

log = get_logger(__name__)


class DistributedTrainingError(RuntimeError):
    """A rank failed; the message names the rank and its exception, `rank_classes` the classes each failed rank
    recorded (rank -> dotted class names, most specific first: `rank_process.error_classes`)."""

    def __init__(self, message: str, rank_classes: Optional[Dict[int, List[str]]] = None) -> None:
        super().__init__(message)
        self.rank_classes: Dict[int, List[str]] = dict(rank_classes or {})


# How a collective that ran past the process group's timeout reads (gloo; NCCL's watchdog)
COLLECTIVE_TIMEOUT_MARKS = ("Timed out waiting", "Watchdog caught collective operation timeout")


# A rank that started and left neither an error nor a result (rank_process.rank_record)
SILENT_RANK = ("ended without reporting an error: killed by a signal (SIGKILL, the kernel's OOM killer, a lost "
               "node) or stopped by the launcher after another rank failed")


def _failures(job: TrainJob) -> str:
    """Each rank's account of the attempt, in rank order: its error's first line, or that it ended without one, and
    the host it ran on."""
    folder = job.folder
    errors, done, started = folder.ranks_with("error"), folder.ranks_with("done"), folder.ranks_with("started")
    parts = []
    for rank in sorted(set(errors) | set(started)):
        if rank in errors:
            first = folder.first_error_line(rank)
            if any(mark in first for mark in COLLECTIVE_TIMEOUT_MARKS):
                first += (f" (a collective did not finish within train.stall_timeout_s="
                          f"{job.cfg.train.stall_timeout_s} s: another rank is stuck or far slower)")
        elif rank not in done:
            first = SILENT_RANK
        else:
            continue
        host = folder.host(rank) if rank in started else ""
        parts.append(f"rank {rank}: {first}" + (f" (on host {host})" if host else ""))
    return "; ".join(parts)


# Threads a launch that `_bounded` gave up on left behind, still waiting on a lost host (Horovod's per-rank threads are
# not daemons: the interpreter would wait for them at exit). The CLI exits without them (`abandoned_threads`).
_ABANDONED: List[threading.Thread] = []


def abandoned_threads() -> List[threading.Thread]:
    """The threads of launches given up on (`_bounded`) that are still alive."""
    return [t for t in _ABANDONED if t.is_alive()]


@contextmanager
def _signals_left_to_the_driver() -> Iterator[None]:
    """Horovod's Gloo launcher installs SIGINT/SIGTERM handlers, which only the main thread may do. Run off it (inside
    `_bounded`), its launch leaves signals to the driver: `forward_sigterm` passes SIGTERM on to the ranks."""
    import horovod.runner.gloo_run as gloo_run

    original = gloo_run.register_shutdown_event

    def event_only() -> threading.Event:
        return original() if threading.current_thread() is threading.main_thread() else threading.Event()

    gloo_run.register_shutdown_event = event_only
    try:
        yield
    finally:
        gloo_run.register_shutdown_event = original


@contextmanager
def _gloo_checked_by_the_ranks() -> Iterator[None]:
    """horovod.run and horovod.spark.run first check that Horovod was built with Gloo, in a fork of the driver that
    imports horovod.torch: the driver's build, not the ranks' (on a cluster they are other machines), and 0.9 s of
    torch's import when the driver has not loaded it (measured), which it needs only for the promotion gate after
    training. Each rank checks its own build before `hvd.init()` instead (`rank_process.horovod_with_gloo`), so the
    launch inside this block skips the driver's check (Horovod 0.28.1's `run_controller` reads it from
    horovod.runner.launch). The driver then forks nothing: a thread still importing cannot hang the launch."""
    import horovod.runner.launch as horovod_launch

    original = horovod_launch.gloo_built

    def checked_by_the_ranks(verbose: bool = False) -> bool:
        return True

    horovod_launch.gloo_built = checked_by_the_ranks
    try:
        yield
    finally:
        horovod_launch.gloo_built = original


def _bounded(job: TrainJob, call: Callable[[], Any]) -> Any:
    """`call()`, a launch of ranks as Spark tasks, with a bound: once a rank has reported an error, the launch must
    return within `train.stall_timeout_s`. When a host is gone, Horovod's driver and Spark wait on it for minutes (the
    task's executor is declared lost only after Spark's own timeouts); past the bound the application's Spark jobs are
    cancelled and DistributedTrainingError names each rank with its host, and the executors that do not answer."""
    box: Dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    before = set(threading.enumerate())
    thread = threading.Thread(target=target, name="launch-ranks", daemon=True)
    thread.start()
    grace = float(job.cfg.train.stall_timeout_s)
    failed_at = None
    seen: Dict[str, None] = {}  # the executors of the launch, in the order first seen
    while thread.is_alive():
        thread.join(timeout=1.0)
        seen.update(dict.fromkeys(executor_addresses()))
        if failed_at is None and job.folder.ranks_with("error"):
            failed_at = time.monotonic()
        if thread.is_alive() and failed_at is not None and time.monotonic() - failed_at > grace:
            lost = unanswering_executors(known=list(seen))
            _ABANDONED.extend(t for t in threading.enumerate() if t not in before and not t.daemon)
            sc = spark_context()
            if sc is not None:
                sc.cancelAllJobs()
            log.error("the ranks' launch did not return within %g s after a rank failed; cancelled its Spark jobs",
                      grace)
            raise DistributedTrainingError(
                f"training failed on {_failures(job)}; the launch did not return within train.stall_timeout_s="
                f"{grace:g} s after the first rank failed"
                + (f"; executor(s) not answering (host lost?): {', '.join(lost)}" if lost else "")
                + "; its Spark jobs were cancelled", job.folder.error_classes())
    if "error" in box:
        raise box["error"]
    return box["value"]


def launch_needs_spark(cfg: Config) -> bool:
    """Whether the launch needs the driver's SparkSession: every launch on a cluster (`train.np` > 1, Spark tasks),
    and TorchDistributor's (DDP, FSDP) here too. Horovod's ranks on this machine, and one process, need none."""
    if cfg.train.np == 1:  # this process (train.backend=single is always one)
        return False
    return cfg.train.np > 1 or cfg.train.backend in ("ddp", "fsdp")


def spark_schedules_gpus(local_mode: bool) -> bool:
    """Whether TorchDistributor may ask Spark for GPUs: the driver has a `gpu` resource (local mode), or tasks get
    one (`spark.task.resource.gpu.amount` >= 1). Its `use_gpu=True` fails without them, and `use_gpu=False` hides the
    executors' GPUs (CUDA_VISIBLE_DEVICES="") on a cluster. The driver's own CUDA decides nothing."""
    from pipeline.lakehouse.spark import active_session

    spark = active_session()  # started on another thread too (pipeline.lakehouse.spark.SparkOnDemand)
    if spark is None:
        return False
    if local_mode:
        return "gpu" in spark.sparkContext.resources
    try:
        return float(spark.conf.get("spark.task.resource.gpu.amount", "0") or 0) >= 1
    except ValueError:
        return False


def launch(job: TrainJob) -> List[RankResult]:
    """Run the super train loop on `train.np` ranks with `train.backend`; results ordered by rank.

    Raises:
        DistributedTrainingError: any rank failed, with the rank and its exception in the message.
    """
    job.folder.reset()
    with rank_environment(job), forward_sigterm(grace_s=float(job.cfg.train.stall_timeout_s) / 2) as term:
        try:
            return _launch(job)
        except DistributedTrainingError:
            raise  # already says what each rank reported (`_bounded`)
        except Exception as exc:
            if term.terminated or job.folder.ranks_with("sigterm"):
                from pipeline.errors import Terminated

                raise Terminated(f"SIGTERM; the ranks stopped with: {exc}") from exc
            detail = _failures(job)
            if detail:
                raise DistributedTrainingError(f"training failed on {detail}", job.folder.error_classes()) from exc
            raise


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


def _restated(job: TrainJob, path: str, data: Any, batch: int, first: tuple) -> str:
    """Checkpoint `path` for a launch of `data`'s plan with `batch` per rank: itself when it records that batch and
    world size, else restated from what it records (`restate.restated`) into the job's own checkpoint folder (never
    beside another run's checkpoint); one that records neither is taken as trained like the job's first launch
    (`first`: its per-rank batch and world size)."""
    from pipeline.distributed.checkpoints.restate import restated

    plan = data.plan.train
    return restated(path, plan.steps_per_epoch, batch, plan.world_size, job.cfg.train.lr_scaling, unrecorded=first,
                    folder=job.ckpt_dir)


def launch_with_restarts(job: TrainJob, on_restart: Optional[Callable[[int, str], None]] = None,
                         on_batch: Optional[Callable[[int, Any, str], None]] = None,
                         on_world: Optional[Callable[[int, str], None]] = None) -> List[RankResult]:
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
    when it records another per-rank batch or world size than that launch's (`restate.restated`).
    `on_restart(n, cause)` is told of each restart, `on_batch(n, plan, cause)` of each back-off, with the new
    shard plan, and `on_world(ranks, cause)` of each elastic change (the driver records them in MLflow).

    Raises:
        DistributedTrainingError: the failure that spent the last restart (with how many were made).
        ConfigError: out of memory at 1 sample per rank (`data.batch_size`).
    """
    import dataclasses

    from pipeline.data.convert import plan_data
    from pipeline.distributed.backoff import backs_off, halved, is_out_of_memory

    limit = max(0, job.cfg.train.max_restarts)
    last = last_checkpoint(job.ckpt_dir)
    started = time.time()
    attempt = restarts = backoffs = 0
    batch = job.data.plan.train.batch_size
    first = (batch, job.data.plan.train.world_size)  # taken for a given checkpoint that records neither
    # the checkpoint the first launch resumes from, as a path and settled; one that does not exist is left to the
    # ranks, which refuse it naming the key
    restore_first = resolve_restore_point(job.restore_point, job.ckpt_dir, job.cfg.train.checkpoint_dir,
                                          required=False)
    if restore_first and os.path.exists(restore_first):  # restated when it records another batch or world size
        job = dataclasses.replace(job, restore_from=_restated(job, restore_first, job.data, batch, first))
    while True:
        try:
            return launch(job)
        except Exception as exc:
            cause = f"{type(exc).__name__}: {exc}"
            settle(last)  # a swap of FSDP's last checkpoint a killed rank interrupted is finished first
            # only a checkpoint this job wrote; an older last one in the folder belongs to another job
            fresh = os.path.exists(last) and os.path.getmtime(last) >= started
            oom = is_restartable(exc) and is_out_of_memory(exc) and backs_off(job.cfg.data, job.cfg.train.oom_backoff)
            if oom:
                smaller = halved(batch, cause)  # ConfigError at 1 per rank
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
            attempt += 1
            restore = last if fresh else restore_first
            data, was = job.data, batch
            world = data.plan.train.world_size
            new_world = world if oom else _elastic_world(job, world, exc)
            if oom:
                backoffs += 1
                batch = smaller
            if oom or new_world != world:
                data = dataclasses.replace(data, plan=plan_data(data.train, data.val, new_world, batch))
            if new_world != world:
                job = dataclasses.replace(job, world_size=new_world)
                if on_world is not None:
                    on_world(new_world, cause)
            if restore and os.path.exists(restore):  # by the batch and world size IT records, not the last launch's
                restore = _restated(job, restore, data, batch, first)
            if oom:
                log.warning("out of memory: relaunching every rank with %d samples per rank (was %d) from %s: %s",
                            batch, was, restore or "the start", cause)
                if on_batch is not None:
                    on_batch(backoffs, data.plan, cause)
            else:
                log.warning("restart %d of %d (train.max_restarts) from %s after: %s", restarts, limit,
                            restore or "the start", cause)
            # the user's config stays as it is; the job carries what this relaunch resumes from
            job = dataclasses.replace(job, restore_from=restore or "", data=data, attempt=attempt)


def _launch(job: TrainJob) -> List[RankResult]:
    cfg = job.cfg
    preload.wait()  # the launch's background imports are done before any rank process starts (nothing half loaded)
    backend = cfg.train.backend
    # an elastic relaunch (train.min_np) runs fewer Spark tasks, one too, never in this process
    np_ = job.world_size if job.world_size and cfg.train.np > 1 else cfg.train.np
    if backend == "single" or cfg.train.np == 1:
        if backend == "horovod":
            return [horovod_worker(job)]
        return [train(job)]
    if backend == "horovod":
        if np_ < 0:
            import horovod

            log.info("launching %d Horovod processes on this machine (gloo)", -np_)
            with _gloo_checked_by_the_ranks():
                return list(horovod.run(horovod_rank_process, args=(job,), num_proc=-np_, use_gloo=True,
                                        start_timeout=cfg.train.start_timeout_s, hosts=f"localhost:{-np_}",
                                        verbose=0))
        import horovod.spark

        log.info("launching %d Horovod tasks on the Spark cluster (gloo)", np_)
        with _signals_left_to_the_driver(), _gloo_checked_by_the_ranks():
            return list(_bounded(job, lambda: horovod.spark.run(
                horovod_rank_process, args=(job,), num_proc=np_, use_gloo=True,
                start_timeout=cfg.train.start_timeout_s, env=executor_env(dict(os.environ), cfg.mlflow.tracking_uri),
                verbose=0,
                nics=driver_nics() if np_ == 1 else None)))
    if backend in ("ddp", "fsdp"):
        from pyspark.ml.torch.distributor import TorchDistributor

        log.info("launching %d %s processes (%s) with TorchDistributor", abs(np_), backend.upper(),
                 "on this machine" if np_ < 0 else "on the Spark cluster")
        # GPUs are asked of Spark only where Spark schedules them; each rank then picks NCCL or gloo from its own CUDA
        dist = TorchDistributor(num_processes=abs(np_), local_mode=np_ < 0, use_gpu=spark_schedules_gpus(np_ < 0))
        worker = fsdp_worker if backend == "fsdp" else ddp_worker
        # on the cluster a task's rank gets no environment of the driver's: what executor_env allows goes with it
        result = (dist.run(worker, job) if np_ < 0 else
                  _bounded(job, lambda: dist.run(with_env, worker, job,
                                                 executor_env(dict(os.environ), cfg.mlflow.tracking_uri))))
        return [result]
    raise ValueError(f"config key 'train.backend': {backend!r} is not horovod, ddp, fsdp or single")
