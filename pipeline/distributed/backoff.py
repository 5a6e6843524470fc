"""OOM back-off: recognising an out-of-memory on a rank (the restart policy relaunches with half the batch).

`data.batch_size: auto` (or a fixed size with `train.oom_backoff: true`): an out-of-memory on any rank ends the
launch (the failing rank reports it, the launcher stops every rank within the existing bound), and the launcher
relaunches all ranks with the plan re-derived for half the per-rank batch (`RunPlan.relaunched(out_of_memory=True)`,
pipeline/data/plan.py, which holds the rules: the halved batch, and the learning rate following the global batch by
`train.lr_scaling`). A relaunch from a checkpoint trained with the larger batch resumes from a copy of it restated
for the smaller one, from the batch the checkpoint records (pipeline/distributed/checkpoints/restate.py, `restated`).
"""
from __future__ import annotations

from typing import Optional

# the plan's rules, importable from here for the restart policy's callers until they take them from the plan
from pipeline.data.plan import backs_off, halved, lr_batch_factor, start_batch_size  # noqa: F401

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
