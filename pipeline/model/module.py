"""The LightningModule: loss, accuracy, optimizer and the learning-rate schedule around an injected network."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import pytorch_lightning as pl
import torch
import torchmetrics
from torch import nn

from pipeline.config import ModelConfig
from pipeline.model.nets import build_network


def scaled_lr(base_lr: float, world_size: int, rule: str) -> float:
    """Learning rate for `world_size` ranks: linear (× size), sqrt (× √size) or none."""
    if rule == "linear":
        return base_lr * world_size
    if rule == "sqrt":
        return base_lr * math.sqrt(world_size)
    if rule == "none":
        return base_lr
    raise ValueError(f"config key 'train.lr_scaling': {rule!r} is not linear, sqrt or none")


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; training stops and nothing is registered."""


class ImageClassifier(pl.LightningModule):
    """Cross-entropy classification over any network mapping (N, C, H, W) to class logits."""

    def __init__(self, network: nn.Module, num_classes: int, model_cfg: ModelConfig, lr: float,
                 warmup_epochs: int = 0, steps_per_epoch: int = 1, max_epochs: int = 1,
                 nan_at_step: Optional[int] = None, fail_at_step: Optional[int] = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["network"])
        self.network = network
        self.loss_fn = nn.CrossEntropyLoss()
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.val_confusion = torchmetrics.ConfusionMatrix(task="multiclass", num_classes=num_classes)
        self.last_confusion: Optional[torch.Tensor] = None

    @classmethod
    def from_config(cls, model_cfg: ModelConfig, channels: int, num_classes: int, lr: float, **kw: Any):
        net = build_network(model_cfg.arch, channels, num_classes, model_cfg.width)
        return cls(net, num_classes, model_cfg, lr, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.loss_fn(logits, y)
        hp = self.hparams
        if hp.fail_at_step is not None and self.global_step >= hp.fail_at_step:
            raise RuntimeError(f"injected failure at step {self.global_step} (train.fail_at_step)")
        if hp.nan_at_step is not None and self.global_step >= hp.nan_at_step:
            loss = loss * float("nan")
        self.train_acc(logits.detach(), y)
        self.log("train_loss", loss.detach(), on_step=False, on_epoch=True, sync_dist=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        loss = self.loss_fn(logits, y)
        self.val_acc(logits, y)
        self.val_confusion(logits, y)
        # Weighted by batch size so a short last batch counts for what it holds.
        self.log("val_loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=len(y))
        self.log("val_acc", self.val_acc, on_step=False, on_epoch=True)

    def on_validation_epoch_end(self) -> None:
        self.last_confusion = self.val_confusion.compute().cpu()
        self.val_confusion.reset()

    def configure_optimizers(self) -> Dict[str, Any]:
        cfg: ModelConfig = self.hparams.model_cfg
        if cfg.optimizer == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=cfg.momentum,
                                  weight_decay=cfg.weight_decay)
        elif cfg.optimizer == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=cfg.weight_decay)
        else:
            raise ValueError(f"config key 'model.optimizer': {cfg.optimizer!r} is not sgd or adam")
        warmup_steps = self.hparams.warmup_epochs * self.hparams.steps_per_epoch
        total_steps = max(1, self.hparams.max_epochs * self.hparams.steps_per_epoch)

        def factor(step: int) -> float:
            # Linear warm-up from 1/10 of the scaled rate, then cosine decay to 1/20 of it.
            if warmup_steps and step < warmup_steps:
                return 0.1 + 0.9 * step / warmup_steps
            progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
            return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def network_meta(model_cfg: ModelConfig, channels: int, image_size: int, class_names: List[str]) -> Dict[str, Any]:
    """What a served model needs to rebuild the network and its input transform."""
    return {"arch": model_cfg.arch, "width": model_cfg.width, "channels": channels, "image_size": image_size,
            "class_names": list(class_names)}
