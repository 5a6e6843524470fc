"""timm backbones (`model.arch: timm/<name>`) with local pretrained weights: the vision tier (.venv-vision, where timm
and a torchvision matching torch import; `scripts/setup_vision.sh`)."""
import json
import os

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from pipeline.config import ModelConfig

try:
    import timm  # imports torchvision, which must be built for this torch
except Exception as exc:  # ImportError, or torchvision's RuntimeError beside a torch it was not built for
    timm = None
    WHY = f"timm/torchvision not importable beside torch {torch.__version__} ({type(exc).__name__}); " \
          f"run in .venv-vision (scripts/setup_vision.sh)"

pytestmark = [pytest.mark.vision,
              pytest.mark.skipif(timm is None, reason=WHY if timm is None else "")]

ARCH = "timm/test_resnet"  # timm's own tiny test ResNet (0.37 M parameters)


def _tiny(num_classes=10, in_chans=1, seed=1):
    torch.manual_seed(seed)
    return timm.create_model("test_resnet", pretrained=False, num_classes=num_classes, in_chans=in_chans)


def _net(pretrained=None, channels=1, classes=10, **kw):
    from pipeline.model.nets import network_from_config

    return network_from_config(ModelConfig(arch=ARCH, pretrained=pretrained, **kw), channels, classes)


def _assert_loaded(net, state):
    own = net.model.state_dict()
    assert set(own) == set(state)
    for key, tensor in state.items():
        assert torch.equal(own[key], tensor), key


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "lightning"])
def test_pretrained_file_loads_exactly_the_saved_tensors(tmp_path, fmt):
    from safetensors.torch import save_file

    state = {k: v.clone() for k, v in _tiny().state_dict().items()}
    path = tmp_path / f"w.{'safetensors' if fmt == 'safetensors' else 'pt'}"
    if fmt == "safetensors":
        save_file(state, str(path))
    elif fmt == "pt":
        torch.save(state, path)
    else:  # a Lightning checkpoint of this project: state_dict with network.model.* keys
        torch.save({"state_dict": {f"network.model.{k}": v for k, v in state.items()}, "epoch": 3}, path)
    net = _net(str(path))
    assert type(net).__name__ == "TimmClassifier"
    _assert_loaded(net, state)


def test_hugging_face_cache_folder_and_its_pretrained_cfg(tmp_path):
    from safetensors.torch import save_file

    state = _tiny().state_dict()
    repo = tmp_path / "models--timm--test_resnet.r160_in1k"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    save_file({k: v.contiguous() for k, v in state.items()}, str(snap / "model.safetensors"))
    (snap / "config.json").write_text(json.dumps({"architecture": "test_resnet", "pretrained_cfg": {
        "input_size": [3, 40, 40], "mean": [0.4, 0.5, 0.6], "std": [0.2, 0.2, 0.2], "interpolation": "bicubic"}}))
    net = _net(str(repo))
    _assert_loaded(net, state)
    t = net.transform
    # the pretrained config's transform, the 3-channel statistics averaged for 1 grey channel
    assert t["input_size"] == 40 and t["interpolation"] == "bicubic"
    assert t["mean"] == pytest.approx([0.5]) and t["std"] == pytest.approx([0.2])
    assert net(torch.zeros(2, 1, 16, 16)).shape == (2, 10)  # resized 16 -> 40 on the device
    # model.* overrides win
    over = _net(str(repo), input_size=24, mean=[0.1], std=[0.3], interpolation="bilinear").transform
    assert over["input_size"] == 24 and over["mean"] == pytest.approx([0.1]) and over["interpolation"] == "bilinear"


def test_mismatched_file_names_the_file_and_the_first_mismatched_tensor(tmp_path):
    from pipeline.model.timm_backbone import PretrainedWeightsError

    state = _tiny().state_dict()
    key = "layer1.0.conv1.weight"
    state[key] = state[key][:, :-1].clone()
    path = tmp_path / "bad.pt"
    torch.save(state, path)
    with pytest.raises(PretrainedWeightsError, match=rf"{path}.*first: {key} has shape"):
        _net(str(path))
    other = tmp_path / "vit.pt"  # another architecture altogether
    torch.save(timm.create_model("test_vit", num_classes=10, in_chans=1).state_dict(), other)
    with pytest.raises(PretrainedWeightsError, match=rf"{other}.*first: conv1\.0\.weight is missing"):
        _net(str(other))
    with pytest.raises(PretrainedWeightsError, match=f"{tmp_path / 'absent.pt'} does not exist"):
        _net(str(tmp_path / "absent.pt"))


def test_head_reinitialised_and_stem_adapted_when_classes_and_channels_differ(tmp_path):
    src = _tiny(num_classes=1000, in_chans=3)
    torch.save(src.state_dict(), tmp_path / "in1k.pt")
    torch.manual_seed(7)
    net = _net(str(tmp_path / "in1k.pt"), channels=1, classes=10)
    own, theirs = net.model.state_dict(), src.state_dict()
    assert own["fc.weight"].shape == (10, 96)  # fresh head of the table's class count
    torch.manual_seed(7)
    fresh = _net(None, channels=1, classes=10).model  # what the same network built without weights starts from
    assert torch.equal(own["fc.weight"], fresh.state_dict()["fc.weight"])
    assert not torch.equal(own["layer1.0.conv1.weight"], fresh.state_dict()["layer1.0.conv1.weight"])
    torch.testing.assert_close(own["conv1.0.weight"], theirs["conv1.0.weight"].sum(1, keepdim=True))  # timm's rule
    for key in theirs:
        if key not in ("fc.weight", "fc.bias", "conv1.0.weight"):
            assert torch.equal(own[key], theirs[key]), key


def _fit(model, epochs=1):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(24, 1, 16, 16, generator=g), torch.randint(0, 10, (24,), generator=g))
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(ds, batch_size=8), DataLoader(ds, batch_size=12))
    return ds, trainer


def test_frozen_timm_backbone_keeps_the_pretrained_weights_and_the_rebuild_predicts_the_same(tmp_path):
    from pipeline.distributed.checkpoints.record import classifier_from_checkpoint
    from pipeline.model.module import ImageClassifier
    from pipeline.model.nets import build_network
    from pipeline.model.timm_backbone import save_pretrained

    torch.save(_tiny().state_dict(), tmp_path / "w.pt")
    cfg = ModelConfig(arch=ARCH, pretrained=str(tmp_path / "w.pt"), freeze_backbone=True, lr=0.05, input_size=24,
                      mean=[0.45], std=[0.25])
    model = ImageClassifier.from_config(cfg, 1, 10, cfg.lr, steps_per_epoch=3, max_epochs=2)
    before = {k: v.clone() for k, v in model.network.model.state_dict().items()}
    ds, trainer = _fit(model, epochs=2)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    after = model.network.model.state_dict()
    for key, value in before.items():
        if key.startswith("fc."):
            assert not torch.equal(after[key], value), f"head {key} did not train"
        else:
            assert torch.equal(after[key], value), f"frozen backbone {key} changed"  # BN statistics too

    # what the served model does: rebuild from arch/channels/classes alone, load the state dict (no pretrained file)
    os.remove(tmp_path / "w.pt")
    model.eval()
    rebuilt = build_network(ARCH, 1, 10)
    rebuilt.load_state_dict({k: v.cpu() for k, v in model.network.state_dict().items()})
    rebuilt.eval()
    x = ds.tensors[0]
    assert rebuilt.transform == model.network.transform and rebuilt.transform["input_size"] == 24
    torch.testing.assert_close(rebuilt(x), model.network(x), rtol=0, atol=0)
    # the checkpoint alone rebuilds it too (arch, classes, channels in its hyperparameters)
    from_ckpt = classifier_from_checkpoint(str(tmp_path / "c.ckpt"))
    torch.testing.assert_close(from_ckpt(x), model(x), rtol=0, atol=0)
    # and the saved network is itself a model.pretrained file carrying its input transform
    path = save_pretrained(model.network, str(tmp_path / "tuned.safetensors"))
    again = _net(path)
    assert again.transform == model.network.transform
    again.eval()
    torch.testing.assert_close(again(x), model.network(x), rtol=0, atol=0)


def test_project_pretrained_file_keeps_the_table_size_not_timms_default(tmp_path):
    """A backbone the project pretrained at its table's size (no resize) is fine-tuned at that size too, not at
    the 160 px of timm's default config for the arch."""
    from pipeline.model.timm_backbone import save_pretrained

    path = save_pretrained(_net(None), str(tmp_path / "own.safetensors"))
    t = _net(path).transform
    assert t["input_size"] == 0 and t["mean"] == pytest.approx([0.5]) and t["std"] == pytest.approx([0.5])
    assert _net(path, input_size=32).transform["input_size"] == 32


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_a_file_without_batchnorm_counters_loads_as_torchs_strict_load_does(tmp_path, fmt):
    """num_batches_tracked is a BatchNorm counter many published files leave out; torch's strict load fills it in."""
    from safetensors.torch import save_file

    state = {k: v.clone() for k, v in _tiny().state_dict().items() if not k.endswith("num_batches_tracked")}
    assert len(state) < len(_tiny().state_dict())  # the tiny ResNet has BatchNorm layers
    _tiny().load_state_dict(state, strict=True)  # what torch accepts
    path = tmp_path / f"w.{fmt}"
    if fmt == "safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, path)
    net = _net(str(path))
    own = net.model.state_dict()
    for key, tensor in state.items():
        assert torch.equal(own[key], tensor), key
    assert all(int(v) == 0 for k, v in own.items() if k.endswith("num_batches_tracked"))
    del state["layer1.0.bn1.running_mean"]  # any other missing tensor is still refused
    torch.save(state, tmp_path / "short.pt")
    from pipeline.model.timm_backbone import PretrainedWeightsError

    with pytest.raises(PretrainedWeightsError, match=r"first: layer1\.0\.bn1\.running_mean is missing"):
        _net(str(tmp_path / "short.pt"))


def test_a_distilled_deit_with_two_heads_freezes_its_backbone_and_takes_two_rates():
    """A distilled DeiT's get_classifier() is (head, head_dist): both are the head for freeze_backbone/backbone_lr."""
    from pipeline.model.module import ImageClassifier
    from pipeline.model.nets import split_parameters

    cfg = ModelConfig(arch="timm/deit_tiny_distilled_patch16_224", freeze_backbone=True, backbone_lr=0.01, lr=0.1)
    model = ImageClassifier.from_config(cfg, 3, 4, cfg.lr, steps_per_epoch=2, max_epochs=1)
    inner = model.network.model
    assert isinstance(inner.get_classifier(), tuple)
    backbone, head = split_parameters(model.network)
    heads = [inner.head.weight, inner.head.bias, inner.head_dist.weight, inner.head_dist.bias]
    assert [id(p) for p in head] == [id(p) for p in heads]
    assert len(backbone) + len(head) == len(list(model.network.parameters()))
    model.train()
    assert all(not p.requires_grad for p in backbone) and all(p.requires_grad for p in head)
    groups = model.configure_optimizers()["optimizer"].param_groups
    assert [g["name"] for g in groups] == ["backbone", "head"]
    assert [len(g["params"]) for g in groups] == [len(backbone), 4]
