"""OOM back-off: recognising an out-of-memory, the halved per-rank batch, its learning rate, a checkpoint restated.

`data.batch_size: auto` (or a fixed size with `train.oom_backoff: true`): an out-of-memory on any rank ends the
launch (the failing rank reports it, the launcher stops every rank within the existing bound), and the launcher
relaunches all ranks with half the per-rank batch, re-planned for equal steps. The learning rate follows the global
batch by `train.lr_scaling`, as it follows the world size: the rate `model.lr` is for the starting per-rank batch,
so halving the batch multiplies the rate by 1/2 (linear), 1/sqrt(2) (sqrt) or 1 (none). A relaunch from a checkpoint
trained with the larger batch resumes from a copy of it restated for the smaller one (`rescale_checkpoint`).
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, Optional, Tuple

from pipeline.config import ConfigError, DataConfig

# what an out-of-memory says, as the rank reports it ("<type>: <message>"): torch.OutOfMemoryError (CUDA), torch's
# CPU allocator, a Python MemoryError (numpy) and the "out of memory" RuntimeErrors of CUDA / cuDNN / NCCL
OOM_MARKERS = ("OutOfMemoryError", "out of memory", "DefaultCPUAllocator: can't allocate memory", "MemoryError")


def is_out_of_memory(exc: Optional[BaseException]) -> bool:
    """Whether `exc`, or an exception it was raised from, is an out-of-memory (also when a launcher only passed on
    its text, as `DistributedTrainingError` passes on each rank's first error line)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MemoryError) or any(m in f"{type(exc).__name__}: {exc}" for m in OOM_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def start_batch_size(data: DataConfig) -> int:
    """The per-rank batch a job starts with: `data.batch_size`, or `data.auto_batch_start` when it is `auto`."""
    return int(data.auto_batch_start if data.batch_size == "auto" else data.batch_size)


def backs_off(data: DataConfig, oom_backoff: bool) -> bool:
    """Whether an out-of-memory halves the batch: always with `data.batch_size: auto`, else `train.oom_backoff`."""
    return data.batch_size == "auto" or bool(oom_backoff)


def halved(batch: int, cause: str = "out of memory") -> int:
    """The next per-rank batch after an out-of-memory at `batch` (floor 1).

    Raises:
        ConfigError: already at 1 per rank, naming `data.batch_size`.
    """
    if batch <= 1:
        raise ConfigError(f"config key 'data.batch_size': out of memory with 1 sample per rank, the smallest batch "
                          f"(after halving it on each out-of-memory); the model does not fit this device: {cause}")
    return batch // 2


def lr_batch_factor(batch_used: int, batch_start: int, rule: str) -> float:
    """What the learning rate is multiplied by when the per-rank batch is `batch_used` instead of `batch_start`: the
    global batch changes by that ratio, and `train.lr_scaling` scales the rate with the global batch (linear: the
    ratio, sqrt: its square root, none: 1), as `scaled_lr` does for the number of ranks."""
    ratio = batch_used / batch_start
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    return 1.0


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
                       lr_factor: float) -> int:
    """Write `src` (a Lightning checkpoint trained with `old_batch` per rank) to `dst` as if trained with `new_batch`:
    every step counter of the fit loop and the LR scheduler at the converted position (`converted_position`), the
    learning rates of the optimizer and scheduler times `lr_factor`, the data stream's steps per epoch. Weights,
    optimizer moments, lineage and callbacks' states are kept. Returns the converted global step."""
    import torch

    ckpt = torch.load(src, map_location="cpu", weights_only=False)
    fit = ckpt["loops"]["fit_loop"]
    progress = fit["epoch_loop.batch_progress"]
    total, current = converted_position(progress["total"]["ready"], progress["current"]["ready"], old_steps,
                                        old_batch, new_steps, new_batch)
    for name in _PROGRESS:
        _set_counts(fit.get(name, {}), total, current)
    fit.get("epoch_loop.state_dict", {})["_batches_that_stepped"] = total
    for state in fit.get("state_dict", {}).get("combined_loader", []) or []:
        if isinstance(state, dict) and "steps_per_epoch" in state:
            state["steps_per_epoch"] = new_steps
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
    tmp = dst + ".tmp"
    torch.save(ckpt, tmp)
    os.replace(tmp, dst)
    return total
