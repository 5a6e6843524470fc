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
    # rank 0: the confusion matrix (rows = true class) of the epoch whose weights and metrics are registered
    confusion: Optional[List[List[int]]] = None


# What every rank's train() imports (its own imports, the model's and the data module's): a rank started early imports
# them while the driver prepares its job (pipeline/distributed/early_start.py)
RANK_IMPORTS = ("torch", "pytorch_lightning", "pipeline.distributed.callbacks",
                "pipeline.distributed.checkpoints.record", "pipeline.distributed.devices",
                "pipeline.distributed.telemetry", "pipeline.data.datamodule", "pipeline.model.module")


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
                                                LastCheckpoint, MinEpochsEarlyStopping, ResumedOptimizer, StopSignals,
                                                host_and_pid, min_epochs_of, progress_bar, quiet_profiler,
                                                skip_idle_step_hooks)
    from pipeline.distributed.checkpoints.io import CheckpointError
    from pipeline.distributed.checkpoints.layout import BEST_STEM, last_checkpoint, resolve_restore_point
    from pipeline.distributed.checkpoints.record import (CheckpointRecord, RngCheckpoint, check_checkpoint_lineage,
                                                         config_split, plain_classifier)
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
    accounting = EpochAccounting(report=tracker.log_epoch if tracker else None, extra=resources.epoch_metrics,
                                 run_id=job.run_id)
    # the best checkpoint when the monitored metric improves; the last one after EVERY epoch (a monitored
    # ModelCheckpoint writes its last only in epochs that improved, so a resume would go back to the last improving
    # epoch) and, with train.checkpoint_every_n_steps, every N steps too but never at an epoch's last step, before
    # its validation (resume then continues inside the epoch; LastCheckpoint); none at the end of an epoch SIGTERM
    # stopped mid-way (EpochCheckpoint: StopSignals' mid-epoch last.ckpt stays)
    checkpoint = EpochCheckpoint(dirpath=ckpt_dir, filename=BEST_STEM, monitor=es.monitor, mode=es.mode,
                                 save_top_k=1, save_last=False, enable_version_counter=False)
    latest = LastCheckpoint(ckpt_dir)
    record = CheckpointRecord(job.lineage, batch_size=batch, world_size=world_size,
                              steps_per_epoch=plan.train.steps_per_epoch, lr=lr, split=config_split(cfg.data))
    # a resume whose checkpoint's optimizer settings differ from the config's: a warning and the run's tag
    optimizer = ResumedOptimizer(on_mismatch=(lambda text: tracker.record_tag("optimizer_from_checkpoint", text))
                                 if tracker is not None else None)
    callbacks = [stop, resources, accounting, checkpoint, latest, record, RngCheckpoint(), optimizer]
    if cfg.train.checkpoint_every_n_steps:
        callbacks.append(LastCheckpoint(ckpt_dir, every_n_train_steps=cfg.train.checkpoint_every_n_steps))
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
            trained = check_checkpoint_lineage(ckpt_path, {**job.lineage, **config_split(cfg.data)},
                                               cfg.train.ckpt_allow_other_data)
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
    # the history does not hold (nothing is registered then: the run stopped). A run that wrote none trained no epoch
    # (train.ckpt_restore of a run that had reached train.max_epochs): its final weights are those it resumed
    if sharded and not (best and os.path.exists(best)) and not stop.mid_epoch:
        best = last_checkpoint(ckpt_dir)
        if not os.path.exists(best) and ckpt_path:
            best = ckpt_path
    state = None
    if is_zero:  # rank 0 reports and registers: the same epoch's weights, metrics and confusion matrix
        # (the resumed checkpoint may be another run's: it is read where it is, as Lightning did)
        state, result.metrics, result.confusion = weights_to_register(
            accounting.history, best, None if best == ckpt_path else ckpt_dir, accounting.confusion)
    if tracker is not None:
        tracker.close()  # metrics buffered while the server was away: sent now, or kept in the job folder
    if is_zero and tracker is not None and stop.reason is None and (gate is None or gate.reason is None):
        if state is None and (sharded or (not ckpt_path and trainer.global_step == 0)):
            # never a freshly initialised network: FSDP has no whole model in memory, and one that neither trained
            # nor resumed has only its initial weights
            why = (f"the sharded (FSDP) model is not whole in memory and neither this run's folder {ckpt_dir} nor "
                   f"a resumed checkpoint holds a checkpoint of it" if sharded else
                   "the network trained no step and resumed no checkpoint: its weights are the initial ones")
            raise CheckpointError(f"rank 0 has no trained weights to register: {why}; nothing is registered")
        if sharded:  # FSDP left the module wrapped and sharded: rank 0 rebuilds it whole from the checkpoint
            model = plain_classifier(cfg.model, job.data.channels, len(job.data.class_names), lr, state)
        elif state is not None:
            model.load_state_dict(state)
        result.model_uri = tracker.finish(model, job, accounting.history, result, own=accounting.own_epochs())
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


def weights_to_register(history: List[Dict[str, Any]], best: Optional[str], folder: Optional[str] = None,
                        confusion: Optional[Dict[int, List[List[int]]]] = None
                        ) -> Tuple[Optional[Dict[str, Any]], Dict[str, float], Optional[List[List[int]]]]:
    """The weights rank 0 registers, the metrics reported with them (run, version tag, summary, tune value) and the
    confusion matrix logged with them, always one epoch's of one attempt: checkpoint `best`'s state dict with the
    record of its epoch that the checkpoint itself holds (EpochAccounting's state, saved in the same write as the
    weights); where no checkpoint was written, None (the final weights in memory) with the last epoch of `history`
    and its matrix in `confusion` (this run's, by epoch). `folder` (the run's checkpoint folder): a `best` outside it
    is not this run's and counts as none (`own_checkpoint`); None: `best` is taken wherever it is (the checkpoint a
    run that trained no epoch resumed).

    The record is read from the checkpoint, not chosen again from `history`: a run resumed from another run's
    checkpoint carries that run's epochs in its history, whose best score Lightning does not carry into the new
    folder; and a rank killed between an epoch's best.ckpt and its last.ckpt leaves a best.ckpt of an epoch the
    restart trains again, which `history` then records with the retrained epoch's metrics. A checkpoint that records
    no history (written by another tool) is matched with `history` by its epoch."""
    from pipeline.distributed.callbacks import EpochAccounting
    from pipeline.distributed.checkpoints.io import (CheckpointError, checkpoint_meta, consolidated_state,
                                                     read_checkpoint)
    from pipeline.distributed.checkpoints.layout import is_sharded_checkpoint

    if folder is not None:
        best = own_checkpoint(best, folder)
    confusion = confusion or {}
    if not (best and os.path.exists(best)):
        if not history:
            return None, {}, None
        return None, _floats(history[-1]), confusion.get(history[-1].get("epoch"))
    if is_sharded_checkpoint(best):
        state, whole = consolidated_state(best), checkpoint_meta(best)
    else:
        whole = read_checkpoint(best)  # one read of the file: its weights and its record are one write's
        state = whole.get("state_dict")
    epoch = whole.get("epoch")
    for key, ok in (("state_dict", isinstance(state, dict)),
                    ("epoch", isinstance(epoch, int) and not isinstance(epoch, bool))):
        if not ok:
            raise CheckpointError(f"checkpoint {best} records no '{key}' (a trained model's checkpoint has one); "
                                  f"it cannot be registered")
    recorded = EpochAccounting.recorded(whole)
    if recorded is not None:
        entries, matrices = recorded["history"], recorded["confusion"]
    else:
        entries, matrices = history, confusion
    entry = next((h for h in entries if h.get("epoch") == epoch), None)
    if entry is None:
        whose = "its own" if recorded is not None else "this run's"
        raise RuntimeError(f"checkpoint {best} holds the weights of epoch {epoch}, which {whose} epoch history "
                           f"(epochs {[h.get('epoch') for h in entries]}) does not have: its metrics are unknown")
    ours = next((h for h in history if h.get("epoch") == epoch), None)
    if recorded is not None and ours is not None and not _same_record(ours, entry):
        log.warning("checkpoint %s holds epoch %d as an earlier attempt trained it (val_loss %s), not as this run's "
                    "history has it (val_loss %s, the epoch trained again after a restart): its weights are registered "
                    "with its own record", best, epoch, entry.get("val_loss"), ours.get("val_loss"))
    return state, _floats(entry), matrices.get(epoch)


def _floats(entry: Dict[str, Any]) -> Dict[str, float]:
    return {k: v for k, v in entry.items() if isinstance(v, float)}


def _same_record(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """Two records of an epoch are the same one (a NaN equal to a NaN)."""
    return a.keys() == b.keys() and all(a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]) for k in a)


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

