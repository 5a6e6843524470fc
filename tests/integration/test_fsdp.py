"""train.backend=fsdp on real parts: 2 CPU ranks over gloo launched by torchrun, sharded checkpoints (whole or
not at all, a rank killed while writing one), the registered model gathered on rank 0 equal to a single-process reload
of the checkpoint."""
import glob
import os

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch

from conftest import make_config

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


def _fsdp_run(spark, table, tmp_path, *extra):
    from pipeline import workflow

    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = make_config(tmp_path, f"delta.table={table}", "data.batch_size=16", "train.warmup_epochs=0",
                      "train.backend=fsdp", "train.np=-2", "model.arch=resnet", "model.width=8", "model.lr=0.05",
                      "train.early_stopping.enabled=false", *extra)
    return cfg, workflow.train(spark, cfg)


def test_two_fsdp_ranks_on_cpu_register_the_checkpoint_they_wrote(spark, digits_table, digits_dir, tmp_path):
    from pipeline.data.transforms import decode_batch
    from pipeline.distributed.checkpoints import classifier_from_checkpoint, is_sharded_checkpoint
    from pipeline.workflow import run_checkpoint_dir

    cfg, summary = _fsdp_run(spark, digits_table, tmp_path, "train.max_epochs=2")
    assert summary["backend"] == "fsdp" and summary["world_size"] == 2 and summary["epochs"] == 2
    assert summary["model_version"] == 1

    # sharded checkpoints: a folder per checkpoint, one shard per rank, plus Lightning's meta.pt
    folder = run_checkpoint_dir(cfg, summary["run_id"])
    for name in ("best.ckpt", "last.ckpt"):
        path = os.path.join(folder, name)
        assert is_sharded_checkpoint(path), os.listdir(folder)
        assert len(glob.glob(os.path.join(path, "*.distcp"))) == 2

    # the single-process reload of best.ckpt (no process group) predicts exactly what the registered model does
    files = sorted(glob.glob(os.path.join(str(digits_dir), "**", "*.png"), recursive=True))[:24]
    contents = [open(f, "rb").read() for f in files]
    net = classifier_from_checkpoint(os.path.join(folder, "best.ckpt"))  # no process group, one process
    with torch.no_grad():
        probs = torch.softmax(net(torch.from_numpy(decode_batch(contents, cfg.data.image_size, 1))), 1).numpy()

    mlflow.set_tracking_uri(summary["tracking_uri"])
    model = mlflow.pyfunc.load_model(f"models:/{cfg.mlflow.registered_model}/{summary['model_version']}")
    out = model.predict(pd.DataFrame({"content": contents}))
    served = np.stack(out["probabilities"].to_list())
    np.testing.assert_allclose(served, probs, rtol=1e-5, atol=1e-6)
    assert summary["val_acc"] > 0.2  # learning (chance 0.1)


def test_fsdp_resumes_from_its_sharded_last_checkpoint(spark, digits_table, tmp_path):
    cfg, first = _fsdp_run(spark, digits_table, tmp_path, "train.max_epochs=1")
    _, second = _fsdp_run(spark, digits_table, tmp_path, "train.max_epochs=2",
                          f"train.ckpt_restore={first['run_id']}/last")
    assert second["epochs"] == 2 and second["backend"] == "fsdp"


def test_a_rank_killed_while_writing_last_ckpt_resumes_from_the_previous_complete_checkpoint(spark, digits_table,
                                                                                           tmp_path):
    """Rank 1 SIGKILLs itself while the ranks write last.ckpt at the end of epoch 1, once its shard is on disk
    (debug.kill_while_saving): last.ckpt stays epoch 0's complete folder, the restart (train.max_restarts) resumes
    from it, and the run ends with exactly the weights of a run that never failed. A checkpoint of mixed shards
    (epoch 1's weights under epoch 0's meta.pt, what Lightning's write in place left) would train epoch 1 twice."""
    import json

    from mlflow.tracking import MlflowClient

    from pipeline.distributed.checkpoints import consolidated_state
    from pipeline.workflow import run_checkpoint_dir

    # the arrow reader resumes the data stream exactly (random states are in the checkpoint too)
    shared = (f"data.cache_dir={tmp_path}/cache", "data.reader=arrow")
    whole_cfg, whole = _fsdp_run(spark, digits_table, tmp_path / "whole", "train.max_epochs=3", *shared)
    client = MlflowClient(whole["tracking_uri"])
    with open(client.download_artifacts(whole["run_id"], "shard_plan.json", str(tmp_path))) as fh:
        steps = json.load(fh)["train"]["steps_per_epoch"]

    # the first last.ckpt written at step steps + 1 or later: the end of epoch 1 (step 2 x steps)
    cfg, cut = _fsdp_run(spark, digits_table, tmp_path / "cut", "train.max_epochs=3", *shared, "train.max_restarts=1",
                         f"debug.kill_while_saving={steps + 1}", "debug.fail_rank=1")
    client = MlflowClient(cut["tracking_uri"])
    run = client.get_run(cut["run_id"])
    assert run.info.status == "FINISHED" and cut["epochs"] == whole["epochs"] == 3
    assert [m.value for m in client.get_metric_history(run.info.run_id, "restarts")] == [1]
    cause = run.data.tags["restart_1_cause"]
    assert "rank 1" in cause and "ended without reporting an error" in cause, cause

    folder = run_checkpoint_dir(cfg, cut["run_id"])
    assert sorted(os.listdir(folder)) == ["best.ckpt", "last.ckpt"]  # no staged or set-aside folder, no copy
    mine = consolidated_state(os.path.join(folder, "last.ckpt"))
    theirs = consolidated_state(os.path.join(run_checkpoint_dir(whole_cfg, whole["run_id"]), "last.ckpt"))
    assert mine.keys() == theirs.keys()
    different = {k: float((mine[k].double() - theirs[k].double()).abs().max()) for k in mine
                 if not torch.equal(mine[k], theirs[k])}
    assert different == {}, different
