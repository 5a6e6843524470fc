"""Ranks started early: a job's local rank processes (`train.np=-N`, `train.early_start`) start, and import torch,
Lightning and their backend, while the driver pins, converts and plans the data and opens the run; each takes the job
from a hand-off folder once the driver has made it, or leaves when the driver calls the start off or is gone.

The hand-off folder is private to the driver's user (0700, a fresh name); the job is written into it signed with a key
that only the ranks were given (over their launcher's channel), and a rank unpickles only what that key signs."""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import importlib
import os
import pickle
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence

from pipeline import preload
from pipeline.config import Config
from pipeline.distributed.loop import RANK_IMPORTS, RankResult, TrainJob
from pipeline.distributed.rank_env import rank_environment
from pipeline.distributed.rank_signals import rank_processes
from pipeline.log import get_logger

log = get_logger(__name__)

JOB_FILE = "job.signed"
CANCELLED = "cancelled"
POLL_S = 0.02
# How long the driver waits for the early ranks to leave after it called their start off
CANCEL_WAIT_S = 30.0
# How long ranks already waiting for the job are given to leave by themselves (they poll every POLL_S) before they
# are killed
LEAVE_WAIT_S = 5.0


class HandoffError(RuntimeError):
    """A rank started early could not take its job: the driver is gone, or the job it found is not the driver's."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Handoff:
    """What a rank started early is given instead of its job: the hand-off folder, the key the job is signed with and
    the driver's process (the ranks are on its machine)."""

    path: str
    key: bytes
    driver_pid: int

    def __repr__(self) -> str:  # the key never reaches a log line
        return f"Handoff(path={self.path!r}, driver_pid={self.driver_pid})"

    def mark(self, rank: int, event: str) -> None:
        with contextlib.suppress(OSError):
            open(os.path.join(self.path, f"rank{rank}.{event}"), "w").close()

    def ranks_with(self, event: str) -> int:
        with contextlib.suppress(OSError):
            return sum(1 for name in os.listdir(self.path) if name.endswith(f".{event}"))
        return 0

    @classmethod
    def new(cls) -> "Handoff":
        """A fresh hand-off folder (0700) and key, for ranks of this process."""
        return cls(tempfile.mkdtemp(prefix="lakehouse-start-"), secrets.token_bytes(32), os.getpid())

    def deliver(self, job: TrainJob) -> None:
        """Write `job`, signed, for the ranks (atomically: a rank never reads half a job)."""
        self.put(JOB_FILE, job)

    def put(self, name: str, value: Any) -> None:
        """Write `value` into the folder as `name`, pickled and signed with the key, atomically."""
        body = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        tmp = os.path.join(self.path, f".{name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(hmac.new(self.key, body, hashlib.sha256).digest())
            fh.write(body)
        os.replace(tmp, os.path.join(self.path, name))

    def get(self, name: str) -> Any:
        """What `put` wrote as `name`, once its signature is this key's.

        Raises:
            HandoffError: it is not signed with this key (never unpickled)."""
        return self._read(os.path.join(self.path, name))

    @property
    def cancelled(self) -> bool:
        return os.path.exists(os.path.join(self.path, CANCELLED))

    def cancel(self) -> None:
        with contextlib.suppress(OSError):
            open(os.path.join(self.path, CANCELLED), "w").close()

    def take(self, rank: int, warm: Callable[[], None]) -> Optional[TrainJob]:
        """In a rank: import what the rank will need (`warm`, best effort: a failing import is left to the rank's own
        start, which records it), then wait for the job. None: the driver called the start off.

        Raises:
            HandoffError: the driver ended without handing over a job; the job file is not signed with this key."""
        self.mark(rank, "waiting")
        t0 = time.perf_counter()
        try:
            warm()
        except Exception as exc:  # noqa: BLE001 - raised again where the rank imports it, inside its record
            log.debug("rank %d: importing ahead failed: %s", rank, exc)
        warmed = time.perf_counter() - t0
        self.mark(rank, "ready")  # imported: a call-off is seen within POLL_S from now (EarlyRanks.close)
        job_path, cancelled = os.path.join(self.path, JOB_FILE), os.path.join(self.path, CANCELLED)
        while True:
            if os.path.exists(cancelled) or not os.path.isdir(self.path):  # called off, or the driver cleaned up
                return None
            if os.path.exists(job_path):
                job = self._read(job_path)
                log.info("rank %d: imported ahead in %.1f s, then waited %.1f s for the job", rank, warmed,
                         time.perf_counter() - t0 - warmed)
                self.mark(rank, "taken")
                return job
            if not _alive(self.driver_pid):
                raise HandoffError(f"rank {rank}: the driver (pid {self.driver_pid}) ended before handing over the "
                                   f"job in {self.path}")
            time.sleep(POLL_S)

    def _read(self, path: str) -> TrainJob:
        with open(path, "rb") as fh:
            blob = fh.read()
        digest, body = blob[:32], blob[32:]
        if not hmac.compare_digest(digest, hmac.new(self.key, body, hashlib.sha256).digest()):
            raise HandoffError(f"{path}: not signed with this launch's key; not loaded")
        return pickle.loads(body)


def job_of(arg: Any, rank: int, warm: Callable[[], None]) -> Optional[TrainJob]:
    """A rank entry's job: `arg` itself, or for a rank started early (`arg` a Handoff) the one the driver hands over
    once it is made (None: the start was called off)."""
    if isinstance(arg, Handoff):
        return arg.take(rank, warm)
    return arg


def importer(modules: Sequence[str]) -> Callable[[], None]:
    """A `warm` for `Handoff.take`: import `modules`, in order, then every train()'s own (`loop.RANK_IMPORTS`)."""
    def warm() -> None:
        for name in (*modules, *RANK_IMPORTS):
            importlib.import_module(name)
    return warm


class EarlyRanks:
    """The first launch's local rank processes, started before their job exists (`start`), handed it (`run`), or
    called off (`close` without `run`): stopped, their folder removed."""

    def __init__(self, cfg: Config, start_local: Callable[[Config, Handoff], List[RankResult]],
                 before_launch: Optional[Callable[[], Any]] = None) -> None:
        self.cfg = cfg
        self.environment = contextlib.ExitStack()  # the ranks' environment in the driver's, until they have run
        self._start_local = start_local
        self._before_launch = before_launch
        self.handoff = Handoff.new()
        self._result: Optional[List[RankResult]] = None
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self.delivered = False

    def start(self, forks: bool, ready_timeout_s: float) -> None:
        """Start the ranks on a thread. `forks`: the launcher forks the driver's Python (horovod.run's middlemen) to
        start them: return only once every rank process runs, or the launch ended, within `ready_timeout_s`, so that no
        fork is taken while the driver's main thread imports (a fork taken during another thread's import can leave the
        child waiting forever). A launcher that only spawns (TorchDistributor's torchrun) is not waited for."""
        preload.wait()
        self._thread = threading.Thread(target=self._launch, name="lakehouse-early-ranks", daemon=True)
        self._thread.start()
        ranks, deadline = abs(self.cfg.train.np), time.monotonic() + ready_timeout_s
        while forks and self._thread.is_alive() and time.monotonic() < deadline and len(rank_processes()) < ranks:
            time.sleep(POLL_S)
        log.info("the %d rank process(es) start ahead; they import while the driver prepares the job", ranks)

    def _launch(self) -> None:
        try:
            if self._before_launch is not None:
                self._before_launch()
            if self.handoff.cancelled:  # called off while the launch's prerequisite started: no rank to start
                return
            self._result = self._start_local(self.cfg, self.handoff)
        except BaseException as exc:  # noqa: BLE001 - raised on the driver's thread by `run`
            self._error = exc

    def run(self, job: TrainJob) -> List[RankResult]:
        """Hand `job` to the ranks and return their results as the launch does (its errors raised here)."""
        self.handoff.deliver(job)
        self.delivered = True
        try:
            self._thread.join()
        finally:
            self.environment.close()  # the driver's own environment back, as after any launch
        if self._error is not None:
            raise self._error
        return self._result

    def close(self) -> None:
        """Call the start off when the job never reached the ranks (the ranks leave, or are killed, and the launch's
        thread is given `CANCEL_WAIT_S` to end); remove the hand-off folder (the signed job with it)."""
        if self._thread is not None and not self.delivered:
            self.handoff.cancel()  # a rank still importing reads it after, and leaves
            if self.handoff.ranks_with("ready") >= abs(self.cfg.train.np):  # all past their imports: they leave
                self._thread.join(LEAVE_WAIT_S)  # within POLL_S, as ranks that ended, and their launcher says nothing
            procs = rank_processes()
            # the launcher prints "Killed" and an exit status 137 for ranks killed here, which reads like an OOM kill
            if procs and self._thread.is_alive():
                log.warning("the job ended before the %d rank process(es) started early took it (its error follows): "
                            "they are stopped, and their launcher's 'Killed' / 'exit status 137' lines are that stop",
                            len(procs))
            for proc in procs:  # their launchers then return at once
                with contextlib.suppress(Exception):
                    proc.kill()
            self._thread.join(CANCEL_WAIT_S)
            if self._thread.is_alive():
                log.warning("the ranks started early did not end within %.0f s of being called off", CANCEL_WAIT_S)
        shutil.rmtree(self.handoff.path, ignore_errors=True)


@contextlib.contextmanager
def ranks_started_early(cfg: Config, start_local: Optional[Callable[[Config, Handoff], List[RankResult]]],
                        forks: bool = False,
                        before_launch: Optional[Callable[[], Any]] = None) -> Iterator[Optional[EarlyRanks]]:
    """The job's local ranks started now (`EarlyRanks`; `forks`: see `EarlyRanks.start`; `before_launch`: what the
    launch needs first, the SparkSession for TorchDistributor), in the ranks' environment (`rank_environment`) until
    the block ends; None when `train.early_start` is off, the ranks are not local processes (`train.np` >= 1) or the
    backend starts none (`start_local` None)."""
    if not cfg.train.early_start or cfg.train.np >= 0 or start_local is None:
        yield None
        return
    early = EarlyRanks(cfg, start_local, before_launch)
    early.environment.enter_context(rank_environment(cfg))
    try:
        early.start(forks, ready_timeout_s=float(cfg.train.start_timeout_s))
        yield early
    finally:
        early.close()
        early.environment.close()
