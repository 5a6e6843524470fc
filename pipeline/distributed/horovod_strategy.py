"""Horovod strategy for Lightning 2: ranks, gradient averaging, broadcasts and reductions over Horovod."""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO
from lightning_fabric.utilities.types import ReduceOp
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import ParallelStrategy, StrategyRegistry
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.optim import Optimizer

from pipeline.distributed.devices import rank_device_index
from pipeline.distributed.horovod_ops import (HorovodEnvironment, disarm, ensure_initialized, horovod_op,
                                             is_horovod_optimizer, require_horovod, route_to_wrapped, unwrap)
from pipeline.log import get_logger

try:  # Horovod is built from source into the venv (scripts/build_horovod.sh); keep this module importable without it.
    import horovod.torch as hvd
except ImportError:  # pragma: no cover - exercised only where the build is missing
    hvd = None

log = get_logger(__name__)

STRATEGY_NAME = "horovod_lakehouse"
# Every collective gets a fixed name. Unnamed Horovod ops are named after a per-process handle counter that also counts
# the named gradient allreduces, so after a step in which the ranks ran different numbers of ops the names differ and
# the ranks wait on each other forever. Fixed names also let Horovod's response cache skip the negotiation.
_NAME = "HorovodStrategy."


class HorovodStrategy(ParallelStrategy):
    """Data-parallel training over Horovod, one process per device, in processes the caller started and initialised.

    Use as ``pl.Trainer(strategy=HorovodStrategy(), accelerator="cpu" | "gpu", devices=1, num_nodes=1)`` in every
    rank. The caller owns ``hvd.init()`` / ``hvd.shutdown()`` (``hvd.init()`` is called here only if it was not).

    Gradient averaging: optimizers are wrapped in ``hvd.DistributedOptimizer``. Lightning runs forward and backward
    inside ``optimizer.step(closure)``, and Horovod's ``step`` synchronises before calling the closure, which would
    step on un-averaged gradients. So the closure is wrapped to call ``optimizer.synchronize()`` right after it ran
    (after backward, before gradient clipping and ``on_before_optimizer_step``), and the step itself runs inside
    ``optimizer.skip_synchronize()``.

    The averaging needs no per-step decision: every rank runs the same number of steps, so ``synchronize()`` is called
    directly. ``skip_steps_without_gradients=True`` restores a blocking all-reduce per step that lets a step in which
    no rank ran backward (manual optimisation) leave the weights untouched, as DDP does; without it such a step is a
    zero-gradient step on every rank.

    Mixed precision: Lightning's precision plugin runs around this. With ``16-mixed`` its ``MixedPrecision`` plugin
    runs the closure (scaled backward, then the averaging above), then ``scaler.unscale_`` on the averaged gradients,
    then ``scaler.step``, all inside ``skip_synchronize()``: the scaler sees identical gradients on every rank, so
    every rank skips the same inf/NaN steps and keeps the same scale.

    The learning rate is not scaled by the number of ranks: averaged gradients of per-rank mean losses equal the
    gradient of the mean loss over the global batch.

    One rank (``hvd.size() == 1``) has nothing to average or agree on: the optimizers are not wrapped (no gradient
    hooks, no ``synchronize()`` waiting on Horovod's background cycle every step) and the collectives return their
    input without calling Horovod. That cost measured 3-10 ms a step on a 2-core CPU
    (``lakehouse bench --only step_overhead``).
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        compression: Any = None,
        skip_steps_without_gradients: bool = False,
    ) -> None:
        require_horovod()
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=HorovodEnvironment(),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._compression = compression if compression is not None else hvd.Compression.none
        self._original_optimizers: dict[int, Optimizer] = {}  # id(wrapped) -> optimizer from configure_optimizers
        self._num_nodes_flag = 1
        self._skip_steps_without_gradients = bool(skip_steps_without_gradients)

    @property
    def optimizers(self) -> list[Optimizer]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[Optimizer]) -> None:
        ParallelStrategy.optimizers.fset(self, optimizers)  # builds the LightningOptimizer wrappers
        for lightning_optimizer in self._lightning_optimizers:
            route_to_wrapped(lightning_optimizer)

    # ------------------------------------------------------------------ ranks and devices
    @property
    def global_rank(self) -> int:
        return hvd.rank()

    @property
    def local_rank(self) -> int:
        return hvd.local_rank()

    @property
    def node_rank(self) -> int:
        return hvd.cross_rank()

    @property
    def world_size(self) -> int:
        return hvd.size()

    @property
    def is_global_zero(self) -> bool:
        return hvd.rank() == 0

    @property
    def alone(self) -> bool:
        """One rank: nothing to average, broadcast or reduce (Horovod's ops are skipped)."""
        return hvd.is_initialized() and hvd.size() == 1

    @property
    def num_nodes(self) -> int:
        return hvd.cross_size() if hvd.is_initialized() else self._num_nodes_flag

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        # Lightning passes Trainer(num_nodes=...) here; the real count is Horovod's cross size.
        self._num_nodes_flag = num_nodes

    @property
    def is_distributed(self) -> bool:
        # Lightning reads this for custom strategies: without it `self.log(..., sync_dist=True)` silently does not sync
        # and no DistributedSampler is injected.
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": hvd.size(), "rank": hvd.rank()}

    def _uses_cuda(self) -> bool:
        devices = self.parallel_devices
        if devices:
            return devices[0].type == "cuda"
        return type(self.accelerator).__name__ == "CUDAAccelerator"

    @property
    def root_device(self) -> torch.device:
        if self._uses_cuda():
            # local rank k takes GPU k; a process that sees exactly one GPU (Spark GPU scheduling) takes device 0
            return torch.device("cuda", rank_device_index(hvd.local_rank(), torch.cuda.device_count()))
        return torch.device("cpu")

    def set_world_ranks(self) -> None:
        """Called by the Trainer's constructor: make rank-zero-only utilities see Horovod's rank."""
        ensure_initialized()
        rank_zero_only.rank = utils_rank_zero_only.rank = hvd.rank()

    def setup_environment(self) -> None:
        ensure_initialized()
        self.set_world_ranks()
        if self._uses_cuda():
            torch.cuda.set_device(self.root_device)
        self.parallel_devices = [self.root_device]
        log.info(
            "Horovod rank %d/%d (local rank %d, node %d/%d) on %s; controller %s, NCCL %s",
            hvd.rank(), hvd.size(), hvd.local_rank(), hvd.cross_rank(), hvd.cross_size(), self.root_device,
            "gloo" if hvd.gloo_enabled() else "mpi", "yes" if hvd.nccl_built() else "no",
        )
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ setup, optimizers, teardown
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)  # accelerator, precision, model to device, configure_optimizers
        if trainer.state.fn != TrainerFn.FITTING:
            return
        assert self.lightning_module is not None
        if self.alone:  # the plain optimizers step on the rank's own gradients
            return
        # The model was restored from ckpt_path (if any) before this hook, so rank 0's weights are the ones to keep.
        hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
        log.debug("broadcast model parameters and buffers from rank 0")
        self.optimizers = [self._wrap_optimizer(opt, trainer.accumulate_grad_batches) for opt in self.optimizers]

    def _wrap_optimizer(self, optimizer: Optimizer, backward_passes_per_step: int) -> Optimizer:
        optimizer = unwrap(optimizer)
        if is_horovod_optimizer(optimizer):
            return optimizer
        assert self.lightning_module is not None
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        named = [(name, p) for name, p in self.lightning_module.named_parameters() if id(p) in params]
        wrapped = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=named,
            compression=self._compression,
            backward_passes_per_step=max(1, int(backward_passes_per_step)),
        )
        if optimizer.state:  # DistributedOptimizer is a new object built from the param groups; carry any state over
            wrapped.load_state_dict(optimizer.state_dict())
        self._original_optimizers[id(wrapped)] = optimizer
        self._share_param_groups(wrapped)
        return wrapped

    def on_train_start(self) -> None:
        # Lightning restores optimizer state from ckpt_path after `setup`, so the optimizer states are made equal here,
        # after any restore and before the first step. Runs on every rank in every fit, so it cannot deadlock.
        if self.alone:
            return
        for optimizer in self.optimizers:
            optimizer = unwrap(optimizer)
            self._broadcast_optimizer_state(optimizer)
            self._share_param_groups(optimizer)

    def _share_param_groups(self, wrapped: Optimizer) -> None:
        """Point the optimizer from configure_optimizers (which the LR schedulers drive) at the wrapped one's param
        groups. torch's `load_state_dict` (a checkpoint restore) replaces an optimizer's group dicts, after which a
        scheduler would set the rate on groups that no longer step: a resumed run would keep the checkpoint's rate."""
        original = self._original_optimizers.get(id(wrapped))
        if original is not None and original.param_groups is not wrapped.param_groups:
            original.param_groups = wrapped.param_groups

    def _broadcast_optimizer_state(self, optimizer: Optimizer) -> None:
        root_has_state = hvd.broadcast_object(bool(optimizer.state), root_rank=0, name=_NAME + "opt_has_state")
        if root_has_state:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            # A rank whose own state was empty had Horovod take a zero-gradient step first to create it, which moves
            # weights under weight decay: send rank 0's weights once more (once per fit, only when resuming).
            assert self.lightning_module is not None
            hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
            log.debug("broadcast optimizer state and parameters from rank 0")
            return
        # A fresh optimizer: hvd.broadcast_optimizer_state would take a zero-gradient step to create the state, which
        # moves weights under weight decay and advances Adam's step count. Only the hyper-parameters are synced.
        optimizer.state.clear()
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        hyper = hvd.broadcast_object(hyper, root_rank=0, name=_NAME + "opt_hyper")
        for group, values in zip(optimizer.param_groups, hyper):
            group.update(values)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # GradientAccumulationScheduler may change accumulate_grad_batches between epochs.
        if not self._original_optimizers:  # nothing wrapped (one rank): no Horovod optimizer to adjust
            return
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return
        passes = max(1, int(trainer.accumulate_grad_batches))
        for optimizer in self.optimizers:
            optimizer = unwrap(optimizer)
            if (is_horovod_optimizer(optimizer) and optimizer.backward_passes_per_step != passes
                    and not optimizer._handles):
                optimizer.set_backward_passes_per_step(passes)

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        optimizer = unwrap(optimizer)
        if not is_horovod_optimizer(optimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_synchronize() -> Any:
            result = closure()  # training_step + backward: Horovod's hooks start the allreduces
            self._synchronize(optimizer)  # wait for them: the gradients are now averaged over the ranks
            return result

        with optimizer.skip_synchronize():
            output = super().optimizer_step(optimizer, closure_then_synchronize, model, **kwargs)
        original = self._original_optimizers.get(id(optimizer))
        if original is not None:
            # LR schedulers watch the optimizer from configure_optimizers; tell them it stepped (they share param groups)
            original._opt_called = True
        return output

    def _synchronize(self, optimizer: Optimizer) -> None:
        if not self._skip_steps_without_gradients:
            # Every rank runs the same number of steps (the equal-steps plan), so the gradients are averaged with no
            # decision first: no blocking collective and no host read per step beyond the averaging itself. A rank
            # that ran no backward pass contributes zeros through the same named allreduces (Horovod fills its
            # missing gradients), so it neither hangs nor diverges; in a step where no rank had gradients every rank
            # steps on zero gradients (identical everywhere; weight decay and momentum still apply).
            optimizer.synchronize()
            return
        local_has_grads = bool(getattr(optimizer, "_handles", None))  # filled by Horovod's hooks during backward
        if not self.reduce_boolean_decision(local_has_grads, all=False):
            # No rank ran a backward pass since the last step: nothing to average, and torch optimizers skip
            # parameters whose .grad is None. (If only some ranks had gradients, the others contribute zeros.)
            log.debug("no gradients on any rank in this step; skipping gradient synchronisation")
            return
        optimizer.synchronize()

    def teardown(self) -> None:
        # Hand the plain optimizers (with the trained state) back, and make the Horovod hooks inert so that a later
        # fit on the same model cannot allreduce twice. hvd.shutdown() is the caller's business.
        restored = []
        for optimizer in self.optimizers:
            optimizer = unwrap(optimizer)
            original = self._original_optimizers.pop(id(optimizer), None)
            if original is None:
                restored.append(optimizer)
                continue
            original.state = optimizer.state
            disarm(optimizer)
            restored.append(original)
        if restored:
            self.optimizers = restored
        super().teardown()

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: Optional[str] = None) -> None:
        # hvd.join() is not a barrier: ranks that joined contribute zeros to the other ranks' allreduces.
        if not self.alone:
            hvd.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.alone:
            return obj
        # A fixed name: Horovod names the op after type(obj) by default, which differs when ranks pass different types.
        return hvd.broadcast_object(obj, root_rank=src, name=_NAME + "broadcast")

    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Union[Tensor, Any]:
        """Allreduce ``tensor`` over all ranks: mean (default), sum, max, min or product; non-tensors are returned."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is not None:
            raise ValueError("Horovod reduces over all ranks only; pass group=None.")
        op = horovod_op(reduce_op)
        if op == hvd.Average and not (tensor.is_floating_point() or tensor.is_complex()):
            tensor = tensor.to(torch.get_default_dtype())  # Horovod averages integers with integer division
        if self.alone:  # every op over one rank gives its own values (a new tensor, as an allreduce would)
            return tensor.clone()
        return hvd.allreduce(tensor, op=op, name=_NAME + "reduce")

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Gather ``tensor`` from every rank into shape ``(world_size, *tensor.shape)`` (same shape on every rank)."""
        if group is not None:
            raise ValueError("Horovod gathers over all ranks only; pass group=None.")
        with torch.set_grad_enabled(sync_grads and torch.is_grad_enabled()):
            if self.alone:
                return tensor.contiguous().unsqueeze(0).clone()
            return hvd.allgather(tensor.contiguous().unsqueeze(0), name=_NAME + "all_gather")

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self.alone:
            return bool(decision)
        flag = torch.tensor([int(bool(decision))], dtype=torch.int32)
        count = hvd.allreduce(flag, op=hvd.Sum, name=_NAME + "decision")
        agreed = int(count.item())
        return agreed == hvd.size() if all else agreed > 0

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="Horovod data parallel (pipeline)")


if hvd is not None:
    HorovodStrategy.register_strategies(StrategyRegistry)
