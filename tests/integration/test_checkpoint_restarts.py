"""Restarts that depend on what a checkpoint and a rank record, on real parts (Horovod ranks over gloo, Spark, Delta,
MLflow): a kill after an OOM back-off resumes at the batch, step and rate the checkpoint was trained with, and a
rank's ConfigError ends a multi-rank job after one launch."""
import glob
import os
import threading
import time

import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import restart_config

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]


_cfg = restart_config


def _kill_a_rank_once_a_checkpoint_records(folder, batch, done):
    """Wait for a last.ckpt under `folder` trained with `batch` per rank, then SIGKILL one rank process."""
    from pipeline.distributed.checkpoints.record import trained_with
    from pipeline.distributed.rank_signals import rank_processes

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not done.is_set():
        for path in glob.glob(os.path.join(folder, "*", "last.ckpt")):
            try:
                record = trained_with(path)
            except Exception:  # replaced while read, or not written yet
                continue
            if record["batch_size"] == batch:
                ranks = rank_processes()
                if ranks:
                    ranks[-1].kill()
                    done.set()
                    return
        time.sleep(0.05)


def test_a_kill_after_an_oom_backoff_resumes_at_the_batch_the_checkpoint_was_trained_with(spark, digits_table,
                                                                                          tmp_path):
    """32 per rank, OOM after the first checkpoint -> restated for 16; then a rank is killed once a checkpoint trained
    at 16 exists -> the restart resumes from it as it is (not restated again as if trained at 32): the run ends with
    the rate, steps and record of batch 16."""
    from pipeline import workflow
    from pipeline.distributed.backoff import lr_batch_factor
    from pipeline.model.module import scaled_lr

    cfg = _cfg(tmp_path, "kill", digits_table, "data.batch_size=auto", "data.auto_batch_start=32",
               "train.max_epochs=3", "train.max_restarts=2", "debug.fail_at_step=5", "debug.fail_rank=1",
               "debug.fail_with=oom", "train.early_stopping.enabled=false")
    done = threading.Event()
    killer = threading.Thread(target=_kill_a_rank_once_a_checkpoint_records,
                              args=(cfg.train.checkpoint_dir, 16, done), daemon=True)
    killer.start()
    try:
        out = workflow.train(spark, cfg)
    finally:
        done.set()
        killer.join(timeout=10)
    client = MlflowClient(out["tracking_uri"])
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED" and out["epochs"] == 3 and out["batch_size_used"] == 16
    assert [m.value for m in client.get_metric_history(run.info.run_id, "restarts")] == [1, 2]
    assert "OutOfMemoryError" in run.data.tags["restart_1_cause"]
    assert "ended without reporting an error" in run.data.tags["restart_2_cause"]

    last = os.path.join(workflow.run_checkpoint_dir(cfg, out["run_id"]), "last.ckpt")
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    steps = ckpt["trained_with"]["steps_per_epoch"]
    lr = scaled_lr(cfg.model.lr, 2, cfg.train.lr_scaling) * lr_batch_factor(16, 32, cfg.train.lr_scaling)
    assert ckpt["trained_with"] == {"batch_size": 16, "world_size": 2, "steps_per_epoch": steps,
                                    "global_step": 3 * steps, "lr": pytest.approx(lr), "optimizer": cfg.model.optimizer,
                                    "param_groups": ["all"]}
    assert ckpt["global_step"] == 3 * steps  # every step of the three epochs at 16, none skipped or counted twice
    # the optimizer's rate is the one for 16 per rank; restated twice (as if trained at 32) it would be half of it
    assert ckpt["optimizer_states"][0]["param_groups"][0]["initial_lr"] == pytest.approx(lr)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")][-1] == 2


def test_a_config_error_in_the_ranks_ends_the_job_after_one_launch(spark, digits_table, tmp_path, monkeypatch):
    """Every rank raises ConfigError (its train.ckpt_restore is gone): one launch, no restart although
    train.max_restarts=2, and the error names the key."""
    from pipeline.data.convert import class_names_of, convert_for_training
    from pipeline.distributed import launcher, restart
    from pipeline.lakehouse.delta import get_engine

    cfg = _cfg(tmp_path, "cfgerr", digits_table, "train.max_restarts=2",
               f"train.ckpt_restore={tmp_path}/gone/last.ckpt")
    df, pinned = get_engine("delta-rs").read(spark, str(digits_table))
    data = convert_for_training(spark, df, cfg, 2, class_names_of(df), pinned)
    job = launcher.TrainJob(cfg=cfg, data=data, delta_table=str(digits_table), delta_version=0,
                            job_dir=str(tmp_path / "job"))
    launches = []
    real = launcher.launch
    monkeypatch.setattr(restart, "launch", lambda j, early=None: launches.append(j.plan.attempt) or real(j, early))
    with pytest.raises(launcher.DistributedTrainingError,
                       match=r"ConfigError: config key 'train.ckpt_restore': checkpoint .*gone/last.ckpt") as err:
        restart.launch_with_restarts(job)
    assert launches == [0]
    # Every rank that recorded its failure names a ConfigError. Not every rank need have recorded one: both fail the
    # same check ~10 ms apart, and the launcher ends the peers of the first rank that exits (seen: [0] alone)
    assert err.value.rank_classes and set(err.value.rank_classes) <= {0, 1}
    assert all(any(c.endswith(".ConfigError") for c in classes) for classes in err.value.rank_classes.values())


def test_an_epoch_whose_checkpoint_a_killed_rank_never_wrote_is_logged_once(spark, digits_table, tmp_path):
    """Rank 0 SIGKILLs itself while writing epoch 0's last.ckpt (debug.kill_while_saving): the restart trains epoch 0
    again; MLflow holds each epoch's metrics once (an epoch is reported once its checkpoints are written)."""
    from conftest import make_config
    from pipeline import workflow

    cfg = make_config(tmp_path, f"delta.table={digits_table}", "data.reader=arrow", "data.batch_size=16",
                      "train.np=-2", "train.max_epochs=2", "train.warmup_epochs=0", "train.max_restarts=1",
                      "train.early_stopping.enabled=false", "debug.kill_while_saving=1", "debug.fail_rank=0")
    out = workflow.train(spark, cfg)
    client = MlflowClient(out["tracking_uri"])
    assert [m.value for m in client.get_metric_history(out["run_id"], "restarts")] == [1]
    for key in ("val_loss", "train_loss", "epoch_time_s"):
        assert sorted(m.step for m in client.get_metric_history(out["run_id"], key)) == [0, 1], key
