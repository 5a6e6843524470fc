"""`lakehouse sync-run` and `lakehouse promote` against a real SQLite MLflow store under tmp_path: two sync-runs of one
folder at once (two real processes) register one version, the second failing at once naming the folder and the
first's pid; the tracking URI is printed and kept with its credentials redacted; and MLflow's HTTP retries are
bounded by `mlflow.retries` (as in `train`) through a sync and a promote, not left at MLflow's minutes per call."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow import MlflowClient

import pipeline
from pipeline.config import Config, apply_overrides, to_yaml
from pipeline.redact import redact_url
from pipeline.tracking.offline import OfflineRun

CLASS_NAMES = ["circle", "square"]
META = {"arch": "cnn", "width": 4, "channels": 1, "image_size": 8, "class_names": CLASS_NAMES}
SECRET = "s3cr3t-pw"
BOUNDS = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One SQLite store for the module (creating one costs seconds); each test its own folder and model name."""
    root = tmp_path_factory.mktemp("sync_store")
    uri = f"sqlite:///{root}/mlflow.db"
    MlflowClient(uri).create_experiment("sync-lock")  # the store made here, not by two processes at once
    return uri, root


def _folder(where: Path, uri: str, model: str, stored_uri: str = None) -> OfflineRun:
    """A run left offline by a job that would have registered its model as `model` (not gated); its tracking URI
    kept as `stored_uri` (record_job keeps it redacted), else `uri`."""
    stored_uri = uri if stored_uri is None else stored_uri
    cfg = apply_overrides(Config(), {
        "mlflow.tracking_uri": stored_uri, "mlflow.artifact_location": str(where / "mlartifacts"),
        "mlflow.experiment": "sync-lock", "mlflow.registered_model": model, "mlflow.retries": 2,
        "mlflow.promote": False, "mlflow.unended_runs": str(where / "unended.jsonl"), "data.image_size": 8,
        "data.channels": 1, "model.width": 4})
    folder = where / "job" / "offline_run"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(to_yaml(cfg))
    off = OfflineRun(str(folder))
    off.write_metrics([(0, {"val_acc": 0.5}, 1_700_000_000_000, False)])
    from pipeline.model.nets import build_network

    off.save_model(build_network("cnn", 1, len(CLASS_NAMES), width=4), META, step=2)
    off.update(run_id="f" * 32, run_name="offline", tracking_uri=stored_uri,
               status="FINISHED", end_time=1_700_000_003_000, register=True, gate_metrics={"val_acc": 0.5},
               lineage={"table": "work/delta/images", "version": 1, "rows": {"train": 4, "val": 2}}, tags={})
    return off


# Each process syncs the folder; the one that gets as far as asking the registry for the run's version waits there
# (`in.<pid>`) until the test says `go`: two syncs without a lock both find none there, and both register one. The
# model is not logged (torch and the pyfunc cost each process seconds and take no part in the race): its URI is the
# run's, which the registry takes as a version's source.
SYNC = """
import json, os, sys, time
import pipeline.tracking.offline as offline
from pipeline.workflow import sync_run

folder, barrier = sys.argv[1], sys.argv[2]
real = offline.Upload.registered_version
offline._log_offline_model = lambda off, run_id: f"runs:/{run_id}/model"

def held(self, name):
    found = real(self, name)
    open(os.path.join(barrier, f"in.{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 180
    while not os.path.exists(os.path.join(barrier, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found

offline.Upload.registered_version = held
try:
    print(json.dumps({"version": sync_run(folder)["model_version"]}))
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
"""


@pytest.mark.timeout(400)
def test_two_syncs_of_one_folder_at_once_register_one_version(store, tmp_path):
    uri, _ = store
    off = _folder(tmp_path, uri, "locked")
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(pipeline.__file__).resolve().parents[1]), "LAKEHOUSE_PROGRESS": "0"}
    procs = [subprocess.Popen([sys.executable, "-c", SYNC, off.folder, str(barrier)], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # both inside (no lock), or one ended (refused by the lock)
            if len(list(barrier.glob("in.*"))) == 2 or any(p.poll() is not None for p in procs):
                break
            time.sleep(0.1)
        (barrier / "go").touch()
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = {}
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.strip(), err[-3000:]
        results[p.pid] = json.loads(out.strip().splitlines()[-1])
    versions = MlflowClient(uri).search_model_versions("name='locked'")
    assert len(versions) == 1, (results, [(v.version, v.run_id) for v in versions])
    done = [pid for pid, r in results.items() if "version" in r]
    refused = [r["error"] for r in results.values() if "error" in r]
    assert len(done) == 1 and len(refused) == 1, results
    assert refused[0].startswith("SyncError: ") and off.folder in refused[0]
    assert "another `lakehouse sync-run`" in refused[0] and f"pid {done[0]}" in refused[0]
    assert off.read()["synced"]["model_version"] == int(versions[0].version)


def test_the_tracking_uri_is_printed_and_kept_redacted_and_http_retries_are_bounded(store, tmp_path, monkeypatch):
    """The folder keeps the URI redacted; the sync is given it with its password (`mlflow.tracking_uri=`): the
    summary it prints and run.json's `synced` record say it redacted. Every MLflow call of the sync (connecting,
    logging, registering) runs under `http_bounds` (mlflow.retries=2, 30 s an attempt)."""
    import mlflow

    import pipeline.tracking.runs as runs
    import pipeline.workflow as workflow

    for name in BOUNDS:
        monkeypatch.delenv(name, raising=False)
    real_uri, _ = store
    given = f"http://alice:{SECRET}@mlflow.example:5000"
    off = _folder(tmp_path, given, "redacted", stored_uri=redact_url(given))
    seen = {}

    def connect(cfg_mlflow):  # the server is the SQLite store; what the sync was given is checked
        assert cfg_mlflow.tracking_uri == given
        seen["connect"] = {k: os.environ.get(k) for k in BOUNDS}
        client = MlflowClient(real_uri)
        mlflow.set_tracking_uri(real_uri)  # as _connect's use_tracking_uri: the model is logged there
        exp = client.get_experiment_by_name("sync-lock")
        return client, exp.experiment_id if exp else client.create_experiment("sync-lock")

    real_register = workflow.register_version

    def register(*args, **kwargs):
        seen["register"] = {k: os.environ.get(k) for k in BOUNDS}
        return real_register(*args, **kwargs)

    monkeypatch.setattr(runs, "_connect", connect)
    monkeypatch.setattr(workflow, "register_version", register)
    out = workflow.sync_run(off.folder, [f"mlflow.tracking_uri={given}"])
    assert out["tracking_uri"] == "http://alice:***@mlflow.example:5000" and SECRET not in json.dumps(out)
    assert off.read()["synced"]["tracking_uri"] == out["tracking_uri"]
    texts = [p.read_text() for p in Path(off.folder).rglob("*") if p.is_file() and p.suffix in (".json", ".yaml")]
    assert texts and not [t for t in texts if SECRET in t]
    bounded = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
    assert seen == {"connect": bounded, "register": bounded}
    assert all(name not in os.environ for name in BOUNDS)  # restored after the sync


def test_promote_bounds_mlflows_http_retries_as_train_does(monkeypatch):
    import pipeline.tracking.runs as runs
    import pipeline.workflow as workflow

    for name in BOUNDS:
        monkeypatch.delenv(name, raising=False)
    seen = {}

    def configure(cfg_mlflow):  # a registry holding the version asked for (promote looks it up before the gate)
        seen["configure"] = {k: os.environ.get(k) for k in BOUNDS}
        return SimpleNamespace(get_model_version=lambda name, version: SimpleNamespace(name=name, version=version))

    def gate(client, cfg, version):
        seen["gate"] = {k: os.environ.get(k) for k in BOUNDS}
        return SimpleNamespace(promoted=False, version=version)

    monkeypatch.setattr(runs, "configure", configure)
    monkeypatch.setattr(workflow, "gate", gate)
    out = workflow.promote_version(apply_overrides(Config(), {"mlflow.retries": 1}), "4")
    assert out == {"promoted": False, "version": "4"}
    bounded = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
    assert seen == {"configure": bounded, "gate": bounded}
    assert all(name not in os.environ for name in BOUNDS)
