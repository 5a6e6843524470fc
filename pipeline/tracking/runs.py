"""The MLflow run lifecycle on the driver: connect, open and close the run, and log config, lineage and metrics to it by id."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import mlflow
from mlflow import MlflowClient
from mlflow.data.delta_dataset_source import DeltaDatasetSource
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunStatus
from mlflow.exceptions import MlflowException

from pipeline.config import Config, MlflowConfig
from pipeline.errors import Terminated  # noqa: F401  (raised here by the SIGTERM handler; callers import it here)
from pipeline.log import get_logger
from pipeline.redact import redact_url, redacted

log = get_logger(__name__)

# MLflow servers before 1.x/2.x accepted 500 characters per param value; newer ones more. The whole
# config is also logged as config.yaml, so truncating long values loses nothing.
PARAM_VALUE_LIMIT = 500
BATCH_LIMIT = 100
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
                            redact_url(uri), attempt, attempts, _short(last), cfg_mlflow.retry_wait_s)
                time.sleep(max(0.0, float(cfg_mlflow.retry_wait_s)))
    raise TrackingUnavailable(f"cannot reach MLflow at config key 'mlflow.tracking_uri' = {redact_url(uri)!r} after "
                              f"{attempts} attempt(s): {_short(last)}") from last


def _connected(client: MlflowClient, uri: str, experiment_id: str, cfg_mlflow: MlflowConfig) -> Tuple[MlflowClient, str]:
    mlflow.set_tracking_uri(uri)  # for the fluent API and model logging in this process
    if cfg_mlflow.unended_runs:
        journal = UnendedRuns(cfg_mlflow.unended_runs)
        try:
            journal.end_all(client, uri)
        except Exception as exc:  # a broken journal must not stop (or be mistaken for) the connection
            log.warning("could not process %s (config key 'mlflow.unended_runs'): %s", journal.path, _short(exc))
    return client, experiment_id


def _store_key(tracking_uri: str) -> str:
    """The tracking URI with a local file store as an absolute path (sqlite URIs are already resolved), its user-info
    password redacted: the journal is a file on disk, and the same server is the same key whatever the credentials."""
    tracking_uri = redact_url(tracking_uri)
    scheme = tracking_uri.split(":", 1)[0] if ":" in tracking_uri else ""
    if scheme in ("", "file") and not tracking_uri.startswith("databricks"):
        path = tracking_uri[len("file://"):] if tracking_uri.startswith("file://") else tracking_uri.split(":", 1)[-1]
        return "file://" + os.path.abspath(os.path.expanduser(path))
    return tracking_uri


class UnendedRuns:
    """A local JSON-lines file of runs whose end could not be recorded because the tracking server was down.

    Each line keeps the run id, its experiment, the server, the status the job ended with and when. The next
    connection to that server ends every such run still RUNNING with that status and end time, so the runs tell
    the truth; a line is dropped once its run is no longer RUNNING or was deleted. Jobs on one machine share the
    file under a lock.
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        import fcntl

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def add(self, tracking_uri: str, experiment_id: str, run_id: str, status: str, end_time_ms: int,
            error: str) -> None:
        entry = {"tracking_uri": _store_key(tracking_uri), "experiment_id": experiment_id, "run_id": run_id,
                 "status": status, "end_time_ms": end_time_ms, "error": error}
        with self._locked(), open(self.path, "a") as fh:
            fh.write(json.dumps(entry) + "\n")
        log.warning("MLflow run %s not marked %s yet (%s); recorded in %s (config key 'mlflow.unended_runs'): if it "
                    "stays unreachable, the next job that reaches %s ends it", run_id, status, error, self.path,
                    redact_url(tracking_uri))

    def end_all(self, client: MlflowClient, tracking_uri: str) -> List[str]:
        """End the recorded runs of `tracking_uri` still RUNNING; returns their ids.

        Lines of other servers, unreadable lines and runs the server cannot answer for now are kept.
        """
        key = _store_key(tracking_uri)
        ended: List[str] = []
        with self._locked():
            if not os.path.exists(self.path):
                return ended
            with open(self.path) as fh:
                lines = [line for line in fh.read().splitlines() if line.strip()]
            keep: List[str] = []
            unreachable = False
            for number, line in enumerate(lines, 1):
                try:
                    entry = json.loads(line)
                    run_id, status, end_ms = entry["run_id"], entry["status"], int(entry["end_time_ms"])
                    mine = entry["tracking_uri"] == key
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("%s line %d is not a recorded run (%s); left as it is", self.path, number, _short(exc))
                    keep.append(line)
                    continue
                if not mine or unreachable:
                    keep.append(line)
                    continue
                try:
                    if client.get_run(run_id).info.status == RunStatus.to_string(RunStatus.RUNNING):
                        client.set_terminated(run_id, status=status, end_time=end_ms)
                        client.set_tag(run_id, "lakehouse.ended_by", "a later job (the server was down when it ended)")
                        log.warning("MLflow run %s ended %s now: its job could not reach %s when it ended", run_id,
                                    status, redact_url(tracking_uri))
                        ended.append(run_id)
                except MlflowException as exc:
                    if not ("RESOURCE_DOES_NOT_EXIST" in str(exc.error_code)
                            and self._experiment_exists(client, entry.get("experiment_id"))):
                        keep.append(line)  # not this store's run after all, or a server error: keep it
                except Exception:  # unreachable again: keep this line and leave the rest for next time
                    unreachable = True
                    keep.append(line)
            self._rewrite(keep)
        return ended

    @staticmethod
    def _experiment_exists(client: MlflowClient, experiment_id: Optional[str]) -> bool:
        try:
            return experiment_id is not None and client.get_experiment(experiment_id) is not None
        except Exception:
            return False

    def _rewrite(self, lines: List[str]) -> None:
        import tempfile

        if not lines:
            os.remove(self.path)
            return
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".unended-")
        with os.fdopen(fd, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        os.replace(tmp, self.path)


def _short(exc: Optional[BaseException], limit: int = 400) -> str:
    """The exception in one line for a log or a tag, URL passwords redacted (a driver's error may quote a URL)."""
    text = redact_url(f"{type(exc).__name__}: {exc}") if exc is not None else "unknown error"
    return text if len(text) <= limit else text[:limit] + "..."


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
                                                              experiment_id, run_id, status, end_ms, _short(exc, 200))
                except Exception as journal_exc:
                    log.error("could not record MLflow run %s in %s (config key 'mlflow.unended_runs'): %s", run_id,
                              cfg_mlflow.unended_runs, _short(journal_exc))
            if attempt < 2:
                time.sleep(1.0)
                continue
            log.error("could not mark MLflow run %s as %s: %s", run_id, status, _short(exc))
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
        client.set_tag(run_id, "error", _short(exc, 5000))
    except Exception as tag_exc:
        log.warning("could not record the error on MLflow run %s: %s", run_id, _short(tag_exc))


def _param_value(value: Any) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= PARAM_VALUE_LIMIT else text[:PARAM_VALUE_LIMIT - 3] + "..."


def config_yaml(cfg: Config) -> str:
    """The config as YAML with its secrets redacted (pipeline.redact): what `config.yaml` artifacts and the offline
    folder keep. `lakehouse sync-run` reloads it; only the redacted values (never the secrets) are then missing."""
    import yaml

    return yaml.safe_dump(redacted(cfg.to_dict()), sort_keys=False)


def config_params(cfg: Config) -> Dict[str, Any]:
    """The flattened config (`train.np`, `spark.conf`, ...) as logged in params, secrets redacted (pipeline.redact)."""
    return redacted(cfg.flat())


def log_config(client: MlflowClient, run_id: str, cfg: Config) -> None:
    """Log the resolved config as artifact `config.yaml` and as flattened params (`train.np`, ...), secrets redacted
    in both (`spark.conf` secret values, passwords in URLs such as `tune.storage`; pipeline.redact)."""
    client.log_text(run_id, config_yaml(cfg), "config.yaml")
    params = [Param(str(k), _param_value(v)) for k, v in sorted(config_params(cfg).items())]
    for start in range(0, len(params), BATCH_LIMIT):
        client.log_batch(run_id, params=params[start:start + BATCH_LIMIT], synchronous=True)


def git_commit(cwd: Optional[str] = None) -> Optional[str]:
    """The commit checked out where the package lives (or `cwd`), or None outside a git checkout."""
    where = cwd or str(Path(__file__).resolve().parents[2])
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


class PinnedDeltaSource(DeltaDatasetSource):
    """A Delta table version as an MLflow dataset source; MLflow's own leaves out version 0 (a falsy check)."""

    def to_dict(self) -> Dict[str, Any]:
        return {**super().to_dict(), "delta_table_version": self._delta_table_version}


def delta_dataset(table: str, version: int, name: Optional[str] = None) -> "mlflow.data.meta_dataset.MetaDataset":
    """The Delta table at `version` as an MLflow dataset (no Spark needed)."""
    from mlflow.data.meta_dataset import MetaDataset

    digest = hashlib.sha256(f"{table}@{version}".encode()).hexdigest()[:16]
    ds_name = name or f"{Path(str(table).rstrip('/')).name or table}@v{version}"
    return MetaDataset(source=PinnedDeltaSource(path=str(table), delta_table_version=int(version)),
                       name=ds_name, digest=digest)


def log_lineage(client: MlflowClient, run_id: str, table: str, version: int, rows: Dict[str, int],
                extra_tags: Optional[Dict[str, Any]] = None) -> None:
    """Tag the run with the Delta table, version and row counts, and log the table as the run's input.

    `rows` maps split name to row count ({'train': 800, 'val': 200} -> tags rows_train, rows_val).
    `extra_tags` (world_size, backend, ...) are added; `git_commit` too when the code is a git checkout.
    """
    if version is None or int(version) < 0:
        raise ValueError(f"log_lineage: delta version must be a pinned version >= 0, got {version!r}")
    tags: Dict[str, str] = {"delta_table": str(table), "delta_version": str(int(version))}
    for split, count in rows.items():
        tags[f"rows_{split}"] = str(int(count))
    tags.update({str(k): str(v) for k, v in (extra_tags or {}).items()})
    commit = git_commit()
    if commit and "git_commit" not in tags:
        tags["git_commit"] = commit
        tags.setdefault("mlflow.source.git.commit", commit)
    from mlflow.entities import RunTag

    items = [RunTag(k, v[:5000]) for k, v in tags.items()]
    for start in range(0, len(items), BATCH_LIMIT):
        client.log_batch(run_id, tags=items[start:start + BATCH_LIMIT], synchronous=True)
    dataset = delta_dataset(table, int(version))
    # Dataset._to_mlflow_entity is what mlflow.log_input uses; the client call needs no active run.
    client.log_inputs(run_id, datasets=[DatasetInput(dataset._to_mlflow_entity(),
                                                     tags=[InputTag("mlflow.data.context", "training")])])


def epoch_metrics(metrics: Dict[str, float], step: int, timestamp_ms: Optional[int] = None) -> List[Metric]:
    """One epoch's metrics as MLflow entities at `step` (NaN and inf are kept, so a divergence shows). A fixed
    `timestamp_ms` makes a value sent twice (a retry whose first answer was lost) one value on an SQL store."""
    ts = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
    items: List[Metric] = []
    for key, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"metric {key!r} at step {step}: value {value!r} is not a number") from None
        items.append(Metric(str(key), number, ts, int(step)))
    return items


def log_epoch_metrics(client: MlflowClient, run_id: str, metrics: Dict[str, float], step: int,
                      timestamp_ms: Optional[int] = None) -> None:
    """Log one epoch's metrics at `step` in one batch, waiting for the server (see `send_metrics` for rank 0's way)."""
    items = epoch_metrics(metrics, step, timestamp_ms)
    for start in range(0, len(items), 1000):
        client.log_batch(run_id, metrics=items[start:start + 1000], synchronous=True)


def http_call_bound_s(env: Optional[Mapping[str, str]] = None) -> float:
    """The longest one MLflow HTTP call can take under the environment's settings (`http_bounds` sets them from
    `mlflow.retries`; MLflow's defaults otherwise): every attempt's MLFLOW_HTTP_REQUEST_TIMEOUT, urllib3's backoff
    before each retry (MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR x 2^n, at most 120 s, plus MLflow's jitter) and 1 s slack."""
    env = os.environ if env is None else env

    def number(key: str, default: float) -> float:
        try:
            return max(0.0, float(env.get(key, default)))
        except (TypeError, ValueError):
            return default

    retries = int(min(number("MLFLOW_HTTP_REQUEST_MAX_RETRIES", 7), 10))  # MLflow refuses more than 10
    timeout = number("MLFLOW_HTTP_REQUEST_TIMEOUT", 120)
    factor = number("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", 2)
    jitter = number("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", 1.0)
    backoff = sum(min(120.0, factor * 2 ** n) + jitter for n in range(retries))
    return (retries + 1) * timeout + backoff + 1.0


class Sending:
    """An asynchronous MLflow logging call (`synchronous=False`: MLflow's own queue and worker threads send it),
    watched without blocking. MLflow's RunOperations offers only `wait()`, which blocks without a bound; its futures
    (`_operation_futures`, there since async logging came in 2.8) give `done`, `error` and a bounded `wait`. An
    MLflow without them: one daemon thread waits on `wait()` for us."""

    def __init__(self, operations: Any = None, error: Optional[BaseException] = None) -> None:
        from concurrent.futures import Future

        self.started = time.monotonic()
        if error is not None:  # the call failed before anything was queued
            failed: Future = Future()
            failed.set_exception(error)
            self.futures = [failed]
            return
        futures = getattr(operations, "_operation_futures", None) if operations is not None else []
        if isinstance(futures, list) and all(isinstance(f, Future) for f in futures):
            self.futures = list(futures)
            return
        waited: Future = Future()

        def _wait() -> None:
            try:
                operations.wait()
                waited.set_result(None)
            except BaseException as exc:  # delivered through the future
                waited.set_exception(exc)

        threading.Thread(target=_wait, name="lakehouse-mlflow-wait", daemon=True).start()
        self.futures = [waited]

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def error(self) -> Optional[BaseException]:
        """The first failure among the finished parts (None: none failed, or still under way)."""
        for f in self.futures:
            if f.done() and f.exception() is not None:
                return f.exception()
        return None

    def wait(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` seconds; whether every part has finished (taken or failed)."""
        from concurrent.futures import wait

        wait(self.futures, timeout=max(0.0, timeout_s))
        return self.done()


def send_metrics(client: MlflowClient, run_id: str, items: List[Metric]) -> Sending:
    """Hand `items` to MLflow's asynchronous logging (`log_batch(..., synchronous=False)`, chunked by MLflow) and
    return at once; a call that fails before queueing anything comes back as a failed `Sending`, never raises. A
    client that logs synchronously and returns nothing counts as done."""
    try:
        return Sending(client.log_batch(run_id, metrics=items, synchronous=False))
    except Exception as exc:
        return Sending(error=exc)


__all__ = ["Terminated", "TrackingUnavailable", "TrackedRun", "configure", "tracked_run", "log_config",
           "log_lineage", "log_epoch_metrics", "epoch_metrics", "send_metrics", "Sending", "http_call_bound_s",
           "resolve_tracking_uri", "resolve_artifact_location", "git_commit",
           "delta_dataset", "experiment_id_of", "config_yaml", "config_params"]
