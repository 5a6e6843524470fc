"""`lakehouse sync-run` of a run left offline, against a real SQLite MLflow store under tmp_path: a resumed sync never
registers a logged model whose upload failed, and a folder whose tracking URI was kept redacted is refused, naming
the key that takes the URI with its credentials."""
from __future__ import annotations

import os

import pytest
from mlflow import MlflowClient
from mlflow.entities import LoggedModelOutput, LoggedModelStatus

from pipeline.config import Config, apply_overrides, to_yaml
from pipeline.redact import redact_url
from pipeline.tracking.offline import OfflineRun, SyncError, upload

CLASS_NAMES = ["circle", "square"]
META = {"arch": "cnn", "width": 4, "channels": 1, "image_size": 8, "class_names": CLASS_NAMES}
OFFLINE_ID = "f" * 32
SECRET = "s3cr3t-pw"


class ServerGone(ConnectionError):
    """The tracking server went away during the model's artifact upload (injected)."""


def _folder(tmp_path, uri: str, stored_uri: str = None) -> OfflineRun:
    """A run left offline by a job that would have registered its model (not promoted: no gate here)."""
    cfg = apply_overrides(Config(), {
        "mlflow.tracking_uri": uri, "mlflow.artifact_location": str(tmp_path / "mlartifacts"),
        "mlflow.experiment": "sync-resume", "mlflow.registered_model": "resumed", "mlflow.retries": 0,
        "mlflow.promote": False, "data.image_size": 8, "data.channels": 1, "model.width": 4})
    folder = tmp_path / "job" / "offline_run"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(to_yaml(cfg))
    off = OfflineRun(str(folder))
    off.write_metrics([(0, {"val_acc": 0.5}, 1_700_000_000_000, False)])
    off.log_dict("gone", [{"rank": 0}], "ranks.json")
    from pipeline.model.nets import build_network

    off.save_model(build_network("cnn", 1, len(CLASS_NAMES), width=4), META, step=2)
    off.update(run_id=OFFLINE_ID, run_name="offline", tracking_uri=uri if stored_uri is None else stored_uri,
               status="FINISHED", end_time=1_700_000_003_000, register=True, gate_metrics={"val_acc": 0.5},
               lineage={"table": "work/delta/images", "version": 1, "rows": {"train": 4, "val": 2}}, tags={})
    return off


def _fail_model_upload_once(monkeypatch) -> dict:
    """The artifact repository raises the first time it is asked to upload a model's folder (one with MLmodel)."""
    from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

    real, fired = LocalArtifactRepository.log_artifacts, {"n": 0}

    def flaky(self, local_dir, artifact_path=None):
        if not fired["n"] and os.path.exists(os.path.join(local_dir, "MLmodel")):
            fired["n"] += 1
            raise ServerGone("server went away during the model upload")
        return real(self, local_dir, artifact_path)

    monkeypatch.setattr(LocalArtifactRepository, "log_artifacts", flaky)
    return fired


@pytest.mark.timeout(180)
def test_resumed_sync_logs_the_model_again_when_the_earlier_upload_failed(tmp_path, monkeypatch):
    """MLflow links the logged model to the run before uploading its artifacts: the failed sync leaves a FAILED model
    with no artifacts as the run's output. The rerun logs the model again from the folder and registers that one."""
    import mlflow

    from pipeline.workflow import sync_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    off = _folder(tmp_path, uri)
    fired = _fail_model_upload_once(monkeypatch)
    with pytest.raises(ServerGone):
        sync_run(off.folder)
    assert fired["n"] == 1 and "synced" not in off.read() and "model_uri" not in off.read()["sync"]
    client = MlflowClient(uri)
    run_id = off.read()["sync"]["run_id"]
    broken = [client.get_logged_model(o.model_id) for o in client.get_run(run_id).outputs.model_outputs]
    assert [str(m.status) for m in broken] == ["FAILED"]  # what the resumed sync finds on the server
    monkeypatch.undo()

    out = sync_run(off.folder)
    assert out["run_id"] == run_id
    assert "model_uri" not in out["resumed"], "the FAILED model was taken as the one an earlier sync-run logged"
    model_id = out["model_uri"].split("/")[-1]
    assert model_id != broken[0].model_id
    assert str(client.get_logged_model(model_id).status) == "READY"
    version = client.get_model_version("resumed", str(out["model_version"]))
    assert version.source == out["model_uri"] and off.read()["synced"]["model_version"] == out["model_version"]
    assert client.list_logged_model_artifacts(model_id)  # the weights were uploaded this time
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model(f"models:/resumed/{out['model_version']}")
    assert model.metadata.metadata["class_names"] == CLASS_NAMES


def _logged(client, experiment_id: str, run_id: str, step: int, status: LoggedModelStatus, name: str = "model") -> str:
    model = client.create_logged_model(experiment_id, name=name, source_run_id=run_id)
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    client.finalize_logged_model(model.model_id, status)
    return model.model_id


def test_a_runs_uri_resolves_only_to_a_ready_logged_model(tmp_path):
    """`runs:/<run>/model` names the newest READY model of that name the run output: never one whose upload failed
    or never ended; a run with none READY is refused with the models' states, not registered unloadable."""
    from pipeline.tracking.offline import _logged_model_of
    from pipeline.tracking.registry import RegistryError, _logged_model_for_runs_uri

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.create_experiment("e", artifact_location=str(tmp_path / "art"))
    run_id = client.create_run(exp).info.run_id
    ready = _logged(client, exp, run_id, 1, LoggedModelStatus.READY)
    _logged(client, exp, run_id, 2, LoggedModelStatus.FAILED)
    _logged(client, exp, run_id, 3, LoggedModelStatus.PENDING)
    _logged(client, exp, run_id, 4, LoggedModelStatus.READY, name="other")
    assert _logged_model_for_runs_uri(client, f"runs:/{run_id}/model") == ready
    assert _logged_model_of(client, run_id) == f"models:/{ready}"

    broken_run = client.create_run(exp).info.run_id
    failed = _logged(client, exp, broken_run, 1, LoggedModelStatus.FAILED)
    assert _logged_model_of(client, broken_run) is None  # the sync logs it again
    with pytest.raises(RegistryError, match=rf"{failed}.*FAILED"):
        _logged_model_for_runs_uri(client, f"runs:/{broken_run}/model")
    assert _logged_model_for_runs_uri(client, f"runs:/{broken_run}/absent") is None


class Connected(Exception):
    """upload() got as far as connecting (injected: the URI it would connect with is its message)."""


@pytest.mark.parametrize("stored", [f"http://alice:{SECRET}@mlflow.example:5000",
                                    f"https://{SECRET}@mlflow.example/",
                                    f"https://mlflow.example/?token={SECRET}"])
def test_a_redacted_tracking_uri_is_refused_naming_the_key_and_taken_with_the_override(tmp_path, monkeypatch, stored):
    """run.json (and config.yaml) keep the URI redacted: connecting with it would send `***` as the password. The
    sync refuses before connecting, naming mlflow.tracking_uri (no secret in the message); the override is used."""
    import pipeline.tracking.runs as runs

    kept = redact_url(stored)
    assert kept != stored and SECRET not in kept
    off = _folder(tmp_path, kept)

    def connect(cfg_mlflow):
        raise Connected(cfg_mlflow.tracking_uri)

    monkeypatch.setattr(runs, "_connect", connect)
    with pytest.raises(SyncError, match=r"mlflow\.tracking_uri=<the URI with its credentials>") as refused:
        upload(off.folder)
    assert SECRET not in str(refused.value) and off.folder in str(refused.value)
    assert "sync" not in off.read()  # refused before anything was done
    with pytest.raises(Connected) as connected:
        upload(off.folder, [f"mlflow.tracking_uri={stored}"])
    assert str(connected.value) == stored


def test_an_unredacted_tracking_uri_is_used_as_kept(tmp_path, monkeypatch):
    import pipeline.tracking.runs as runs

    uri = "http://mlflow.example:5000"
    off = _folder(tmp_path, uri)

    def connect(cfg_mlflow):
        raise Connected(cfg_mlflow.tracking_uri)

    monkeypatch.setattr(runs, "_connect", connect)
    with pytest.raises(Connected, match="^http://mlflow.example:5000$"):
        upload(off.folder)



@pytest.mark.parametrize("uri, hint", [(f"http://alice:{SECRET}@mlflow.example:5000", True),
                                       ("http://mlflow.example:5000", False)])
def test_rank_zero_going_offline_says_to_give_the_uri_with_its_credentials(tmp_path, caplog, uri, hint):
    import logging
    from types import SimpleNamespace

    from pipeline.tracking.rank_zero import RankZeroTracker

    tracker = RankZeroTracker(None, "r1", local_dir=str(tmp_path))
    job = SimpleNamespace(job_dir=str(tmp_path), tracking_uri=uri,
                          cfg=apply_overrides(Config(), {"mlflow.reconnect_wait_s": 1}))
    with caplog.at_level(logging.WARNING):
        tracker._go_offline(job)
    text = caplog.text
    assert f"lakehouse sync-run {tmp_path / 'offline_run'}" in text and SECRET not in text
    assert ("mlflow.tracking_uri=<the URI with its credentials>" in text) is hint
