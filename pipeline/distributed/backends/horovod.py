"""`train.backend: horovod`: ranks started by horovod.run on this machine or horovod.spark.run as Spark tasks (gloo),
each training with `HorovodStrategy` (pipeline/distributed/horovod_strategy.py)."""
from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional

from pipeline.config import Config, ConfigError
from pipeline.distributed.backends.base import Backend, MachineFacts
from pipeline.distributed.backends.spark_tasks import bounded
from pipeline.distributed.early_start import importer, job_of
from pipeline.distributed.executors import driver_nics
from pipeline.distributed.loop import RankResult, TrainJob, train
from pipeline.distributed.rank_env import command_line_env, executor_env
from pipeline.distributed.rank_process import exit_fast_after_delivery, exit_now, rank_record, repair_horovod_env
from pipeline.log import current_rank, get_logger, setup_logging

log = get_logger(__name__)


@contextmanager
def signals_left_to_the_driver() -> Iterator[None]:
    """Horovod's Gloo launcher installs SIGINT/SIGTERM handlers that set its shutdown event (which ends the ranks) and
    never puts the previous ones back: after a launch on the main thread Ctrl-C no longer interrupted the driver, and
    during it `forward_sigterm`'s handler was replaced. Inside this block its launch gets its event without them:
    SIGTERM stays the driver's (`forward_sigterm` passes it on to the ranks); on the main thread a first Ctrl-C sets
    the event (the launcher ends the ranks, in sessions of their own, which the terminal's SIGINT does not reach) and
    KeyboardInterrupt is raised once the launch ended, a second one at once. SIGINT's and SIGTERM's handlers are
    as before afterwards. Off the main thread (inside `spark_tasks.bounded`, or ranks started early) no handler is
    installed: signals are the driver's."""
    import horovod.runner.gloo_run as gloo_run

    original = gloo_run.register_shutdown_event
    main = threading.current_thread() is threading.main_thread()
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    interrupted = []

    def event_only() -> threading.Event:
        event = threading.Event()
        if threading.current_thread() is threading.main_thread():
            def on_interrupt(signum, frame) -> None:
                if interrupted:
                    raise KeyboardInterrupt
                interrupted.append(signum)
                log.warning("Ctrl-C: stopping the Horovod ranks (again to interrupt at once)")
                event.set()

            signal.signal(signal.SIGINT, on_interrupt)
        return event

    gloo_run.register_shutdown_event = event_only
    try:
        yield
    except Exception as exc:
        if interrupted:  # the ranks it ended made the launch fail: the interrupt is what happened
            raise KeyboardInterrupt from exc
        raise
    finally:
        gloo_run.register_shutdown_event = original
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if interrupted:
        raise KeyboardInterrupt


_signals_left_to_the_driver = signals_left_to_the_driver  # the name used before it was public (tests, the backend)


@contextmanager
def gloo_checked_by_the_ranks() -> Iterator[None]:
    """horovod.run and horovod.spark.run first check that Horovod was built with Gloo, in a fork of the driver that
    imports horovod.torch: the driver's build, not the ranks' (on a cluster they are other machines), and 0.9 s of
    torch's import when the driver has not loaded it (measured), which it needs only for the promotion gate after
    training. Each rank checks its own build before `hvd.init()` instead (`horovod_with_gloo`), so the launch inside
    this block skips the driver's check (Horovod 0.28.1's `run_controller` reads it from horovod.runner.launch). The
    driver then forks nothing: a thread still importing cannot hang the launch."""
    import horovod.runner.launch as horovod_launch

    original = horovod_launch.gloo_built

    def checked_by_the_ranks(verbose: bool = False) -> bool:
        return True

    horovod_launch.gloo_built = checked_by_the_ranks
    try:
        yield
    finally:
        horovod_launch.gloo_built = original


@contextmanager
def secrets_off_the_command_line() -> Iterator[None]:
    """Horovod 0.28.1's Gloo launcher starts each rank on this machine as `env K1=V1 K2=V2 ... python -m
    horovod.runner.run_task ...` through a shell, from the driver's whole environment (horovod.run takes no `env`;
    horovod.runner.gloo_run._slot_info_to_command_fn): every variable, MLflow's password and cloud keys included,
    stood on the command line of a shell that lives as long as its rank, where every user of the machine reads it
    (`ps`, /proc/<pid>/cmdline). Inside this block the launch (horovod.runner.launch's `gloo_run`, looked up as the
    launch starts) writes there only what `rank_env.command_line_env` allows: Horovod's own settings, never a secret.
    The ranks lose nothing: the rest of that command line only repeated the environment they inherit anyway, since
    Horovod's middlemen start the shells with the driver's environment (safe_shell_exec passes no `env` of its own),
    which only this user reads; ranks but 0 drop MLflow's credentials as they start, as before
    (`rank_process.rank_record`). Withheld names are logged, never values. Every launch on this machine, the ranks
    started early's and each relaunch's, goes through `start_local` and so through this block."""
    import horovod.runner.launch as horovod_launch

    original = horovod_launch.gloo_run

    def public_env_only(settings, nics, env, server_ip, command):
        public, withheld = command_line_env(env, os.environ)
        if withheld:
            log.debug("kept off the ranks' command line (they inherit them): %s", ", ".join(withheld))
        return original(settings, nics, public, server_ip, command)

    horovod_launch.gloo_run = public_env_only
    try:
        yield
    finally:
        horovod_launch.gloo_run = original


def horovod_with_gloo(python: str = sys.executable):
    """horovod.torch, once this rank's own build is known to have Gloo (the launcher leaves that check to the ranks:
    `gloo_checked_by_the_ranks`).

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


def horovod_worker(arg: Any) -> Optional[RankResult]:
    """The Horovod entry of the super train loop: init, shard = rank, LR × size, then the same `train()`. Recorded
    from the start under the rank its launcher gave it (HOROVOD_RANK, which `hvd.init()` takes), so a build without
    Gloo reaches the driver as this rank's ConfigError. `arg`: the job, or a rank started early's hand-off
    (`early_start.job_of`; None: called off)."""
    setup_logging()
    repair_horovod_env()
    job = job_of(arg, current_rank(), importer(("horovod.torch", "pipeline.distributed.horovod_strategy")))
    if job is None:
        return None
    with rank_record(job, current_rank()):
        hvd = horovod_with_gloo()
        # the strategy's module (Lightning, torch: ~2 s) is imported before hvd.init(), whose rendezvous then lines
        # the ranks up: after it, a rank that fails and exits at once no longer cuts off a peer still importing,
        # its own error unrecorded (test_a_config_error_in_the_ranks_ends_the_job_after_one_launch)
        import pipeline.distributed.horovod_strategy  # noqa: F401

        hvd.init()
        return train(job, hvd.rank(), hvd.size(), HOROVOD.strategy(job), local_rank=hvd.local_rank(),
                     local_world_size=hvd.local_size())


def horovod_rank_process(arg: Any) -> Optional[RankResult]:
    """`horovod_worker` in a rank process of its own (horovod.run on this machine; on a Spark cluster each Horovod
    task starts its rank as a process, horovod.spark.task.gloo_exec_fn): a rank that failed exits at once, its
    error written (`rank_record`), its traceback printed and its output flushed, without the interpreter's
    teardown of torch, Horovod and reader threads. That teardown kept a failed rank alive ~1 s after its error
    (measured with timestamps: the error, atexit done 3 ms later, the process still there 0.4 s later with no Python
    frame), while the launcher waited to stop the other ranks and relaunch them (`train.max_restarts`)."""
    try:
        result = horovod_worker(arg)
    except BaseException:
        traceback.print_exc()
        exit_now(1)
        raise  # only where exit_now is replaced (tests)
    if result is None:  # started early and called off: it never joined Horovod, and ends as fast as a rank that
        exit_fast_after_delivery()  # trained (the driver waits only early_start.LEAVE_WAIT_S for it)
        return None
    # Horovod's own shutdown (a normal exit's handler, which the fast exit skips), agreed by every rank's background
    # loop: a rank that left without it resets its peers' connections while rank 0 still logs the model
    import horovod.torch as hvd

    hvd.shutdown()
    exit_fast_after_delivery()
    return result


class Horovod(Backend):
    name = "horovod"
    watches_progress = True  # its stall shutdown does not fire on a gloo CPU build (pipeline/distributed/progress.py)

    def launch(self, job: TrainJob) -> List[RankResult]:
        cfg = job.cfg
        # an elastic relaunch (train.min_np) runs fewer Spark tasks, one too, never in this process
        np_ = job.plan.world_size if cfg.train.np > 1 else cfg.train.np
        if cfg.train.np == 1:
            return [horovod_worker(job)]
        if np_ < 0:
            return self.start_local(cfg, job)
        import horovod.spark

        log.info("launching %d Horovod tasks on the Spark cluster (gloo)", np_)
        with _signals_left_to_the_driver(), gloo_checked_by_the_ranks():
            return list(bounded(job, lambda: horovod.spark.run(
                horovod_rank_process, args=(job,), num_proc=np_, use_gloo=True,
                start_timeout=cfg.train.start_timeout_s, env=executor_env(dict(os.environ), cfg.mlflow.tracking_uri),
                verbose=0,
                nics=driver_nics() if np_ == 1 else None)))

    local_processes = True
    launcher_forks = True  # horovod.run's middlemen (safe_shell_exec: multiprocessing, forked)

    def start_local(self, cfg: Config, arg: Any) -> List[RankResult]:
        import horovod

        log.info("launching %d Horovod processes on this machine (gloo)", -cfg.train.np)
        # off the main thread when the ranks start early (pipeline/distributed/early_start.py)
        with _signals_left_to_the_driver(), gloo_checked_by_the_ranks(), secrets_off_the_command_line():
            return list(horovod.run(horovod_rank_process, args=(arg,), num_proc=-cfg.train.np, use_gloo=True,
                                    start_timeout=cfg.train.start_timeout_s, hosts=f"localhost:{-cfg.train.np}",
                                    verbose=0))

    def worker(self, job: TrainJob) -> RankResult:
        return horovod_worker(job)

    def strategy(self, job: TrainJob) -> Any:
        from pipeline.distributed.horovod_strategy import HorovodStrategy

        return HorovodStrategy()

    def problems(self, facts: MachineFacts, np_: int) -> List[str]:
        if facts.horovod_installed is False:
            return ["config train.backend=horovod but horovod is missing"]
        return []


HOROVOD = Horovod()
