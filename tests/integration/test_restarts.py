"""Runs that restart themselves (train.max_restarts): real Horovod ranks over gloo, real Spark, Delta and MLflow."""
import json

import pytest
from mlflow.tracking import MlflowClient

from conftest import make_config

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]


def _cfg(tmp_path, name, table, *extra):
    return make_config(tmp_path / name, f"delta.table={table}", "data.reader=arrow", "data.batch_size=16",
                       "train.np=-2", "train.max_epochs=2", "train.warmup_epochs=0",
                       f"data.cache_dir={tmp_path}/cache", "train.checkpoint_every_n_steps=2", *extra)


def _digests(client, run_id, tmp_path):
    with open(client.download_artifacts(run_id, "ranks.json", str(tmp_path))) as fh:
        return [r["weights_digest"] for r in json.load(fh)]


def test_dead_rank_restarts_from_the_last_checkpoint_like_an_uninterrupted_run(spark, digits_table, tmp_path):
    """Rank 1 dies mid-epoch on the first attempt: every rank is relaunched from the last (mid-epoch) checkpoint in
    the same MLflow run, which ends FINISHED with exactly the weights of a run that never failed."""
    from pipeline import workflow

    whole = workflow.train(spark, _cfg(tmp_path, "whole", digits_table))
    cfg = _cfg(tmp_path, "cut", digits_table, "train.max_restarts=1", "train.fail_at_step=13", "train.fail_rank=1")
    healed = workflow.train(spark, cfg)
    client = MlflowClient(healed["tracking_uri"])
    run = client.get_run(healed["run_id"])
    assert run.info.status == "FINISHED" and healed["epochs"] == whole["epochs"] == 2
    assert [m.value for m in client.get_metric_history(run.info.run_id, "restarts")] == [1]
    cause = run.data.tags["restart_1_cause"]
    assert "rank 1" in cause and "injected failure at step 13" in cause
    digests = _digests(client, run.info.run_id, tmp_path / "a")
    assert digests[0] == digests[1] == _digests(MlflowClient(whole["tracking_uri"]), whole["run_id"], tmp_path / "b")[0]
    # BatchNorm running statistics are per rank (as in Horovod); a restore gives every rank rank 0's, so the val
    # loss (each rank scores its own shard) may differ in the last digits while the weights are identical
    assert healed["val_loss"] == pytest.approx(whole["val_loss"], rel=0.01)


def test_without_restarts_the_job_fails_naming_the_rank(spark, digits_table, tmp_path):
    from pipeline import workflow
    from pipeline.distributed.launcher import DistributedTrainingError

    cfg = _cfg(tmp_path, "fail", digits_table, "train.fail_at_step=3", "train.fail_rank=1")
    with pytest.raises(DistributedTrainingError, match="rank 1"):
        workflow.train(spark, cfg)
