"""A rank's process: each backend's entry (Horovod, DDP, FSDP, a Spark executor's environment), what the launcher
learns of a rank whatever becomes of it (the job folder's markers), and how the process ends."""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import traceback
from datetime import timedelta
from typing import Callable, Dict, Iterator

from pipeline.config import ConfigError
from pipeline.distributed.loop import RankResult, TrainJob, train
from pipeline.log import current_rank, flush_and_exit, get_logger, setup_logging

log = get_logger(__name__)


def error_classes(exc: BaseException) -> str:
    """`exc`'s class and its bases as dotted names, one a line, most specific first: how a rank tells the driver what
    failed (`launcher.is_restartable` decides from them, not from the message)."""
    return "\n".join(f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__)


@contextlib.contextmanager
def rank_record(job: TrainJob, rank: int) -> Iterator[None]:
    """What the launcher learns of a rank whatever becomes of it, in the job folder: `rank<r>.started` when it starts,
    `rank<r>.error` (its exception and traceback) and `rank<r>.class` (its exception's classes, `error_classes`) when
    it fails, `rank<r>.done` when it returns. A rank that left only `.started` ended without a word: killed
    (`launcher._failures` says so). Ranks but 0 drop MLflow's credentials from their environment first: only rank 0
    writes to MLflow (pipeline.redact.TRACKING_CREDENTIALS)."""
    from pipeline.redact import TRACKING_CREDENTIALS, redact_url, without

    if rank != 0:
        without(os.environ, TRACKING_CREDENTIALS)
    job.folder.write(rank, "started", f"{socket.gethostname()} {os.getpid()}")  # the host the launcher names
    try:
        yield
    except BaseException as exc:
        # the records first, the log after: once a rank exits, the launcher may kill the others within moments
        # (horovod.run does), and the classes are what it decides a restart from
        job.folder.write(rank, "class", error_classes(exc))
        job.folder.write(rank, "error", redact_url(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}"))
        log.error("rank %d failed: %s: %s", rank, type(exc).__name__, redact_url(str(exc)))
        raise
    job.folder.write(rank, "done")


def repair_horovod_env() -> None:
    """Undo a horovod.run (0.28.1) bug before `hvd.init()`: a stray comma in its argument defaults hands every rank
    HOROVOD_CYCLE_TIME="(None,)" and HOROVOD_CACHE_CAPACITY="(None,)", which Horovod parses as 0: a background
    thread that negotiates without pause (measured: 20-65 % of a core per idle rank) and no response cache.
    The value set by the launcher (LAKEHOUSE_HOROVOD_CYCLE_TIME, ...) is restored, else Horovod's default.
    """
    for key in ("HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY"):
        if os.environ.get(key, "").startswith("("):
            wanted = os.environ.get(f"LAKEHOUSE_{key}")
            if wanted:
                os.environ[key] = wanted
            else:
                del os.environ[key]


def horovod_with_gloo(python: str = sys.executable):
    """horovod.torch, once this rank's own build is known to have Gloo (the launcher leaves that check to the ranks:
    launcher._gloo_checked_by_the_ranks).

    Raises:
        ConfigError: horovod.torch does not import here, or was built without Gloo (names `train.backend`)."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise ConfigError(f"config key 'train.backend' = 'horovod': horovod.torch does not import in {python} "
                          f"({exc}); reinstall Horovod against this torch (`make setup`), or use "
                          f"train.backend=ddp") from exc
    if not hvd.gloo_built():
        raise ConfigError(f"config key 'train.backend' = 'horovod': the Horovod in {python} was built without Gloo, "
                          f"which the launcher uses; reinstall it with HOROVOD_WITH_GLOO=1 (`make setup` does), or "
                          f"use train.backend=ddp")
    return hvd


def horovod_worker(job: TrainJob) -> RankResult:
    """The Horovod entry of the super train loop: init, shard = rank, LR × size, then the same `train()`. Recorded
    from the start under the rank its launcher gave it (HOROVOD_RANK, which `hvd.init()` takes), so a build without
    Gloo reaches the driver as this rank's ConfigError."""
    setup_logging()
    repair_horovod_env()
    with rank_record(job, current_rank()):
        hvd = horovod_with_gloo()
        from pipeline.distributed.horovod_strategy import HorovodStrategy

        hvd.init()
        return train(job, hvd.rank(), hvd.size(), HorovodStrategy(), local_rank=hvd.local_rank(),
                     local_world_size=hvd.local_size())


def horovod_rank_process(job: TrainJob) -> RankResult:
    """`horovod_worker` in a rank process of its own (horovod.run on this machine; on a Spark cluster each Horovod
    task starts its rank as a process, horovod.spark.task.gloo_exec_fn): a rank that failed exits at once, its
    error written (`rank_record`), its traceback printed and its output flushed, without the interpreter's
    teardown of torch, Horovod and reader threads. That teardown kept a failed rank alive ~1 s after its error
    (measured with timestamps: the error, atexit done 3 ms later, the process still there 0.4 s later with no Python
    frame), while the launcher waited to stop the other ranks and relaunch them (`train.max_restarts`)."""
    try:
        result = horovod_worker(job)
    except BaseException:
        traceback.print_exc()
        exit_now(1)
        raise  # only where exit_now is replaced (tests)
    # Horovod's own shutdown (a normal exit's handler, which the fast exit skips), agreed by every rank's background
    # loop: a rank that left without it resets its peers' connections while rank 0 still logs the model
    import horovod.torch as hvd

    hvd.shutdown()
    exit_fast_after_delivery()
    return result


def exit_fast_after_delivery() -> None:
    """A rank process whose rank function returned: once its launcher's code has handed the result over and the
    interpreter starts to shut down, end the process at once, as `exit_now(0)`, without the teardown of torch,
    Lightning, Horovod and MLflow's modules and threads: 1.2 s for the imports alone, measured; about 3 s between rank
    0's last word and the driver seeing the ranks gone in a 2-rank job. The three launchers (horovod.run's run_task,
    horovod.spark's task_exec, TorchDistributor's train script) all deliver the result before their script ends, so
    the first exit handler (atexit runs the last registered first) comes after it. An error in that delivery is left
    to the normal exit and its status (the interpreter records it in `sys.last_value` before the exit handlers)."""
    import atexit
    import sys

    def _now() -> None:
        if getattr(sys, "last_value", None) is None:
            exit_now(0)

    atexit.register(_now)


def exit_now(code: int) -> None:
    """Flush the logs and the standard streams, then end the process without the interpreter's teardown."""
    flush_and_exit(code)


def ddp_worker(job: TrainJob, sharded: bool = False) -> RankResult:
    """The DDP entry (torch.distributed: NCCL where this rank has a GPU, else gloo), launched by TorchDistributor;
    `sharded`: the FSDP entry (train.backend=fsdp), the same launch with Lightning's FSDP strategy."""
    setup_logging()
    import torch
    from pytorch_lightning.strategies import DDPStrategy

    from pipeline.distributed.devices import ddp_backend

    rank = int(os.environ.get("RANK", "0"))
    size = int(os.environ.get("WORLD_SIZE", "1"))
    with rank_record(job, rank):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
        backend = ddp_backend(torch.cuda.is_available())  # decided in the rank, not on the driver
        # a collective that a rank cannot finish within train.stall_timeout_s raises there (torch's default: 30 min)
        timeout = timedelta(seconds=job.cfg.train.stall_timeout_s)
        if sharded:
            from pipeline.distributed.fsdp import LakehouseFSDPStrategy

            strategy = LakehouseFSDPStrategy(process_group_backend=backend, timeout=timeout)
        else:
            strategy = DDPStrategy(process_group_backend=backend, timeout=timeout)
        result = train(job, rank, size, strategy, devices=local,
                       num_nodes=max(1, size // local), local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                       local_world_size=local)
    exit_fast_after_delivery()  # always a process of its own (TorchDistributor's torchrun)
    return result


def fsdp_worker(job: TrainJob) -> RankResult:
    """The FSDP entry (train.backend=fsdp): launched like DDP, the model sharded over the ranks."""
    return ddp_worker(job, sharded=True)


def with_env(worker: Callable[[TrainJob], RankResult], job: TrainJob, env: Dict[str, str]) -> RankResult:
    """A TorchDistributor rank on a Spark executor, which gets none of the driver's environment: the variables the
    launcher hands ranks (launcher.executor_env: tracking settings, and the credentials rank 0 needs, which the
    other ranks drop in `rank_record`) that this process lacks are set, then `worker` runs."""
    for key, value in env.items():
        os.environ.setdefault(key, value)
    return worker(job)
