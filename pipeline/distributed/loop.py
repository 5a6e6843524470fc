"""The super train loop: one `train()` for a single process, wrapped by the Horovod and DDP rank entries."""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from pipeline.config import Config
from pipeline.data.convert import ConvertedData
from pipeline.log import get_logger, quiet_third_party_warnings, setup_logging

log = get_logger(__name__)


class CheckpointLineageError(RuntimeError):
    """A checkpoint was trained on another Delta table or version than this job."""


@dataclass
class TrainJob:
    """Everything a rank needs; picklable (no Spark session, no open files)."""

    cfg: Config
    data: ConvertedData
    delta_table: str
    delta_version: int
    run_id: Optional[str] = None
    tracking_uri: Optional[str] = None
    job_dir: str = "work/jobs/current"

    @property
    def lineage(self) -> Dict[str, Any]:
        return {"delta_table": self.delta_table, "delta_version": self.delta_version}


@dataclass
class RankResult:
    rank: int
    world_size: int
    host: str
    pid: int
    epochs: int = 0
    stopped_early: bool = False
    stop_reason: Optional[str] = None
    metrics: Dict[str, float] = field(default_factory=dict)
    history: List[Dict[str, float]] = field(default_factory=list)
    model_uri: Optional[str] = None
    best_checkpoint: Optional[str] = None
    lr: float = 0.0
    final_weights_digest: Optional[str] = None


def resolve_checkpoint(cfg: Config) -> Optional[str]:
    """`train.ckpt_restore`: None, `last` (the checkpoint folder's last.ckpt) or a path."""
    value = cfg.train.ckpt_restore
    if not value:
        return None
    path = os.path.join(cfg.train.checkpoint_dir, "last.ckpt") if value == "last" else value
    if not os.path.exists(path):
        raise FileNotFoundError(f"config key 'train.ckpt_restore': checkpoint {path} does not exist")
    return path


def check_checkpoint_lineage(path: str, lineage: Dict[str, Any], allow_other: bool) -> None:
    """Refuse a checkpoint from another Delta table or version unless `train.ckpt_allow_other_data`."""
    import torch

    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    theirs = ckpt.get("lakehouse") or {}
    if any(theirs.get(k) != v for k, v in lineage.items()):
        msg = (f"checkpoint {path} was trained on {theirs.get('delta_table')} version {theirs.get('delta_version')}, "
               f"this job reads {lineage['delta_table']} version {lineage['delta_version']}")
        if not allow_other:
            raise CheckpointLineageError(msg + "; set train.ckpt_allow_other_data=true to resume anyway")
        log.warning("%s; resuming anyway (train.ckpt_allow_other_data=true)", msg)


def _digest(module) -> str:
    """SHA-256 of the trainable parameters (BatchNorm running statistics are per-rank by design)."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted(module.named_parameters()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(job: TrainJob, rank: int = 0, world_size: int = 1, strategy: Any = None, devices: int = 1,
          num_nodes: int = 1) -> RankResult:
    """Train on shard `rank` of `world_size`; the same function for one process and for every rank.

    Rank 0 alone writes checkpoints and talks to MLflow (into the driver's run `job.run_id`).
    """
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint

    from pipeline.data.datamodule import make_datamodule
    from pipeline.distributed.callbacks import (AtomicCheckpointIO, EpochAccounting, LineageCheckpoint, StopSignals,
                                                host_and_pid)
    from pipeline.model.module import ImageClassifier, scaled_lr

    quiet_third_party_warnings()
    cfg = job.cfg
    torch.set_num_threads(max(1, cfg.train.threads_per_rank))
    pl.seed_everything(cfg.train.seed, workers=True, verbose=False)
    is_zero = rank == 0
    lr = scaled_lr(cfg.model.lr, world_size, cfg.train.lr_scaling)
    if is_zero:
        log.info("training on %d rank(s), lr %.4g (%s scaling of %.4g)", world_size, lr, cfg.train.lr_scaling,
                 cfg.model.lr)

    dm = make_datamodule(job.data, rank, world_size, cfg.data)
    plan = job.data.plan
    model = ImageClassifier.from_config(
        cfg.model, job.data.channels, len(job.data.class_names), lr, warmup_epochs=cfg.train.warmup_epochs,
        steps_per_epoch=plan.train.steps_per_epoch, max_epochs=cfg.train.max_epochs,
        nan_at_step=cfg.train.nan_at_step, fail_at_step=cfg.train.fail_at_step, fail_rank=cfg.train.fail_rank)

    tracker = None
    if is_zero and job.run_id:
        from pipeline.tracking.rank_zero import RankZeroTracker

        tracker = RankZeroTracker(job.tracking_uri, job.run_id)

    ckpt_dir = cfg.train.checkpoint_dir
    es = cfg.train.early_stopping
    stop = StopSignals(os.path.join(ckpt_dir, "last.ckpt"))
    accounting = EpochAccounting(report=tracker.log_epoch if tracker else None)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor=es.monitor, mode=es.mode,
                                 save_top_k=1, save_last=True, enable_version_counter=False)
    callbacks = [stop, accounting, checkpoint, LineageCheckpoint(job.lineage)]
    if es.enabled:
        callbacks.append(EarlyStopping(monitor=es.monitor, mode=es.mode, min_delta=es.min_delta,
                                       patience=es.patience, stopping_threshold=es.stopping_threshold,
                                       check_finite=True, verbose=False))
    trainer = pl.Trainer(
        max_epochs=cfg.train.max_epochs, accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=devices, num_nodes=num_nodes,
        strategy=strategy if strategy is not None else "auto", plugins=[AtomicCheckpointIO()],
        callbacks=callbacks, logger=False, enable_progress_bar=is_zero and os.environ.get("LAKEHOUSE_PROGRESS", "1") == "1",
        enable_model_summary=is_zero, num_sanity_val_steps=0, deterministic=False,
        use_distributed_sampler=False, log_every_n_steps=max(1, plan.train.steps_per_epoch))

    ckpt_path = resolve_checkpoint(cfg)
    if ckpt_path:
        check_checkpoint_lineage(ckpt_path, job.lineage, cfg.train.ckpt_allow_other_data)
        if is_zero:
            log.info("resuming from %s", ckpt_path)
    try:
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    finally:
        stop.restore()

    if stop.reason and stop.reason.startswith("SIGTERM"):
        # Launchers may kill the ranks right after they stop (horovod.run does, 5 s after SIGTERM), so the
        # driver learns why from this marker rather than from a return value that may never arrive.
        os.makedirs(job.job_dir, exist_ok=True)
        with open(os.path.join(job.job_dir, f"rank{rank}.sigterm"), "w") as fh:
            fh.write(stop.reason)
    result = RankResult(rank=rank, world_size=world_size, lr=lr, **host_and_pid())
    if trainer.optimizers:  # the rate the optimizer was actually built with (before the schedule)
        group = trainer.optimizers[0].param_groups[0]
        result.lr = float(group.get("initial_lr", group["lr"]))
    result.epochs = trainer.current_epoch
    result.history = accounting.history
    result.stop_reason = stop.reason
    early = next((c for c in callbacks if isinstance(c, EarlyStopping)), None)
    result.stopped_early = bool(early is not None and early.stopped_epoch > 0) or stop.reason is not None
    if early is not None and early.stopped_epoch > 0 and stop.reason is None:
        result.stop_reason = f"early stopping on {es.monitor} at epoch {early.stopped_epoch}"
    best = checkpoint.best_model_path if checkpoint.best_model_path else None
    result.best_checkpoint = best
    result.final_weights_digest = _digest(model)

    best_epoch = None
    if accounting.history:
        key = es.monitor
        pick = min if es.mode == "min" else max
        finite = [h for h in accounting.history if h.get(key) == h.get(key)]
        best_epoch = pick(finite, key=lambda h: h[key]) if finite else accounting.history[-1]
        result.metrics = {k: v for k, v in best_epoch.items() if isinstance(v, float)}
    if is_zero and tracker is not None and stop.reason is None:
        if best and os.path.exists(best):
            state = torch.load(best, map_location="cpu", weights_only=False)["state_dict"]
            model.load_state_dict(state)
        result.model_uri = tracker.finish(model, job, accounting.history, result)
    return result


def _write_failure(job: TrainJob, rank: int, exc: BaseException) -> None:
    try:
        os.makedirs(job.job_dir, exist_ok=True)
        with open(os.path.join(job.job_dir, f"rank{rank}.error"), "w") as fh:
            fh.write(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
    except OSError:
        pass


def repair_horovod_env() -> None:
    """Undo a horovod.run (0.28.1) bug before `hvd.init()`: a stray comma in its argument defaults hands every rank
    HOROVOD_CYCLE_TIME="(None,)" and HOROVOD_CACHE_CAPACITY="(None,)", which Horovod parses as 0: a background
    thread that negotiates without pause (measured: 20-65 % of a core per idle rank) and no response cache.
    The value set by the launcher (LAKEHOUSE_HOROVOD_CYCLE_TIME, ...) is restored, else Horovod's default.
    """
    for key in ("HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY"):
        if os.environ.get(key, "").startswith("("):
            wanted = os.environ.get(f"LAKEHOUSE_{key}")
            if wanted:
                os.environ[key] = wanted
            else:
                del os.environ[key]


def horovod_worker(job: TrainJob) -> RankResult:
    """The Horovod entry of the super train loop: init, shard = rank, LR × size, then the same `train()`."""
    setup_logging()
    import horovod.torch as hvd

    from pipeline.distributed.horovod_strategy import HorovodStrategy

    repair_horovod_env()
    hvd.init()
    rank = hvd.rank()
    try:
        return train(job, rank, hvd.size(), HorovodStrategy())
    except BaseException as exc:
        log.error("rank %d failed: %s: %s", rank, type(exc).__name__, exc)
        _write_failure(job, rank, exc)
        raise


def ddp_worker(job: TrainJob) -> RankResult:
    """The DDP entry (torch.distributed over gloo), launched by Spark's TorchDistributor."""
    setup_logging()
    from pytorch_lightning.strategies import DDPStrategy

    rank = int(os.environ.get("RANK", "0"))
    size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
        return train(job, rank, size, DDPStrategy(process_group_backend="gloo"), devices=local,
                     num_nodes=max(1, size // local))
    except BaseException as exc:
        log.error("rank %d failed: %s: %s", rank, type(exc).__name__, exc)
        _write_failure(job, rank, exc)
        raise
