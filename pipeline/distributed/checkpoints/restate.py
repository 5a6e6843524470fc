"""Restating a checkpoint for another global batch (an OOM back-off's smaller batch, an elastic relaunch's fewer
ranks) or another number of steps per epoch: the fit loop's and the schedule's step counters at the same place in
training, the rates by `train.lr_scaling`, from the batch, world size and steps per epoch the checkpoint records
(`record.trained_with`)."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

from pipeline.data.plan import lr_batch_factor
from pipeline.distributed.checkpoints.io import CheckpointError, read_checkpoint, write_atomically
from pipeline.distributed.checkpoints.layout import (META_FILE, is_sharded_checkpoint, linked_copy, restated_path,
                                                     settle)
from pipeline.distributed.checkpoints.record import TRAINED_WITH, recorded_training, trained_with
from pipeline.log import get_logger

log = get_logger(__name__)


def converted_position(total: int, current: int, old_steps: int, old_batch: int, new_steps: int,
                       new_batch: int) -> Tuple[int, int]:
    """A checkpoint's place in training, (batches trained in all, batches trained in its epoch) in batches of
    `old_batch` (`old_steps` per epoch), in batches of `new_batch` (`new_steps` per epoch): the same epoch, and within
    it the batch that covers the same number of samples (an epoch that had ended stays ended; a mid-epoch one never
    reaches its last step)."""
    epochs = (int(total) - int(current)) // old_steps
    within = new_steps if current >= old_steps else min(new_steps - 1, int(current) * old_batch // new_batch)
    return epochs * new_steps + within, within


# the fit loop's step counters in a Lightning checkpoint (progress trackers with `total` and `current` counts)
_PROGRESS = ("epoch_loop.batch_progress", "epoch_loop.scheduler_progress",
             "epoch_loop.automatic_optimization.optim_progress")


def _set_counts(node: Dict[str, Any], total: int, current: int) -> None:
    """Every `total` / `current` count under a progress tracker's state set to `total` / `current`."""
    for key, value in node.items():
        if not isinstance(value, dict):
            continue
        if key in ("total", "current"):
            value.update({k: total if key == "total" else current for k, v in value.items() if isinstance(v, int)})
        else:
            _set_counts(value, total, current)


def rescale_checkpoint(src: str, dst: str, old_steps: int, old_batch: int, new_steps: int, new_batch: int,
                       lr_factor: float, new_world: Optional[int] = None, rank_batch: Optional[int] = None) -> int:
    """Write `src` (a Lightning checkpoint trained with `old_batch` per rank) to `dst` as if trained with `new_batch`:
    every step counter of the fit loop and the LR scheduler at the converted position (`converted_position`), the
    learning rates of the optimizer and scheduler times `lr_factor`, the data stream's steps per epoch, and its
    `trained_with` record (`new_world` ranks of `rank_batch` each, when given: the batches are then global).
    Weights, optimizer moments, lineage and callbacks' states are kept. Returns the converted global step.

    Raises:
        CheckpointError: it lacks the fit loop's progress (`loops`), or a record of it has another shape; naming the
            file and the key.
    """
    ckpt = read_checkpoint(src)
    fit = _at(src, ckpt, "loops", "fit_loop")
    total, current = (_at(src, fit, "epoch_loop.batch_progress", which, "ready", within="loops.fit_loop")
                      for which in ("total", "current"))
    for key, value in (("total", total), ("current", current)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"checkpoint {src} records 'loops.fit_loop.epoch_loop.batch_progress.{key}.ready' "
                                  f"as {value!r}, not a number of batches; it cannot be restated")
    try:
        return _rescale(src, dst, ckpt, fit, total, current, old_steps, old_batch, new_steps, new_batch, lr_factor,
                        new_world, rank_batch)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
        raise CheckpointError(f"checkpoint {src} cannot be restated: a record of it has another shape than "
                              f"Lightning's ({type(exc).__name__}: {exc})") from None


def _at(path: str, node: Any, *keys: str, within: str = "") -> Any:
    """`node[keys[0]][keys[1]]...` of checkpoint `path`; CheckpointError naming the file and the key when missing."""
    trail = within
    for key in keys:
        trail = f"{trail}.{key}" if trail else key
        if not isinstance(node, dict) or key not in node:
            raise CheckpointError(f"checkpoint {path} has no '{trail}' (the fit loop's progress Lightning records); "
                                  f"it cannot be restated")
        node = node[key]
    return node


def _rescale(src: str, dst: str, ckpt: Dict[str, Any], fit: Dict[str, Any], total: int, current: int, old_steps: int,
             old_batch: int, new_steps: int, new_batch: int, lr_factor: float, new_world: Optional[int],
             rank_batch: Optional[int]) -> int:
    total, current = converted_position(total, current, old_steps, old_batch, new_steps, new_batch)
    for name in _PROGRESS:
        _set_counts(fit.get(name, {}), total, current)
    fit.get("epoch_loop.state_dict", {})["_batches_that_stepped"] = total
    for state in fit.get("state_dict", {}).get("combined_loader", []) or []:
        if isinstance(state, dict) and "steps_per_epoch" in state:
            state["steps_per_epoch"] = new_steps
            if new_world is not None and "world_size" in state:
                state["world_size"] = int(new_world)
    for opt in ckpt.get("optimizer_states", []):
        for group in opt.get("param_groups", []):
            for key in ("lr", "initial_lr"):
                if key in group:
                    group[key] *= lr_factor
    for sched in ckpt.get("lr_schedulers", []):
        sched["last_epoch"], sched["_step_count"] = total, total + 1
        for key in ("base_lrs", "_last_lr"):
            if key in sched:
                sched[key] = [lr * lr_factor for lr in sched[key]]
    ckpt["global_step"] = total
    record = ckpt.get(TRAINED_WITH)
    if isinstance(record, dict):
        ckpt[TRAINED_WITH] = {**record, "batch_size": rank_batch or new_batch, "steps_per_epoch": new_steps,
                              "global_step": total,
                              "lr": float(record.get("lr", 0.0)) * lr_factor}
        if new_world is not None:
            ckpt[TRAINED_WITH]["world_size"] = int(new_world)
    write_atomically(ckpt, dst)  # a temporary file of its own: a reader of `dst` sees a whole checkpoint
    return total


def restated(path: str, steps_per_epoch: int, batch_size: int, world_size: int, lr_scaling: str,
             unrecorded: Optional[Tuple[int, int]] = None, folder: Optional[str] = None) -> str:
    """Checkpoint `path` for a launch of `world_size` ranks with `batch_size` per rank (`steps_per_epoch`): `path`
    itself when it records that batch, world size and number of steps per epoch, else a copy restated from what it
    records (`rescale_checkpoint`), written into `folder` (the job's own checkpoint folder; default: beside `path`).
    Another number of steps per epoch at the same batch (the same rows planned otherwise: data.source converted or
    direct) is restated too: its epoch and the samples trained within it kept, so the data stream resumes at the same
    share of its epoch instead of cutting the first resumed epoch short; a sharded (FSDP) checkpoint so restated is a
    copy of its folder (the shards hard-linked where the file system allows) with its `meta.pt` restated. A
    checkpoint of another run is never written beside: two jobs resuming it at once, with other rules, would read
    each other's copy. Positions and rates follow the global batch (per-rank batch x ranks): an OOM back-off
    halves it, an elastic relaunch on fewer ranks (train.min_np) shrinks it, a restore point trained on another
    number of ranks differs from it; the rate by `train.lr_scaling`. Always decided from what the checkpoint records,
    never from the launch before.

    `unrecorded`: the (per-rank batch, world size) a checkpoint that records neither (written before checkpoints
    recorded them) is taken to have been trained with; such a checkpoint is `path` itself for a launch of exactly
    that. None: it is refused.

    Raises:
        CheckpointError: it records no batch (and `unrecorded` is not this launch's), records a batch, world size or
            number of steps that is not a positive whole number, lacks what restating reads (`loops`), or is a sharded
            (FSDP) checkpoint trained with another batch or world size; naming the file and the key.
    """
    record = recorded_training(path)
    if record is None and unrecorded is not None and tuple(unrecorded) == (batch_size, world_size):
        log.info("checkpoint %s records no batch or world size; resumed as it is", path)
        return path
    if record is None:
        record = trained_with(path)  # raises, naming the file
    old_batch = _count(path, record, "batch_size")
    old_world = _count(path, record, "world_size") if "world_size" in record else world_size
    old_steps = _count(path, record, "steps_per_epoch")
    if (old_batch, old_world, old_steps) == (batch_size, world_size, steps_per_epoch):
        return path
    same_batch = (old_batch, old_world) == (batch_size, world_size)  # only the steps per epoch differ
    if is_sharded_checkpoint(path) and not same_batch:
        raise CheckpointError(f"checkpoint {path} (sharded, trained with {old_batch} per rank on {old_world} ranks) "
                              f"cannot be restated for {batch_size} per rank on {world_size}: a sharded checkpoint "
                              f"resumes only with the batch and world size it records (data.batch_size={old_batch} "
                              f"on {old_world} ranks; train.min_np=null keeps the world size on a relaunch)")
    dst = restated_path(path, batch_size, world_size, old_world, folder,
                        steps_per_epoch=steps_per_epoch if same_batch else None)
    old_global, new_global = old_batch * old_world, batch_size * world_size
    factor = lr_batch_factor(new_global, old_global, lr_scaling)

    def rescale(src: str, out: str) -> int:
        return rescale_checkpoint(src, out, old_steps, old_global, steps_per_epoch, new_global, factor,
                                  new_world=world_size, rank_batch=batch_size)

    if is_sharded_checkpoint(path):  # the same batch, other steps per epoch: the shards as they are, meta.pt restated
        steps = []
        settle(dst)
        try:
            linked_copy(path, dst, before_swap=lambda staged: steps.append(rescale(
                os.path.join(staged, META_FILE), os.path.join(staged, META_FILE))))
        except FileNotFoundError as exc:
            raise CheckpointError(f"checkpoint {path} cannot be restated: it lost files while it was read "
                                  f"({exc})") from exc
        step = steps[0]
    else:
        step = rescale(path, dst)
    log.info("checkpoint %s (%d per rank x %d, %d steps per epoch, step %s) restated for %d per rank x %d, %d steps "
             "per epoch, at step %d: %s", path, old_batch, old_world, old_steps, record.get("global_step"), batch_size,
             world_size, steps_per_epoch, step, dst)
    return dst


def _count(path: str, record: Dict[str, Any], key: str) -> int:
    """A positive whole number the `trained_with` record of checkpoint `path` holds under `key`.

    Raises:
        CheckpointError: it is missing, or not a positive whole number; naming the file and the key.
    """
    value = record.get(key)
    if value is None:
        raise CheckpointError(f"checkpoint {path} records no '{TRAINED_WITH}.{key}' (its record: "
                              f"{', '.join(sorted(map(str, record)))}); it cannot be restated")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or int(value) < 1:
        raise CheckpointError(f"checkpoint {path} records '{TRAINED_WITH}.{key}' as {value!r}, not a positive whole "
                              f"number; refused")
    return int(value)
