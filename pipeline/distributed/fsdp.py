"""`train.backend: fsdp`: Lightning's FSDP strategy on GPUs (NCCL) and on CPU (gloo); its sharded checkpoints are
written (whole or not at all) and read by pipeline/distributed/checkpoints.py."""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional

import torch
from pytorch_lightning.strategies import FSDPStrategy

from pipeline.distributed.checkpoints import write_sharded

# Modules holding at least this many parameters get their own FSDP unit: each is gathered only while it runs, so a
# rank holds its shard plus one unit's full weights, not the whole model.
MIN_UNIT_PARAMS = 100_000


def fsdp_problem() -> Optional[str]:
    """Why FSDP cannot run in this process (None: it can): torch's distributed package and its FSDP module."""
    if not torch.distributed.is_available():
        return f"torch {torch.__version__} is built without torch.distributed"
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: F401
    except Exception as exc:  # pragma: no cover - a torch without FSDP
        return f"torch {torch.__version__} has no FSDP ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available() and not torch.distributed.is_gloo_available():
        return f"no CUDA and torch {torch.__version__} has no gloo backend: FSDP on CPU needs gloo"
    return None


class LakehouseFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy, also on CPU ranks: Lightning refuses its own class on a CPU accelerator and torch's
    FSDP asks for an accelerator unless it is given `device_id=cpu`; with gloo, torch >= 2.4 runs it there (used
    for tests and CPU clusters; GPUs with NCCL are what it is for). Checkpoints are sharded (a folder per
    checkpoint, each rank writing its shard into a new folder, swapped in once every rank is done:
    `checkpoints.write_sharded`, not Lightning's write in place); `checkpoints.consolidated_state` turns one into a
    full state dict."""

    # a test's fault hook (pipeline/distributed/faults.py): called on a rank with the checkpoint's path once its shard
    # is on disk, before the checkpoint is complete
    part_written: Optional[Callable[[str], None]] = None

    def __init__(self, process_group_backend: str, min_unit_params: int = MIN_UNIT_PARAMS, **kw: Any) -> None:
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=min_unit_params)
        super().__init__(process_group_backend=process_group_backend, state_dict_type="sharded",
                         auto_wrap_policy=policy, **kw)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.root_device.type != "cpu":
            return super()._setup_model(model)
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload,
                                        mixed_precision=self.mixed_precision_config,
                                        sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                                        **self.kwargs)

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("the FSDP strategy writes its sharded checkpoints itself: storage_options are not supported")
        write_sharded(self, checkpoint, filepath, self.part_written)
