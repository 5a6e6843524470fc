"""Checkpoints kept per MLflow run: jobs sharing `train.checkpoint_dir` never overwrite or reload each other's."""
from __future__ import annotations

import pytest
from mlflow import MlflowClient

from conftest import make_config
from pipeline.config import ConfigError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _cfg(tmp_path, table, *extra):
    return make_config(tmp_path, f"delta.table={table}", "train.backend=single", "train.np=1", "data.batch_size=32",
                       "train.threads_per_rank=1", "train.early_stopping.enabled=false", *extra)


def test_two_jobs_sharing_a_checkpoint_dir_keep_their_own_checkpoints(spark, digits_table, tmp_path):
    from pipeline import workflow

    first = workflow.train(spark, _cfg(tmp_path, digits_table, "train.max_epochs=1"))
    root = tmp_path / "checkpoints"
    mine = root / first["run_id"]
    assert (mine / "best.ckpt").exists() and (mine / "last.ckpt").exists()
    assert not (root / "best.ckpt").exists() and not (root / "last.ckpt").exists()
    before = (mine / "last.ckpt").stat().st_mtime_ns

    # a second job asking for `best` means its own run's best: a new run has none, and it must not take the first's
    with pytest.raises(ConfigError, match=rf"train\.ckpt_restore.*does not exist.*{first['run_id']}"):
        workflow.train(spark, _cfg(tmp_path, digits_table, "train.max_epochs=2", "train.ckpt_restore=best"))
    client = MlflowClient(first["tracking_uri"])
    failed = [r for r in client.search_runs([client.get_run(first["run_id"]).info.experiment_id])
              if r.info.run_id != first["run_id"]]
    assert [r.info.status for r in failed] == ["FAILED"]
    assert len(client.search_model_versions(f"name='{first['model_name']}'")) == 1  # nothing registered from it

    # naming the first run's best resumes from it; the new run writes only into its own folder
    third = workflow.train(spark, _cfg(tmp_path, digits_table, "train.max_epochs=2",
                                       f"train.ckpt_restore={first['run_id']}/best"))
    assert third["run_id"] != first["run_id"] and third["epochs"] == 2
    assert (root / third["run_id"] / "last.ckpt").exists()
    assert (mine / "last.ckpt").stat().st_mtime_ns == before
    assert [m.step for m in client.get_metric_history(third["run_id"], "val_loss")] == [1]
    run = client.get_run(third["run_id"])
    assert run.data.tags["resumed_from"] == str(mine / "best.ckpt")
    assert run.data.tags["checkpoint_dir"] == str(root / third["run_id"])
