"""Pure logic of run-scoped checkpoints (train.ckpt_restore) and of the folder a run is left in when MLflow is gone."""
from __future__ import annotations

import json
import os
import time

import pytest

from pipeline.config import Config, ConfigError, apply_overrides


def _cfg(tmp_path, restore):
    return apply_overrides(Config(), {"train.checkpoint_dir": str(tmp_path), "train.ckpt_restore": restore})


def test_ckpt_restore_resolves_within_the_run_or_the_run_named(tmp_path):
    from pipeline.distributed.checkpoints.layout import resolve_restore_point, run_checkpoint_dir

    def resolve_restore(cfg, run_id):  # as the driver resolves it for run `run_id` (workflow.train_in_run)
        return resolve_restore_point(cfg.train.ckpt_restore, run_checkpoint_dir(cfg, run_id), cfg.train.checkpoint_dir)

    for run, age in (("older", 100), ("newer", 0)):
        (tmp_path / run).mkdir()
        for name in ("last.ckpt", "best.ckpt"):
            (tmp_path / run / name).write_bytes(b"x")
            os.utime(tmp_path / run / name, (time.time() - age, time.time() - age))
    assert resolve_restore(_cfg(tmp_path, None), "newer") is None
    assert resolve_restore(_cfg(tmp_path, "best"), "older") == str(tmp_path / "older" / "best.ckpt")
    assert resolve_restore(_cfg(tmp_path, "last"), "newer") == str(tmp_path / "newer" / "last.ckpt")
    assert resolve_restore(_cfg(tmp_path, "older/last"), "mine") == str(tmp_path / "older" / "last.ckpt")
    explicit = str(tmp_path / "older" / "best.ckpt")
    assert resolve_restore(_cfg(tmp_path, explicit), "mine") == explicit
    # a new run's own `best` does not exist, and another run's is never taken: the error lists them, newest first
    with pytest.raises(ConfigError, match=r"train\.ckpt_restore.*mine/best\.ckpt does not exist.*newer, older"):
        resolve_restore(_cfg(tmp_path, "best"), "mine")
    with pytest.raises(ConfigError, match=r"nothere/last\.ckpt does not exist"):
        resolve_restore(_cfg(tmp_path, "nothere/last"), "mine")


def test_offline_folder_takes_client_calls_and_keeps_metrics_with_steps(tmp_path):
    from pipeline.tracking.offline import OfflineRun, SyncError, left_offline, offline_folder
    from pipeline.workflow import sync_run

    off = OfflineRun(offline_folder(str(tmp_path)))
    off.write_metrics([(0, {"val_loss": 1.5, "val_acc": 0.25}, 1000, True), (1, {"val_loss": 1.0}, 2000, False)])
    off.set_tag("r", "precision", "32-true")
    off.log_dict("r", [{"rank": 0}], "ranks.json")
    off.update(tags={"rank_0_host": "h"}, status="FINISHED")
    assert left_offline(str(tmp_path)) is None  # no model yet: not a run left offline
    assert [(m["key"], m["step"], m["sent"]) for m in off.metrics()] == [("val_loss", 0, True), ("val_acc", 0, True),
                                                                        ("val_loss", 1, False)]
    info = off.read()
    assert info["tags"] == {"precision": "32-true", "rank_0_host": "h"} and info["status"] == "FINISHED"
    assert json.loads((tmp_path / "offline_run" / "artifacts" / "ranks.json").read_text()) == [{"rank": 0}]
    with pytest.raises(SyncError, match="not a run left offline"):
        sync_run(off.folder)
    (tmp_path / "offline_run" / "metrics.jsonl").write_text('{"key": "x"}\n')
    with pytest.raises(SyncError, match=r"metrics\.jsonl line 1"):
        off.metrics()
