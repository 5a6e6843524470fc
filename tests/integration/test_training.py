"""Training and tracking on real parts: Horovod ranks over Gloo, Spark, Petastorm, an MLflow store and server."""
import json
import os
import time

import mlflow
import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import make_config

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

CONTRACT_KEYS = {"run_id", "model_name", "model_version", "delta_table", "delta_version", "rows_train", "rows_val",
                 "world_size", "backend", "val_loss", "val_acc", "epochs", "stopped_early"}


def _cfg(tmp_path, table, *extra):
    return make_config(tmp_path, f"delta.table={table}", "data.batch_size=16", "train.max_epochs=2",
                       "train.warmup_epochs=0", *extra)


def _only_run(client, cfg):
    exp = client.get_experiment_by_name(cfg.mlflow.experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def _versions(client, name):
    """The registered versions of `name` ([] when none: the search raises only when the query itself fails)."""
    return client.search_model_versions(f"name='{name}'")


def _ranks(client, run_id, tmp_path):
    path = client.download_artifacts(run_id, "ranks.json", str(tmp_path))
    with open(path) as fh:
        return json.load(fh)


def test_two_horovod_ranks_one_run_one_version(spark, digits_table, tmp_path):
    from pipeline import workflow

    cfg = _cfg(tmp_path, digits_table, "train.np=-2", "model.lr=0.02", "train.max_epochs=3",
               "mlflow.system_metrics_interval_s=1")
    summary = workflow.train(spark, cfg)

    assert CONTRACT_KEYS <= set(summary)
    assert summary["world_size"] == 2 and summary["backend"] == "horovod" and summary["delta_version"] == 0
    assert summary["rows_train"] + summary["rows_val"] == 600 and summary["epochs"] == 3
    assert summary["val_acc"] > 0.25  # learning (chance is 0.1), in 3 short epochs on 480 rows
    # the registered network scores on the val rows, in the gate, what the ranks reported for them: every rank
    # validated with rank 0's BatchNorm statistics (each had its own before: the two differed by a few rows)
    version = MlflowClient(summary["tracking_uri"]).get_model_version(summary["model_name"],
                                                                     str(summary["model_version"]))
    rows = summary["rows_val"]
    # (a row apart at most: the gate's batches are not the ranks', and a near tie of two logits may fall either way;
    # the ranks' own statistics had put the two 3 rows apart)
    assert abs(round(float(version.tags["gate_val_acc"]) * rows) - round(summary["val_acc"] * rows)) <= 1, version.tags

    client = MlflowClient(summary["tracking_uri"])
    run = _only_run(client, cfg)
    assert run.info.run_id == summary["run_id"] and run.info.status == "FINISHED"
    assert run.data.params["train.np"] == "-2" and run.data.params["delta.engine"] == "delta-rs"
    tags = run.data.tags
    assert tags["delta_version"] == "0" and tags["delta_table"] == str(digits_table)
    assert tags["rows_train"] == str(summary["rows_train"]) and tags["world_size"] == "2"
    assert tags["backend"] == "horovod"
    assert tags["precision"] == "32-true" and run.data.params["train.precision"] == "auto"  # auto, resolved on CPU
    for metric in ("train_loss", "val_loss", "val_acc", "samples_per_sec", "data_wait_fraction",
                   "rows_read_rank_0", "rows_read_rank_1"):
        assert len(client.get_metric_history(run.info.run_id, metric)) == 3, metric
    # telemetry: rank 0's machine sampled in the background (a series, not one point), every rank's host and memory
    # reported through rank 0 at each epoch end; no GPU series on a CPU machine
    for key in ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"):
        assert client.get_metric_history(run.info.run_id, key), key  # >= 1 point: 3 short epochs may take < 1 s
    for rank in (0, 1):
        for field in ("host_cpu_percent", "host_memory_used_mb", "peak_rss_mb"):
            history = client.get_metric_history(run.info.run_id, f"{field}_rank_{rank}")
            assert len(history) == 3 and all(m.value >= 0 for m in history), (field, rank)
        peak = client.get_metric_history(run.info.run_id, f"peak_rss_mb_rank_{rank}")
        assert 50 < peak[-1].value < 8000 and peak[-1].value >= peak[0].value  # a peak never falls
    assert not [k for k in run.data.metrics if k.startswith("gpu_") or k.startswith("system/gpu")]
    # every rank read the same planned rows each epoch
    r0 = client.get_metric_history(run.info.run_id, "rows_read_rank_0")
    r1 = client.get_metric_history(run.info.run_id, "rows_read_rank_1")
    assert [m.value for m in r0] == [m.value for m in r1] and r0[0].value > 0
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)} | {
        a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"config.yaml", "ranks.json", "plots/learning_curves.png", "plots/confusion_matrix.png"} <= artifacts
    inputs = run.inputs.dataset_inputs
    assert inputs and "delta" in inputs[0].dataset.source_type.lower()
    assert json.loads(inputs[0].dataset.source) == {"path": str(digits_table), "delta_table_version": 0}

    # two ranks, two processes, identical final weights, LR scaled linearly
    ranks = _ranks(client, run.info.run_id, tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] != ranks[1]["pid"]
    assert ranks[0]["weights_digest"] == ranks[1]["weights_digest"]
    assert ranks[0]["lr"] == pytest.approx(2 * 0.02) and ranks[1]["lr"] == pytest.approx(2 * 0.02)

    versions = _versions(client, cfg.mlflow.registered_model)
    assert len(versions) == 1 and versions[0].tags["delta_version"] == "0"
    assert versions[0].tags["run_id"] == run.info.run_id
    champion = client.get_model_version_by_alias(cfg.mlflow.registered_model, "champion")
    assert str(champion.version) == str(versions[0].version) == str(summary["model_version"])

    # the checkpoint records what it was trained on
    ckpt = torch.load(os.path.join(cfg.train.checkpoint_dir, summary["run_id"], "last.ckpt"), map_location="cpu",
                      weights_only=False)
    assert ckpt["lakehouse"] == {"delta_table": str(digits_table), "delta_version": 0,  # and the split (resume checks)
                                 "val_fraction": cfg.data.val_fraction, "split_key": cfg.data.split_key}

    # the registered model predicts label names for rows read back from the Delta table
    mlflow.set_tracking_uri(summary["tracking_uri"])
    model = mlflow.pyfunc.load_model(f"models:/{cfg.mlflow.registered_model}@champion")
    from pipeline.lakehouse.delta import get_engine

    table_df, _ = get_engine("delta-rs").read(spark, str(digits_table))
    rows = table_df.select("label", "content").limit(40).toPandas()
    pred = model.predict(pd.DataFrame({"content": rows["content"]}))
    from pipeline.lakehouse.sample_data import CLASS_NAMES

    assert set(pred["label"]) <= set(CLASS_NAMES)
    assert (pred["label"].values == rows["label"].values).mean() > 0.25
    with pytest.raises(Exception, match="content|not a decodable image"):
        model.predict(pd.DataFrame({"content": [b"not an image"]}))


def test_single_process_bf16_mixed_trains_on_cpu_and_records_its_precision(spark, digits_table, tmp_path):
    import torch as _torch

    from pipeline import workflow

    threads_before = _torch.get_num_threads()
    cfg = _cfg(tmp_path, digits_table, "train.backend=single", "train.np=1", "train.precision=bf16-mixed",
               "train.max_epochs=2", "model.lr=0.02", "train.threads_per_rank=1")
    summary = workflow.train(spark, cfg)
    assert summary["world_size"] == 1 and summary["epochs"] == 2
    assert summary["val_acc"] > 0.2  # learned under bf16 autocast (chance is 0.1)
    client = MlflowClient(summary["tracking_uri"])
    run = _only_run(client, cfg)
    assert run.info.status == "FINISHED" and run.data.tags["precision"] == "bf16-mixed"
    assert _versions(client, cfg.mlflow.registered_model)  # the model (float32 weights) was logged and registered
    assert _torch.get_num_threads() == threads_before  # the run in this process handed its thread count back


def test_resume_continues_epochs_and_checks_lineage(spark, digits_table, tmp_path):
    from pipeline import workflow
    from pipeline.distributed.checkpoints.record import CheckpointLineageError, check_checkpoint_lineage

    cfg = _cfg(tmp_path, digits_table, "train.np=-2", "train.max_epochs=1")
    first = workflow.train(spark, cfg)
    assert first["epochs"] == 1
    ckpt_path = os.path.join(cfg.train.checkpoint_dir, first["run_id"], "last.ckpt")  # checkpoints are per run
    saved = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    momentum_before = saved["optimizer_states"][0]["state"]
    assert momentum_before, "SGD momentum buffers were checkpointed"

    cfg2 = _cfg(tmp_path, digits_table, "train.np=-2", "train.max_epochs=3", f"train.ckpt_restore={first['run_id']}/last",
                "mlflow.experiment=resumed")
    second = workflow.train(spark, cfg2)
    assert second["epochs"] == 3
    client = MlflowClient(second["tracking_uri"])
    steps = [m.step for m in client.get_metric_history(second["run_id"], "val_loss")]
    assert steps == [1, 2]  # epoch 0 was the first job's; the count continues

    with pytest.raises(CheckpointLineageError, match="version 0.*version 5"):
        check_checkpoint_lineage(ckpt_path, {"delta_table": str(digits_table), "delta_version": 5}, False)
    check_checkpoint_lineage(ckpt_path, {"delta_table": str(digits_table), "delta_version": 5}, True)


def test_a_run_resumed_from_another_registers_the_weights_of_the_epoch_it_reports(spark, digits_table, tmp_path):
    """Issue 37, defect 2. The second run resumes the first run's last.ckpt and carries its epoch in the history;
    the monitor's mode makes that old epoch the history's best (val_loss, mode max: the first epoch's loss is the
    highest), while the new run's best.ckpt holds only its own epochs. What is reported (the JSON line, the version's
    gate tag) must be the epoch whose weights were registered."""
    from pipeline import workflow

    first = workflow.train(spark, _cfg(tmp_path, digits_table, "train.np=-2", "train.max_epochs=1"))
    cfg = _cfg(tmp_path, digits_table, "train.np=-2", "train.max_epochs=3", f"train.ckpt_restore={first['run_id']}/last",
               "train.early_stopping.monitor=val_loss", "train.early_stopping.mode=max",
               "train.early_stopping.enabled=false", "mlflow.gate_metric=val_loss", "mlflow.promote=false",
               "mlflow.experiment=resumed")
    second = workflow.train(spark, cfg)
    client = MlflowClient(second["tracking_uri"])
    losses = {m.step: m.value for m in client.get_metric_history(second["run_id"], "val_loss")}
    assert sorted(losses) == [1, 2]  # the first run's epoch 0 is not this run's

    best = torch.load(os.path.join(cfg.train.checkpoint_dir, second["run_id"], "best.ckpt"), map_location="cpu",
                      weights_only=True)
    assert best["epoch"] in (1, 2)
    assert second["val_loss"] == pytest.approx(losses[best["epoch"]])
    version = client.get_model_version(cfg.mlflow.registered_model, str(second["model_version"]))
    assert float(version.tags["val_loss"]) == pytest.approx(losses[best["epoch"]])
    assert f"val_loss={losses[best['epoch']]:.4g}" in version.description  # defect 11: not the run's last epoch's
    # and the registered weights are that checkpoint's
    folder = mlflow.artifacts.download_artifacts(f"models:/{cfg.mlflow.registered_model}/{second['model_version']}",
                                                 dst_path=str(tmp_path / "registered"),
                                                 tracking_uri=second["tracking_uri"])
    weights = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f.startswith("weights")]
    assert len(weights) == 1, weights
    registered = torch.load(weights[0], map_location="cpu", weights_only=True)
    for key, tensor in registered.items():
        assert torch.equal(tensor, best["state_dict"][f"network.{key}"]), key


def test_failing_rank_fails_run_in_bounded_time(spark, digits_table, tmp_path):
    from pipeline import workflow
    from pipeline.distributed.launcher import DistributedTrainingError

    cfg = _cfg(tmp_path, digits_table, "train.np=-2", "debug.fail_at_step=3", "debug.fail_rank=1")
    t0 = time.monotonic()
    with pytest.raises(DistributedTrainingError) as err:
        workflow.train(spark, cfg)
    elapsed = time.monotonic() - t0
    assert elapsed < 240, elapsed
    assert "rank 1" in str(err.value) and "injected failure" in str(err.value)
    client = MlflowClient(cfg.mlflow.tracking_uri.replace("sqlite:///", "sqlite:///"))
    run = _only_run(client, cfg)
    assert run.info.status == "FAILED"
    assert _versions(client, cfg.mlflow.registered_model) == []


def test_nan_loss_stops_and_registers_nothing(spark, digits_table, tmp_path):
    from pipeline import workflow

    cfg = _cfg(tmp_path, digits_table, "train.np=-2", "debug.nan_at_step=2")
    with pytest.raises(workflow.TrainingStopped, match="non-finite training loss at step 2"):
        workflow.train(spark, cfg)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    assert _only_run(client, cfg).info.status == "FAILED"
    assert _versions(client, cfg.mlflow.registered_model) == []


def test_uneven_partitions_equal_steps_no_hang(spark, digits_table, tmp_path):
    """Partitions of very different sizes (~10% / ~90%): the converter's row groups are sized by the plan, so whole
    row groups still spread evenly over the ranks; both ranks train the same steps and agree on the weights."""
    from pyspark.sql import functions as F

    from pipeline.data.convert import (ConvertedData, class_names_of, group_rows_for, plan_data, prepare_split,
                                       split_frame, split_from_manifest, write_split)
    from pipeline.data.cache import entry_url
    from pipeline.distributed.launcher import launch
    from pipeline.distributed.loop import TrainJob
    from pipeline.lakehouse.delta import get_engine

    cfg = _cfg(tmp_path, digits_table, "train.np=-2", "train.max_epochs=1", "data.batch_size=16")
    df, pinned = get_engine("delta-rs").read(spark, str(digits_table))
    train_df, val_df = split_frame(df, 0.2)
    prepared = prepare_split(train_df, cfg, 1)
    uneven = (prepared.filter(F.col("label_index") == 0).coalesce(1)
              .union(prepared.filter(F.col("label_index") != 0).coalesce(1)))
    root = entry_url(cfg.data.cache_dir, "uneven")
    splits = {}
    for name, frame in (("train", uneven), ("val", prepare_split(val_df, cfg, 2))):
        group_rows = group_rows_for(frame.count(), 2, 32 * 32, cfg.data.row_groups_per_rank, 32)
        files = write_split(frame, f"{root}/{name}", 32, 1, group_rows)
        splits[name] = split_from_manifest(name, f"{root}/{name}", files)
    sizes = [sum(f["row_groups"]) for f in write_split(uneven, f"{root}/sizes", 32, 1, 10 ** 6)]
    assert max(sizes) / min(sizes) > 5  # the partitions really are uneven
    plan = plan_data(splits["train"], splits["val"], 2, 16)
    assert plan.train.balance() <= 1.05  # and the plan still is not
    data = ConvertedData(splits["train"], splits["val"], plan, class_names_of(df), 32, 1)
    job = TrainJob(cfg=cfg, data=data, delta_table=str(digits_table), delta_version=pinned.version,
                   job_dir=str(tmp_path / "job"))
    t0 = time.monotonic()
    results = launch(job)
    assert time.monotonic() - t0 < 300
    assert len(results) == 2
    rows = [r.history[-1][f"rows_read_rank_{r.rank}"] for r in results]
    assert rows[0] == rows[1] == plan.train.steps_per_epoch * 16
    assert results[0].final_weights_digest == results[1].final_weights_digest


def test_horovod_spark_run_local_against_mlflow_server(spark, digits_table, tmp_path, mlflow_server):
    from pipeline import workflow

    cfg = _cfg(tmp_path, digits_table, "train.np=2", "train.max_epochs=1", f"mlflow.tracking_uri={mlflow_server}",
               "mlflow.artifact_location=null", "mlflow.experiment=spark-run")
    summary = workflow.train(spark, cfg)
    assert summary["world_size"] == 2 and summary["backend"] == "horovod"
    client = MlflowClient(mlflow_server)
    run = _only_run(client, cfg)
    assert run.info.status == "FINISHED" and run.data.tags["delta_version"] == "0"
    ranks = _ranks(client, run.info.run_id, tmp_path)
    assert len(ranks) == 2 and ranks[0]["pid"] != ranks[1]["pid"]
    assert ranks[0]["weights_digest"] == ranks[1]["weights_digest"]
    versions = _versions(client, cfg.mlflow.registered_model)
    assert len(versions) == 1 and versions[0].tags["delta_version"] == "0"


def test_ddp_with_torch_distributor_local_mode(spark, digits_table, tmp_path):
    from pipeline import workflow

    cfg = _cfg(tmp_path, digits_table, "train.backend=ddp", "train.np=-2", "train.max_epochs=1")
    summary = workflow.train(spark, cfg)
    assert summary["world_size"] == 2 and summary["backend"] == "ddp" and summary["model_version"] == 1
    client = MlflowClient(summary["tracking_uri"])
    assert _only_run(client, cfg).info.status == "FINISHED"


def test_last_checkpoint_is_the_last_epoch_even_without_improvement(spark, digits_table, tmp_path):
    """last.ckpt follows every epoch, not only those where the monitored metric improved (val_loss watched with
    mode=max: after the first epoch it only "worsens"), so a resume or a restart continues from the last epoch."""
    from pipeline.data.convert import class_names_of, convert_for_training
    from pipeline.distributed.launcher import launch
    from pipeline.distributed.loop import TrainJob
    from pipeline.lakehouse.delta import get_engine

    cfg = _cfg(tmp_path, digits_table, "train.backend=single", "train.np=1", "train.max_epochs=3", "model.lr=0.05",
               "train.early_stopping.mode=max", "train.early_stopping.enabled=false")
    df, pinned = get_engine("delta-rs").read(spark, str(digits_table))
    data = convert_for_training(spark, df, cfg, 1, class_names_of(df), pinned)
    result = launch(TrainJob(cfg=cfg, data=data, delta_table=str(digits_table), delta_version=pinned.version,
                             job_dir=str(tmp_path / "job")))[0]
    losses = [h["val_loss"] for h in result.history]
    assert losses[0] == max(losses)  # the monitored "best" stayed at epoch 0
    last = torch.load(os.path.join(cfg.train.checkpoint_dir, "last.ckpt"), map_location="cpu", weights_only=False)
    best = torch.load(os.path.join(cfg.train.checkpoint_dir, "best.ckpt"), map_location="cpu", weights_only=False)
    assert best["epoch"] == 0 and last["epoch"] == 2
