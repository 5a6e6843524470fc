"""The LightningModule: loss, accuracy, optimizer and the learning-rate schedule around an injected network."""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Dict, List, Optional

import pytorch_lightning as pl
import torch
from torch import nn

from pipeline.config import ModelConfig
from pipeline.data.crops import VAL_CROP
from pipeline.data.plan import scaled_lr  # noqa: F401  (the rate is the plan's: pipeline/data/plan.py)
from pipeline.data.transforms import PIXEL_MEAN, PIXEL_STD
from pipeline.log import get_logger
from pipeline.model.nets import network_from_config, split_parameters

log = get_logger(__name__)


# Lightning's notes on what this module does on purpose: the batch hooks are the model's (the data module has none),
# and the summary's size estimate under mixed precision is only an estimate.
warnings.filterwarnings("ignore", message="You have overridden `on_after_batch_transfer`")
warnings.filterwarnings("ignore", message="You have overridden `transfer_batch_to_device`")
warnings.filterwarnings("ignore", message="Precision .* is not supported by the model summary")
# a frozen backbone's normalisation layers are in eval mode on purpose (model.freeze_backbone)
warnings.filterwarnings("ignore", message="Found .* module\\(s\\) in eval mode at the start of training")


def normalize_pixels(x: torch.Tensor) -> torch.Tensor:
    """uint8 pixels (N, C, H, W) -> normalised float32 on their own device; the loader's formula
    (pipeline.data.batches.PixelsToTensor.normalize), so both paths give the same values."""
    return x.to(torch.float32).mul_(1.0 / (255.0 * PIXEL_STD)).sub_(PIXEL_MEAN / PIXEL_STD)


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; training stops and nothing is registered."""


class ImageClassifier(pl.LightningModule):
    """Cross-entropy classification over any network mapping (N, C, H, W) to class logits."""

    # Lightning calls these hooks in every training step, each through its profiler with the module's
    # `_current_fx_name` set and restored; here they do nothing, so they are None, which Lightning skips
    # (`callable(fn)` in pytorch_lightning/trainer/call.py). configure_gradient_clipping: train() builds its Trainer
    # without gradient clipping. A subclass that needs one defines it as usual.
    on_train_batch_start = on_train_batch_end = None
    on_before_backward = on_after_backward = on_before_optimizer_step = on_before_zero_grad = None
    configure_gradient_clipping = None

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets `_current_fx_name` (a plain string) twice per hook call; nn.Module.__setattr__ looks it up
        # among parameters, buffers and submodules first (~1 us each, ~30 times a step)
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __init__(self, network: nn.Module, num_classes: int, model_cfg: ModelConfig, lr: float,
                 warmup_epochs: int = 0, steps_per_epoch: int = 1, max_epochs: int = 1,
                 channels_last: bool = False) -> None:
        super().__init__()
        # Only plain values in hparams, so checkpoints load with torch's weights_only=True. What trains the model is
        # all here; fault injection for tests (the config's debug: section) is a callback, never a hyperparameter.
        self.model_cfg = model_cfg
        self.save_hyperparameters(ignore=["network", "model_cfg"])
        self.hparams["model"] = dataclasses.asdict(model_cfg)
        # data.channels_last: the network's weights in the batches' NHWC order too (the ImageNet recipe on a GPU: the
        # convolutions then run without a layout change each way), before any strategy wraps it or moves it
        self.network = network.to(memory_format=torch.channels_last) if channels_last else network
        self._apply_freeze()  # before any strategy wraps the network: DDP/FSDP see which parameters take gradients
        self.loss_fn = nn.CrossEntropyLoss()
        self._epoch_sums: Dict[str, list] = {}  # "train" | "val" -> [loss sum, correct (device), rows (host)]
        self.last_confusion: Optional[torch.Tensor] = None  # rows = true class, columns = predicted

    @classmethod
    def from_config(cls, model_cfg: ModelConfig, channels: int, num_classes: int, lr: float, **kw: Any):
        net = network_from_config(model_cfg, channels, num_classes)
        model = cls(net, num_classes, model_cfg, lr, **kw)
        model.hparams["channels"] = channels  # with hparams' model (arch, width): what rebuilds it from a checkpoint
        return model

    # ------------------------------------------------------------------ fine-tuning: frozen backbone, two rates
    def backbone_frozen(self, epoch: Optional[int] = None) -> bool:
        """model.freeze_backbone, until model.unfreeze_at_epoch (if set) is reached."""
        cfg = self.model_cfg
        if not cfg.freeze_backbone:
            return False
        if epoch is None:
            epoch = self.current_epoch if self._trainer is not None else 0
        return cfg.unfreeze_at_epoch is None or epoch < cfg.unfreeze_at_epoch

    def _apply_freeze(self) -> None:
        """A backbone frozen for good takes no gradients (nothing computed for it); one that thaws later keeps them
        (every rank's DDP/Horovod/FSDP hooks then stay the same) and its rate is 0 until the epoch it thaws.
        Frozen or not, its normalisation layers keep their statistics while frozen (eval mode)."""
        if not self.model_cfg.freeze_backbone:  # nothing to do (and any network, with a head or not, trains)
            return
        frozen = self.backbone_frozen()
        backbone, _ = split_parameters(self.network)
        if self.model_cfg.unfreeze_at_epoch is None:
            for p in backbone:
                p.requires_grad_(False)
        if frozen and self.training:
            head = {id(m) for m in _head_of(self.network).modules()}
            for m in self.network.modules():
                if id(m) not in head and isinstance(m, nn.modules.batchnorm._NormBase):
                    m.eval()

    def train(self, mode: bool = True):
        out = super().train(mode)
        if mode and getattr(self, "model_cfg", None) is not None:
            self._apply_freeze()
        return out

    def on_train_epoch_start(self) -> None:
        self.train(True)  # the frozen backbone's norm layers back to eval, or thawed at model.unfreeze_at_epoch

    def compile_network(self) -> None:
        """train.compile: the network's forward compiled by torch.compile, in place (nn.Module.compile: the same
        module, parameters and state-dict keys, so checkpoints and logged models are the plain network's), before any
        strategy wraps the model, as PyTorch advises for DDP and FSDP. The first steps compile it."""
        self.network.compile()

    @property
    def network_compiled(self) -> bool:
        return getattr(self.network, "_compiled_call_impl", None) is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """An (x, y) pair of tensors goes to `device` directly (already there: as it is), as Lightning's
        move_data_to_device would move it (non-blocking but to a CPU or MPS device), without its walk over the
        collection in every step; any other batch goes Lightning's way."""
        if type(batch) is tuple and len(batch) == 2 and all(type(t) is torch.Tensor for t in batch):
            x, y = batch
            if x.device == device and y.device == device:
                return batch
            blocking = device.type in ("cpu", "mps")
            return x.to(device, non_blocking=not blocking), y.to(device, non_blocking=not blocking)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """A uint8 (N, C, H, W) batch becomes normalised float32 here, on the model's device (4x fewer bytes copied
        than float32); a float batch (normalised by the loader) passes unchanged."""
        if not isinstance(batch, (tuple, list)) or not batch:
            return batch
        x, *rest = batch
        if not (isinstance(x, torch.Tensor) and x.dtype == torch.uint8):
            return batch
        return (normalize_pixels(x), *rest) if isinstance(batch, tuple) else [normalize_pixels(x), *rest]

    def _sums(self, prefix: str) -> torch.Tensor:
        """[loss sum, correct, rows] of this rank so far, float64 on the model's device: the device accumulators and
        the host's row count put together (the epoch end's reduction takes it; no host read)."""
        acc = self._epoch_sums.get(prefix)
        if acc is None:
            return torch.zeros(3, dtype=torch.float64, device=self.device)
        loss_sum, correct, rows = acc
        return torch.stack([loss_sum, correct, torch.tensor(float(rows), dtype=torch.float64, device=loss_sum.device)])

    def _reset_sums(self, prefix: str) -> None:
        self._epoch_sums.pop(prefix, None)

    def _accumulate(self, prefix: str, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        # Two in-place adds on the model's device (float64 loss sum and correct count) and the rows counted on the
        # host (a batch's length is host metadata): no host-device sync, and as few ops as possible, since each op
        # costs the host microseconds in every step. Reduced over all ranks once per epoch (_log_epoch).
        acc = self._epoch_sums.get(prefix)
        if acc is None or acc[0].device != loss.device:
            acc = self._epoch_sums[prefix] = [torch.zeros((), dtype=torch.float64, device=loss.device),
                                              torch.zeros((), dtype=torch.float64, device=loss.device), 0]
        n = len(y)
        acc[0].add_(loss.detach(), alpha=n)
        acc[1].add_((logits.detach().argmax(1) == y).sum())
        acc[2] += n

    def _log_epoch(self, prefix: str) -> None:
        """Exact epoch metrics over every rank's rows: one sum-reduction through the strategy (Horovod or DDP)."""
        sums = self._sums(prefix)
        total = self.trainer.strategy.reduce(sums.clone(), reduce_op="sum").cpu()  # the epoch's one read
        rows = max(1.0, float(total[2]))
        self.log(f"{prefix}_loss", float(total[0]) / rows, on_epoch=True, sync_dist=False, rank_zero_only=False)
        self.log(f"{prefix}_acc", float(total[1]) / rows, on_epoch=True, sync_dist=False, rank_zero_only=False)
        self._reset_sums(prefix)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.loss_fn(logits, y)
        self._accumulate("train", loss, logits, y)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)  # also for an empty batch (a rank with fewer rows): a sharded model gathers in forward
        if len(y) == 0:
            return
        loss = self.loss_fn(logits, y)
        self._accumulate("val", loss, logits, y)
        n = self.hparams.num_classes
        cm = getattr(self, "_confusion", None)
        if cm is None or cm.device != logits.device:
            cm = self._confusion = torch.zeros(n * n, dtype=torch.float64, device=logits.device)
        # scatter_add_, not bincount: CUDA's bincount reads the input's max on the host (a sync per call)
        cm.scatter_add_(0, y * n + logits.detach().argmax(1), torch.ones(len(y), dtype=cm.dtype, device=cm.device))

    def on_validation_epoch_start(self) -> None:
        self.take_rank_zero_norm_stats()

    def take_rank_zero_norm_stats(self) -> None:
        """Every rank's BatchNorm running statistics set to rank 0's (one sum-reduction through the strategy, the other
        ranks contributing zeros: an exact copy), before validation. Each rank updated its own from its own batches
        (Horovod averages gradients, not buffers; DDP broadcasts them only at a training forward's start), so each
        rank validated its rows with other statistics than the network rank 0 registers: a run reported val_acc 140 of
        318 rows where its registered version scored 137 on the same rows in the gate. Rank 0's, not their mean, so
        that rank 0's network, whose checkpoint every rank resumes from, is what the other ranks never change."""
        trainer = self.trainer
        if trainer.world_size <= 1:
            return
        buffers = [b for m in self.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                   for b in (m.running_mean, m.running_var) if b is not None]
        if not buffers:
            return
        flat = torch.cat([b.detach().reshape(-1).to(torch.float64) for b in buffers])
        if trainer.global_rank != 0:
            flat.zero_()
        flat = trainer.strategy.reduce(flat, reduce_op="sum")
        offset = 0
        with torch.no_grad():
            for b in buffers:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()

    def on_validation_epoch_end(self) -> None:
        # Validation runs at the end of each training epoch, so the epoch's training sums are complete
        # here, and callbacks see both in `callback_metrics` at on_train_epoch_end.
        self._log_epoch("train")
        self._log_epoch("val")
        n = self.hparams.num_classes
        cm = getattr(self, "_confusion", None)
        cm = torch.zeros(n * n, dtype=torch.float64, device=self.device) if cm is None else cm
        # stays on the device (read by rank 0's tracker with .cpu() after training)
        self.last_confusion = self.trainer.strategy.reduce(cm.clone(), reduce_op="sum").round().long().reshape(n, n)
        self._confusion = None

    def param_groups(self) -> List[Dict[str, Any]]:
        """Two groups, backbone then head: the head at the scaled model.lr, the backbone at model.backbone_lr scaled
        the same way (null: model.lr); one group when they are equal and nothing is frozen."""
        cfg: ModelConfig = self.model_cfg
        lr = self.hparams.lr
        backbone_lr = lr if cfg.backbone_lr is None else lr * cfg.backbone_lr / cfg.lr
        if backbone_lr == lr and not cfg.freeze_backbone:
            return [{"params": list(self.parameters()), "lr": lr, "name": "all"}]
        backbone, head = split_parameters(self.network)
        known = {id(p) for p in backbone + head}
        head = head + [p for p in self.parameters() if id(p) not in known]
        return [{"params": backbone, "lr": backbone_lr, "name": "backbone"}, {"params": head, "lr": lr, "name": "head"}]

    def configure_optimizers(self) -> Dict[str, Any]:
        cfg: ModelConfig = self.model_cfg
        groups = self.param_groups()
        if cfg.optimizer == "sgd":
            opt = torch.optim.SGD(groups, lr=self.hparams.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        elif cfg.optimizer == "adam":
            opt = torch.optim.Adam(groups, lr=self.hparams.lr, weight_decay=cfg.weight_decay)
        else:
            raise ValueError(f"config key 'model.optimizer': {cfg.optimizer!r} is not sgd or adam")
        warmup_steps = self.hparams.warmup_epochs * self.hparams.steps_per_epoch
        total_steps = max(1, self.hparams.max_epochs * self.hparams.steps_per_epoch)

        steps_per_epoch = max(1, self.hparams.steps_per_epoch)

        def factor(step: int) -> float:
            # model.schedule=warmup_cosine: linear warm-up from 1/10 of the scaled rate, then cosine decay to 1/20
            if cfg.schedule == "constant":
                return 1.0
            if warmup_steps and step < warmup_steps:
                return 0.1 + 0.9 * step / warmup_steps
            progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
            return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

        def backbone_factor(step: int) -> float:  # 0 while the backbone is frozen (until model.unfreeze_at_epoch)
            return 0.0 if self.backbone_frozen(step // steps_per_epoch) else factor(step)

        factors = [backbone_factor if g.get("name") == "backbone" else factor for g in groups]
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factors)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _head_of(network: nn.Module) -> nn.Module:
    from pipeline.model.nets import head_module

    return head_module(network)


def network_meta(model_cfg: ModelConfig, channels: int, image_size: int, class_names: List[str],
                 network: Optional[nn.Module] = None, center_crop: bool = False) -> Dict[str, Any]:
    """What a served model needs to rebuild the network and its input transform. `center_crop`: the ranks decoded
    the rows (data.decode=cpu|gpu|auto), so validation saw the central VAL_CROP of each image, resized; the served
    model, the gate and the preprocessing contract then take the same crop (`center_crop`: that share)."""
    meta = {"arch": model_cfg.arch, "width": model_cfg.width, "channels": channels, "image_size": image_size,
            "class_names": list(class_names)}
    if center_crop:
        meta["center_crop"] = VAL_CROP
    if network is not None and hasattr(network, "transform"):  # a timm backbone: the input transform it applies
        meta["input_transform"] = network.transform  # (also in its state dict: informative, not needed to rebuild)
        meta["pretrained"] = model_cfg.pretrained  # where its starting weights came from (not read at load time)
    return meta

