"""A run left in a local folder when the tracking server never came back, and `lakehouse sync-run` that uploads it.

The folder (`<job dir>/offline_run`) holds what the server did not get: `run.json` (run id, experiment, server, tags,
the pinned Delta version, the true end status and whether the job would have registered the model), `config.yaml`,
`metrics.jsonl` (every epoch's metrics with their steps, and whether the server already took them), `artifacts/`
(plots, ranks.json, ...) and `model/` (the network's weights and what rebuilds it). Rank 0 writes the metrics, plots
and model; the driver the rest, through the same calls it makes on an MLflow client (`set_tag`, `log_dict`, ...).
`lakehouse sync-run` records its own progress in run.json (`sync`: see `Upload`), so a sync that failed part way is
resumed by the next one: one run, each metric value once, one registered version; and it holds `sync.lock` while it
runs (`sync_lock`), so two at once cannot both register.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from pipeline.config import load_config
from pipeline.distributed.job_folder import JobFolder
from pipeline.log import get_logger
from pipeline.redact import URL_MASK, redact_url

log = get_logger(__name__)

# A probe of the server must fail fast: the caller's own bounded loop does the waiting.
_PROBE_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


class SyncError(RuntimeError):
    """A folder that `lakehouse sync-run` cannot upload; the message names the folder and the file."""


def offline_folder(job_dir: str) -> str:
    return JobFolder(job_dir).offline_run


def left_offline(job_dir: str) -> Optional["OfflineRun"]:
    """The run rank 0 left in `job_dir` because the server never came back, or None."""
    folder = offline_folder(job_dir)
    return OfflineRun(folder) if os.path.exists(os.path.join(folder, "model", "network.pt")) else None


def server_back(client, run_id: str, wait_s: float, retry_wait_s: float) -> bool:
    """Whether the server answers for `run_id` within `wait_s` seconds (probed every `retry_wait_s`)."""
    from pipeline.tracking.runs import temporary_env  # local: mlflow, in rank 0 alone (all ranks import this)

    deadline = time.monotonic() + max(0.0, float(wait_s))
    while True:
        try:
            with temporary_env(_PROBE_ENV):
                client.get_run(run_id)
            return True
        except Exception as exc:  # connection refused, timeouts, 5xx while it starts
            if time.monotonic() >= deadline:
                log.warning("MLflow still unreachable after %.0f s (config key 'mlflow.reconnect_wait_s'): %s",
                            wait_s, exc)
                return False
        time.sleep(max(0.1, float(retry_wait_s)))


class OfflineRun:
    """The folder of one run kept offline; also takes the MLflow client calls the driver makes on a run."""

    def __init__(self, folder: str) -> None:
        self.folder = os.path.abspath(folder)

    # -- writing ---------------------------------------------------------------------------------------------------
    def _path(self, *parts: str) -> str:
        return os.path.join(self.folder, *parts)

    @contextlib.contextmanager
    def _atomic(self, path: str, mode: str = "w") -> Iterator[Any]:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            with os.fdopen(fd, mode) as fh:
                yield fh
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def read(self) -> Dict[str, Any]:
        path = self._path("run.json")
        if not os.path.exists(path):
            return {}
        try:
            with open(path) as fh:
                return json.load(fh)
        except ValueError as exc:
            raise SyncError(f"{path} is not valid JSON: {exc}") from None

    def update(self, **fields: Any) -> Dict[str, Any]:
        """Merge `fields` into run.json (tags merge key by key)."""
        data = self.read()
        for key, value in fields.items():
            if key == "tags":
                data.setdefault("tags", {}).update({str(k): str(v) for k, v in value.items()})
            else:
                data[key] = value
        with self._atomic(self._path("run.json")) as fh:
            json.dump(data, fh, indent=2, sort_keys=True, default=str)
        return data

    def write_metrics(self, epochs: Iterable[Tuple[int, Dict[str, float], int, bool]]) -> None:
        """Every epoch's metrics: (step, metrics, timestamp in ms, whether the server already took them)."""
        with self._atomic(self._path("metrics.jsonl")) as fh:
            for step, metrics, ts, sent in epochs:
                for key, value in metrics.items():
                    fh.write(json.dumps({"key": key, "value": float(value), "step": int(step), "timestamp": int(ts),
                                         "sent": bool(sent)}) + "\n")

    def save_model(self, network, meta: Dict[str, Any], step: int) -> str:
        """The network's weights and what rebuilds it (`sync-run` logs it with the same pyfunc code as online)."""
        import torch

        folder = self._path("model")
        os.makedirs(folder, exist_ok=True)
        with self._atomic(os.path.join(folder, "meta.json")) as fh:
            json.dump({"meta": meta, "step": int(step)}, fh, indent=2, sort_keys=True)
        with self._atomic(os.path.join(folder, "network.pt"), "wb") as fh:  # last: its presence marks the folder
            torch.save({k: v.detach().cpu() for k, v in network.state_dict().items()}, fh)
        return folder

    # the MLflow client calls the driver and rank 0 make on a run (the run id is the folder's)
    def set_tag(self, run_id: str, key: str, value: Any) -> None:
        self.update(tags={key: value})

    def log_artifact(self, run_id: str, local_path: str, artifact_path: Optional[str] = None) -> None:
        dest = self._path("artifacts", *([artifact_path] if artifact_path else []))
        os.makedirs(dest, exist_ok=True)
        shutil.copy2(local_path, os.path.join(dest, os.path.basename(local_path)))

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        with self._atomic(self._path("artifacts", artifact_file)) as fh:
            fh.write(text)

    def log_dict(self, run_id: str, dictionary: Any, artifact_file: str) -> None:
        self.log_text(run_id, json.dumps(dictionary, indent=2, default=str), artifact_file)

    # -- reading ---------------------------------------------------------------------------------------------------
    def metrics(self) -> List[Dict[str, Any]]:
        path = self._path("metrics.jsonl")
        out: List[Dict[str, Any]] = []
        if not os.path.exists(path):
            return out
        with open(path) as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                    out.append({"key": str(item["key"]), "value": float(item["value"]), "step": int(item["step"]),
                                "timestamp": int(item["timestamp"]), "sent": bool(item.get("sent"))})
                except (ValueError, KeyError, TypeError) as exc:
                    raise SyncError(f"{path} line {number} is not a metric ({exc})") from None
        return out


def _run_exists(client, run_id: str, experiment_id: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        if "RESOURCE_DOES_NOT_EXIST" in str(exc.error_code):
            return False
        raise
    return run.info.experiment_id == experiment_id and run.info.lifecycle_stage == "active"


# run.json's key recording what a `lakehouse sync-run` of the folder has done so far (see `Upload.record`)
SYNC_KEY = "sync"
# the name the model is logged under in the uploaded run (pipeline.tracking.pyfunc.log_model)
MODEL_NAME = "model"
# the file in the folder a `lakehouse sync-run` holds locked (fcntl.flock) while it syncs; it names the holder
SYNC_LOCK = "sync.lock"


# what a folder must hold to be a run left offline by `lakehouse train` (the rest is optional)
RUN_FILES = ("run.json", "config.yaml", os.path.join("model", "network.pt"))


def is_offline_run(folder: str) -> bool:
    """Whether `folder` holds what a run left offline by `lakehouse train` does (RUN_FILES)."""
    return all(os.path.isfile(os.path.join(folder, name)) for name in RUN_FILES)


@contextlib.contextmanager
def sync_lock(folder: str) -> Iterator[None]:
    """Hold the folder's sync lock (an exclusive `fcntl.flock` on `<folder>/sync.lock`) for the block: one
    `lakehouse sync-run` of a folder at a time, or two that both find no registered version both register one (two
    versions from one run, both gated). The lock is the open file's: the operating system releases it when the
    holder ends, however it ends, so a crashed sync never blocks the next. The file records the holder's pid and
    host. A path that is not a run left offline (`is_offline_run`: another folder, a file) is not locked, so no lock
    file is left in it: `upload` refuses it, naming what it lacks.

    Raises:
        SyncError: another process holds the lock; the message names the folder, the lock file and the holder.
    """
    import fcntl

    folder = os.path.abspath(folder)
    if not is_offline_run(folder):
        yield
        return
    path = os.path.join(folder, SYNC_LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
            raise SyncError(f"{folder}: another `lakehouse sync-run` of this folder holds its lock {path} "
                            f"({holder or 'holder not recorded yet'}); wait for it to end (a sync that failed part "
                            "way is resumed by the next one)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


@dataclass
class Upload:
    """A run left offline and uploaded to the server: what `lakehouse sync-run` (pipeline.workflow.sync_run) goes
    on with: registering the model, then ending the run (`end`).

    Each step of the sync is recorded in run.json under `sync` as soon as it completes (`record`): the run it
    created or continued, the metric values logged, the artifacts, the logged model's URI, the registered version
    and the gate's verdict. A sync that failed part way is resumed by the next one from there; a step that completed
    on the server just before its record was written is found there (`resuming`: the server is asked)."""

    off: OfflineRun
    info: Dict[str, Any]  # run.json as the job left it
    cfg: Any  # the run's config (pipeline.config.Config) with the sync's overrides
    client: Any  # the MLflow client of the server uploaded to
    summary: Dict[str, Any]  # what `lakehouse sync-run` prints; registering fills in model_version, champion
    state: Dict[str, Any]  # run.json's `sync` record: the steps done so far
    resuming: bool = False  # an earlier sync-run of this folder got as far as a run on the server

    def record(self, **steps: Any) -> None:
        """Write the steps just completed into run.json's `sync` record (atomically, before the next step)."""
        self.state.update(steps)
        self.off.update(**{SYNC_KEY: dict(self.state)})

    def resumed(self, step: str, value: Any) -> None:
        """Note in the summary (`resumed`) a step an earlier sync-run of the folder had done."""
        self.summary.setdefault("resumed", {})[step] = value

    def registered_version(self, name: str) -> Optional[str]:
        """The version of registered model `name` this run already has: the one recorded, else one the registry
        holds for the run (registered by an earlier sync-run that failed before recording it), else None."""
        if self.state.get("model_version") is not None:
            self.resumed("model_version", str(self.state["model_version"]))
            return str(self.state["model_version"])
        from pipeline.tracking.registry import model_versions  # local: mlflow (a sync-run's alone)

        run_id = self.summary["run_id"]
        found = [mv for mv in model_versions(self.client, name, run_id) if str(mv.status) != "FAILED_REGISTRATION"]
        if not found:
            return None
        version = str(min(int(mv.version) for mv in found))
        log.warning("model %r version %s was registered from run %s by an earlier sync-run of %s; not registering "
                    "it again", name, version, run_id, self.off.folder)
        self.record(model_version=version)
        self.resumed("model_version", version)
        return version

    def end(self) -> Dict[str, Any]:
        """The run's true end status, and the folder marked uploaded (a second sync-run refuses it). The tracking URI
        is kept and printed with its credentials redacted (pipeline.redact), as everywhere in the folder."""
        s = self.summary
        self.client.set_terminated(s["run_id"], status=s["status"], end_time=self.info.get("end_time"))
        s["tracking_uri"] = redact_url(s["tracking_uri"])
        self.off.update(synced={"run_id": s["run_id"], "tracking_uri": s["tracking_uri"],
                                "model_version": s["model_version"], "at": int(time.time() * 1000)})
        log.info("uploaded %s to MLflow run %s (%s, %d metric values)%s%s", self.off.folder, s["run_id"],
                 "continued" if s["continued"] else "created", s["metrics"],
                 f"; registered version {s['model_version']}" if s["model_version"] is not None else "",
                 f"; resumed an earlier sync-run: {json.dumps(s['resumed'])}" if s["resumed"] else "")
        return s


def _created_before(client, experiment_id: str, offline_run_id: str, folder: str) -> Optional[str]:
    """The run an earlier sync-run of `folder` created for `offline_run_id` but failed to record, or None."""
    runs = client.search_runs([experiment_id], f"tags.`lakehouse.offline_run_id` = '{offline_run_id}'")
    mine = [r for r in runs if r.data.tags.get("lakehouse.synced_from") == folder]
    return min(mine, key=lambda r: r.info.start_time or 0).info.run_id if mine else None


def _redacted(uri: Any) -> bool:
    """Whether `uri` was kept with its credentials replaced (pipeline.redact: `user:***@`, `?token=***`)."""
    return isinstance(uri, str) and URL_MASK in uri


def _logged_model_of(client, run_id: str) -> Optional[str]:
    """`models:/<id>` of the newest READY model named MODEL_NAME that run `run_id` output, or None.

    MLflow links a logged model to its run before it uploads the artifacts: one an earlier sync-run failed to upload
    (FAILED; PENDING where the process died) has none, so it is never taken: the model is logged again."""
    from pipeline.tracking.registry import logged_model_ready  # local: mlflow (a sync-run's alone)

    run = client.get_run(run_id)
    ready = []
    for out in (run.outputs.model_outputs if run.outputs else []):
        model = client.get_logged_model(out.model_id)
        if model.name != MODEL_NAME:
            continue
        if logged_model_ready(model):
            ready.append(model)
        else:
            log.warning("run %s has logged model %s (%r) in state %s: its upload did not complete; not resuming "
                        "from it", run_id, model.model_id, model.name, model.status)
    if not ready:
        return None
    newest = max(ready, key=lambda m: (m.creation_timestamp or 0, m.last_updated_timestamp or 0))
    return f"models:/{newest.model_id}"


def upload(folder: str, overrides: Optional[List[str]] = None) -> Upload:
    """Upload a run left offline to the tracking server (the folder's, or `mlflow.tracking_uri=` in `overrides`).

    The run continues where the server has it (else a new run is created in the experiment, tagged with the
    original id): the metrics the server never took, the tags, the artifacts and the model (logged by the same code
    as online). The run is left running: the caller registers the model if the job would have, then `Upload.end`.
    A sync-run that failed part way is resumed (see `Upload`): the same run, no metric value logged twice.

    MLflow's HTTP retries are bounded by `mlflow.retries` throughout (pipeline.tracking.runs.http_bounds, as in a
    training run), so a slow or dead server costs seconds per call, not MLflow's default minutes.

    Raises:
        SyncError: the folder is not a run left offline, or was uploaded already; its tracking URI was kept with
            the credentials redacted and no `mlflow.tracking_uri=` is in `overrides`; the run an earlier sync-run of
            the folder created or continued is no longer on the server (deleted).
    """
    from pipeline.tracking.runs import http_bounds, temporary_env  # local: mlflow (a sync-run's alone)

    off = OfflineRun(folder)
    info = off.read()
    if not info or not is_offline_run(off.folder):
        raise SyncError(f"{off.folder} is not a run left offline by `lakehouse train` (it needs "
                        f"{', '.join(RUN_FILES[:-1])} and {RUN_FILES[-1]})")
    if info.get("synced"):
        raise SyncError(f"{off.folder} was uploaded already: {json.dumps(info['synced'])}")
    overrides = list(overrides or [])
    uri_given = any(o.startswith("mlflow.tracking_uri=") for o in overrides)
    if not uri_given and info.get("tracking_uri"):
        overrides.insert(0, f"mlflow.tracking_uri={info['tracking_uri']}")
    cfg = load_config(os.path.join(off.folder, "config.yaml"), overrides)
    if not uri_given and _redacted(cfg.mlflow.tracking_uri):  # it would connect as `user:***` (a 401, no hint)
        raise SyncError(f"{off.folder}: the tracking URI it keeps, {redact_url(cfg.mlflow.tracking_uri)!r}, has its "
                        "credentials redacted (no secret is written to the folder); give the URI with them under "
                        f"config key 'mlflow.tracking_uri': `lakehouse sync-run {off.folder} "
                        "mlflow.tracking_uri=<the URI with its credentials>`")
    with temporary_env(http_bounds(cfg.mlflow)):
        return _upload(off, info, cfg)


def _upload(off: OfflineRun, info: Dict[str, Any], cfg: Any) -> Upload:
    """`upload`'s work once the folder and its config are read."""
    from mlflow.entities import Metric, RunTag

    from pipeline.tracking.lineage import log_config, log_lineage  # local: mlflow (a sync-run's alone)
    from pipeline.tracking.runs import _connect  # local: mlflow (a sync-run's alone)

    client, experiment_id = _connect(cfg.mlflow)
    offline_run_id = str(info["run_id"])
    up = Upload(off=off, info=info, cfg=cfg, client=client, state=dict(info.get(SYNC_KEY) or {}),
                summary={"folder": off.folder, "offline_run_id": offline_run_id, "model_version": None,
                         "champion": False, "status": info.get("status", "FINISHED"),
                         "tracking_uri": redact_url(cfg.mlflow.tracking_uri), "resumed": {}})

    # the run: the one an earlier sync-run recorded, else the job's own run where the server has it, else a new one
    lineage = info.get("lineage") or {}
    state = up.state
    if state.get("run_id"):
        run_id, continued, up.resuming = str(state["run_id"]), bool(state.get("continued")), True
        if not _run_exists(client, run_id, experiment_id):
            raise SyncError(f"{off.folder}: MLflow run {run_id}, which an earlier `lakehouse sync-run` of this folder "
                            f"{'continued' if continued else 'created'} on {state.get('tracking_uri')}, is not an "
                            f"active run of experiment {cfg.mlflow.experiment!r} on "
                            f"{redact_url(cfg.mlflow.tracking_uri)} (deleted?); restore it (`mlflow runs restore "
                            f"--run-id {run_id}`), or remove the '{SYNC_KEY}' entry of "
                            f"{off._path('run.json')} to upload the folder as a new run")
        up.resumed("run_id", run_id)
    else:
        continued = _run_exists(client, offline_run_id, experiment_id)
        run_id = offline_run_id if continued else _created_before(client, experiment_id, offline_run_id, off.folder)
        if run_id is None:
            run = client.create_run(experiment_id, run_name=info.get("run_name"), start_time=info.get("start_time"),
                                    tags={"lakehouse.offline_run_id": offline_run_id,
                                          "lakehouse.synced_from": off.folder})
            run_id = run.info.run_id
        elif not continued:  # created by an earlier sync-run that failed before recording it
            up.resuming = True
            up.resumed("run_id", run_id)
        up.record(run_id=run_id, continued=continued, tracking_uri=redact_url(cfg.mlflow.tracking_uri))
    up.summary.update(run_id=run_id, continued=continued)

    if not continued and not state.get("params"):  # logging the same values again is allowed
        log_config(client, run_id, cfg)
        if lineage:
            log_lineage(client, run_id, lineage["table"], int(lineage["version"]), lineage.get("rows") or {})
        up.record(params=True)
    tags = [RunTag(k, str(v)[:5000]) for k, v in (info.get("tags") or {}).items()]
    tags.append(RunTag("lakehouse.synced_from", off.folder))
    for start in range(0, len(tags), 100):  # setting a tag again is harmless
        client.log_batch(run_id, tags=tags[start:start + 100], synchronous=True)

    metrics = [Metric(m["key"], m["value"], m["timestamp"], m["step"]) for m in off.metrics()
               if not (continued and m["sent"])]
    done = min(int(state.get("metrics_logged", 0)), len(metrics))
    on_server = set()
    if up.resuming and done < len(metrics):  # a batch the server took just before its record failed
        for key in sorted({m.key for m in metrics[done:]}):
            on_server.update((key, m.step, m.timestamp) for m in client.get_metric_history(run_id, key))
    logged = 0
    for start in range(done, len(metrics), 1000):
        batch = [m for m in metrics[start:start + 1000] if (m.key, m.step, m.timestamp) not in on_server]
        if batch:
            client.log_batch(run_id, metrics=batch, synchronous=True)
        logged += len(batch)
        up.record(metrics_logged=min(start + 1000, len(metrics)))
    if logged < len(metrics):  # the rest an earlier sync-run logged
        up.resumed("metrics", len(metrics) - logged)

    artifacts = os.path.join(off.folder, "artifacts")
    if state.get("artifacts"):
        up.resumed("artifacts", True)
    elif os.path.isdir(artifacts):
        client.log_artifacts(run_id, artifacts)
        up.record(artifacts=True)

    model_uri = state.get("model_uri") or (_logged_model_of(client, run_id) if up.resuming else None)
    if model_uri:
        up.resumed("model_uri", model_uri)
    else:
        model_uri = _log_offline_model(off, run_id)
    if state.get("model_uri") != model_uri:
        up.record(model_uri=model_uri)

    up.summary.update(metrics=logged, model_uri=model_uri)
    return up


def _log_offline_model(off: OfflineRun, run_id: str) -> str:
    import torch

    from pipeline.model.nets import build_network  # local: torch (a sync-run's alone)
    from pipeline.tracking.pyfunc import log_model  # local: mlflow and torch (a sync-run's alone)

    with open(os.path.join(off.folder, "model", "meta.json")) as fh:
        saved = json.load(fh)
    meta = saved["meta"]
    network = build_network(meta["arch"], meta["channels"], len(meta["class_names"]), meta["width"])
    network.load_state_dict(torch.load(os.path.join(off.folder, "model", "network.pt"), map_location="cpu"))
    network.eval()
    return log_model(network, meta, MODEL_NAME, run_id=run_id, step=int(saved.get("step", 0)))


def record_job(off: OfflineRun, run, cfg, pinned, rows: Dict[str, int], tags: Dict[str, Any], r0,
               run_name: Optional[str] = None, register: bool = True) -> Dict[str, Any]:
    """The driver's part of a run left offline: the config, lineage, tags, gate metrics and the true end status
    (FINISHED: training ended normally), and whether the job would have registered the model."""
    from pipeline.tracking.lineage import config_yaml  # local: mlflow, out of the ranks (all import this)

    off.log_text(run.run_id, config_yaml(cfg), "config.yaml")  # secrets redacted (pipeline.redact)
    shutil.move(off._path("artifacts", "config.yaml"), off._path("config.yaml"))
    return off.update(run_id=run.run_id, run_name=run_name, experiment=cfg.mlflow.experiment,
                      experiment_id=run.experiment_id, tracking_uri=redact_url(run.tracking_uri), status="FINISHED",
                      end_time=int(time.time() * 1000), register=bool(register),
                      gate_metrics={k: v for k, v in (r0.metrics or {}).items()},
                      lineage={"table": redact_url(pinned.table), "version": int(pinned.version), "rows": dict(rows)},
                      tags={str(k): str(v) for k, v in (tags or {}).items()},
                      epochs=r0.epochs, stopped_early=r0.stopped_early)
