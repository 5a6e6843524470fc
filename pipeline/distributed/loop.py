"""The super train loop: one `train()` for a single process, which each backend's rank entry calls
(pipeline/distributed/rank_process.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from pipeline.config import Config
from pipeline.data.plan import RunPlan, derive_plan, plan_lr
from pipeline.data.shards import ConvertedData
from pipeline.distributed.job_folder import JobFolder
from pipeline.log import get_logger, quiet_third_party_warnings

log = get_logger(__name__)


def job_plan(cfg: Config, data: ConvertedData, restore_from: Optional[str], attempt: int = 0) -> RunPlan:
    """The plan of a job over `data` as converted (its shards, its per-rank batch as planned: `derive_plan` with no
    further lowering), resuming from `restore_from` (a resolved path, or a train.ckpt_restore value the ranks
    resolve; None or "": the start)."""
    train = data.plan.train
    return derive_plan(cfg, data.plan, train.world_size, train.batch_size, restore_from or None, attempt, min_steps=0)


@dataclass
class TrainJob:
    """Everything a rank needs; picklable (no Spark session, no open files). `cfg` is the user's validated config and
    is never rewritten; what the driver learns while the job runs (the run's checkpoint folder, the restore point, the
    attempt, the batch it started with) lives in the job's own fields."""

    cfg: Config
    data: ConvertedData
    delta_table: str
    delta_version: int
    run_id: Optional[str] = None
    tracking_uri: Optional[str] = None
    job_dir: str = "work/jobs/current"
    # a folder where rank 0 hands each epoch's metrics to the driver and reads its verdict (callbacks.DriverVerdict)
    epoch_gate_dir: Optional[str] = None
    epoch_gate_timeout_s: float = 30.0
    # rank 0's tracker, made as tracker(tracking_uri, run_id, local_dir=job_dir) when run_id is set: the driver passes
    # the tracking layer's class (pipeline.tracking.rank_zero.RankZeroTracker), so this layer never imports it
    tracker: Optional[Callable[..., Any]] = None
    # where this job's checkpoints go (the driver: the run's own folder, <train.checkpoint_dir>/<run_id>); None: the
    # configured train.checkpoint_dir itself (a job without an MLflow run)
    checkpoint_dir: Optional[str] = None
    # what this launch trains with (pipeline.data.plan: ranks, per-rank batch, rate, steps, shards, the checkpoint it
    # resumes from, the attempt): the driver derives it, the restart policy re-derives it for each relaunch; a job
    # made without one (a test's, the bench's) gets `job_plan`'s, resuming from train.ckpt_restore as configured
    plan: Optional[RunPlan] = None
    # how often each rank marks its progress in the job folder, where the driver watches the launch for a stall
    # (pipeline/distributed/progress.py: the launcher sets it); None: not marked
    heartbeat_s: Optional[float] = None

    def __post_init__(self) -> None:
        if self.plan is None and self.data is not None:  # (a job with no data has no plan: some unit tests')
            self.plan = job_plan(self.cfg, self.data, self.cfg.train.ckpt_restore)

    @property
    def folder(self) -> JobFolder:
        """The job folder's layout (rank markers, the offline run): pipeline.distributed.job_folder."""
        return JobFolder(self.job_dir)

    @property
    def ckpt_dir(self) -> str:
        return self.checkpoint_dir or self.cfg.train.checkpoint_dir

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
    batch_size: int = 0  # per rank, as trained (data.batch_size, or what an OOM back-off left)


# What every rank's train() imports (its own imports, the model's and the data module's): a rank started early imports
# them while the driver prepares its job (pipeline/distributed/early_start.py)
RANK_IMPORTS = ("torch", "pytorch_lightning", "pipeline.distributed.callbacks", "pipeline.distributed.checkpoints.record",
                "pipeline.distributed.devices", "pipeline.distributed.telemetry", "pipeline.data.datamodule",
                "pipeline.model.module")


def _digest(module) -> str:
    """SHA-256 of the trainable parameters (BatchNorm running statistics are per-rank by design)."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted(module.named_parameters()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _make_datamodule(job: TrainJob, rank: int, world_size: int, normalize_on_device: bool):
    """The rank's data module; uint8 batches (normalised on the GPU by the model) where the loader offers them."""
    import inspect

    from pipeline.data.datamodule import make_datamodule

    if normalize_on_device and "normalize_on_device" in inspect.signature(make_datamodule).parameters:
        return make_datamodule(job.data, rank, world_size, job.cfg.data, normalize_on_device=True)
    return make_datamodule(job.data, rank, world_size, job.cfg.data)


def train(job: TrainJob, rank: int = 0, world_size: int = 1, strategy: Any = None, devices: int = 1,
          num_nodes: int = 1, local_rank: int = 0, local_world_size: Optional[int] = None) -> RankResult:
    """Train on shard `rank` of `world_size`; the same function for one process and for every rank.

    `local_rank` / `local_world_size`: this rank's index among, and the number of, the ranks on its host (None: all
    `world_size` ranks may share it); they pick the GPU and the thread count. Whether the rank trains on a GPU, its
    precision (`train.precision=auto`) and, for DDP, its backend are decided here, from this process's own CUDA.
    Rank 0 alone writes checkpoints and talks to MLflow (into the driver's run `job.run_id`).
    """
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.callbacks import EarlyStopping

    from pipeline.distributed.callbacks import (AtomicCheckpointIO, DriverVerdict, EpochAccounting, EpochCheckpoint,
                                                MinEpochsEarlyStopping, ResumedOptimizer, StopSignals, host_and_pid,
                                                min_epochs_of, progress_bar, quiet_profiler, skip_idle_step_hooks)
    from pipeline.distributed.checkpoints.layout import (BEST_STEM, LATEST_STEM, STEP_STEM, last_checkpoint,
                                                         resolve_restore_point)
    from pipeline.distributed.checkpoints.record import (CheckpointRecord, RngCheckpoint, check_checkpoint_lineage,
                                                         plain_classifier)
    from pipeline.distributed.devices import (cuda_capability, rank_device_index, resolve_precision, threads_for_rank,
                                              trainer_strategy)
    from pipeline.distributed.faults import InjectedFaults, wanted
    from pipeline.distributed.telemetry import RankResources

    quiet_third_party_warnings()
    cfg = job.cfg
    previous_threads = torch.get_num_threads()
    threads = threads_for_rank(cfg.train.threads_per_rank, world_size if local_world_size is None else local_world_size)
    if threads is not None:
        torch.set_num_threads(threads)
    cuda = torch.cuda.is_available()  # this process's CUDA: what the launcher or Spark GPU scheduling left visible
    capability = None
    if cuda:
        device_index = rank_device_index(local_rank, torch.cuda.device_count())
        torch.cuda.set_device(device_index)
        capability = cuda_capability(device_index)
    precision = resolve_precision(cfg.train.precision, cuda, capability)
    pl.seed_everything(cfg.train.seed, workers=True, verbose=False)
    is_zero = rank == 0
    run = job.plan
    plan = job.data.plan
    batch, start, lr = run.batch_size, run.start_batch, run.lr  # the plan's rate: model.lr scaled to its global batch
    if run.world_size != world_size:  # a rank started outside the plan (a test's one process over a 2-rank plan)
        lr = plan_lr(run.base_lr, run.lr_scaling, world_size, batch, start)
    if is_zero:
        log.info("training on %d rank(s), batch %d per rank%s, lr %.4g (%s scaling of %.4g), %s, precision %s, "
                 "%s torch threads per rank, attempt %d", world_size, batch,
                 "" if batch == start else f" (backed off from {start})", lr, run.lr_scaling, run.base_lr,
                 f"GPU (capability {capability})" if cuda else "CPU", precision,
                 threads if threads is not None else f"{torch.get_num_threads()} (torch's default)", run.attempt)

    dm = _make_datamodule(job, rank, world_size, normalize_on_device=cuda)
    model = model_for(job, lr)
    if cfg.train.compile:  # before the strategy wraps it (train.compile)
        model.compile_network()

    tracker = None
    if is_zero and job.run_id and job.tracker is not None:
        tracker = job.tracker(job.tracking_uri, job.run_id, local_dir=job.job_dir)
        tracker.record_precision(precision)
        tracker.record_tag("decode", dm.decode_used)  # where this run decodes: data.decode, auto resolved
        # this machine sampled into the run in the background; a relaunch continues the same run's series
        tracker.start_telemetry(cfg.mlflow.system_metrics_interval_s, resume=run.attempt > 0)

    ckpt_dir = job.ckpt_dir
    es = cfg.train.early_stopping
    stop = StopSignals(last_checkpoint(ckpt_dir))
    resources = RankResources()  # every rank's host CPU and memory, peak RSS and peak GPU memory, per epoch
    accounting = EpochAccounting(report=tracker.log_epoch if tracker else None, extra=resources.epoch_metrics)
    # the best checkpoint when the monitored metric improves; the last one after EVERY epoch (a monitored
    # ModelCheckpoint writes its last only in epochs that improved, so a resume would go back to the last improving
    # epoch) and, with train.checkpoint_every_n_steps, every N steps too (resume then continues inside the epoch);
    # none at the end of an epoch SIGTERM stopped mid-way (EpochCheckpoint: StopSignals' mid-epoch last.ckpt stays)
    checkpoint = EpochCheckpoint(dirpath=ckpt_dir, filename=BEST_STEM, monitor=es.monitor, mode=es.mode,
                                 save_top_k=1, save_last=False, enable_version_counter=False)
    latest = EpochCheckpoint(dirpath=ckpt_dir, filename=LATEST_STEM, monitor=None, save_top_k=1, save_last=True,
                             enable_version_counter=False)
    record = CheckpointRecord(job.lineage, batch_size=batch, world_size=world_size,
                              steps_per_epoch=plan.train.steps_per_epoch, lr=lr)
    # a resume whose checkpoint's optimizer settings differ from the config's: a warning and the run's tag
    optimizer = ResumedOptimizer(on_mismatch=(lambda text: tracker.record_tag("optimizer_from_checkpoint", text))
                                 if tracker is not None else None)
    callbacks = [stop, resources, accounting, checkpoint, latest, record, RngCheckpoint(), optimizer]
    if cfg.train.checkpoint_every_n_steps:
        callbacks.append(EpochCheckpoint(dirpath=ckpt_dir, filename=STEP_STEM, monitor=None, save_top_k=1,
                                         save_last=True, every_n_train_steps=cfg.train.checkpoint_every_n_steps,
                                         enable_version_counter=False))
    if wanted(cfg.debug):  # fault injection for tests: a callback, never the model's (injected on the first attempt)
        callbacks.append(InjectedFaults(cfg.debug, first_attempt=run.attempt == 0))
    if job.heartbeat_s:  # the driver's stall watchdog reads it (pipeline/distributed/progress.py)
        from pipeline.distributed.progress import heartbeat

        callbacks.append(heartbeat(job.folder, rank, job.heartbeat_s))
    gate = DriverVerdict(job.epoch_gate_dir, job.epoch_gate_timeout_s) if job.epoch_gate_dir else None
    if gate is not None:
        callbacks.append(gate)
    if es.enabled:
        callbacks.append(MinEpochsEarlyStopping(
            monitor=es.monitor, mode=es.mode, min_delta=es.min_delta, patience=es.patience,
            stopping_threshold=es.stopping_threshold, check_finite=True, verbose=False,
            min_epochs=min_epochs_of(es.min_epochs, es.patience, cfg.train.warmup_epochs, cfg.train.max_epochs)))
    progress = is_zero and os.environ.get("LAKEHOUSE_PROGRESS", "1") == "1"
    if progress:  # redrawn twice a second, not at every step
        callbacks.append(progress_bar())
    trainer = pl.Trainer(
        max_epochs=cfg.train.max_epochs, accelerator="gpu" if cuda else "cpu", precision=precision,
        devices=devices, num_nodes=num_nodes,
        strategy=trainer_strategy(strategy, world_size), plugins=[AtomicCheckpointIO()],
        callbacks=callbacks, logger=False, enable_progress_bar=progress, profiler=quiet_profiler(),
        enable_model_summary=is_zero, num_sanity_val_steps=0, deterministic=False,
        use_distributed_sampler=False, log_every_n_steps=max(1, plan.train.steps_per_epoch))
    skip_idle_step_hooks(trainer.callbacks)  # Lightning's per-step calls of hooks that do nothing (callbacks.py)

    ckpt_path = resolve_restore_point(run.restore_from, ckpt_dir, cfg.train.checkpoint_dir)
    try:  # (a refused checkpoint, too, stops the telemetry and restores the threads below)
        if ckpt_path:
            check_checkpoint_model(ckpt_path, dict(model.hparams))  # before Lightning loads its weights: names keys
            trained = check_checkpoint_lineage(ckpt_path, job.lineage, cfg.train.ckpt_allow_other_data)
            dm.train_loader.resume_at(trained)  # a mid-epoch checkpoint continues its epoch's stream where it stopped
            if is_zero:
                log.info("resuming from %s", ckpt_path)
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path, weights_only=True)
    finally:
        stop.restore()
        if tracker is not None:
            tracker.stop_telemetry()
        if threads is not None:
            torch.set_num_threads(previous_threads)  # a single-process run happens in the caller's process

    if stop.reason and stop.reason.startswith("SIGTERM"):
        # Launchers may kill the ranks right after they stop (horovod.run does, 5 s after SIGTERM), so the
        # driver learns why from this marker rather than from a return value that may never arrive.
        job.folder.write(rank, "sigterm", stop.reason)
    result = RankResult(rank=rank, world_size=world_size, lr=lr, batch_size=batch, **host_and_pid())
    if trainer.optimizers:  # the rate the optimizer was actually built with (before the schedule)
        groups = trainer.optimizers[0].param_groups  # the head's rate where model.backbone_lr made two groups
        group = next((g for g in groups if g.get("name") == "head"), groups[0])
        result.lr = float(group.get("initial_lr", group["lr"]))
    result.epochs = trainer.current_epoch
    result.history = accounting.history
    result.stop_reason = stop.reason or (gate.reason if gate is not None else None)
    early = next((c for c in callbacks if isinstance(c, EarlyStopping)), None)
    result.stopped_early = bool(early is not None and early.stopped_epoch > 0) or result.stop_reason is not None
    if early is not None and early.stopped_epoch > 0 and result.stop_reason is None:
        result.stop_reason = f"early stopping on {es.monitor} at epoch {early.stopped_epoch}"
    # Lightning restores best_model_path from a checkpoint of another run's folder too (train.ckpt_restore=<run>/...):
    # only this run's own best.ckpt is registered
    best = own_checkpoint(checkpoint.best_model_path, ckpt_dir)
    result.best_checkpoint = best
    result.final_weights_digest = _digest(model)

    sharded = bool(getattr(strategy, "shards_the_model", False))  # the strategy says (fsdp.LakehouseFSDPStrategy)
    # FSDP has no whole model in memory: its last checkpoint; not the mid-epoch one of a SIGTERM stop, whose epoch
    # the history does not hold (nothing is registered then: the run stopped)
    if sharded and not (best and os.path.exists(best)) and not stop.mid_epoch:
        best = last_checkpoint(ckpt_dir)
    state = None
    if is_zero and accounting.history:  # rank 0 reports and registers: the same epoch's weights and metrics
        state, result.metrics = weights_to_register(accounting.history, best, ckpt_dir)
    if tracker is not None:
        tracker.close()  # metrics buffered while the server was away: sent now, or kept in the job folder
    if is_zero and tracker is not None and stop.reason is None and (gate is None or gate.reason is None):
        if sharded:  # FSDP left the module wrapped and sharded: rank 0 rebuilds it whole from the checkpoint
            model = plain_classifier(cfg.model, job.data.channels, len(job.data.class_names), lr, state)
        elif state is not None:
            model.load_state_dict(state)
        result.model_uri = tracker.finish(model, job, accounting.history, result)
    return result


def own_checkpoint(path: Optional[str], folder: str) -> Optional[str]:
    """`path` when it names a file inside this run's checkpoint folder `folder`, else None (with a warning for a
    path elsewhere: Lightning restores `best_model_path` from a resumed checkpoint of another run's folder)."""
    if not path:
        return None
    inside = os.path.commonpath([os.path.realpath(path), os.path.realpath(folder)]) == os.path.realpath(folder)
    if not inside:
        log.warning("best checkpoint %s is not in this run's folder %s (restored from the checkpoint resumed from); "
                    "not registered: the run's final weights and last epoch are", path, folder)
        return None
    return path


def weights_to_register(history: List[Dict[str, Any]], best: Optional[str], folder: Optional[str] = None
                        ) -> Tuple[Optional[Dict[str, Any]], Dict[str, float]]:
    """The weights rank 0 registers and the metrics reported with them (run, version tag, summary, tune value),
    always one epoch's: checkpoint `best`'s state dict with the metrics of the epoch it records; where no checkpoint
    was written, None (the final weights in memory) with the last epoch's metrics. `folder` (the run's checkpoint
    folder): a `best` outside it is not this run's and counts as none (`own_checkpoint`).

    The epoch is read from the checkpoint, not chosen again from the history: a run resumed from another run's
    checkpoint carries that run's epochs in its history, whose best score Lightning does not carry into the new
    folder, so the best of the history can be an epoch whose weights are not in `best`."""
    from pipeline.distributed.checkpoints.io import weights_and_epoch

    if folder is not None:
        best = own_checkpoint(best, folder)
    state, epoch = None, history[-1].get("epoch")
    if best and os.path.exists(best):
        state, epoch = weights_and_epoch(best)
    entry = next((h for h in history if h.get("epoch") == epoch), None)
    if entry is None:
        raise RuntimeError(f"checkpoint {best} holds the weights of epoch {epoch}, which this run's epoch history "
                           f"(epochs {[h.get('epoch') for h in history]}) does not have: its metrics are unknown")
    return state, {k: v for k, v in entry.items() if isinstance(v, float)}


# the hyperparameters that decide a network's shapes (ImageClassifier's hparams; "model.x": its model config's key x)
SHAPE_KEYS = ("model.arch", "model.width", "model.input_size", "num_classes", "channels")


def _hparam(hparams: Dict[str, Any], key: str) -> Tuple[bool, Any]:
    node: Any = hparams
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def check_checkpoint_model(path: str, hparams: Dict[str, Any]) -> None:
    """Refuse checkpoint `path` when the model hyperparameters it records (`hyper_parameters`: model.arch, model.width,
    model.input_size, num_classes, channels) differ from this job's model's `hparams`: its weights have other shapes.
    A key the checkpoint does not record is not compared (Lightning's load then names a shape that differs).

    Raises:
        CheckpointError: naming the file and each differing key with both values (not restartable: a relaunch would
            fail on the same file).
    """
    from pipeline.distributed.checkpoints.io import CheckpointError, checkpoint_meta, read_checkpoint
    from pipeline.distributed.checkpoints.layout import is_sharded_checkpoint

    if is_sharded_checkpoint(path):
        meta = checkpoint_meta(path)  # meta.pt: no weights in it
    else:
        try:
            meta = read_checkpoint(path, mmap=True)  # the weights mapped, not read
        except CheckpointError:
            meta = checkpoint_meta(path)  # a file mmap cannot map (torch's legacy format)
    recorded = meta.get("hyper_parameters") or {}
    differing = []
    for key in SHAPE_KEYS:
        has, theirs = _hparam(recorded, key)
        _, ours = _hparam(hparams, key)
        if has and theirs != ours:
            differing.append(f"{key} {theirs!r} (this job: {ours!r})")
    if differing:
        raise CheckpointError(f"checkpoint {path} holds a model of other shapes than this job's: "
                              f"{', '.join(differing)}; resume it with the model settings it was trained with, or "
                              f"unset train.ckpt_restore to train from the start")


def model_for(job: TrainJob, lr: float):
    """The LightningModule a rank trains: the network of model.*, its rate and schedule; nothing else of the config
    (the debug: section's faults are a callback, pipeline/distributed/faults.py), so its hyperparameters, saved in every
    checkpoint, are what trains it."""
    from pipeline.model.module import ImageClassifier

    cfg = job.cfg
    return ImageClassifier.from_config(
        cfg.model, job.data.channels, len(job.data.class_names), lr, warmup_epochs=cfg.train.warmup_epochs,
        steps_per_epoch=job.data.plan.train.steps_per_epoch, max_epochs=cfg.train.max_epochs,
        channels_last=cfg.data.channels_last)

