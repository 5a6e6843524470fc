"""Checkpoints kept per MLflow run: jobs sharing `train.checkpoint_dir` never overwrite or reload each other's."""
from __future__ import annotations

import os
import re

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


def _val_losses(client, run_id):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, "val_loss"), key=lambda m: m.step)]


def test_a_sigterm_mid_epoch_is_resumed_at_its_step_and_the_epoch_finished_once(spark, digits_table, tmp_path,
                                                                               monkeypatch):
    """SIGTERM (as StopSignals' handler records it) in epoch 1: the partial epoch is neither reported nor checkpointed
    as finished (StopSignals' mid-epoch last.ckpt stays, no best.ckpt of it); train.ckpt_restore=<run>/last then
    finishes epoch 1 from its step, validates it and registers this run's own best.ckpt."""
    import math

    import torch

    from pipeline import workflow
    from pipeline.distributed import callbacks, loop
    from pipeline.errors import Terminated

    real = callbacks.StopSignals.on_train_batch_end

    def term_in_epoch_1(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 1 and armed:
            self._term = True  # what the SIGTERM handler sets; decided at the window's end (step 16 of the epoch)
        return real(self, trainer, pl_module, outputs, batch, batch_idx)

    armed = True
    monkeypatch.setattr(callbacks.StopSignals, "on_train_batch_end", term_in_epoch_1)
    cfg = _cfg(tmp_path, digits_table, "train.max_epochs=2", "data.batch_size=8", "data.reader=arrow",
               "train.warmup_epochs=0")
    with pytest.raises(Terminated, match="SIGTERM"):
        workflow.train(spark, cfg)
    armed = False
    client = MlflowClient(cfg.mlflow.tracking_uri)
    killed = client.search_runs([client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id])[0].info.run_id
    folder = tmp_path / "checkpoints" / killed
    last = torch.load(folder / "last.ckpt", map_location="cpu", weights_only=True)
    steps = last["trained_with"]["steps_per_epoch"]
    assert steps < last["global_step"] < 2 * steps  # StopSignals' checkpoint, in epoch 1
    assert torch.load(folder / "best.ckpt", map_location="cpu", weights_only=True)["epoch"] == 0
    assert [s for s, _ in _val_losses(client, killed)] == [0]  # the partial epoch 1 is not an epoch

    best_paths = []
    real_weights = loop.weights_to_register
    monkeypatch.setattr(loop, "weights_to_register", lambda h, best, *a: best_paths.append(best) or real_weights(
        h, best, *a))
    resumed = workflow.train(spark, _cfg(tmp_path, digits_table, "train.max_epochs=2", "data.batch_size=8",
                                         "data.reader=arrow", "train.warmup_epochs=0",
                                         f"train.ckpt_restore={killed}/last"))
    losses = _val_losses(client, resumed["run_id"])
    assert [s for s, _ in losses] == [1] and not math.isnan(losses[0][1])  # epoch 1 finished and validated
    rows = [m.value for m in client.get_metric_history(resumed["run_id"], "rows_read_rank_0")]
    assert rows == [(2 * steps - last["global_step"]) * 8]  # the rest of epoch 1's steps, no more
    mine = tmp_path / "checkpoints" / resumed["run_id"]
    final = torch.load(mine / "last.ckpt", map_location="cpu", weights_only=True)
    assert final["global_step"] == 2 * steps and final["epoch"] == 1
    assert [os.path.realpath(p) for p in best_paths] == [os.path.realpath(mine / "best.ckpt")]  # this run's own


def test_a_resume_refuses_another_model_shape_and_names_optimizer_settings_it_does_not_apply(spark, digits_table,
                                                                                             tmp_path):
    """train.ckpt_restore of a checkpoint with another model.width: refused before Lightning loads it, naming the file
    and the key, and not restarted (train.max_restarts=1). Another model.lr: the checkpoint's optimizer state trains
    (Lightning restores it); the run says so (a warning and the `optimizer_from_checkpoint` tag)."""
    from pipeline import workflow

    first = workflow.train(spark, _cfg(tmp_path, digits_table, "train.max_epochs=1"))
    # another run's checkpoint is resumed from this run's snapshot of it (checkpoints.layout.snapshot)
    snapshot = re.escape(str(tmp_path / "checkpoints")) + r"/[0-9a-f]+/restore-point/last\.ckpt"
    with pytest.raises(Exception, match=rf"checkpoint {snapshot} holds a model of other shapes.*"
                                        r"model.width 32 \(this job: 16\)") as err:
        workflow.train(spark, _cfg(tmp_path, digits_table, "train.max_epochs=2", "model.width=16",
                                   "train.max_restarts=1", f"train.ckpt_restore={first['run_id']}/last"))
    assert "size mismatch" not in str(err.value)
    client = MlflowClient(first["tracking_uri"])
    runs = client.search_runs([client.get_run(first["run_id"]).info.experiment_id], order_by=["start_time DESC"])
    refused = runs[0]
    assert refused.info.status == "FAILED" and "restart_1_cause" not in refused.data.tags  # not retried

    resumed = workflow.train(spark, _cfg(tmp_path, digits_table, "train.max_epochs=2", "model.lr=0.5",
                                         "model.schedule=constant", f"train.ckpt_restore={first['run_id']}/last"))
    tag = client.get_run(resumed["run_id"]).data.tags["optimizer_from_checkpoint"]
    assert "lr (before the schedule) of parameter group 'all': checkpoint 0.01, config 0.5" in tag
    assert [m.value for m in client.get_metric_history(resumed["run_id"], "lr")] == [pytest.approx(0.01)]
