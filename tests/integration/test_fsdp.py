"""train.backend=fsdp on real parts: 2 CPU ranks over gloo launched by TorchDistributor, sharded checkpoints,
the registered model gathered on rank 0 equal to a single-process reload of the checkpoint."""
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
