"""`train.backend: fsdp`: Lightning's FSDP strategy on GPUs (NCCL) and on CPU (gloo); its sharded checkpoints are
written (whole or not at all) and read, on resume, only through pipeline/distributed/checkpoints/io.py."""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Dict, Optional

import torch
from pytorch_lightning.strategies import FSDPStrategy

from pipeline.distributed.checkpoints.io import (plain_shard_reader, read_checkpoint, refusals_unwrapped,
                                                 write_sharded)
from pipeline.distributed.checkpoints.layout import META_FILE, is_sharded_checkpoint

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
    `checkpoints.io.write_sharded`, not Lightning's write in place); `io.consolidated_state` turns one into a
    full state dict. A resume reads the checkpoint only through checkpoints/io.py (`load_checkpoint`), never with
    torch's or Lightning's own readers, which unpickle a shard's non-tensor items or a whole file without
    `weights_only`."""

    # no rank holds the whole model: the loop registers it rebuilt from the last checkpoint (loop.train)
    shards_the_model = True

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

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Lightning 2.6's FSDPStrategy.load_checkpoint (the module's and the optimizers' states loaded here, the rest
        of the checkpoint returned to the loop), reading only as checkpoints/io.py does, whatever `weights_only` says:
        a sharded folder through `io.plain_shard_reader` (index, non-tensor items and tensors all with
        `weights_only=True`), its meta.pt and a whole file with `read_checkpoint`. The loop checks a folder before it
        resumes (`checkpoints.checkpoint_meta`); this read does not rely on that check, so a shard swapped in between
        is refused here too.

        Raises:
            CheckpointError: the checkpoint holds more than tensors and plain values, naming the file (and item).
        """
        path = os.fspath(self.broadcast(os.fspath(checkpoint_path)))  # every rank reads rank 0's path
        assert self.model is not None and self.lightning_module is not None
        if is_sharded_checkpoint(path):
            self._load_sharded(path)
            return read_checkpoint(os.path.join(path, META_FILE))  # anything not a module or optimizer state
        if os.path.isfile(path):
            return self._load_whole(read_checkpoint(path, mmap=True))
        raise ValueError(f"The path {path!r} does not point to a valid checkpoint. Make sure the path points to either "
                         f"a directory with FSDP checkpoint shards, or a single file with a full checkpoint.")

    def _fitting(self) -> bool:
        from pytorch_lightning.trainer.states import TrainerFn

        return self.lightning_module.trainer.state.fn == TrainerFn.FITTING

    def _load_sharded(self, path: str) -> None:
        """The module's shard, then (when fitting) each optimizer's, from sharded folder `path` (Lightning's steps)."""
        from lightning_fabric.strategies.fsdp import _get_sharded_state_dict_context
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with _get_sharded_state_dict_context(self.model), refusals_unwrapped(path):
            module_state = {"model": self.model.state_dict()}
            load(module_state, storage_reader=plain_shard_reader(path))
            self.model.load_state_dict(module_state["model"], strict=self.lightning_module.strict_loading)
            if not (self._fitting() and self.optimizers):
                return
            reader = plain_shard_reader(path)
            for idx, optim in enumerate(self.optimizers):
                key = f"optimizer_{idx}"
                optim_state = load_sharded_optimizer_state_dict(model_state_dict=module_state["model"],
                                                                optimizer_key=key, storage_reader=reader)
                optim.load_state_dict(FSDP.optim_state_dict_to_load(optim_state_dict=optim_state[key],
                                                                    model=self.model, optim=optim))

    def _load_whole(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        """A whole checkpoint's module state, then (when fitting) its optimizers' (Lightning's steps); the rest of
        `checkpoint` returned."""
        from lightning_fabric.strategies.fsdp import _get_full_state_dict_context
        from lightning_fabric.strategies.model_parallel import _load_raw_module_state
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import OptimStateKeyType

        _load_raw_module_state(checkpoint.pop("state_dict"), module=self.model, world_size=self.world_size,
                               strict=self.lightning_module.strict_loading)
        optimizer_states = checkpoint.get("optimizer_states")
        if optimizer_states is None or not self._fitting():
            return checkpoint
        if len(self.optimizers) != len(optimizer_states):
            raise RuntimeError(f"You have configured {len(self.optimizers)} optimizers but the checkpoint contains "
                               f"{len(optimizer_states)} optimizers to load. Please resume training with the same "
                               f"number of optimizers or edit the checkpoint manually to remove states.")
        # rank0_only=False: every rank loads the optimizer state
        with _get_full_state_dict_context(self.model, world_size=self.world_size, rank0_only=False):
            for optim, opt_state in zip(self.optimizers, optimizer_states):
                if isinstance(next(iter(opt_state["state"]), None), int):  # saved from a plain optimizer
                    opt_state = FSDP.rekey_optim_state_dict(opt_state, OptimStateKeyType.PARAM_NAME, self.model)
                optim.load_state_dict(FSDP.optim_state_dict_to_load(optim_state_dict=opt_state, model=self.model,
                                                                    optim=optim))
        return checkpoint
