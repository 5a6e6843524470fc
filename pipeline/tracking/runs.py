"""The MLflow run lifecycle on the driver: connect (bounded retries), open the run, and close it with the status the job
ended with, even when killed or when the server went away (then through the unended-runs journal)."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

import mlflow
from mlflow import MlflowClient
from mlflow.entities import RunStatus
from mlflow.exceptions import MlflowException

from pipeline.config import Config, MlflowConfig
from pipeline.errors import Terminated
from pipeline.log import get_logger
from pipeline.redact import redact_url
from pipeline.tracking.journal import UnendedRuns, short_error

log = get_logger(__name__)

# While connecting, one HTTP attempt must fail fast; our own bounded loop does the retrying.
_CONNECT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
_NOT_TRANSIENT = ("INVALID_PARAMETER_VALUE", "PERMISSION_DENIED", "UNAUTHENTICATED", "BAD_REQUEST")


class TrackingUnavailable(RuntimeError):
    """The tracking server or store given by `mlflow.tracking_uri` cannot be reached."""


@contextlib.contextmanager
def temporary_env(overrides: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the block, restoring (or removing) them afterwards."""
    old = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def resolve_tracking_uri(uri: str) -> str:
    """Make a `sqlite:///relative/path` absolute (so every process agrees) and create its folder."""
    prefix = "sqlite:///"
    if uri.startswith(prefix):
        path = uri[len(prefix):]
        if not path or path.startswith(":memory:"):
            return uri
        db = Path(path) if path.startswith("/") else Path.cwd() / path
        db = db.resolve()
        db.parent.mkdir(parents=True, exist_ok=True)
        return prefix + str(db)
    return uri


def resolve_artifact_location(location: Optional[str]) -> Optional[str]:
    """A relative or absolute local path becomes an absolute `file://` URI; URIs are kept; None stays None."""
    if not location:
        return None
    if "://" in location or location.split(":", 1)[0] in ("mlflow-artifacts", "dbfs", "file"):
        return location
    path = Path(location).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path.as_uri()


def _connect(cfg_mlflow: MlflowConfig) -> Tuple[MlflowClient, str]:
    uri = resolve_tracking_uri(cfg_mlflow.tracking_uri)
    try:
        client = MlflowClient(tracking_uri=uri)
    except MlflowException as exc:  # an unknown scheme, a malformed URI
        raise TrackingUnavailable(f"config key 'mlflow.tracking_uri' = {redact_url(uri)!r} is not usable: "
                                  f"{redact_url(exc.message)}") from exc
    attempts = max(0, int(cfg_mlflow.retries)) + 1
    last: Optional[BaseException] = None
    with temporary_env(_CONNECT_ENV):
        for attempt in range(1, attempts + 1):
            try:
                exp = client.get_experiment_by_name(cfg_mlflow.experiment)
                if exp is None:
                    try:
                        exp_id = client.create_experiment(
                            cfg_mlflow.experiment, artifact_location=resolve_artifact_location(cfg_mlflow.artifact_location))
                        log.info("created MLflow experiment %r (id %s) at %s", cfg_mlflow.experiment, exp_id,
                                 redact_url(uri))
                        return _connected(client, uri, exp_id, cfg_mlflow)
                    except MlflowException as exc:  # another process created it first
                        if "ALREADY_EXISTS" not in str(exc.error_code):
                            raise
                        exp = client.get_experiment_by_name(cfg_mlflow.experiment)
                        if exp is None:
                            raise
                if exp.lifecycle_stage == "deleted":
                    raise ValueError(f"config key 'mlflow.experiment': experiment {cfg_mlflow.experiment!r} is deleted "
                                     f"at {redact_url(uri)}; restore it or choose another name")
                return _connected(client, uri, exp.experiment_id, cfg_mlflow)
            except ValueError:
                raise
            except MlflowException as exc:
                if any(code in str(exc.error_code) for code in _NOT_TRANSIENT) and "API request" not in str(exc):
                    raise TrackingUnavailable(f"config key 'mlflow.tracking_uri' = {redact_url(uri)!r}: "
                                              f"{redact_url(exc.message)}") from exc
                last = exc
            except Exception as exc:  # connection errors, a locked SQLite file, ...
                last = exc
            if attempt < attempts:
                log.warning("MLflow at %s not reachable (attempt %d of %d): %s; retrying in %.1f s",
                            redact_url(uri), attempt, attempts, short_error(last), cfg_mlflow.retry_wait_s)
                time.sleep(max(0.0, float(cfg_mlflow.retry_wait_s)))
    raise TrackingUnavailable(f"cannot reach MLflow at config key 'mlflow.tracking_uri' = {redact_url(uri)!r} after "
                              f"{attempts} attempt(s): {short_error(last)}") from last


def use_tracking_uri(uri: str) -> None:
    """Point this process's fluent API and model logging (and the processes it starts) at `uri`.

    Where nothing in this process has chosen a tracking URI yet, MLflow reads MLFLOW_TRACKING_URI, the variable
    `mlflow.set_tracking_uri` also sets for subprocesses; setting it is enough. `mlflow.set_tracking_uri` would also
    rebuild MLflow's tracing provider: 0.3 s of OpenTelemetry imports in the driver and again in rank 0 before the
    first step (measured), for traces this project does not write. A URI chosen earlier in this process (a notebook's
    `mlflow.set_tracking_uri`) takes precedence over the variable, so it is replaced the usual way."""
    from mlflow.tracking._tracking_service import utils as tracking_service

    if tracking_service._tracking_uri is None:
        os.environ["MLFLOW_TRACKING_URI"] = uri
    elif tracking_service._tracking_uri != uri:
        mlflow.set_tracking_uri(uri)


def _connected(client: MlflowClient, uri: str, experiment_id: str, cfg_mlflow: MlflowConfig) -> Tuple[MlflowClient, str]:
    use_tracking_uri(uri)  # for the fluent API and model logging in this process
    if cfg_mlflow.unended_runs:
        journal = UnendedRuns(cfg_mlflow.unended_runs)
        try:
            journal.end_all(client, uri)
        except Exception as exc:  # a broken journal must not stop (or be mistaken for) the connection
            log.warning("could not process %s (config key 'mlflow.unended_runs'): %s", journal.path, short_error(exc))
    return client, experiment_id


def configure(cfg_mlflow: MlflowConfig) -> MlflowClient:
    """Point MLflow at `mlflow.tracking_uri`, make sure `mlflow.experiment` exists; return a client.

    Raises:
        TrackingUnavailable: the store cannot be reached after `mlflow.retries` retries; names the key and URI.
    """
    return _connect(cfg_mlflow)[0]


def experiment_id_of(client: MlflowClient, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is None:
        raise ValueError(f"config key 'mlflow.experiment': experiment {name!r} does not exist")
    return exp.experiment_id


@dataclass
class TrackedRun:
    """The run opened by `tracked_run`: log to it with `client` and `run_id` (also from other processes)."""

    run_id: str
    client: MlflowClient
    experiment_id: str
    tracking_uri: str


def _end_run(client: MlflowClient, experiment_id: str, run_id: str, status: str, cfg_mlflow: MlflowConfig) -> bool:
    """Mark the run ended with `status` (bounded retries); False when the server could not be told."""
    # Bounded: a job being killed has seconds, not the minutes MLflow's default HTTP retries can take. The run is
    # recorded in mlflow.unended_runs at the first failure, so a driver killed while retrying still leaves it there.
    end_ms = int(time.time() * 1000)
    recorded = not cfg_mlflow.unended_runs
    try:  # 10 s an attempt, or less where the environment asks for less (a server that accepts and never answers)
        timeout = str(max(1, min(10, int(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")))))
    except ValueError:
        timeout = "10"
    for attempt in range(3):
        try:
            with temporary_env({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": timeout}):
                client.set_terminated(run_id, status=status, end_time=end_ms)
            return True
        except Exception as exc:  # never mask the exception that ended the run
            if not recorded:
                recorded = True
                try:
                    UnendedRuns(cfg_mlflow.unended_runs).add(resolve_tracking_uri(cfg_mlflow.tracking_uri),
                                                              experiment_id, run_id, status, end_ms, short_error(exc, 200))
                except Exception as journal_exc:
                    log.error("could not record MLflow run %s in %s (config key 'mlflow.unended_runs'): %s", run_id,
                              cfg_mlflow.unended_runs, short_error(journal_exc))
            if attempt < 2:
                time.sleep(1.0)
                continue
            log.error("could not mark MLflow run %s as %s: %s", run_id, status, short_error(exc))
    return False


def http_bounds(cfg_mlflow: MlflowConfig) -> Dict[str, str]:
    """MLflow's HTTP retries bounded by `mlflow.retries` (its defaults retry for minutes against a dead server, per
    call); values set in the environment win."""
    wanted = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(max(0, int(cfg_mlflow.retries))),
              "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
    return {key: os.environ.get(key, value) for key, value in wanted.items()}


@contextlib.contextmanager
def tracked_run(cfg: Config, run_name: Optional[str] = None, tags: Optional[Dict[str, Any]] = None,
                reopen: Optional[str] = None) -> Iterator[TrackedRun]:
    """Open an MLflow run for the block; end it FINISHED, FAILED (exception) or KILLED (Ctrl-C, SIGTERM).

    For the block's duration SIGTERM raises `Terminated` in the main thread, so a killed job still
    closes its run, and MLflow's HTTP retries are bounded (`http_bounds`), so a server that goes away costs
    seconds per call, not minutes. The exception is re-raised after the run's status is set. `reopen`: the id of an
    existing run to continue (RUNNING again; `lakehouse tune --resume` reopens its study's parent run).
    """
    client, experiment_id = _connect(cfg.mlflow)
    if reopen:
        client.update_run(reopen, status=RunStatus.to_string(RunStatus.RUNNING))
        run_id = reopen
        log.info("MLflow run %s reopened in experiment %s", run_id, experiment_id)
    else:
        run = client.create_run(experiment_id, run_name=run_name, tags=_run_tags(tags))
        run_id = run.info.run_id
        log.info("MLflow run %s (%s) started in experiment %s", run_id, run.info.run_name, experiment_id)

    terminating = {"flag": False}
    old_handler: Any = None
    installed = threading.current_thread() is threading.main_thread()
    if installed:
        def _on_sigterm(signum: int, frame: Any) -> None:
            if terminating["flag"]:
                log.warning("SIGTERM again while closing MLflow run %s; ignored", run_id)
                return
            terminating["flag"] = True
            raise Terminated(f"received SIGTERM (signal {signum})")

        old_handler = signal.signal(signal.SIGTERM, _on_sigterm)
    status = RunStatus.to_string(RunStatus.FAILED)
    bounded = contextlib.ExitStack()
    bounded.enter_context(temporary_env(http_bounds(cfg.mlflow)))
    try:
        yield TrackedRun(run_id=run_id, client=client, experiment_id=experiment_id,
                         tracking_uri=mlflow.get_tracking_uri())
        status = RunStatus.to_string(RunStatus.FINISHED)
    except (KeyboardInterrupt, Terminated) as exc:
        terminating["flag"] = True
        status = RunStatus.to_string(RunStatus.KILLED)
        _tag_error(client, run_id, exc)
        raise
    except SystemExit as exc:
        terminating["flag"] = True
        status = RunStatus.to_string(RunStatus.FINISHED if exc.code in (0, None) else RunStatus.FAILED)
        raise
    except BaseException as exc:
        terminating["flag"] = True
        status = RunStatus.to_string(RunStatus.FAILED)
        _tag_error(client, run_id, exc)
        raise
    finally:
        terminating["flag"] = True
        ended = _end_run(client, experiment_id, run_id, status, cfg.mlflow)
        bounded.close()
        if installed:
            signal.signal(signal.SIGTERM, old_handler if old_handler is not None else signal.SIG_DFL)
        if ended:
            log.info("MLflow run %s ended %s", run_id, status)


def _run_tags(tags: Optional[Dict[str, Any]]) -> Dict[str, str]:
    """The caller's tags over MLflow's context tags (user, source name and type, git commit), as mlflow.start_run sets."""
    user = {str(k): str(v) for k, v in (tags or {}).items()}
    try:
        from mlflow.tracking.context.registry import resolve_tags

        return {str(k): str(v) for k, v in resolve_tags(user).items()}
    except Exception as exc:  # context providers are best effort
        log.debug("MLflow context tags unavailable: %s", exc)
        return user


def _tag_error(client: MlflowClient, run_id: str, exc: BaseException) -> None:
    try:
        client.set_tag(run_id, "error", short_error(exc, 5000))
    except Exception as tag_exc:
        log.warning("could not record the error on MLflow run %s: %s", run_id, short_error(tag_exc))
