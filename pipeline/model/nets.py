"""Plain nn.Module image classifiers, chosen by `model.arch`; no training logic here."""
from __future__ import annotations

from typing import Any, List, Tuple

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Three conv blocks and a linear head; fits 32x32 digits in a few epochs, any square size works."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 32) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                                 nn.MaxPool2d(2))

        self.features = nn.Sequential(block(in_channels, width), block(width, width * 2), block(width * 2, width * 4))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2),
                                  nn.Linear(width * 4, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """A ResNet-10-style network (four stages of one basic block) for larger images."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        stages, cin = [], width
        for i, mult in enumerate((1, 2, 4, 8)):
            stages.append(_BasicBlock(cin, width * mult, stride=1 if i == 0 else 2))
            cin = width * mult
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


ARCHS = {"cnn": SmallCNN, "resnet": SmallResNet}


def build_network(arch: str, in_channels: int, num_classes: int, width: int = 32) -> nn.Module:
    """Make the network named by `model.arch` (a timm/<name> one with its input transform at its defaults: loading a
    state dict of the trained network restores it, so this also rebuilds a served model offline)."""
    from pipeline.model.timm_backbone import build_timm_network, is_timm_arch

    if is_timm_arch(arch):
        return build_timm_network(arch, in_channels, num_classes)
    if arch not in ARCHS:
        raise ValueError(f"config key 'model.arch': {arch!r} is not one of {', '.join(ARCHS)} or timm/<name>")
    return ARCHS[arch](in_channels, num_classes, width)


def network_from_config(model_cfg: Any, in_channels: int, num_classes: int) -> nn.Module:
    """The network for training: `model.arch`, with `model.pretrained` weights and the input transform settings."""
    from pipeline.model.timm_backbone import build_timm_network, is_timm_arch

    if is_timm_arch(model_cfg.arch):
        return build_timm_network(model_cfg.arch, in_channels, num_classes, pretrained=model_cfg.pretrained,
                                  input_size=model_cfg.input_size, mean=model_cfg.mean, std=model_cfg.std,
                                  interpolation=model_cfg.interpolation)
    if model_cfg.pretrained:
        raise ValueError(f"config key 'model.pretrained': loading weights needs model.arch timm/<name>, "
                         f"not {model_cfg.arch!r}")
    return build_network(model_cfg.arch, in_channels, num_classes, model_cfg.width)


def head_module(network: nn.Module) -> nn.Module:
    """The classifier head: timm's get_classifier() (several heads as one ModuleList: TimmClassifier.head_module), the
    project nets' `head`."""
    if hasattr(network, "head_module"):
        return network.head_module()
    head = getattr(network, "head", None)
    if not isinstance(head, nn.Module):
        raise ValueError(f"{type(network).__name__} has no classifier head to tell from its backbone")
    return head


def split_parameters(network: nn.Module) -> Tuple[List[nn.Parameter], List[nn.Parameter]]:
    """(backbone parameters, head parameters) of a network, each in the network's order."""
    head_ids = {id(p) for p in head_module(network).parameters()}
    params = list(network.parameters())
    return [p for p in params if id(p) not in head_ids], [p for p in params if id(p) in head_ids]
