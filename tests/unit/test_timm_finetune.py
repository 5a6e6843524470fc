"""Fine-tuning controls and the timm/FSDP config keys, on the project's own nets (no timm needed)."""
import sys

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from pipeline.config import ConfigError, ModelConfig, load_config
from pipeline.model.module import ImageClassifier
from pipeline.model.nets import split_parameters


def _loaders(channels=1, size=16, n=32, classes=4):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, channels, size, size, generator=g), torch.randint(0, classes, (n,), generator=g))
    return DataLoader(ds, batch_size=8), DataLoader(ds, batch_size=16)


class _Snapshots(pl.Callback):
    """The backbone's and the head's parameters at the end of every training epoch."""

    def __init__(self):
        self.epochs = []

    def on_train_epoch_end(self, trainer, module):
        backbone, head = split_parameters(module.network)
        self.epochs.append(([p.detach().clone() for p in backbone], [p.detach().clone() for p in head]))


def fit(model_cfg, epochs=2, **kw):
    pl.seed_everything(0, verbose=False)
    model = ImageClassifier.from_config(model_cfg, 1, 4, model_cfg.lr, steps_per_epoch=4, max_epochs=epochs, **kw)
    start = [[p.detach().clone() for p in part] for part in split_parameters(model.network)]
    snaps = _Snapshots()
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[snaps])
    train, val = _loaders()
    trainer.fit(model, train, val)
    return model, start, snaps.epochs, trainer


def _same(a, b):
    assert a and len(a) == len(b), "compare two non-empty snapshots of the same parameters"  # zip would hide it
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_freeze_backbone_trains_the_head_only_and_keeps_norm_statistics():
    model, (backbone0, head0), epochs, _ = fit(ModelConfig(arch="cnn", width=4, lr=0.1, freeze_backbone=True))
    backbone, head = epochs[-1]
    assert _same(backbone0, backbone), "a frozen backbone's parameters changed"
    assert not _same(head0, head), "the head did not train"
    frozen = split_parameters(model.network)[0]
    assert frozen and all(not p.requires_grad for p in frozen)
    bn = model.network.features[0][1]
    assert not bn.training and int(bn.num_batches_tracked) == 0  # frozen BatchNorm: eval mode, statistics kept


def test_unfreeze_at_epoch_thaws_the_backbone_then():
    _, (backbone0, head0), epochs, trainer = fit(
        ModelConfig(arch="cnn", width=4, lr=0.1, freeze_backbone=True, unfreeze_at_epoch=1, backbone_lr=0.05),
        epochs=2)
    assert _same(backbone0, epochs[0][0]), "the backbone changed before model.unfreeze_at_epoch"
    assert not _same(head0, epochs[0][1])
    assert not _same(epochs[0][0], epochs[1][0]), "the backbone did not train after model.unfreeze_at_epoch"
    groups = trainer.optimizers[0].param_groups
    assert [g["name"] for g in groups] == ["backbone", "head"]
    assert groups[0]["initial_lr"] == pytest.approx(0.05) and groups[1]["initial_lr"] == pytest.approx(0.1)


def test_backbone_lr_scales_with_model_lr_and_constant_schedule_keeps_rates():
    cfg = ModelConfig(arch="resnet", width=4, lr=0.1, backbone_lr=0.01, schedule="constant")
    model = ImageClassifier.from_config(cfg, 1, 4, 0.4, steps_per_epoch=2, max_epochs=3)  # 4 ranks, linear
    opt = model.configure_optimizers()
    sched = opt["lr_scheduler"]["scheduler"]
    for _ in range(5):
        opt["optimizer"].step()
        sched.step()
    assert [g["lr"] for g in opt["optimizer"].param_groups] == pytest.approx([0.04, 0.4])


def test_config_keys_for_timm_archs_and_fsdp():
    cfg = load_config("conf/local.yaml", ["model.arch=timm/resnet18", "model.pretrained=/w/resnet18.safetensors",
                                          "model.mean=[0.485, 0.456, 0.406]", "model.freeze_backbone=true",
                                          "train.backend=fsdp", "train.np=-2"])
    assert cfg.model.arch == "timm/resnet18" and cfg.model.mean == [0.485, 0.456, 0.406]
    assert cfg.flat()["model.pretrained"] == "/w/resnet18.safetensors"  # logged as an MLflow param like the rest
    for bad, key in (("model.arch=timm/", "model.arch"), ("model.arch=vgg", "model.arch"),
                     ("model.schedule=step", "model.schedule"), ("model.interpolation=lanczos", "model.interpolation"),
                     ("model.unfreeze_at_epoch=-1", "model.unfreeze_at_epoch")):
        with pytest.raises(ConfigError, match=key):
            load_config("conf/local.yaml", [bad])


def test_a_timm_arch_without_timm_says_what_to_install(monkeypatch):
    from pipeline.model.nets import network_from_config

    monkeypatch.setitem(sys.modules, "timm", None)  # as where timm (or its torchvision) cannot import
    with pytest.raises(ImportError, match=r"config key 'model.arch': timm/<name> needs the timm package"):
        network_from_config(ModelConfig(arch="timm/resnet18"), 3, 10)
    from pipeline.model.timm_backbone import timm_problems

    assert any("model.arch" in p and "setup_vision.sh" in p for p in timm_problems())  # what `lakehouse doctor` says


def test_pretrained_needs_a_timm_arch():
    from pipeline.model.nets import network_from_config

    with pytest.raises(ValueError, match="model.pretrained"):
        network_from_config(ModelConfig(arch="cnn", pretrained="/w/x.pt"), 1, 10)


def test_doctor_says_where_fsdp_cannot_run():
    from pipeline.distributed.backends import MachineFacts, get
    from pipeline.doctor import GpuFacts, backend_problems

    def fsdp_problems(torch, devices, nccl, gloo, np_, backend="fsdp"):
        return get(backend).problems(MachineFacts(torch=torch, device_count=devices, dist_nccl=nccl, gloo=gloo), np_)

    assert fsdp_problems("2.13.0", 0, False, True, -2) == []  # CPU ranks over gloo
    assert fsdp_problems("2.13.0", 0, False, True, -2, backend="ddp") == []
    assert any("no NCCL" in p for p in fsdp_problems("2.13.0", 2, False, True, -2))
    assert any("no gloo" in p for p in fsdp_problems("2.13.0", 0, False, False, -2))
    assert any("shards nothing" in p for p in fsdp_problems("2.13.0", 0, False, True, 1))
    assert any("fsdp" in p for p in backend_problems(GpuFacts(torch="2.13.0"), None, "fsdp", 1))
