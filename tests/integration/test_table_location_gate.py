"""A model trained from a relative `delta.table` is gated on that table from any working directory (issue 37, defect
4): the run, the version, the checkpoint and the train JSON line record the table's absolute location. Real Spark,
Delta, Lightning and MLflow."""
import os
import shutil

import pyarrow as pa
import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import make_config

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


def test_promote_from_another_directory_scores_the_table_the_model_was_trained_on(spark, digits_table, tmp_path,
                                                                                  monkeypatch):
    from deltalake import write_deltalake

    from pipeline import workflow

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    shutil.copytree(digits_table, project / "work" / "delta" / "digits")
    # another project's table under the same relative path: what a relative record would be resolved to from there
    write_deltalake(str(elsewhere / "work" / "delta" / "digits"),
                    pa.table({"path": [f"/decoy/{i}.png" for i in range(60)], "content": [b"not an image"] * 60,
                              "label": ["decoy"] * 60}))
    table = os.path.realpath(project / "work" / "delta" / "digits")
    cfg = make_config(tmp_path / "job", "delta.table=work/delta/digits", "train.backend=single", "train.np=1",
                      "train.max_epochs=1", "train.warmup_epochs=0", "data.batch_size=16", "model.lr=0.02",
                      "train.threads_per_rank=1", "mlflow.promote=false", "mlflow.gate_min_lift=null")

    monkeypatch.chdir(project)
    summary = workflow.train(spark, cfg)
    assert summary["delta_table"] == table  # the train JSON line
    client = MlflowClient(summary["tracking_uri"])
    run = client.get_run(summary["run_id"])
    assert run.data.tags["delta_table"] == table and run.data.params["delta.table"] == table
    mv = client.get_model_version(cfg.mlflow.registered_model, str(summary["model_version"]))
    assert mv.tags["delta_table"] == table
    ckpt = torch.load(os.path.join(cfg.train.checkpoint_dir, summary["run_id"], "last.ckpt"), map_location="cpu",
                      weights_only=False)
    assert ckpt["lakehouse"] == {"delta_table": table, "delta_version": 0, "val_fraction": cfg.data.val_fraction,
                                 "split_key": cfg.data.split_key}

    monkeypatch.chdir(elsewhere)  # `lakehouse promote` run from another project's folder
    decision = workflow.promote_version(cfg)
    assert decision["error"] is None and decision["promoted"], decision["reason"]
    assert f"Delta table {table} version 0" in decision["rows"]
    holder = client.get_model_version_by_alias(cfg.mlflow.registered_model, "champion")
    assert str(holder.version) == str(summary["model_version"])
