"""OOM back-off: recognising an out-of-memory, the halved per-rank batch and its learning rate.

`data.batch_size: auto` (or a fixed size with `train.oom_backoff: true`): an out-of-memory on any rank ends the
launch (the failing rank reports it, the launcher stops every rank within the existing bound), and the launcher
relaunches all ranks with half the per-rank batch, re-planned for equal steps. The learning rate follows the global
batch by `train.lr_scaling`, as it follows the world size: the rate `model.lr` is for the starting per-rank batch,
so halving the batch multiplies the rate by 1/2 (linear), 1/sqrt(2) (sqrt) or 1 (none). A relaunch from a checkpoint
trained with the larger batch resumes from a copy of it restated for the smaller one, from the batch the checkpoint
records (pipeline/distributed/checkpoints/restate.py, `restated`).
"""
from __future__ import annotations

import math
from typing import Optional

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

