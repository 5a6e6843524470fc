"""Integration tests of pipeline.tracking against a real SQLite store and a real `mlflow server` process."""
from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
from mlflow.exceptions import MlflowException

from conftest import free_port
from pipeline.config import Config, apply_overrides
from pipeline.model.nets import build_network
from pipeline.tracking import plots
from pipeline.tracking.gate import promote
from pipeline.tracking.pyfunc import log_model
from pipeline.tracking.registry import register_model
from pipeline.errors import Terminated
from pipeline.tracking.journal import UnendedRuns
from pipeline.tracking.lineage import log_config, log_lineage
from pipeline.tracking.runs import (TrackingUnavailable, configure, resolve_artifact_location, resolve_tracking_uri,
                                    tracked_run)
from pipeline.tracking.sending import log_epoch_metrics

pytestmark = pytest.mark.integration

VENV_BIN = Path(sys.executable).parent
CLASS_NAMES = ["circle", "square", "triangle"]
META = {"arch": "cnn", "width": 4, "channels": 1, "image_size": 16, "class_names": CLASS_NAMES}


def _png(seed: int, size: int = 20, mode: str = "L") -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    shape = (size, size) if mode == "L" else (size, size, 3)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode).save(buf, format="PNG")
    return buf.getvalue()


def _jpeg(seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8), mode="RGB").save(buf, format="JPEG")
    return buf.getvalue()


def _label_of(i: int) -> str:
    return CLASS_NAMES[0] if i % 6 < 3 else CLASS_NAMES[1] if i % 6 < 5 else CLASS_NAMES[2]


@pytest.fixture(scope="module")
def gate_table(tmp_path_factory) -> str:
    """A real Delta table (delta-rs, version 0) of 90 labelled PNGs with the columns the gate scores: path, label,
    content. Labels 1/2 circle, 1/3 square, 1/6 triangle, so a network that always answers one class has a known
    accuracy on any split."""
    import pyarrow as pa
    from deltalake import write_deltalake

    root = tmp_path_factory.mktemp("gate_table") / "shapes"
    paths = [f"/data/shapes/{_label_of(i)}/{i:03d}.png" for i in range(90)]
    write_deltalake(str(root), pa.table({"path": paths, "label": [_label_of(i) for i in range(90)],
                                         "content": [_png(100 + i) for i in range(90)]}))
    return str(root)


def _always(cls: int):
    """A real network of the META shape whose answer is class `cls` whatever the image (zero weights, one bias)."""
    import torch

    net = build_network("cnn", 1, len(CLASS_NAMES), width=4)
    last = [m for m in net.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.copy_(torch.tensor([10.0 if k == cls else 0.0 for k in range(len(CLASS_NAMES))]))
    return net


def _val_share(table: str, label: str) -> float:
    from deltalake import DeltaTable

    from pipeline.lakehouse.split import is_validation

    rows = DeltaTable(table).to_pyarrow_table(columns=["path", "label"]).to_pylist()
    val = [r["label"] for r in rows if is_validation(r["path"], 0.2)]
    assert val, "the gate table has no validation rows"
    return sum(v == label for v in val) / len(val)


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory):
    """(tracking_uri, artifact_location) of one SQLite store shared by this module (each test uses its own
    experiment), so the schema migrations run once."""
    root = tmp_path_factory.mktemp("sqlite_store")
    return f"sqlite:///{root}/mlflow.db", str(root / "mlartifacts")


@pytest.fixture(params=["sqlite", "server"])
def store(request):
    """(kind, tracking_uri, artifact_location) for the SQLite store or the server (artifacts proxied)."""
    old_uri = mlflow.get_tracking_uri()
    if request.param == "sqlite":
        yield ("sqlite", *request.getfixturevalue("sqlite_store"))
    else:
        yield "server", request.getfixturevalue("mlflow_server"), None
    mlflow.set_tracking_uri(old_uri)


def _cfg(uri: str, artifact_location, experiment: str) -> Config:
    return apply_overrides(Config(), {
        "mlflow.tracking_uri": uri, "mlflow.artifact_location": artifact_location, "mlflow.experiment": experiment,
        "mlflow.retries": 1, "mlflow.retry_wait_s": 0.5, "data.image_size": 16, "data.channels": 1, "model.width": 4})


@pytest.mark.timeout(240)
def test_tracked_run_model_and_registry(store, tmp_path, gate_table):
    kind, uri, artifacts = store
    cfg = _cfg(uri, artifacts, f"flow-{kind}-{tmp_path.name}")
    name = f"clf_{kind}_{tmp_path.name}"
    net = build_network("cnn", 1, len(CLASS_NAMES), width=4)
    history = [{"epoch": 0, "train_loss": 1.2, "val_loss": 1.1, "val_acc": 0.4},
               {"epoch": 1, "train_loss": 0.9, "val_loss": 0.95, "val_acc": 0.55}]

    with tracked_run(cfg, run_name="test", tags={"purpose": "test"}) as run:
        client, run_id = run.client, run.run_id
        log_config(client, run_id, cfg)
        log_lineage(client, run_id, "work/delta/images", 3, {"train": 8, "val": 2},
                    {"world_size": 2, "backend": "horovod"})
        for h in history:
            log_epoch_metrics(client, run_id, {k: v for k, v in h.items() if k != "epoch"}, step=h["epoch"])
        png = plots.learning_curves_png(history, tmp_path / "learning_curves.png")
        client.log_artifact(run_id, str(png))
        model_uri = log_model(net, META, input_example_content=_png(0), run_id=run_id, step=1)
        assert client.get_run(run_id).info.status == "RUNNING"  # logging the model did not end the run
        version = register_model(client, model_uri, name, run_id,
                                 {"delta_table": gate_table, "delta_version": "0", "val_acc": "0.55"})
        # scored on the val rows of the real table it names (an untrained net: no chance floor, see test_gate_chance)
        decision = promote(client, name, version, min_lift=None)
        assert decision.promoted and decision.champion_version is None and "val split" in decision.rows

    r = client.get_run(run_id)
    assert r.info.status == "FINISHED"
    assert r.data.params["train.np"] == "-2" and r.data.params["model.arch"] == "cnn"
    assert r.data.params["delta.version"] == "null"
    # recorded by its location (issue 37, defect 4): the path typed relative, resolved where the run was logged
    assert r.data.tags["delta_table"] == os.path.realpath("work/delta/images") and r.data.tags["delta_version"] == "3"
    assert r.data.params["delta.table"] == os.path.realpath(cfg.delta.table)
    assert (r.data.tags["rows_train"], r.data.tags["rows_val"]) == ("8", "2")
    assert r.data.tags["world_size"] == "2" and r.data.tags["purpose"] == "test"
    assert [m.value for m in client.get_metric_history(run_id, "val_acc")] == [0.4, 0.55]
    source = json.loads(r.inputs.dataset_inputs[0].dataset.source)
    assert source["path"] == os.path.realpath("work/delta/images") and source["delta_table_version"] == 3
    assert {"config.yaml", "learning_curves.png"} <= {a.path for a in client.list_artifacts(run_id)}
    config_text = mlflow.artifacts.load_text(f"runs:/{run_id}/config.yaml")
    assert "image_size: 16" in config_text
    mv = client.get_model_version(name, version)
    assert mv.tags["run_id"] == run_id and mv.tags["delta_version"] == "0" and mv.tags["delta_table"] == gate_table
    assert str(client.get_model_version_by_alias(name, "champion").version) == version

    images = [_png(1), _png(2, size=40), _jpeg(3), _png(4, mode="RGB")]
    df = pd.DataFrame({"content": images})
    for load_uri in (f"models:/{name}/{version}", f"models:/{name}@champion", f"runs:/{run_id}/model"):
        model = mlflow.pyfunc.load_model(load_uri)
        out = model.predict(df)
        assert list(out.columns) == ["label", "label_index", "probability", "probabilities"]
        assert len(out) == len(images)
        assert set(out["label"]) <= set(CLASS_NAMES)
        for _, row in out.iterrows():
            assert CLASS_NAMES[row["label_index"]] == row["label"]
            assert np.isclose(sum(row["probabilities"]), 1.0, atol=1e-5)
            assert np.isclose(max(row["probabilities"]), row["probability"])

    # bad input: a row that is not an image, a missing column
    with pytest.raises(ValueError, match=r"row 1, column 'content'.*not a decodable image"):
        model.predict(pd.DataFrame({"content": [_png(5), b"definitely not an image"]}))
    python_model = model.unwrap_python_model()
    with pytest.raises(ValueError, match=r"no 'content' column.*\['image'\]"):
        python_model.predict(None, pd.DataFrame({"image": [_png(5)]}))
    # through the pyfunc wrapper MLflow's signature check answers first, also naming the column
    with pytest.raises(MlflowException, match=r"missing inputs \['content'\]"):
        model.predict(pd.DataFrame({"image": [_png(5)]}))

    if kind == "sqlite":
        _load_in_fresh_process(uri, f"models:/{name}/{version}", tmp_path)


def _load_in_fresh_process(tracking_uri: str, model_uri: str, tmp_path: Path) -> None:
    """Load and predict in a new interpreter that cannot import this checkout's `pipeline` package: the model runs
    the code logged with it, and loading it puts no `pipeline` module in the process."""
    repo = str(Path(__file__).resolve().parents[2])
    (tmp_path / "img.png").write_bytes(_png(7))
    script = textwrap.dedent(f"""
        import os, sys
        repo = {repo!r}
        sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != repo]
        # an editable install (`pip install -e .`) maps `pipeline` to this checkout with a meta-path finder
        sys.meta_path[:] = [f for f in sys.meta_path
                            if "editable" not in str(getattr(f, "__module__", None) or type(f).__module__).lower()]
        try:
            import pipeline
            raise SystemExit("pipeline importable before loading: " + str(pipeline.__file__))
        except ImportError:
            pass
        import json, mlflow, pandas as pd
        mlflow.set_tracking_uri({tracking_uri!r})
        model = mlflow.pyfunc.load_model({model_uri!r})
        out = model.predict(pd.DataFrame({{"content": [open("img.png", "rb").read()]}}))
        served = sys.modules[type(model.unwrap_python_model()).__module__]
        print(json.dumps({{"label": out["label"][0], "served": served.__name__, "file": served.__file__,
                           "pipeline": "pipeline" in sys.modules}}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    answer = json.loads(res.stdout.strip().splitlines()[-1])
    assert answer["label"] in CLASS_NAMES
    # the model's own code, shipped with it under its own name (never a partial `pipeline`), not this checkout's
    assert answer["served"].startswith("lakehouse_model_") and not answer["file"].startswith(repo), answer
    assert answer["pipeline"] is False, answer


@pytest.mark.timeout(300)
def test_promotion_gate(store, tmp_path, gate_table):
    """The gate on real registered versions and a real Delta table: each scored by its pyfunc on the same val rows,
    the alias moves only to a better one; a version without lineage cannot be judged and moves nothing."""
    from pipeline.tracking.registry import RegistryError

    kind, uri, artifacts = store
    cfg = _cfg(uri, artifacts, f"gate-{kind}-{tmp_path.name}")
    client = configure(cfg.mlflow)
    name = f"gate_{kind}_{tmp_path.name}"
    share = {c: _val_share(gate_table, c) for c in CLASS_NAMES}
    low, mid, high = sorted(CLASS_NAMES, key=share.get)
    assert share[low] < share[mid] < share[high], share

    def candidate(label: str, lineage: bool = True) -> str:
        with tracked_run(cfg, run_name=f"always-{label}") as run:
            model_uri = log_model(_always(CLASS_NAMES.index(label)), META, input_example_content=_png(0),
                                  run_id=run.run_id)
            tags = {"delta_table": gate_table, "delta_version": "0"} if lineage else {}
            return register_model(run.client, model_uri, name, run.run_id, tags)

    v1 = candidate(mid)  # constant guesses, none above the majority's share: no chance floor (test_gate_chance)
    d1 = promote(client, name, v1, min_lift=None)
    assert d1.promoted and d1.value == pytest.approx(share[mid])
    v2 = candidate(low)
    d2 = promote(client, name, v2, min_lift=None)
    assert not d2.promoted and d2.champion_version == v1
    assert (d2.value, d2.champion_value) == (pytest.approx(share[low]), pytest.approx(share[mid]))
    assert str(client.get_model_version_by_alias(name, "champion").version) == v1
    v3 = candidate(high)
    d3 = promote(client, name, v3, min_lift=None)
    assert d3.promoted and d3.champion_version == v1 and d3.value == pytest.approx(share[high])
    assert str(client.get_model_version_by_alias(name, "champion").version) == v3
    v4 = candidate(high, lineage=False)
    with pytest.raises(RegistryError, match=f"version {v4} has no tag.*delta_table"):
        promote(client, name, v4)
    assert str(client.get_model_version_by_alias(name, "champion").version) == v3


@pytest.mark.timeout(120)
def test_tracked_run_statuses(sqlite_store):
    cfg = _cfg(*sqlite_store, "statuses")
    before = signal.getsignal(signal.SIGTERM)
    env_before = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}

    ids = {}
    with pytest.raises(RuntimeError, match="boom"):
        with tracked_run(cfg) as run:
            ids["failed"] = run.run_id
            raise RuntimeError("boom")
    with pytest.raises(Terminated):
        with tracked_run(cfg) as run:
            ids["terminated"] = run.run_id
            raise Terminated("test")
    with pytest.raises(Terminated):
        with tracked_run(cfg) as run:
            ids["sigterm"] = run.run_id
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
    with pytest.raises(KeyboardInterrupt):
        with tracked_run(cfg) as run:
            ids["interrupt"] = run.run_id
            raise KeyboardInterrupt
    with tracked_run(cfg) as run:
        ids["ok"] = run.run_id
        # MLflow's own retries (minutes against a dead server) bounded by mlflow.retries while the run is open
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == (env_before["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] or "1")

    client = configure(cfg.mlflow)
    status = {k: client.get_run(v).info.status for k, v in ids.items()}
    assert status == {"failed": "FAILED", "terminated": "KILLED", "sigterm": "KILLED", "interrupt": "KILLED",
                      "ok": "FINISHED"}
    assert "boom" in client.get_run(ids["failed"]).data.tags["error"]
    assert signal.getsignal(signal.SIGTERM) is before
    assert {k: os.environ.get(k) for k in env_before} == env_before  # the bounded HTTP retries end with the run


def test_unended_runs_are_ended_at_the_next_connection(sqlite_store, tmp_path):
    """A run recorded in mlflow.unended_runs is ended with its recorded status and time by the next `configure` of
    the same store; lines of other servers and unreadable lines are kept, not lost."""
    cfg = _cfg(*sqlite_store, "unended")
    cfg = apply_overrides(cfg, {"mlflow.unended_runs": str(tmp_path / "unended.jsonl")})
    client = configure(cfg.mlflow)
    exp_id = client.get_experiment_by_name("unended").experiment_id
    run, done = client.create_run(exp_id), client.create_run(exp_id)
    client.set_terminated(done.info.run_id, "FINISHED")
    uri = resolve_tracking_uri(cfg.mlflow.tracking_uri)
    journal = UnendedRuns(cfg.mlflow.unended_runs)
    journal.add(uri, exp_id, run.info.run_id, "KILLED", 1_700_000_000_000, "ConnectionError: server down")
    journal.add(uri, exp_id, done.info.run_id, "FAILED", 1, "ended by a later retry of its job")
    journal.add(uri, exp_id, "0" * 32, "FAILED", 1, "a run deleted from this store since")
    journal.add(uri, "999999", "1" * 32, "FAILED", 1, "same URI, but not this store's experiment")
    journal.add("http://127.0.0.1:1", "1", "other-server-run", "FAILED", 1, "ConnectionError")
    with open(journal.path, "a") as fh:
        fh.write("{not json\n")

    configure(cfg.mlflow)
    ended = client.get_run(run.info.run_id)
    assert ended.info.status == "KILLED" and ended.info.end_time == 1_700_000_000_000
    assert "later job" in ended.data.tags["lakehouse.ended_by"]
    assert client.get_run(done.info.run_id).info.status == "FINISHED"  # not RUNNING any more: left alone
    left = open(journal.path).read().splitlines()
    assert len(left) == 3 and "1" * 32 in left[0] and "other-server-run" in left[1] and left[2] == "{not json"
    assert journal.end_all(client, uri) == []  # nothing of this store is left to end


@pytest.mark.timeout(60)
def test_configure_unreachable_server_fails_fast():
    port = free_port()  # nothing listens here
    cfg = _cfg(f"http://127.0.0.1:{port}", None, "unreachable")
    cfg = apply_overrides(cfg, {"mlflow.retries": 2, "mlflow.retry_wait_s": 0.5})
    env_before = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    start = time.monotonic()
    with pytest.raises(TrackingUnavailable, match=rf"mlflow\.tracking_uri.*127\.0\.0\.1:{port}"):
        configure(cfg.mlflow)
    assert time.monotonic() - start < 30
    assert {k: os.environ.get(k) for k in env_before} == env_before


def test_relative_sqlite_uri_and_artifact_location(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_tracking_uri("sqlite:///nested/dir/mlflow.db") == f"sqlite:///{tmp_path}/nested/dir/mlflow.db"
    assert (tmp_path / "nested" / "dir").is_dir()
    assert resolve_tracking_uri("sqlite:////abs/x.db") == "sqlite:////abs/x.db"
    assert resolve_tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert resolve_artifact_location("rel/artifacts") == (tmp_path / "rel" / "artifacts").as_uri()
    assert resolve_artifact_location("s3://bucket/x") == "s3://bucket/x"
    assert resolve_artifact_location(None) is None


@pytest.mark.timeout(120)
def test_configure_creates_experiment_with_absolute_artifact_location(sqlite_store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(sqlite_store[0], "rel/artifacts", "relative")
    client = configure(cfg.mlflow)
    exp = client.get_experiment_by_name("relative")
    assert exp.artifact_location == (tmp_path / "rel" / "artifacts").as_uri()
    assert configure(cfg.mlflow).get_experiment_by_name("relative").experiment_id == exp.experiment_id
    assert mlflow.get_tracking_uri() == sqlite_store[0]


def test_plots_write_png(tmp_path):
    cm = np.array([[3, 1, 0], [0, 4, 1], [1, 0, 5]])
    out = plots.confusion_matrix_png(cm, CLASS_NAMES, tmp_path / "cm.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="does not match 2 class names"):
        plots.confusion_matrix_png(cm, CLASS_NAMES[:2], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="history is empty"):
        plots.learning_curves_png([], tmp_path / "lc.png")


@pytest.mark.timeout(240)
def test_sync_run_creates_the_run_where_the_server_never_had_it(sqlite_store, tmp_path):
    """A folder left offline, uploaded to a store that does not have its run: a new run with every epoch (also those
    the lost server had taken), the tags, artifacts and model, the true status, and a version through the gate."""
    from pipeline.config import to_yaml
    from pipeline.tracking.offline import OfflineRun, SyncError
    from pipeline.workflow import sync_run

    cfg = _cfg(*sqlite_store, f"sync-{tmp_path.name}")
    cfg = apply_overrides(cfg, {"mlflow.registered_model": f"synced_{tmp_path.name}"})
    off = OfflineRun(str(tmp_path / "offline_run"))
    (tmp_path / "offline_run").mkdir()
    (tmp_path / "offline_run" / "config.yaml").write_text(to_yaml(cfg))
    off.write_metrics([(0, {"val_acc": 0.4, "val_loss": 1.2}, 1_700_000_000_000, True),
                       (1, {"val_acc": 0.6, "val_loss": 0.9}, 1_700_000_001_000, False)])
    off.log_dict("gone", [{"rank": 0, "host": "h"}], "ranks.json")
    off.save_model(build_network("cnn", 1, len(CLASS_NAMES), width=4), META, step=2)
    off.update(run_id="f" * 32, run_name="offline", tracking_uri=sqlite_store[0], status="FINISHED",
               end_time=1_700_000_002_000, register=True, gate_metrics={"val_acc": 0.6},
               lineage={"table": "work/delta/images", "version": 3, "rows": {"train": 8, "val": 2}},
               tags={"precision": "32-true", "rank_0_host": "h"})

    out = sync_run(off.folder)
    client = configure(cfg.mlflow)
    run = client.get_run(out["run_id"])
    assert not out["continued"] and out["run_id"] != "f" * 32 and out["model_version"] == 1
    assert run.info.status == "FINISHED" and run.info.end_time == 1_700_000_002_000  # the recorded end, kept
    assert run.data.tags["lakehouse.offline_run_id"] == "f" * 32 and run.data.tags["precision"] == "32-true"
    assert run.data.tags["delta_version"] == "3" and run.data.params["model.width"] == "4"
    assert [(m.step, m.value) for m in client.get_metric_history(out["run_id"], "val_acc")] == [(0, 0.4), (1, 0.6)]
    assert "ranks.json" in {a.path for a in client.list_artifacts(out["run_id"])}
    mv = client.get_model_version(cfg.mlflow.registered_model, "1")
    assert mv.run_id == out["run_id"] and mv.tags["delta_version"] == "3"
    model = mlflow.pyfunc.load_model(f"models:/{cfg.mlflow.registered_model}/1")
    assert set(model.predict(pd.DataFrame({"content": [_png(1)]}))["label"]) <= set(CLASS_NAMES)
    with pytest.raises(SyncError, match="uploaded already"):
        sync_run(off.folder)
