"""The unended-runs journal: runs whose end the tracking server could not be told, ended by the next job that reaches it."""
from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator, List, Optional

from mlflow import MlflowClient
from mlflow.entities import RunStatus
from mlflow.exceptions import MlflowException

from pipeline.log import get_logger
from pipeline.redact import redact_url

log = get_logger(__name__)


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
                    log.warning("%s line %d is not a recorded run (%s); left as it is", self.path, number, short_error(exc))
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


def short_error(exc: Optional[BaseException], limit: int = 400) -> str:
    """The exception in one line for a log or a tag, URL passwords redacted (a driver's error may quote a URL)."""
    text = redact_url(f"{type(exc).__name__}: {exc}") if exc is not None else "unknown error"
    return text if len(text) <= limit else text[:limit] + "..."
