"""Checkpoints: writing them whole or not at all, reading them safely, what each records, the lineage check, and
rebuilding a trained classifier from one (restating one for another batch or world size: restate.py, from what it
records here).

A checkpoint is a Lightning file (`*.ckpt`) or, with FSDP, a folder of per-rank shards plus Lightning's `meta.pt`.
Either appears whole or not at all: a file is written beside its name and renamed into place (`write_atomically`); a
sharded folder is written by every rank into a new folder beside its name (`<name>.lakehouse-staged-<step>-<id>`),
and only once every shard and `meta.pt` are on disk (a barrier) does rank 0 swap it in: the old folder renamed aside
(`<name>.lakehouse-aside-<id>`), the new one renamed in, the old one removed (`write_sharded`). `settle` finishes or
undoes a swap a crash interrupted and removes what an interrupted write left, only entries named exactly so (`<id>`:
8 hex digits); every reader of a checkpoint name settles it first.
Every one the loop writes records, beside the weights, the Delta table and version it was trained on (`lakehouse`)
and how it was trained (`trained_with`: per-rank batch, world size, steps per epoch, global step, learning rate):
an OOM back-off restates a checkpoint from what it records, never from when it was written.

Every read goes through safe_read.py: `torch.load(weights_only=True)` (tensors and plain values only), and a
checkpoint whose pickle would construct anything else, which could run code, is refused with `CheckpointError` naming
the file. A sharded folder's `.metadata` is read with an unpickler that admits only that format's own record types,
and every non-tensor item of its shards (which torch's own reader unpickles whole) with `weights_only=True`.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytorch_lightning as pl
import torch

from pipeline.config import ConfigError, ModelConfig
from pipeline.log import get_logger
from pipeline.model.module import ImageClassifier
from pipeline.model.nets import build_network
# CheckpointError and read_checkpoint are imported from here by the modules that read checkpoints
from pipeline.distributed.safe_read import (DCP_METADATA, CheckpointError, check_sharded,  # noqa: F401
                                            read_checkpoint, sharded_state)

log = get_logger(__name__)

META_FILE = "meta.pt"  # Lightning's file of the non-tensor state inside a sharded checkpoint folder
LINEAGE = "lakehouse"  # checkpoint key: the Delta table and version trained on
TRAINED_WITH = "trained_with"  # checkpoint key: batch_size (per rank), world_size, steps_per_epoch, global_step, lr
# The names this project gives what it writes beside a checkpoint <name>: its marker, then an id of 8 hex digits the
# writer drew. Only entries named exactly so are ever settled (renamed or removed): never a user's <name>.old-2024-06-01
STAGED = ".lakehouse-staged-"  # <name>.lakehouse-staged-<step>-<id>: a sharded checkpoint every rank is writing
ASIDE = ".lakehouse-aside-"  # <name>.lakehouse-aside-<id>: the previous folder of <name>, set aside during a swap
_OURS = re.compile(rf"(?:{re.escape(STAGED)}(?P<step>\d+)-|{re.escape(ASIDE)})[0-9a-f]{{8}}")



class CheckpointLineageError(CheckpointError):
    """A checkpoint was trained on another Delta table or version than this job."""


# ------------------------------------------------------------------------------------ writing: whole or not at all
def _fsync_folder(folder: str) -> None:
    """Make the renames in `folder` durable (where the file system lets a folder be opened and synced)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomically(obj: Dict[str, Any], path: str, part_written: Optional[Callable[[str], None]] = None) -> None:
    """`torch.save(obj)` to a temporary file beside `path`, fsynced, then renamed into place: a crash during the write
    leaves the previous file under `path` intact. `part_written(path)` (a test's fault hook, pipeline/distributed/
    faults.py) is called once the bytes are on disk, before the rename."""
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".ckpt", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        if part_written is not None:
            part_written(path)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_folder(folder)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _is_complete(folder: str) -> bool:
    """A staged folder every rank finished: meta.pt (written by rank 0 after every shard and the index) is there."""
    return os.path.isfile(os.path.join(folder, META_FILE)) and os.path.isfile(os.path.join(folder, DCP_METADATA))


def leftovers(path: str) -> Tuple[List[str], List[str]]:
    """(staged folders, folders set aside) of checkpoint `path` that an interrupted write or swap left beside it:
    only entries named as this project names them (`STAGED`, `ASIDE`, each with its writer's 8-hex-digit id)."""
    folder, name = os.path.split(os.path.abspath(os.fspath(path)))
    try:
        entries = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return [], []
    staged: List[Tuple[int, str]] = []
    aside: List[str] = []
    for entry in entries:
        ours = _OURS.fullmatch(entry, len(name)) if entry.startswith(name) else None
        if ours is not None and ours.group("step") is not None:
            staged.append((int(ours.group("step")), entry))
        elif ours is not None:
            aside.append(entry)
    return [os.path.join(folder, e) for _, e in sorted(staged)], [os.path.join(folder, e) for e in sorted(aside)]


def settle(path: str) -> Optional[str]:
    """Leave checkpoint `path` as its last complete write left it, and nothing of this project's writes beside it.

    A crash between the two renames of a swap (`swap_in`) left no `path`, the old checkpoint set aside and the new one
    staged and complete: the new one is renamed in (the old one when the staged folder is incomplete). Then every
    staged folder (a write interrupted before its swap: shards of an epoch no checkpoint completed) and every folder
    set aside are removed: only what this project names so (`leftovers`), never another file beside `path`. Safe
    when several processes settle the same path at once (each rename is tried once and a rename another process made
    first is taken as done); never while ranks are writing that checkpoint.

    Returns `path` when a checkpoint is there afterwards, else None.
    """
    path = os.path.abspath(os.fspath(path))
    staged, aside = leftovers(path)
    if aside and not os.path.lexists(path):
        complete = [s for s in staged if _is_complete(s)]
        source = complete[-1] if complete else max(aside, key=lambda a: os.path.getmtime(a)
                                                   if os.path.lexists(a) else 0.0)
        try:
            os.replace(source, path)
            _fsync_folder(os.path.dirname(path))
            log.warning("checkpoint %s: a swap interrupted by a crash finished from %s", path,
                        "the new folder" if complete else "the previous folder")
        except FileNotFoundError:
            pass  # another process settled it first
    for stale in staged + aside:
        if os.path.lexists(stale):
            log.info("checkpoint %s: removing %s, left by an interrupted write", path, os.path.basename(stale))
            _remove(stale)
    return path if os.path.lexists(path) else None


def swap_in(staged: str, path: str) -> None:
    """Put the complete folder `staged` in place of checkpoint `path`: the old one renamed aside, the new one renamed
    in, the old one removed. A crash between the renames leaves both, which `settle` resolves to the new one."""
    aside = None
    if os.path.lexists(path):
        aside = f"{path}{ASIDE}{uuid.uuid4().hex[:8]}"
        os.replace(path, aside)
    os.replace(staged, path)
    _fsync_folder(os.path.dirname(path))
    if aside is not None:
        _remove(aside)


def write_sharded(strategy: Any, checkpoint: Dict[str, Any], path: Any,
                  part_written: Optional[Callable[[str], None]] = None) -> None:
    """An FSDP checkpoint, whole or not at all, called on every rank (`strategy`: Lightning's FSDP strategy, its
    `broadcast`, `barrier` and `global_rank`): rank 0 settles `path` and makes a new staged folder beside it; every
    rank writes its shard of the weights and optimizer state there (torch.distributed.checkpoint, which also writes
    the index); rank 0 writes `meta.pt` (the rest of `checkpoint`, atomically); after a barrier (every rank done)
    rank 0 swaps the folder in (`swap_in`). A rank that dies on the way leaves `path` as it was.

    `part_written(path)` (a test's fault hook, pipeline/distributed/faults.py) is called on each rank once its shard
    is on disk, before the checkpoint is complete."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    final = os.path.abspath(os.fspath(strategy.broadcast(os.fspath(path))))
    ident = uuid.uuid4().hex[:8] if strategy.global_rank == 0 else ""
    staged = strategy.broadcast(f"{final}{STAGED}{int(checkpoint.get('global_step', 0))}-{ident}")
    if strategy.global_rank == 0:
        settle(final)  # what an earlier interrupted save left goes first
        os.makedirs(staged)
    strategy.barrier("lakehouse-checkpoint-staged")

    class ShardWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            written = super().write_data(plan, planner)
            written.wait()  # this rank's shard is on disk (the index is written after every rank's)
            if part_written is not None:
                part_written(final)
            return written

    state = {"model": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": opt for i, opt in enumerate(checkpoint.pop("optimizer_states", []))})
    save(state, storage_writer=ShardWriter(staged))
    if strategy.global_rank == 0:
        write_atomically(checkpoint, os.path.join(staged, META_FILE))
    strategy.barrier("lakehouse-checkpoint-written")  # every shard, the index and meta.pt are on disk
    if strategy.global_rank == 0:
        swap_in(staged, final)
    strategy.barrier("lakehouse-checkpoint-swapped")


# ---------------------------------------------------------------------------------------------------------- reading
def is_sharded_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, META_FILE))


def checkpoint_meta(path: str) -> Dict[str, Any]:
    """The non-tensor part of a checkpoint (global_step, callbacks, lineage, trained_with): a file's whole dict, or a
    sharded checkpoint folder's meta.pt, once its `.metadata` and every non-tensor item of its shards passed
    `safe_read.check_sharded` (every reader of a folder, Lightning's resume included, comes through here first)."""
    if is_sharded_checkpoint(path):
        check_sharded(path)
        return read_checkpoint(os.path.join(path, META_FILE))
    return read_checkpoint(path)


def consolidated_state(path: str) -> Dict[str, torch.Tensor]:
    """The LightningModule state dict of a checkpoint, in one process and without a process group: a file's
    `state_dict`, or the full state gathered from a sharded folder's shards (read by `safe_read.sharded_state`, its
    weights only: the optimizer's state stays on disk)."""
    if not is_sharded_checkpoint(path):
        return read_checkpoint(path)["state_dict"]
    checkpoint_meta(path)  # meta.pt, the index and the shards' non-tensor items pass the same checks first
    return sharded_state(path, keys=["model"])["model"]


def weights_and_epoch(path: str) -> Tuple[Dict[str, torch.Tensor], int]:
    """The LightningModule state dict of a checkpoint (`consolidated_state`) and the epoch it was saved in: the
    weights a run registers and the epoch whose metrics go with them."""
    if is_sharded_checkpoint(path):
        return consolidated_state(path), int(checkpoint_meta(path)["epoch"])
    whole = read_checkpoint(path)  # one read of the file for both
    return whole["state_dict"], int(whole["epoch"])


# -------------------------------------------------------------------------------------- what a checkpoint records
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


def recorded_training(path: str) -> Optional[Dict[str, Any]]:
    """What checkpoint `path` records of how it was trained (`CheckpointRecord`); None when it records nothing
    (written before checkpoints recorded it)."""
    record = checkpoint_meta(path).get(TRAINED_WITH)
    return record if isinstance(record, dict) and "batch_size" in record else None


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


# ---------------------------------------------------------------------------------------------- resume and lineage
def resolve_checkpoint(value: Optional[str], checkpoint_dir: str) -> Optional[str]:
    """The restore point as a rank reads it (`TrainJob.restore_point`): None, `last` (`checkpoint_dir`'s last.ckpt)
    or a path (the driver resolves train.ckpt_restore's run-scoped names to a path before launching).

    Raises:
        ConfigError: the checkpoint does not exist, naming the key.
    """
    if not value:
        return None
    path = os.path.join(checkpoint_dir, "last.ckpt") if value == "last" else value
    settle(path)  # a swap a crash interrupted is finished, an interrupted write's folder removed
    if not os.path.exists(path):
        raise ConfigError(f"config key 'train.ckpt_restore': checkpoint {path} does not exist")
    return path


def check_checkpoint_lineage(path: str, lineage: Dict[str, Any], allow_other: bool) -> int:
    """Refuse a checkpoint from another Delta table or version unless `train.ckpt_allow_other_data`.

    Returns the checkpoint's global step (the batches trained: where the data stream resumes).
    """
    ckpt = checkpoint_meta(path)  # a file, or the meta.pt of a sharded (FSDP) checkpoint folder
    theirs = ckpt.get(LINEAGE) or {}
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
    return int(ckpt.get("global_step", 0))


# ------------------------------------------------------------------------------------------ a trained classifier
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
    net = build_network(model_cfg.arch, hp["channels"], hp["num_classes"], model_cfg.width)
    model = ImageClassifier(net, hp["num_classes"], model_cfg, hp.get("lr", model_cfg.lr))
    model.load_state_dict(consolidated_state(path))
    return model.eval()
