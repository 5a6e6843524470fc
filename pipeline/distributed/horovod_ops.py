"""Horovod's parts of the Lightning strategy (pipeline/distributed/horovod_strategy.py): the cluster environment whose
ranks come from Horovod, the handling of Horovod's DistributedOptimizer under Lightning, and Lightning's reduce ops
as Horovod's."""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Optional, Union

from lightning_fabric.plugins import ClusterEnvironment
from lightning_fabric.utilities.types import ReduceOp
from pytorch_lightning.core.optimizer import LightningOptimizer
from torch.optim import Optimizer

from pipeline.log import get_logger

try:  # Horovod is built from source into the venv (scripts/build_horovod.sh); keep this module importable without it.
    import horovod.torch as hvd
except ImportError:  # pragma: no cover - exercised only where the build is missing
    hvd = None

log = get_logger(__name__)


def require_horovod() -> None:
    if hvd is None:
        raise ImportError("horovod.torch is not importable; build it into the venv with `bash scripts/build_horovod.sh`.")


def ensure_initialized() -> None:
    require_horovod()
    if not hvd.is_initialized():
        log.info("hvd.init() had not been called; initialising Horovod now")
        hvd.init()


def is_horovod_optimizer(optimizer: Any) -> bool:
    return hvd is not None and isinstance(optimizer, Optimizer) and hasattr(optimizer, "skip_synchronize")


def unwrap(optimizer: Any) -> Any:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


# Methods of Horovod's optimizer that must run on the wrapped optimizer itself when called through Lightning's
# LightningOptimizer (what `self.optimizers()` returns). LightningOptimizer subclasses the optimizer's class, and
# Horovod's methods call `super(self.__class__, self)`, so `self.optimizers().zero_grad()` recursed until
# "RecursionError: maximum recursion depth exceeded"; skip_synchronize() would set its flag on the wrong object.
HOROVOD_METHODS = ("zero_grad", "load_state_dict", "synchronize", "skip_synchronize", "set_backward_passes_per_step")


def route_to_wrapped(lightning_optimizer: LightningOptimizer) -> None:
    wrapped = lightning_optimizer._optimizer
    if is_horovod_optimizer(wrapped):
        for name in HOROVOD_METHODS:
            setattr(lightning_optimizer, name, getattr(wrapped, name))


def disarm(wrapped: Optimizer) -> None:
    """Make a finished DistributedOptimizer's gradient hooks inert.

    Horovod registers hooks on the parameters' gradient accumulators and never hands back their handles, so they
    outlive the optimizer. Left armed, a later fit on the same model would run two allreduces under the same parameter
    name per backward pass. With an infinite delay the hooks only count, and never communicate again.
    """
    delay = getattr(wrapped, "_allreduce_delay", None)
    if isinstance(delay, dict):
        for p in delay:
            delay[p] = math.inf
    if isinstance(getattr(wrapped, "_handles", None), dict):
        wrapped._handles.clear()
    wrapped._requires_update = set()
    wrapped.state = defaultdict(dict)  # the state now lives in the original optimizer; do not keep a second reference


class HorovodEnvironment(ClusterEnvironment):
    """Cluster environment whose ranks come from Horovod (processes are started by horovodrun / horovod.run / Spark)."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"  # Horovod does its own rendezvous; nothing in Lightning should need this

    @property
    def main_port(self) -> int:
        return -1

    @staticmethod
    def detect() -> bool:
        return hvd is not None and hvd.is_initialized()

    def world_size(self) -> int:
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        pass  # owned by Horovod

    def global_rank(self) -> int:
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        pass  # owned by Horovod

    def local_rank(self) -> int:
        return hvd.local_rank()

    def node_rank(self) -> int:
        return hvd.cross_rank()


def horovod_op(reduce_op: Optional[Union[ReduceOp, str]]) -> Any:
    if reduce_op is None:
        return hvd.Average
    if isinstance(reduce_op, str):
        ops = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min,
               "product": hvd.Product, "prod": hvd.Product}
        key = reduce_op.lower()
        if key in ops:
            return ops[key]
    else:
        for name, op in (("AVG", hvd.Average), ("SUM", hvd.Sum), ("MAX", hvd.Max), ("MIN", hvd.Min),
                         ("PRODUCT", hvd.Product)):
            if hasattr(ReduceOp, name) and reduce_op == getattr(ReduceOp, name):
                return op
    raise ValueError(f"unsupported reduce_op for Horovod: {reduce_op!r}")
