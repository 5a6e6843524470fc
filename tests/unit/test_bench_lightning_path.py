"""The bench's timing of the product's train() on batches held in memory (real Lightning, one CPU process), and the
plain reference loop with each precision's autocast: windows complete, the run stops once they are, nothing left."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from bench.jobs import _plain
from bench.lightning_path import timed_train
from pipeline.config import Config
from pipeline.lakehouse.partition import ShardPlan, plan_split


def _data(batch: int = 8):
    plan = ShardPlan(train=plan_split("train", [40, 40], 1, batch), val=plan_split("val", [16], 1, batch))
    return SimpleNamespace(plan=plan, channels=1, image_size=16, class_names=[str(i) for i in range(4)])


def _batches(n: int = 3, batch: int = 8):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 1, 16, 16, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(n)]


def _cfg(tmp_path):
    cfg = Config()
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, threads_per_rank=1,
                                                              checkpoint_dir=str(tmp_path / "ckpt")),
                               model=dataclasses.replace(cfg.model, width=8))


@pytest.mark.timeout(400)
def test_timed_train_stops_once_the_windows_are_complete(tmp_path):
    data = _data()  # 10 steps per epoch, 9 step intervals inside each
    out = timed_train(_cfg(tmp_path), data, 0, 1, lambda: None, warmup=4, steps=5, windows=3, batches=_batches())
    assert len(out["window_s"]) == 3 and all(w > 0 for w in out["window_s"])
    assert out["steps"] == 5 and out["batch_size"] == 8
    assert out["epochs"] <= 3  # 19 intervals needed: stopped in the third epoch, not at max_epochs
    waits = out["data_wait_fraction_per_epoch"]
    assert waits and all(f == 0.0 for f in waits)  # batches from memory: no loader wait
    assert not list(tmp_path.glob("ckpt/*.ckpt"))  # checkpoints went to a temporary folder that is gone


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_plain_reference_loop_per_precision(tmp_path, precision):
    out = _plain(_cfg(tmp_path), _data(), _batches(), precision, warmup=1, steps=3, windows=2)
    assert len(out["window_s"]) == 2 and out["steps"] == 3 and out["batch_size"] == 8
