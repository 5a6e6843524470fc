"""Runs that restart themselves (train.max_restarts): real Horovod ranks over gloo, real Spark, Delta and MLflow."""
import json

import pytest
from mlflow.tracking import MlflowClient

from conftest import restart_config

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]


_cfg = restart_config


def _digests(client, run_id, tmp_path):
    with open(client.download_artifacts(run_id, "ranks.json", str(tmp_path))) as fh:
        return [r["weights_digest"] for r in json.load(fh)]


def test_dead_rank_restarts_from_the_last_checkpoint_like_an_uninterrupted_run(spark, digits_table, tmp_path):
    """Rank 1 dies mid-epoch on the first attempt: every rank is relaunched from the last (mid-epoch) checkpoint in
    the same MLflow run, which ends FINISHED with exactly the weights of a run that never failed."""
    from pipeline import workflow

    whole = workflow.train(spark, _cfg(tmp_path, "whole", digits_table))
    cfg = _cfg(tmp_path, "cut", digits_table, "train.max_restarts=1", "debug.fail_at_step=13", "debug.fail_rank=1")
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

    cfg = _cfg(tmp_path, "fail", digits_table, "debug.fail_at_step=3", "debug.fail_rank=1")
    with pytest.raises(DistributedTrainingError, match="rank 1"):
        workflow.train(spark, cfg)


def _ranks(client, run_id, tmp_path):
    with open(client.download_artifacts(run_id, "ranks.json", str(tmp_path))) as fh:
        return json.load(fh)


def test_out_of_memory_at_step_1_with_auto_batch_halves_it_on_every_rank_and_finishes(spark, digits_table, tmp_path):
    """data.batch_size=auto: an out-of-memory on rank 1 at step 1 (before any checkpoint) relaunches both ranks with
    half the batch, re-planned, the LR scaled by the same rule; the run finishes, records it and registers once."""
    from pipeline import workflow
    from pipeline.distributed.backoff import lr_batch_factor
    from pipeline.model.module import scaled_lr

    cfg = _cfg(tmp_path, "oom", digits_table, "data.batch_size=auto", "data.auto_batch_start=32",
               "train.max_epochs=1", "debug.fail_at_step=1", "debug.fail_rank=1", "debug.fail_with=oom")
    out = workflow.train(spark, cfg)
    client = MlflowClient(out["tracking_uri"])
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED" and out["epochs"] == 1 and out["batch_size_used"] == 16
    assert run.data.params["data.batch_size"] == "auto" and run.data.tags["batch_size_used"] == "16"
    assert "OutOfMemoryError" in run.data.tags["oom_backoff_1_cause"] and "rank 1" in run.data.tags["oom_backoff_1_cause"]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "oom_backoffs")] == [1]
    assert not client.get_metric_history(run.info.run_id, "restarts")  # no checkpoint yet: not a restart
    with open(client.download_artifacts(run.info.run_id, "shard_plan.json", str(tmp_path / "p"))) as fh:
        plan = json.load(fh)["train"]
    assert plan["batch_size"] == 16 and plan["steps_per_epoch"] == min(plan["rows_per_rank"]) // 16
    lr = scaled_lr(cfg.model.lr, 2, cfg.train.lr_scaling) * lr_batch_factor(16, 32, cfg.train.lr_scaling)
    assert [r["lr"] for r in _ranks(client, run.info.run_id, tmp_path / "r")] == [pytest.approx(lr)] * 2
    assert len(client.search_model_versions(f"name='{cfg.mlflow.registered_model}'")) == 1


def test_out_of_memory_with_a_fixed_batch_and_no_backoff_fails_naming_it(spark, digits_table, tmp_path):
    from pipeline import workflow
    from pipeline.distributed.launcher import DistributedTrainingError

    cfg = _cfg(tmp_path, "oomfail", digits_table, "train.oom_backoff=false", "train.max_epochs=1",
               "debug.fail_at_step=1", "debug.fail_rank=1", "debug.fail_with=oom")
    with pytest.raises(DistributedTrainingError, match=r"rank 1: OutOfMemoryError: CUDA out of memory"):
        workflow.train(spark, cfg)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.status for r in runs] == ["FAILED"] and runs[0].data.tags["batch_size_used"] == "16"
    assert not client.search_model_versions(f"name='{cfg.mlflow.registered_model}'")


def test_out_of_memory_after_a_checkpoint_restarts_from_it_with_half_the_batch(spark, digits_table, tmp_path):
    """An out-of-memory after the job's first checkpoint (step 4 of 7): every rank restarts from that checkpoint with
    half the batch (a restart, within train.max_restarts), the interrupted epoch goes on at the same share of its
    rows, and the run finishes both epochs."""
    from pipeline import workflow

    cfg = _cfg(tmp_path, "late", digits_table, "data.batch_size=auto", "data.auto_batch_start=32",
               "train.max_restarts=1", "debug.fail_at_step=5", "debug.fail_rank=1", "debug.fail_with=oom")
    out = workflow.train(spark, cfg)
    client = MlflowClient(out["tracking_uri"])
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED" and out["epochs"] == 2 and out["batch_size_used"] == 16
    assert [m.value for m in client.get_metric_history(run.info.run_id, "restarts")] == [1]
    assert "OutOfMemoryError" in run.data.tags["restart_1_cause"] and run.data.tags["batch_size_used"] == "16"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [0, 1]
    assert len(client.search_model_versions(f"name='{cfg.mlflow.registered_model}'")) == 1
