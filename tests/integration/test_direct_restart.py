"""data.source=direct relaunched after a SIGKILL mid-epoch, on real parts (2 Horovod ranks over gloo, a Delta table,
MLflow): the relaunch resumes at the same row as an uninterrupted run, bit for bit, as the converted path does
(test_restarts.py, test_checkpoint_restarts.py)."""
import json
import threading

import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import restart_config
from test_checkpoint_restarts import _kill_a_rank_once_a_checkpoint_records

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

DIRECT = ("data.source=direct", "data.decode=cpu", "data.decode_workers=1", "train.early_stopping.enabled=false")


def _cfg(tmp_path, name, table, *extra):
    return restart_config(tmp_path, name, table, *DIRECT, *extra)


def _digests(client, run_id, folder):
    with open(client.download_artifacts(run_id, "ranks.json", str(folder))) as fh:
        return [r["weights_digest"] for r in json.load(fh)]


def _train_ids(data, rank, cfg, resume, epochs):
    """The row ids the train loader of `rank` (as the ranks build it from `cfg.data`) hands out over `epochs` epochs,
    resumed after `resume` batches."""
    from pipeline.data.datamodule import make_datamodule

    dm = make_datamodule(data, rank, data.train.world_size, cfg.data, track_ids=True)
    loader = dm.train_dataloader()
    loader.resume_at(resume)
    ids = []
    try:
        for _ in range(epochs):
            for _ in loader:
                pass
            loader.check_rows()
            ids += loader.ids_read
    finally:
        dm.teardown("fit")
    return ids


def test_a_relaunch_after_a_sigkill_mid_epoch_resumes_at_the_same_row_bit_for_bit(spark, digits_table, tmp_path,
                                                                                  monkeypatch):
    """A rank SIGKILLed once a mid-epoch checkpoint exists: both ranks are relaunched from the job's last checkpoint
    (mid-epoch), read from there the rows an uninterrupted run reads, and the run ends FINISHED with exactly the
    weights of the run that never failed; nothing is converted into the cache."""
    from pipeline import workflow
    from pipeline.data.source import prepare_direct
    from pipeline.distributed import restart

    whole = workflow.train(spark, _cfg(tmp_path, "whole", digits_table))
    assert whole["data_source"] == "direct" and whole["epochs"] == 2

    cfg = _cfg(tmp_path, "cut", digits_table, "train.max_restarts=1")
    restored = []  # (world size, checkpoint path, its global step and steps per epoch) of each launch
    real = restart.launch

    def launch(job, *args, **kwargs):
        path = job.plan.restore_from
        ckpt = torch.load(path, map_location="cpu", weights_only=False) if path else None
        restored.append((job.plan.world_size, path, ckpt and ckpt["global_step"],
                         ckpt and ckpt["trained_with"]["steps_per_epoch"]))
        return real(job, *args, **kwargs)

    monkeypatch.setattr(restart, "launch", launch)
    done = threading.Event()
    killer = threading.Thread(target=_kill_a_rank_once_a_checkpoint_records,
                              args=(cfg.train.checkpoint_dir, cfg.data.batch_size, done), daemon=True)
    killer.start()
    try:
        healed = workflow.train(spark, cfg)
    finally:
        done.set()
        killer.join(timeout=10)

    client = MlflowClient(healed["tracking_uri"])
    run = client.get_run(healed["run_id"])
    assert run.info.status == "FINISHED" and healed["epochs"] == 2 and healed["data_source"] == "direct"
    assert run.data.tags["data_source"] == "direct"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "restarts")] == [1]
    assert "ended without reporting an error" in run.data.tags["restart_1_cause"]  # the SIGKILL, not an injection
    assert len(restored) == 2 and restored[0][1] is None
    world, path, step, steps = restored[1]
    assert world == 2 and path and 0 < step and step % steps != 0, restored  # relaunched from mid-epoch
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [0, 1]

    # every step of both epochs once: none skipped after the kill, none trained twice
    last = torch.load(f"{workflow.run_checkpoint_dir(cfg, healed['run_id'])}/last.ckpt", map_location="cpu",
                      weights_only=True)
    assert last["global_step"] == 2 * steps
    # bit for bit: both relaunched ranks end with the weights of the run that never failed
    digests = _digests(client, run.info.run_id, tmp_path / "a")
    assert digests[0] == digests[1] == _digests(MlflowClient(whole["tracking_uri"]), whole["run_id"], tmp_path / "b")[0]

    # the same rows: from the restored step on, each rank's loader (as the ranks build it from the job's data and
    # config) hands out by row id exactly what an uninterrupted one hands out from that step
    data, _ = prepare_direct(cfg)
    batch = data.plan.train.batch_size
    for rank in range(2):
        uninterrupted = _train_ids(data, rank, cfg, 0, 2)
        resumed = _train_ids(data, rank, cfg, step, 2 - step // steps)
        assert len(uninterrupted) == 2 * steps * batch
        assert resumed == uninterrupted[step * batch:]
    assert not any((tmp_path / "cache").rglob("*.parquet"))  # nothing converted: the table's own files were read
