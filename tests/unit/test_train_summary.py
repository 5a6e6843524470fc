"""`lakehouse train`'s JSON line: a run left offline (MLflow never came back, exit 3) carries the same keys as a
registered one (nothing registered yet: model_version and champion null), and the demo's summary renders either."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from pipeline import summary, workflow
from pipeline.config import load_config
from pipeline.distributed.loop import RankResult

# the line's contract (docs: "The contract users and scripts rely on")
CONTRACT = {"run_id", "model_name", "model_version", "delta_table", "delta_version", "rows_train", "rows_val",
            "world_size", "backend", "val_loss", "val_acc", "epochs", "stopped_early"}


def _train(monkeypatch, tmp_path, offline: bool) -> dict:
    import pipeline.tracking.runs as runs

    cfg = load_config(None, ["train.np=-2", f"train.checkpoint_dir={tmp_path}/ckpt",
                             "mlflow.tracking_uri=http://user:pw@mlflow.example:5000"])
    data = SimpleNamespace(rows=(80, 20))
    pinned = SimpleNamespace(table="/t/digits", version=4)
    run = SimpleNamespace(run_id="r1", tracking_uri=cfg.mlflow.tracking_uri, client=object())
    r0 = RankResult(rank=0, world_size=2, host="h", pid=1, epochs=3, stopped_early=True,
                    metrics={"val_loss": 0.5, "val_acc": 0.8}, model_uri=None if offline else "runs:/r1/model",
                    batch_size=16)
    monkeypatch.setattr(workflow, "prepare_data", lambda spark, cfg, leases: (data, pinned))
    monkeypatch.setattr(runs, "tracked_run", lambda cfg, run_name, tags: contextlib.nullcontext(run))
    monkeypatch.setattr(workflow, "train_in_run", lambda *a, **k: r0)
    monkeypatch.setattr(workflow, "left_offline",
                        lambda folder: SimpleNamespace(folder=f"{folder}/offline_run") if offline else None)
    monkeypatch.setattr(workflow, "record_job", lambda *a, **k: None)
    monkeypatch.setattr(workflow, "register_and_promote", lambda *a, **k: ("7", SimpleNamespace(promoted=True)))
    return workflow._train_from(None, cfg, None, None, {"train_called": 0.0}, None)


def test_a_run_left_offline_has_the_line_contract_with_nulls_for_what_is_not_known(monkeypatch, tmp_path):
    online = _train(monkeypatch, tmp_path, offline=False)
    off = _train(monkeypatch, tmp_path, offline=True)
    assert CONTRACT <= set(online) and CONTRACT <= set(off)
    assert set(off) == set(online) | {"offline_run"}
    assert off["offline_run"].endswith("offline_run") and off["model_version"] is None and off["champion"] is None
    assert (off["rows_train"], off["rows_val"], off["world_size"], off["backend"], off["stopped_early"]) == \
        (80, 20, 2, "horovod", True)
    assert "pw" not in off["tracking_uri"] and online["model_version"] == 7 and online["champion"] is True


def test_the_demo_summary_renders_a_run_left_offline_and_a_line_without_the_newer_keys():
    offline = {"run_id": "r1", "offline_run": "/ckpt/.job/r1/offline_run", "model_name": "m", "model_version": None,
               "delta_table": "/t", "delta_version": 4, "epochs": 3, "val_loss": None, "val_acc": None,
               "tracking_uri": "sqlite:///m.db"}
    text = summary.render_summary(offline, "sqlite:///m.db", None)
    assert "/t @ version 4" in text and "r1" in text and "lakehouse sync-run /ckpt/.job/r1/offline_run" in text
    assert "not registered" in text
    full = {**offline, "offline_run": None, "model_version": 7, "rows_train": 80, "rows_val": 20, "world_size": 2,
            "backend": "horovod", "stopped_early": True, "val_loss": 0.5, "val_acc": 0.8}
    text = summary.render_summary(full, "sqlite:///m.db", "7")
    assert "(80 train / 20 val rows)" in text and "horovod on 2 rank(s), 3 epoch(s) (stopped early)" in text
    assert "accuracy 0.8000, loss 0.5000" in text and "m version 7" in text and "version 7 (this run)" in text


@pytest.mark.parametrize("missing", sorted(CONTRACT - {"run_id"}))
def test_the_demo_summary_takes_a_line_missing_any_key(missing):
    line = {"run_id": "r1", "model_name": "m", "model_version": 7, "delta_table": "/t", "delta_version": 4,
            "rows_train": 80, "rows_val": 20, "world_size": 2, "backend": "horovod", "val_loss": 0.5, "val_acc": 0.8,
            "epochs": 3, "stopped_early": False}
    del line[missing]
    text = summary.render_summary(line, "sqlite:///m.db", None)
    assert "MLflow run      r1" in text
