"""`lakehouse sync-run` resumed after a failure part way (issue 24 defect 5), against a real SQLite MLflow store and
real offline folders: one run, one registered version, every metric value once."""
from __future__ import annotations

import json

import pytest

from pipeline.config import Config, apply_overrides, to_yaml
from pipeline.model.nets import build_network
from pipeline.tracking.offline import OfflineRun, SyncError, Upload
from pipeline.tracking.runs import configure

pytestmark = pytest.mark.integration

CLASS_NAMES = ["circle", "square", "triangle"]
META = {"arch": "cnn", "width": 4, "channels": 1, "image_size": 16, "class_names": CLASS_NAMES}
OFFLINE_ID = "e" * 32
# (step, metrics, timestamp ms, taken by the lost server): all uploaded, since the server never had the run
EPOCHS = [(0, {"val_acc": 0.4, "val_loss": 1.2}, 1_700_000_000_000, True),
          (1, {"val_acc": 0.6, "val_loss": 0.9}, 1_700_000_001_000, False),
          (2, {"val_acc": 0.7, "val_loss": 0.8}, 1_700_000_002_000, False)]


class Crash(RuntimeError):
    """The process died here (injected)."""


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("sync_resume_store")
    return f"sqlite:///{root}/mlflow.db", str(root / "mlartifacts")


def _folder(store, tmp_path, promote: bool = False) -> OfflineRun:
    """A run left offline by a job that would have registered its model, in its own experiment and model name."""
    uri, artifacts = store
    cfg = apply_overrides(Config(), {
        "mlflow.tracking_uri": uri, "mlflow.artifact_location": artifacts, "mlflow.experiment": f"resume-{tmp_path.name}",
        "mlflow.registered_model": f"resumed_{tmp_path.name}", "mlflow.retries": 1, "mlflow.retry_wait_s": 0.5,
        "mlflow.promote": promote, "data.image_size": 16, "data.channels": 1, "model.width": 4})
    (tmp_path / "offline_run").mkdir()
    (tmp_path / "offline_run" / "config.yaml").write_text(to_yaml(cfg))
    off = OfflineRun(str(tmp_path / "offline_run"))
    off.write_metrics(EPOCHS)
    off.log_dict("gone", [{"rank": 0, "host": "h"}], "ranks.json")
    off.save_model(build_network("cnn", 1, len(CLASS_NAMES), width=4), META, step=3)
    off.update(run_id=OFFLINE_ID, run_name="offline", tracking_uri=uri, status="FINISHED",
               end_time=1_700_000_003_000, register=True, gate_metrics={"val_acc": 0.7},
               lineage={"table": "work/delta/images", "version": 3, "rows": {"train": 8, "val": 2}},
               tags={"precision": "32-true"})
    return off


def _crash_once(monkeypatch, target, name: str, when=lambda *a, **k: True) -> dict:
    """Make `target.name` raise Crash the first time `when(*args, **kwargs)` holds, before it does anything."""
    real, fired = getattr(target, name), {"n": 0}

    def flaky(*args, **kwargs):
        if not fired["n"] and when(*args, **kwargs):
            fired["n"] += 1
            raise Crash(f"injected crash in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, flaky)
    return fired


def _crash_before_recording(monkeypatch, step: str) -> dict:
    """The step completes on the server; the process dies before the folder records it."""
    return _crash_once(monkeypatch, Upload, "record", lambda self, **steps: step in steps)


def _assert_uploaded_once(off: OfflineRun, out: dict) -> None:
    """One run of the offline run in the experiment, FINISHED, each metric value once, one logged model, one
    version of the model (from that run), and the folder marked uploaded (a third sync-run refuses it)."""
    cfg = _cfg_of(off)
    client = configure(cfg)
    exp = client.get_experiment_by_name(cfg.experiment)
    runs = client.search_runs([exp.experiment_id], f"tags.`lakehouse.offline_run_id` = '{OFFLINE_ID}'")
    assert [r.info.run_id for r in runs] == [out["run_id"]]
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED" and run.info.end_time == 1_700_000_003_000
    assert run.data.params["model.width"] == "4" and run.data.tags["precision"] == "32-true"
    for key in ("val_acc", "val_loss"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(out["run_id"], key))
        assert history == [(step, metrics[key]) for step, metrics, _, _ in EPOCHS], key
    assert len(run.outputs.model_outputs) == 1
    assert out["model_uri"] == f"models:/{run.outputs.model_outputs[0].model_id}"
    versions = client.search_model_versions(f"name='{cfg.registered_model}'")
    assert [(str(v.version), v.run_id) for v in versions] == [("1", out["run_id"])]
    assert out["model_version"] == 1
    synced = off.read()["synced"]
    assert synced["run_id"] == out["run_id"] and synced["model_version"] == 1
    with pytest.raises(SyncError, match="uploaded already"):
        from pipeline.workflow import sync_run

        sync_run(off.folder)


def _cfg_of(off: OfflineRun):
    from pipeline.config import load_config

    return load_config(f"{off.folder}/config.yaml").mlflow


@pytest.mark.timeout(240)
@pytest.mark.parametrize("step", ["run_id", "metrics_logged", "model_uri", "model_version"])
def test_crash_after_a_step_before_its_record_is_resumed_without_doing_it_twice(sqlite_store, tmp_path, monkeypatch,
                                                                                step):
    """The server took the step (the run created, the metrics, the model, the version), the folder never recorded
    it: the rerun finds it on the server (tag, metric history, run outputs, registry) and does not repeat it."""
    from pipeline.workflow import sync_run

    off = _folder(sqlite_store, tmp_path)
    fired = _crash_before_recording(monkeypatch, step)
    with pytest.raises(Crash):
        sync_run(off.folder)
    assert fired["n"] == 1 and "synced" not in off.read()
    monkeypatch.undo()

    out = sync_run(off.folder)
    _assert_uploaded_once(off, out)
    resumed = out["resumed"]
    assert resumed["run_id"] == out["run_id"]  # the run the failed attempt created, found and reused
    assert resumed.get("metrics") == (None if step == "run_id" else 6)  # 2 keys x 3 epochs, not logged again
    assert ("model_uri" in resumed) == (step in ("model_uri", "model_version"))
    assert resumed.get("model_version") == ("1" if step == "model_version" else None)
    assert off.read()["sync"]["model_version"] == "1"
    assert json.loads(json.dumps(out)) == out  # the JSON line sync-run prints


@pytest.mark.timeout(240)
def test_registry_failing_once_after_the_run_was_created_then_a_rerun(sqlite_store, tmp_path, monkeypatch):
    """Registration fails (after the run, metrics, artifacts and model are on the server): the rerun reuses all of
    them and registers exactly one version; the gate, on (no pinned data to score on), judges it once."""
    from pipeline.tracking import registry
    from pipeline.workflow import sync_run

    off = _folder(sqlite_store, tmp_path, promote=True)
    fired = _crash_once(monkeypatch, registry, "register_model")
    with pytest.raises(Crash):
        sync_run(off.folder)
    assert fired["n"] == 1
    state = dict(off.read().get("sync") or {})

    out = sync_run(off.folder)
    _assert_uploaded_once(off, out)
    assert state["metrics_logged"] == 6 and "model_version" not in state  # what the failed attempt had recorded
    assert out["metrics"] == 0 and out["resumed"]["metrics"] == 6
    assert out["resumed"]["model_uri"] == state["model_uri"] == out["model_uri"]
    assert out["champion"] is False and off.read()["sync"]["champion"] is False  # the gate's verdict, recorded


@pytest.mark.timeout(240)
def test_crash_after_registering_and_gating_reuses_the_verdict(sqlite_store, tmp_path, monkeypatch):
    """The process dies after the gate judged the version, before ending the run: the rerun only ends it."""
    from pipeline.tracking import gate
    from pipeline.workflow import sync_run

    off = _folder(sqlite_store, tmp_path, promote=True)
    _crash_once(monkeypatch, Upload, "end")
    with pytest.raises(Crash):
        sync_run(off.folder)
    monkeypatch.undo()
    gates = _crash_once(monkeypatch, gate, "promote")  # a second gate would crash: it must not run
    out = sync_run(off.folder)
    assert gates["n"] == 0
    _assert_uploaded_once(off, out)
    assert out["resumed"]["champion"] is False and out["resumed"]["model_version"] == "1"


@pytest.mark.timeout(240)
def test_a_run_deleted_on_the_server_meanwhile_is_a_clear_error(sqlite_store, tmp_path, monkeypatch):
    """The run a failed sync-run created was deleted before the rerun: an error naming the folder and the run, and
    nothing created or registered in its place."""
    from pipeline.tracking import registry
    from pipeline.workflow import sync_run

    off = _folder(sqlite_store, tmp_path)
    _crash_once(monkeypatch, registry, "register_model")
    with pytest.raises(Crash):
        sync_run(off.folder)
    client = configure(_cfg_of(off))
    exp = client.get_experiment_by_name(_cfg_of(off).experiment)
    (run,) = client.search_runs([exp.experiment_id], f"tags.`lakehouse.offline_run_id` = '{OFFLINE_ID}'")
    run_id = run.info.run_id
    client.delete_run(run_id)
    with pytest.raises(SyncError, match=rf"{off.folder}: MLflow run {run_id}, which an earlier .* created .* "
                                        r"\(deleted\?\).*mlflow runs restore"):
        sync_run(off.folder)
    assert client.search_runs([exp.experiment_id]) == []
    assert client.search_model_versions(f"name='{_cfg_of(off).registered_model}'") == []
