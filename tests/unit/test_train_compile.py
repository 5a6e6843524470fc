"""train.compile=true: the product's train() compiles the network with torch.compile (inductor, a C compiler on this
CPU) before the strategy wraps it; the state dict keeps the plain network's keys; off by default."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from bench.lightning_path import timed_train
from pipeline.config import Config, ModelConfig
from pipeline.lakehouse.partition import ShardPlan, plan_split
from pipeline.model.module import ImageClassifier


def _run(tmp_path, monkeypatch, compile_: bool):
    seen = []
    original = ImageClassifier.compile_network

    def recording(self):
        seen.append(self)
        original(self)

    monkeypatch.setattr(ImageClassifier, "compile_network", recording)
    plan = ShardPlan(train=plan_split("train", [48], 1, 8), val=plan_split("val", [16], 1, 8))  # 6 steps an epoch
    data = SimpleNamespace(plan=plan, channels=1, image_size=16, class_names=["a", "b", "c"])
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 1, 16, 16, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    cfg = Config()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, threads_per_rank=1, compile=compile_,
                                                              checkpoint_dir=str(tmp_path / "ckpt")),
                              model=dataclasses.replace(cfg.model, width=8))
    out = timed_train(cfg, data, 0, 1, lambda: None, warmup=2, steps=3, windows=1, batches=batches)
    return out, seen


def test_compile_is_off_by_default():
    assert Config().train.compile is False


@pytest.mark.timeout(900)  # inductor's first compilation on a 2-core CPU: about a minute (cached afterwards)
def test_train_compile_compiles_the_network_before_training(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    out, seen = _run(tmp_path, monkeypatch, True)
    assert len(seen) == 1 and seen[0].network_compiled
    assert counters["stats"]["unique_graphs"] >= 1 and counters["stats"]["calls_captured"] > 0  # dynamo traced it
    assert out["warmup_s"] > 0 and len(out["window_s"]) == 1
    plain = ImageClassifier.from_config(ModelConfig(arch="cnn", width=8), 1, 3, 0.01)
    assert list(seen[0].state_dict()) == list(plain.state_dict())  # checkpoints and logged models: the same keys


def test_train_without_compile_leaves_the_network_eager(tmp_path, monkeypatch):
    _, seen = _run(tmp_path, monkeypatch, False)
    assert seen == []
