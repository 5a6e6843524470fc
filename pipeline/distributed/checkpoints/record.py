"""What a checkpoint records besides its weights, and what is rebuilt from that: the Delta table and version it was
trained on (`lakehouse`, checked on resume), how it was trained (`trained_with`: per-rank batch, world size, steps per
epoch, global step, learning rate; an OOM back-off or an elastic relaunch restates a checkpoint from it, restate.py),
the random-number states (`RngCheckpoint`), and the network its hyperparameters describe (`plain_classifier`, the one
rebuild of a classifier from a checkpoint: offline, and on rank 0 after FSDP)."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional

import pytorch_lightning as pl
import torch

from pipeline.config import ModelConfig
from pipeline.distributed.checkpoints.io import CheckpointError, checkpoint_meta, consolidated_state
from pipeline.log import get_logger
from pipeline.model.module import ImageClassifier
from pipeline.model.nets import build_network

log = get_logger(__name__)

LINEAGE = "lakehouse"  # checkpoint key: the Delta table and version trained on
TRAINED_WITH = "trained_with"  # checkpoint key: batch_size (per rank), world_size, steps_per_epoch, global_step, lr


class CheckpointLineageError(CheckpointError):
    """A checkpoint was trained on another Delta table or version than this job."""


class CheckpointRecord(pl.Callback):
    """Stores in every checkpoint the Delta table and version (`lakehouse`, checked on resume) and how the weights
    were trained (`trained_with`: per-rank batch, world size, steps per epoch, global step, learning rate), which a
    restart after an OOM back-off restates from."""

    def __init__(self, lineage: Dict[str, Any], batch_size: int, world_size: int, steps_per_epoch: int,
                 lr: float) -> None:
        self.lineage = dict(lineage)
        self.trained = {"batch_size": int(batch_size), "world_size": int(world_size),
                        "steps_per_epoch": int(steps_per_epoch), "lr": float(lr)}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        checkpoint[LINEAGE] = dict(self.lineage)
        checkpoint[TRAINED_WITH] = {**self.trained, "global_step": int(trainer.global_step)}


def _record(path: str, checkpoint: Dict[str, Any], key: str) -> Optional[Dict[str, Any]]:
    """Checkpoint `path`'s record `key` (`lakehouse`, `trained_with`): a dict, or None when it has none.

    Raises:
        CheckpointError: the entry is there but not a dict (a garbled or foreign checkpoint), naming the file.
    """
    record = checkpoint.get(key)
    if record is not None and not isinstance(record, dict):
        raise CheckpointError(f"checkpoint {path} records '{key}' as a {type(record).__name__}, not a dict; refused")
    return record


def recorded_training(path: str) -> Optional[Dict[str, Any]]:
    """What checkpoint `path` records of how it was trained (`CheckpointRecord`); None when it records nothing
    (written before checkpoints recorded it)."""
    record = _record(path, checkpoint_meta(path), TRAINED_WITH)
    return record if record is not None and "batch_size" in record else None


def trained_with(path: str) -> Dict[str, Any]:
    """What checkpoint `path` records of how it was trained (`CheckpointRecord`).

    Raises:
        CheckpointError: it records nothing (written before checkpoints recorded it), naming the file.
    """
    record = recorded_training(path)
    if record is None:
        raise CheckpointError(f"checkpoint {path} does not record the batch it was trained with ('{TRAINED_WITH}'); "
                              f"it cannot be restated for another batch")
    return record


class RngCheckpoint(pl.Callback):
    """The random-number states (torch, CUDA, numpy, Python) go into each checkpoint and come back on resume, so
    dropout after a mid-epoch resume draws what the uninterrupted run would have drawn (Lightning saves none)."""

    def state_dict(self) -> Dict[str, Any]:
        import random

        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()  # plain values: checkpoints load weights_only
        state = {"torch": torch.get_rng_state(), "python": random.getstate(),
                 "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        import random

        import numpy as np

        if "torch" in state_dict:
            torch.set_rng_state(state_dict["torch"])
        if "numpy" in state_dict:
            name, keys, pos, has_gauss, cached = state_dict["numpy"]
            np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        if "python" in state_dict:
            random.setstate(state_dict["python"])
        cuda = state_dict.get("cuda")
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


# ------------------------------------------------------------------------------------------------- lineage
def check_checkpoint_lineage(path: str, lineage: Dict[str, Any], allow_other: bool) -> int:
    """Refuse a checkpoint from another Delta table or version unless `train.ckpt_allow_other_data`.

    Returns the checkpoint's global step (the batches trained: where the data stream resumes).
    """
    ckpt = checkpoint_meta(path)  # a file, or the meta.pt of a sharded (FSDP) checkpoint folder
    theirs = _record(path, ckpt, LINEAGE) or {}
    from pipeline.lakehouse.delta_common import same_table

    def same(key: str, ours: Any) -> bool:  # the table by its location, not its spelling (old ones: as typed)
        recorded = theirs.get(key)
        if key == "delta_table" and isinstance(recorded, str) and isinstance(ours, str):
            return same_table(recorded, ours)
        return recorded == ours

    if not all(same(k, v) for k, v in lineage.items()):
        msg = (f"checkpoint {path} was trained on {theirs.get('delta_table')} version {theirs.get('delta_version')}, "
               f"this job reads {lineage['delta_table']} version {lineage['delta_version']}")
        if not allow_other:
            raise CheckpointLineageError(msg + "; set train.ckpt_allow_other_data=true to resume anyway")
        log.warning("%s; resuming anyway (train.ckpt_allow_other_data=true)", msg)
    try:
        return int(ckpt.get("global_step", 0))
    except (TypeError, ValueError):
        raise CheckpointError(f"checkpoint {path} records global_step {ckpt.get('global_step')!r}, not a number of "
                              f"steps; refused") from None


# ------------------------------------------------------------------------------------------ a trained classifier
def plain_classifier(model_cfg: ModelConfig, channels: int, num_classes: int, lr: float,
                     state: Optional[Mapping[str, torch.Tensor]] = None) -> ImageClassifier:
    """A fresh, unwrapped ImageClassifier of `model_cfg`'s network (arch, width) for `channels` and `num_classes`,
    with `state` (a LightningModule state dict) loaded when given: the one rebuild of a trained classifier, from a
    checkpoint's hyperparameters (`classifier_from_checkpoint`) or, after FSDP left the rank's module wrapped and
    sharded, from the job's config (pipeline/distributed/loop.py)."""
    net = build_network(model_cfg.arch, channels, num_classes, model_cfg.width)
    model = ImageClassifier(net, num_classes, model_cfg, lr)
    if state is not None:
        model.load_state_dict(state)
    return model


def classifier_from_checkpoint(path: str) -> ImageClassifier:
    """A trained ImageClassifier from its checkpoint alone (a file, or an FSDP checkpoint folder, gathered here):
    the network from the checkpoint's hyperparameters (model.arch, classes, channels; a model.pretrained file is not
    read), its weights and a timm backbone's input transform from the state dict. Offline, one process."""
    hp = checkpoint_meta(path).get("hyper_parameters") or {}
    if "model" not in hp or "channels" not in hp:
        raise CheckpointError(f"checkpoint {path} has no model hyperparameters (model, channels) to rebuild its "
                              f"network")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model_cfg = ModelConfig(**{k: v for k, v in hp["model"].items() if k in fields})
    return plain_classifier(model_cfg, hp["channels"], hp["num_classes"], hp.get("lr", model_cfg.lr),
                            consolidated_state(path)).eval()
