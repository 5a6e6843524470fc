"""What a checkpoint records besides its weights, and what is rebuilt from that: the Delta table and version it was
trained on and the train/validation split of its rows (`lakehouse`: table and version checked on every rank's resume,
the split by the driver before the first launch, `check_resume`), how it was trained (`trained_with`: per-rank batch,
world size, steps per epoch, global step, learning rate, the optimizer and its parameter groups; an OOM back-off, an
elastic relaunch or another number of steps per epoch restates a checkpoint from it, restate.py), the random-number
states (`RngCheckpoint`), and the network its hyperparameters describe (`plain_classifier`, the one rebuild of a
classifier from a checkpoint: offline, and on rank 0 after FSDP)."""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import pytorch_lightning as pl
import torch

from pipeline.config import Config, DataConfig, ModelConfig
from pipeline.data.cache import read_manifest
from pipeline.distributed.checkpoints.io import (CheckpointError, checkpoint_meta, consolidated_state, read_checkpoint,
                                                 read_index)
from pipeline.distributed.checkpoints.layout import is_sharded_checkpoint
from pipeline.lakehouse.split import SPLIT_KEYS, split_rule
from pipeline.log import get_logger
from pipeline.model.module import ImageClassifier
from pipeline.model.nets import build_network

log = get_logger(__name__)

LINEAGE = "lakehouse"  # checkpoint key: the Delta table and version trained on, and the split (SPLIT)
TRAINED_WITH = "trained_with"  # checkpoint key: batch_size (per rank), world_size, steps_per_epoch, global_step, lr,
# optimizer (sgd | adam), param_groups (their names)
SPLIT = ("val_fraction", "split_key")  # the split's keys in the lineage record: data.val_fraction, data.split_key


class CheckpointLineageError(CheckpointError):
    """A checkpoint was trained on another Delta table or version, or another train/validation split, than this job."""


def data_split(data: Any) -> Dict[str, Any]:
    """The train/validation split the rows of `data` (a rank's ConvertedData or DirectData) were drawn with:
    `val_fraction` and `split_key`, as far as it says: direct data records both; converted data's cache entry records
    them in its manifest (the inputs its content key hashes: the fraction and the split rule). {} when unknown."""
    fraction, key = getattr(data, "val_fraction", None), getattr(data, "split_key", None)
    if fraction is None and key is None and getattr(data, "entry_url", ""):
        inputs = (read_manifest(data.entry_url) or {}).get("inputs") or {}
        fraction = inputs.get("val_fraction")
        key = {split_rule(k): k for k in SPLIT_KEYS}.get(inputs.get("split_rule"))
    split = {}
    if isinstance(fraction, (int, float)) and not isinstance(fraction, bool):
        split["val_fraction"] = float(fraction)
    if isinstance(key, str):
        split["split_key"] = key
    return split


def optimizer_record(optimizers: Any) -> Dict[str, Any]:
    """The optimizer (`sgd`, `adam`: its torch.optim class, whatever wraps it) and its parameter groups' names of the
    first of `optimizers` (a trainer's); {} when there is none."""
    if not optimizers:
        return {}
    opt = optimizers[0]
    kind = next((c.__name__.lower() for c in type(opt).__mro__
                 if c.__module__.startswith("torch.optim.") and c is not torch.optim.Optimizer), None)
    record: Dict[str, Any] = {"param_groups": [str(g.get("name", i)) for i, g in enumerate(opt.param_groups)]}
    if kind is not None:
        record["optimizer"] = kind
    return record


class CheckpointRecord(pl.Callback):
    """Stores in every checkpoint the Delta table and version with the train/validation split (`lakehouse`, checked on
    resume) and how the weights were trained (`trained_with`: per-rank batch, world size, steps per epoch, global step,
    learning rate, the optimizer and its parameter groups' names), which a restart after an OOM back-off restates from.

    `split`: the split's `val_fraction` and `split_key` (data.*); None: read from the rank's data (`data_split`, once).
    """

    def __init__(self, lineage: Dict[str, Any], batch_size: int, world_size: int, steps_per_epoch: int,
                 lr: float, split: Optional[Mapping[str, Any]] = None) -> None:
        self.lineage = dict(lineage)
        self.trained = {"batch_size": int(batch_size), "world_size": int(world_size),
                        "steps_per_epoch": int(steps_per_epoch), "lr": float(lr)}
        self.split: Optional[Dict[str, Any]] = None if split is None else {k: split[k] for k in SPLIT if k in split}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        if self.split is None:
            self.split = data_split(getattr(getattr(trainer, "datamodule", None), "data", None))
        checkpoint[LINEAGE] = {**self.split, **self.lineage}
        checkpoint[TRAINED_WITH] = {**self.trained, "global_step": int(trainer.global_step),
                                    **optimizer_record(getattr(trainer, "optimizers", None))}


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
    """Refuse a checkpoint from another Delta table or version unless `train.ckpt_allow_other_data`; and, when
    `lineage` holds the split's keys (`SPLIT`: data.val_fraction, data.split_key), one trained with another split
    (one that records none: a warning that it cannot be checked). The driver checks the split before the first
    launch (`check_resume`).

    Returns the checkpoint's global step (the batches trained: where the data stream resumes).
    """
    ckpt = checkpoint_meta(path)  # a file, or the meta.pt of a sharded (FSDP) checkpoint folder
    split = {k: lineage[k] for k in SPLIT if k in lineage}
    lineage = {k: v for k, v in lineage.items() if k not in SPLIT}
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
    if split:
        _check_split(path, ckpt, split, allow_other)
    try:
        return int(ckpt.get("global_step", 0))
    except (TypeError, ValueError):
        raise CheckpointError(f"checkpoint {path} records global_step {ckpt.get('global_step')!r}, not a number of "
                              f"steps; refused") from None


# ------------------------------------------------------------------------- the driver's checks before a resume
def _resume_meta(path: str) -> Dict[str, Any]:
    """What the driver's checks read of checkpoint `path`: a file's dict (its tensors mapped, not read), or a sharded
    folder's meta.pt (after the folder's checks)."""
    if is_sharded_checkpoint(path):
        return checkpoint_meta(path)
    try:
        return read_checkpoint(path, mmap=True)
    except CheckpointError:
        return checkpoint_meta(path)  # a file mmap cannot map (torch's legacy format): read whole, or refused


def config_split(data_cfg: DataConfig) -> Dict[str, Any]:
    """The train/validation split of the data.* config keys, as a checkpoint's lineage records it (`SPLIT`)."""
    return {"val_fraction": float(data_cfg.val_fraction), "split_key": data_cfg.split_key}


def _check_split(path: str, meta: Dict[str, Any], ours: Dict[str, Any], allow_other: bool) -> None:
    """Refuse checkpoint `path` (its dict `meta`) trained with another split than `ours` (`config_split`) unless
    `allow_other`; one that records none is accepted with a warning that it cannot be checked."""
    theirs = _record(path, meta, LINEAGE) or {}
    differing = []
    for key, value in ours.items():
        if key not in theirs:
            continue
        recorded = theirs[key]
        if key == "val_fraction":
            if isinstance(recorded, bool) or not isinstance(recorded, (int, float)) or not 0 < recorded < 1:
                raise CheckpointError(f"checkpoint {path} records '{LINEAGE}.{key}' as {recorded!r}, not a fraction "
                                      f"between 0 and 1; refused")
            same = math.isclose(float(recorded), value, rel_tol=1e-9, abs_tol=1e-12)
        else:
            if not isinstance(recorded, str):
                raise CheckpointError(f"checkpoint {path} records '{LINEAGE}.{key}' as {recorded!r}, not a split key; "
                                      f"refused")
            same = recorded == value
        if not same:
            differing.append(f"data.{key}={recorded!r} (this job: {value!r})")
    unrecorded = [k for k in ours if k not in theirs]
    if unrecorded:
        log.warning("checkpoint %s records no %s (written before checkpoints recorded the split): whether the rows it "
                    "trained on are outside this job's validation rows (%s) cannot be checked", path,
                    " or ".join(f"data.{k}" for k in unrecorded), ", ".join(f"data.{k}={v}" for k, v in ours.items()))
    if not differing:
        return
    msg = (f"checkpoint {path} was trained with another train/validation split: {', '.join(differing)}; rows it "
           f"trained on would be among this job's validation rows, and the validation metrics and the promotion gate "
           f"would score on them")
    if not allow_other:
        raise CheckpointLineageError(msg + "; resume with the split it records, or set "
                                           "train.ckpt_allow_other_data=true to resume anyway")
    log.warning("%s; resuming anyway (train.ckpt_allow_other_data=true)", msg)


# what each model.optimizer's step reads first from every parameter group, which torch fills in for no state loaded
# into it (SGD's state in Adam: KeyError 'betas' at the first step; Adam's in SGD: KeyError 'momentum')
_NEEDS = {"sgd": ("momentum",), "adam": ("betas",)}
_GROUP_KEY = re.compile(r"optimizer_0\.param_groups\.(\d+)\.([^.]+)")


def config_param_groups(model_cfg: ModelConfig, lr: float) -> List[str]:
    """The names of the parameter groups the model of `model_cfg` at rate `lr` (the plan's, as the ranks build it)
    gives its optimizer, by ImageClassifier.param_groups' rule: `all`, or `backbone` and `head` when model.backbone_lr
    gives the backbone another rate or model.freeze_backbone is set."""
    if model_cfg.backbone_lr is None or not model_cfg.lr:
        backbone_lr = lr
    else:
        backbone_lr = lr * model_cfg.backbone_lr / model_cfg.lr
    return ["all"] if backbone_lr == lr and not model_cfg.freeze_backbone else ["backbone", "head"]


def _state_groups(path: str, meta: Dict[str, Any]) -> Optional[Tuple[List[Set[str]], List[Optional[str]]]]:
    """The keys of each parameter group of checkpoint `path`'s (first) optimizer state, and their names where it has
    them: a file's `optimizer_states`; a sharded folder's from its index (the shards' item names). None: it holds no
    optimizer state.

    Raises:
        CheckpointError: `optimizer_states` is not a list of optimizer states, naming the file and the key.
    """
    if is_sharded_checkpoint(path):
        groups: Dict[int, Set[str]] = {}
        for fqn in read_index(path).state_dict_metadata:
            found = _GROUP_KEY.match(str(fqn))
            if found is not None:
                groups.setdefault(int(found.group(1)), set()).add(found.group(2))
        if not groups:
            return None
        return [groups.get(i, set()) - {"params"} for i in range(max(groups) + 1)], [None] * (max(groups) + 1)
    states = meta.get("optimizer_states")
    if states is None or (isinstance(states, list) and not states):
        return None
    first = states[0] if isinstance(states, list) else None
    param_groups = first.get("param_groups") if isinstance(first, dict) else None
    if not isinstance(param_groups, list) or not all(isinstance(g, dict) for g in param_groups):
        raise CheckpointError(f"checkpoint {path} holds no optimizer state the optimizer could load "
                              f"('optimizer_states' [0] 'param_groups' is not a list of parameter groups); refused")
    return ([set(map(str, g)) - {"params"} for g in param_groups],
            [g.get("name") if isinstance(g.get("name"), str) else None for g in param_groups])


def _check_optimizer(path: str, meta: Dict[str, Any], model_cfg: ModelConfig, lr: float) -> None:
    wanted, groups = model_cfg.optimizer, config_param_groups(model_cfg, lr)
    record = _record(path, meta, TRAINED_WITH) or {}
    state = _state_groups(path, meta)
    recorded = record.get("optimizer")
    keys = sorted(set().union(*state[0])) if state is not None else []
    where = "its shards' 'optimizer_0'" if is_sharded_checkpoint(path) else "'optimizer_states'"
    missing = [k for k in _NEEDS.get(wanted, ()) if state is not None and any(k not in g for g in state[0])]
    if (isinstance(recorded, str) and recorded != wanted) or missing:
        what = f"a {recorded} optimizer" if isinstance(recorded, str) else "another optimizer"
        held = f" (its parameter groups' keys in {where}: {', '.join(keys)})" if state is not None else ""
        needs = f", whose parameter groups need {', '.join(missing)}" if missing else ""
        raise CheckpointError(
            f"checkpoint {path} holds the state of {what}{held}; this job's config builds {wanted} (model.optimizer="
            f"{wanted}){needs}: Lightning would load the one into the other and the first step would fail; resume with "
            f"the model.optimizer it was trained with, or unset train.ckpt_restore to train from the start")
    if state is None:
        return
    count = len(state[0])
    names = state[1] if all(state[1]) else record.get("param_groups")
    if count != len(groups):
        held = f" ({', '.join(map(str, names))})" if isinstance(names, list) and len(names) == count else ""
        raise CheckpointError(
            f"checkpoint {path} holds {count} optimizer parameter group(s){held} in {where}; this job's "
            f"config builds {len(groups)} ({', '.join(groups)}: model.backbone_lr={model_cfg.backbone_lr}, "
            f"model.freeze_backbone={model_cfg.freeze_backbone}): Lightning cannot load the one into the other; resume "
            f"with the model.backbone_lr / model.freeze_backbone it was trained with, or unset train.ckpt_restore")


def check_resume(path: str, cfg: Config, lr: float) -> None:
    """The driver's checks of checkpoint `path` before the first launch resumes it, of what no rank could get past (a
    relaunch would fail on the same file, so none is restartable):

    - its train/validation split (`lakehouse`: data.val_fraction, data.split_key) is this job's: another one would
      move rows it trained on into validation (refused as another table or version is, unless
      train.ckpt_allow_other_data); one that records none is resumed with a warning that it cannot be checked;
    - its optimizer state is of the optimizer this job's config builds (model.optimizer: the type it records, else
      the keys of its parameter groups) with as many parameter groups (model.backbone_lr, model.freeze_backbone; `lr`:
      the plan's rate, which decides them as it does on the ranks).

    Raises:
        CheckpointLineageError: another split, naming the file and both values.
        CheckpointError: another optimizer or other parameter groups, or an unreadable record; naming the file and
            the keys.
    """
    meta = _resume_meta(path)
    _check_split(path, meta, config_split(cfg.data), cfg.train.ckpt_allow_other_data)
    _check_optimizer(path, meta, cfg.model, lr)


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
    if not isinstance(hp, dict):
        raise CheckpointError(f"checkpoint {path} records 'hyper_parameters' as a {type(hp).__name__}, not a dict")
    missing = [k for k in ("model", "channels", "num_classes") if k not in hp]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no model hyperparameters ({', '.join(missing)}: "
                              f"'hyper_parameters' needs model, channels and num_classes) to rebuild its network")
    if not isinstance(hp["model"], dict):
        raise CheckpointError(f"checkpoint {path} records 'hyper_parameters.model' as a {type(hp['model']).__name__}, "
                              f"not the model's settings (a dict)")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        model_cfg = ModelConfig(**{k: v for k, v in hp["model"].items() if k in fields})
        return plain_classifier(model_cfg, hp["channels"], hp["num_classes"], hp.get("lr", model_cfg.lr),
                                consolidated_state(path)).eval()
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(f"checkpoint {path}: its 'hyper_parameters' (model {hp['model'].get('arch')!r}, "
                              f"channels {hp['channels']!r}, num_classes {hp['num_classes']!r}) do not rebuild its "
                              f"network: {type(exc).__name__}: {first}") from exc
