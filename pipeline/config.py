"""Configuration: one frozen dataclass per section (the only home of the defaults), YAML profiles merged with dotted
`key=value` overrides, and validation; a validated config is never changed, `apply_overrides` makes a new one."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import yaml

from pipeline.config_parse import ConfigError, build, merge, parse_override, read_yaml


@dataclass(frozen=True)
class SparkConfig:
    master: str = "local[2]"  # the Spark master: local[N], spark://host:7077, yarn; on Databricks the cluster's
    app_name: str = "lakehouse"  # the Spark application's name
    # Extra Spark settings (e.g. spark.jars / spark.jars.packages for the Delta jars).
    conf: Dict[str, str] = field(default_factory=dict)
    # Local folders every cluster host mounts at the same path (NFS, /dbfs, /Volumes). On a cluster (a master not on
    # this machine) the table, data.cache_dir, train.checkpoint_dir and a file-based MLflow store must be under one
    # of them or on cluster storage (dbfs:/, s3://, hdfs://); anything else is refused before a job starts.
    shared_paths: List[str] = field(default_factory=lambda: ["/dbfs", "/Volumes"])


@dataclass(frozen=True)
class DeltaConfig:
    engine: str = "delta-rs"  # delta-rs | spark
    table: str = "work/delta/images"  # a Delta table path (file://, s3a://, abfss://, dbfs:/) or catalog.schema.table
    version: Optional[int] = None  # null = latest, pinned when a job starts


@dataclass(frozen=True)
class IngestConfig:
    strict: bool = False  # true: any file skipped (listed in the ingest report) fails the ingest, nothing written
    on_bad_file: str = "skip"  # skip | fail; the older switch: fail is the same as strict: true
    label_depth: int = 1  # the label is folder N under the source (1: SOURCE/<label>/...); -1: the file's own folder
    extensions: List[str] = field(
        default_factory=lambda: [".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"])
    # a larger file is skipped (too_large, named in the report; strict: fails the ingest), never read: each file is
    # read whole into one row, and a 64 MB one exhausts Spark's default 1 GiB heap (local[2]): raise it together with
    # spark.conf.spark.driver.memory (local) or spark.conf.spark.executor.memory; at most 2048 (one binary cell)
    max_file_mb: float = 16.0


@dataclass(frozen=True)
class DataConfig:
    batch_size: Union[int, str] = 64  # per rank; auto: from data.auto_batch_start, halved on out-of-memory
    auto_batch_start: int = 256  # data.batch_size=auto starts here (per rank), down to 1
    # a small table: the per-rank batch is lowered so every epoch has at least this many steps (model.lr follows by
    # train.lr_scaling, as after an out-of-memory back-off); 0: data.batch_size whatever the table's size
    min_steps_per_epoch: int = 16
    val_fraction: float = 0.2  # the held-out share of rows (a stable hash of each row's data.split_key picks them)
    # content: the SHA-256 of the image bytes picks a row's split, the same wherever the files were mounted at ingest
    # (re-ingesting from another mount moves no row) | path: the absolute path, the rule of runs before this key
    # (a run that records no data.split_key was split by path; the gate reads each version's own rule)
    split_key: str = "content"
    cache_dir: str = "work/data_cache"  # converted Parquet, content-keyed, kept across jobs (`lakehouse cache`)
    cache_max_gb: float = 20.0  # least recently used entries are evicted above this; 0 = no bound
    reader: str = "petastorm"  # petastorm | arrow: how the ranks read the converted Parquet
    # converted: Spark splits (and with data.decode=convert decodes) the pinned version into the converted-data cache,
    # which the ranks read | direct: the ranks read the table's own Parquet files at the pinned version (delta-rs
    # pins and plans, no copy, no cache entry); the split, shuffle and resume rules are the same
    source: str = "converted"
    row_groups_per_rank: int = 32  # the converter sizes row groups so each rank gets about this many
    max_row_group_mb: float = 32.0  # no row group larger than this
    # ... and none smaller, down to one row group per partition (a reader pays a fixed cost per row group)
    min_row_group_mb: float = 1.0
    partitions_per_worker: int = 2  # the table is repartitioned to this many x the number of ranks
    image_size: int = 32  # the square side the model sees (data.decode says where images are brought to it)
    channels: int = 1  # 1 = greyscale, 3 = RGB
    # where images are decoded. convert: once, by Spark at conversion, resized to data.image_size (fixed pixels, no
    # augmentation; the cheapest epoch, right for small images such as the digits). cpu | gpu | auto: the conversion
    # keeps the encoded bytes and each rank decodes them every epoch with the ImageNet recipe at data.image_size
    # (train: random resized crop and flip; val: resize and center crop): cpu in data.decode_workers worker processes, gpu with
    # nvJPEG on the rank's GPU (torchvision; rows that are not JPEG on the CPU), auto: gpu on a CUDA rank, else cpu
    decode: str = "convert"
    decode_workers: int = 0  # decode=cpu|gpu|auto: processes per rank decoding on the CPU (1: a thread); 0: the host's cores / ranks
    # decode on the GPU (gpu, or auto on a CUDA rank): this share of each batch's rows is decoded by the rank's CPU decode
    # workers (data.decode_workers > 1) while nvJPEG decodes the rest, so both work on every batch; 0: nvJPEG alone
    decode_cpu_share: float = 0.0
    channels_last: bool = False  # batches in channels_last (NHWC) memory order, as GPU convolutions prefer
    reader_workers: int = 2  # per rank: threads reading and decoding row groups ahead of the step
    shuffle_buffer: int = 1024  # rows shuffled across row groups per rank (0: row groups in a shuffled order only)
    memory_cache_mb: int = 1024  # per rank: train then val shard, if it fits, read once then served from memory; 0 = never
    seed: int = 42  # the train/val split and the readers' shuffle


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "cnn"  # cnn | resnet | timm/<name> (any timm model, e.g. timm/resnet18; needs timm)
    lr: float = 0.01  # for one rank at data.batch_size; scaled by train.lr_scaling for the global batch
    optimizer: str = "sgd"  # sgd | adam
    momentum: float = 0.9  # SGD momentum (adam: beta1)
    weight_decay: float = 1e-4
    width: int = 32  # channels of the first layer of the cnn and resnet architectures
    # a local safetensors file, torch state dict or Hugging Face cache folder (timm archs); nothing is downloaded
    pretrained: Optional[str] = None
    # the backbone's input size; null: the pretrained config's (with model.pretrained), else data.image_size;
    input_size: Optional[int] = None  # resized on the device from data.image_size (images stay decoded once)
    mean: Optional[List[float]] = None  # per-channel normalisation; null: the pretrained config's, else 0.5
    std: Optional[List[float]] = None  # ... and its standard deviation; null: the pretrained config's, else 0.5
    interpolation: Optional[str] = None  # bilinear | bicubic | nearest
    freeze_backbone: bool = False  # train the head only ...
    unfreeze_at_epoch: Optional[int] = None  # ... until this epoch (0-based), then everything
    backbone_lr: Optional[float] = None  # the backbone's rate (scaled like model.lr); null: model.lr
    schedule: str = "warmup_cosine"  # warmup_cosine (train.warmup_epochs, then cosine) | constant


@dataclass(frozen=True)
class EarlyStoppingConfig:
    enabled: bool = True  # Lightning's EarlyStopping on the metric below
    monitor: str = "val_loss"  # val_loss | val_acc | train_loss | train_acc
    mode: str = "min"  # min | max
    min_delta: float = 0.01  # a smaller change is no improvement
    patience: int = 10  # epochs without improvement before training stops
    stopping_threshold: Optional[float] = None  # stop once the metric reaches this
    # Early stopping never stops before this many epochs (a non-finite metric, a NaN loss or SIGTERM still stop).
    # null: train.warmup_epochs + 2 x patience, at most train.max_epochs: a small table's val_loss can rise for a
    # patience window after the warm-up while BatchNorm's statistics settle (a 360-image, 4-class table stopped at
    # epoch 3 near chance, and reached 0.86 by epoch 8 without the stop). 0: no minimum
    min_epochs: Optional[int] = None


@dataclass(frozen=True)
class TrainConfig:
    backend: str = "horovod"  # horovod | ddp | fsdp | single
    np: int = -2  # -N: N processes here; N: N tasks on the Spark cluster; 1: this process
    max_epochs: int = 10  # at most this many epochs
    lr_scaling: str = "linear"  # linear | sqrt | none
    warmup_epochs: int = 1  # epochs of linear warm-up to model.lr (model.schedule=warmup_cosine)
    seed: int = 42  # initial weights and every rank's random state
    checkpoint_dir: str = "work/checkpoints"  # each run writes last.ckpt and best.ckpt under <this>/<run_id>/
    # last | best (this run's own <checkpoint_dir>/<run_id>/ folder) | <run_id>/last | <run_id>/best | PATH
    ckpt_restore: Optional[str] = None
    ckpt_allow_other_data: bool = False  # resume from a checkpoint of another Delta table, version or split
    checkpoint_every_n_steps: Optional[int] = None  # also checkpoint (last.ckpt) every N steps, mid-epoch
    max_restarts: int = 0  # a rank that dies: relaunch every rank from the last checkpoint, up to N times
    oom_backoff: bool = False  # a fixed data.batch_size: an out-of-memory halves it and relaunches (auto always does)
    # torch threads per rank; null: 1 when several ranks share a host, torch's default for a rank alone on its host
    threads_per_rank: Optional[int] = None
    # 32-true | bf16-mixed | 16-mixed | auto (bf16-mixed on a GPU with bfloat16, else 32-true; decided in each rank)
    precision: str = "auto"
    # torch.compile the network (nn.Module.compile, in each rank, before any strategy wraps it): the first steps
    # compile it (seconds to minutes, counted by `lakehouse bench --only step_overhead`); checkpoints and logged
    # models hold the plain network's weights. Needs a C compiler on a CPU rank
    compile: bool = False
    # Every rank must have started within this many seconds; with Horovod it is also Gloo's timeout for each
    # collective (one setting in Horovod), so a rank whose peer's host is lost fails after it (docs/multi-host.md)
    start_timeout_s: int = 120
    # Start the local rank processes (train.np=-N), and their imports of torch, Lightning and the backend, while the
    # driver pins, converts and plans the data; they take the job once it is made (off: they start after it)
    early_start: bool = True
    # A rank that cannot finish a collective within this many seconds shuts the job down (Horovod's stall check;
    # on a Spark cluster the launcher also gives the other ranks this long to return after one failed). Local
    # Horovod ranks (train.np=-N) that mark no step for this long, once each finished its first batch, are ended by
    # the driver: one batch, an epoch end's checkpoint or a tune verdict wait must fit in it (>= 1).
    stall_timeout_s: int = 120
    # Elastic (train.np=N on a cluster): after a restartable failure with fewer task slots left than the job's ranks
    # (a host lost), go on from the last checkpoint with the ranks that remain, down to this many (restated for the
    # smaller global batch); null: always relaunch the same world size
    min_np: Optional[int] = None
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)


@dataclass(frozen=True)
class MlflowConfig:
    tracking_uri: str = "sqlite:///work/mlflow.db"  # an MLflow store or server (http://host:5000, databricks)
    artifact_location: Optional[str] = "work/mlartifacts"  # a new experiment's artifact root; null: the server's
    experiment: str = "lakehouse"  # the MLflow experiment (created when missing)
    registered_model: str = "lakehouse_classifier"  # every train registers a version of this model
    promote: bool = True  # run the gate: the better of challenger and champion gets the `champion` alias
    gate_metric: str = "val_acc"  # what the gate compares, on the same held-out rows
    gate_mode: str = "max"  # max | min
    # promote only if the challenger beats the champion by more than this (same held-out rows; 0: strictly better)
    gate_margin: float = 0.0
    # ... and, first model included, only if it beats a constant guess on the same rows by more than this (val_acc:
    # the majority class's share; val_loss: the entropy of the labels; no floor for other metrics); null: no floor
    gate_min_lift: Optional[float] = 0.05
    retries: int = 3  # each MLflow call is retried this many times ...
    # ... the connection attempts at a command's start this many seconds apart, the same wait each time (no
    # doubling); also how often rank 0 probes a server that went away (`reconnect_wait_s`). An open run's HTTP
    # calls use MLflow's own retries instead: exponential backoff (MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR=1), at most
    # `retries` of them
    retry_wait_s: float = 2.0
    # the server unreachable when training ends: rank 0 waits this long for it, then leaves the run (metrics, plots,
    # model) in <job dir>/offline_run for `lakehouse sync-run`
    reconnect_wait_s: float = 120.0
    # runs a job could not end (the server was unreachable) are written here and ended at the next connection
    unended_runs: Optional[str] = "work/mlflow_unended_runs.jsonl"
    # rank 0's machine (CPU, memory, disk, network, every GPU NVML sees) sampled into the run every N seconds by
    # MLflow's system-metrics monitor, off the training thread; 0: off. Every rank's host CPU and memory and its peak
    # GPU memory are logged per epoch regardless (`<name>_rank_<r>`)
    system_metrics_interval_s: float = 10.0


@dataclass(frozen=True)
class TuneConfig:
    """`lakehouse tune`: the Optuna study around the same train (pipeline/tune)."""

    study: Optional[str] = None  # null: <space file name>-<UTC time>; `lakehouse tune --resume NAME` reopens one
    storage: Optional[str] = None  # Optuna RDB URL; null: sqlite optuna.db beside the MLflow SQLite store (else work/)
    metric: str = "val_loss"  # per-epoch validation metric: reported each epoch (pruning), best epoch = trial value
    direction: str = "minimize"  # minimize | maximize
    sampler: str = "tpe"  # tpe | random
    pruner: str = "median"  # median | none
    n_trials: int = 10  # trials of the study
    timeout_s: Optional[float] = None  # no new trial starts after this many seconds
    seed: Optional[int] = 42  # sampler seed
    startup_trials: int = 5  # finished trials before the median pruner prunes (and TPE's random trials)
    warmup_epochs: int = 0  # epochs of a trial before the median pruner may prune it
    verdict_timeout_s: float = 30.0  # how long rank 0 waits at an epoch end for the driver's pruning decision
    # a sweep records its running trial's heartbeat every N s; a sweep on the same study fails a trial silent for
    # 3 N s (its process is gone), never a live one
    heartbeat_s: int = 10


@dataclass(frozen=True)
class DebugConfig:
    """Fault injection for tests (pipeline/distributed/faults.py): read by a callback, never by the model, so none of
    it is saved in a checkpoint's hyperparameters or the registered model. Every fault hits the first attempt only."""

    fail_at_step: Optional[int] = None  # raise on this global step (and every later one)
    fail_rank: Optional[int] = None  # ... on this rank only (null: every rank); debug.kill_while_saving too
    # ... error (a RuntimeError) | oom (torch.OutOfMemoryError) | hang (the rank stops answering, alive)
    fail_with: str = "error"
    nan_at_step: Optional[int] = None  # the training loss is NaN from this global step
    # SIGKILL the rank while it writes last.ckpt at this global step or later: once its part (its FSDP shard; rank 0's
    # file otherwise) is on disk and before the checkpoint is complete
    kill_while_saving: Optional[int] = None


@dataclass(frozen=True)
class Config:
    spark: SparkConfig = field(default_factory=SparkConfig)
    delta: DeltaConfig = field(default_factory=DeltaConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)  # fault injection for tests

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def flat(self) -> Dict[str, Any]:
        """The config as dotted keys, e.g. {'train.np': -2}, for MLflow params."""
        out: Dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict) and prefix.count(".") < 2 and not prefix.endswith("spark.conf"):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = value

        walk("", self.to_dict())
        return out


# What every epoch logs (the LightningModule's exact sums over all ranks): what early stopping and the gate can use.
EPOCH_METRICS = ("val_loss", "val_acc", "train_loss", "train_acc")

CHOICES = {
    "delta.engine": ("delta-rs", "spark"),
    "ingest.on_bad_file": ("skip", "fail"),
    "model.optimizer": ("sgd", "adam"),
    "model.schedule": ("warmup_cosine", "constant"),
    "data.split_key": ("content", "path"),
    "train.backend": ("horovod", "ddp", "fsdp", "single"),
    "train.lr_scaling": ("linear", "sqrt", "none"),
    "train.precision": ("auto", "32-true", "bf16-mixed", "16-mixed"),
    "train.early_stopping.mode": ("min", "max"),
    "mlflow.gate_mode": ("min", "max"),
    "data.channels": (1, 3),
    "tune.direction": ("minimize", "maximize"),
    "tune.sampler": ("tpe", "random"),
    "tune.pruner": ("median", "none"),
    "data.reader": ("petastorm", "arrow"),
    "data.source": ("converted", "direct"),
    "data.decode": ("convert", "cpu", "gpu", "auto"),
    "debug.fail_with": ("error", "oom", "hang"),
}


def load_config(path: Optional[str] = None, overrides: Optional[List[str]] = None) -> Config:
    """Load a profile (merged over `base.yaml` in the same folder when present), then overrides.

    Raises:
        ConfigError: naming the file, key, value and what was expected.
    """
    merged: Dict[str, Any] = {}
    if path:
        p = Path(path)
        extends = read_yaml(p).pop("extends", None) if p.exists() else None
        base = p.parent / (extends or "base.yaml")
        if extends and not base.exists():  # only the implicit base.yaml is optional: a named one missing would
            # silently leave every key it holds at the defaults
            raise ConfigError(f"{p}: extends: {extends!r}, but {base} does not exist (the path is relative to "
                              f"the profile's folder)")
        if base.resolve() != p.resolve() and base.exists():
            merged = read_yaml(base)
            merged.pop("extends", None)
            check_keys(merged, base)
        profile = read_yaml(p)
        profile.pop("extends", None)
        check_keys(profile, p)
        merged = merge(merged, profile)
    for text in overrides or []:
        merged = merge(merged, parse_override(text))
    cfg = build(Config, merged, "")
    validate(cfg)
    return cfg


def check_keys(data: Dict[str, Any], path: Path, cls: type = Config, prefix: str = "") -> None:
    """Refuse a key of the YAML file `path` (read as `data`) that no config section has, naming the file and the
    dotted key: `build` checks the merged config, which no longer knows the file a key came from.

    Raises:
        ConfigError: `config file <path>: unknown config key '<section.key>'; valid keys of ...`."""
    if not isinstance(data, dict):
        return  # a section that is no mapping: `build` says so, naming the section
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            where = f"section '{prefix}'" if prefix else "the top level"
            raise ConfigError(f"config file {path}: unknown config key '{dotted}'; valid keys of {where}: "
                              f"{', '.join(names)}")
        if dataclasses.is_dataclass(hints[key]):
            check_keys(value, path, hints[key], dotted)


def validate(cfg: Config) -> None:
    flat = cfg.flat()
    for key, allowed in CHOICES.items():
        if flat.get(key) not in allowed:
            raise ConfigError(f"config key '{key}': value {flat.get(key)!r} is not one of {', '.join(map(str, allowed))}")
    checks = [
        ("data.batch_size", cfg.data.batch_size == "auto" or (isinstance(cfg.data.batch_size, int)
                                                               and cfg.data.batch_size >= 1), "must be an int >= 1 or auto"),
        ("data.auto_batch_start", cfg.data.auto_batch_start >= 1, "must be >= 1"),
        ("data.val_fraction", 0.0 < cfg.data.val_fraction < 1.0, "must be between 0 and 1 (exclusive)"),
        ("data.partitions_per_worker", cfg.data.partitions_per_worker >= 1, "must be >= 1"),
        ("data.image_size", cfg.data.image_size >= 8, "must be >= 8"),
        ("data.seed", 0 <= cfg.data.seed < 2 ** 32, "must be between 0 and 2**32 - 1 (numpy's seeds)"),
        ("data.reader_workers", cfg.data.reader_workers >= 1, "must be >= 1"),
        ("data.decode_workers", cfg.data.decode_workers >= 0, "must be >= 0 (0: the host's cores / ranks)"),
        ("data.decode_cpu_share", 0.0 <= cfg.data.decode_cpu_share <= 1.0, "must be between 0 and 1"),
        ("data.memory_cache_mb", cfg.data.memory_cache_mb >= 0, "must be >= 0 (0: read every epoch from Parquet)"),
        ("data.cache_max_gb", cfg.data.cache_max_gb >= 0, "must be >= 0 (0: no bound)"),
        ("data.row_groups_per_rank", cfg.data.row_groups_per_rank >= 1, "must be >= 1"),
        ("data.max_row_group_mb", cfg.data.max_row_group_mb > 0, "must be > 0"),
        ("data.min_row_group_mb", 0 <= cfg.data.min_row_group_mb <= cfg.data.max_row_group_mb,
         "must be >= 0 and <= data.max_row_group_mb"),
        ("data.source", cfg.data.source != "direct" or cfg.data.decode != "convert",
         "reads the table's encoded images, which the ranks decode: it needs data.decode cpu, gpu or auto, not "
         "convert"),
        ("model.lr", cfg.model.lr > 0, "must be > 0"),
        ("model.arch", cfg.model.arch in ("cnn", "resnet") or (cfg.model.arch.startswith("timm/")
                                                              and len(cfg.model.arch) > 5),
         "is not one of cnn, resnet, timm/<name> (e.g. timm/resnet18)"),
        ("model.backbone_lr", cfg.model.backbone_lr is None or cfg.model.backbone_lr >= 0, "must be >= 0 or null"),
        ("model.unfreeze_at_epoch", cfg.model.unfreeze_at_epoch is None or cfg.model.unfreeze_at_epoch >= 0,
         "must be >= 0 or null"),
        ("model.input_size", cfg.model.input_size is None or cfg.model.input_size >= 8, "must be >= 8 or null"),
        ("model.interpolation", cfg.model.interpolation in (None, "bilinear", "bicubic", "nearest"),
         "must be bilinear, bicubic, nearest or null"),
        ("train.np", cfg.train.np != 0, "must not be 0 (-N: N local processes, N: N Spark tasks, 1: this process)"),
        ("train.max_epochs", cfg.train.max_epochs >= 1, "must be >= 1"),
        ("train.stall_timeout_s", cfg.train.stall_timeout_s >= 1,
         "must be >= 1 (0 turned Horovod's stall shutdown off, gave DDP no time and a SIGTERM no grace)"),
        ("train.start_timeout_s", cfg.train.start_timeout_s >= 1, "must be >= 1 (0 gave Gloo's rendezvous no time)"),
        ("train.seed", 0 <= cfg.train.seed < 2 ** 32,
         "must be between 0 and 2**32 - 1 (Lightning replaces a seed outside it with a random one)"),
        ("data.min_steps_per_epoch", cfg.data.min_steps_per_epoch >= 0,
         "must be >= 0 (0: data.batch_size whatever the table's size)"),
        ("train.checkpoint_every_n_steps", (cfg.train.checkpoint_every_n_steps or 1) >= 1, "must be >= 1 or null"),
        ("train.max_restarts", cfg.train.max_restarts >= 0, "must be >= 0"),
        ("train.min_np", cfg.train.min_np is None or (cfg.train.np > 1 and 1 <= cfg.train.min_np <= cfg.train.np),
         "must be null, or between 1 and train.np when train.np > 1 (ranks as Spark tasks on a cluster)"),
        ("mlflow.reconnect_wait_s", cfg.mlflow.reconnect_wait_s >= 0, "must be >= 0 (0: leave the run offline at once)"),
        ("train.threads_per_rank", cfg.train.threads_per_rank is None or cfg.train.threads_per_rank >= 1,
         "must be >= 1 or null (null: 1 per rank when ranks share a host, else torch's default)"),
        ("train.early_stopping.patience", cfg.train.early_stopping.patience >= 0, "must be >= 0"),
        ("train.early_stopping.min_epochs", (cfg.train.early_stopping.min_epochs or 0) >= 0,
         "must be >= 0 or null (null: train.warmup_epochs + 2 x patience, at most train.max_epochs)"),
        ("delta.version", cfg.delta.version is None or cfg.delta.version >= 0, "must be >= 0 or null"),
        ("delta.table", bool(cfg.delta.table), "must not be empty"),
        ("ingest.label_depth", cfg.ingest.label_depth != 0,
         "must not be 0 (N: folder N under the source, -N: folder N above the file)"),
        ("ingest.max_file_mb", 0 < cfg.ingest.max_file_mb <= 2048,
         "must be > 0 and at most 2048 (2 GiB, the most one binary cell holds)"),
        ("mlflow.system_metrics_interval_s", cfg.mlflow.system_metrics_interval_s >= 0, "must be >= 0 (0: off)"),
        ("mlflow.gate_margin", cfg.mlflow.gate_margin >= 0, "must be >= 0 (0: the challenger must be strictly better)"),
        ("mlflow.gate_min_lift", cfg.mlflow.gate_min_lift is None or cfg.mlflow.gate_min_lift >= 0,
         "must be >= 0 or null (null: no chance floor)"),
        ("tune.n_trials", cfg.tune.n_trials >= 1, "must be >= 1"),
        ("tune.seed", cfg.tune.seed is None or 0 <= cfg.tune.seed < 2 ** 32,
         "must be between 0 and 2**32 - 1, or null (numpy's seeds)"),
        ("tune.startup_trials", cfg.tune.startup_trials >= 0, "must be >= 0"),
        ("tune.warmup_epochs", cfg.tune.warmup_epochs >= 0, "must be >= 0"),
        ("tune.timeout_s", cfg.tune.timeout_s is None or cfg.tune.timeout_s > 0, "must be > 0 or null"),
        ("tune.verdict_timeout_s", cfg.tune.verdict_timeout_s > 0, "must be > 0"),
        ("tune.heartbeat_s", cfg.tune.heartbeat_s >= 1, "must be >= 1"),
        ("debug.fail_rank", cfg.debug.fail_rank is None or cfg.debug.fail_rank >= 0, "must be >= 0 or null"),
    ]
    for key, ok, why in checks:
        if not ok:
            raise ConfigError(f"config key '{key}': value {flat.get(key)!r} {why}")
    for key, metric in (("train.early_stopping.monitor", cfg.train.early_stopping.monitor),
                        ("mlflow.gate_metric", cfg.mlflow.gate_metric)):
        if metric not in EPOCH_METRICS:  # checked before training: a gate on a metric never logged registers junk
            raise ConfigError(f"config key '{key}': {metric!r} is not a metric training logs; one of "
                              f"{', '.join(EPOCH_METRICS)}")
    if cfg.train.backend == "single" and cfg.train.np != 1:
        raise ConfigError(f"config key 'train.np': value {cfg.train.np} needs train.backend horovod, ddp or fsdp; "
                          "train.backend=single runs one process (train.np=1)")


def apply_overrides(cfg: Config, values: Dict[str, Any]) -> Config:
    """A new, validated config: `cfg` with dotted keys set to already-parsed values ({'model.lr': 0.1}).

    Raises:
        ConfigError: an unknown key, a wrong type or a value out of range, naming the key.
    """
    merged = cfg.to_dict()
    for key, value in values.items():
        node = parse_override(f"{key}=null")
        cur = node
        while True:
            (k, v), = cur.items()
            if not isinstance(v, dict) or not v:
                cur[k] = value
                break
            cur = v
        merged = merge(merged, node)
    out = build(Config, merged, "")
    validate(out)
    return out


def world_size_of(cfg: Config) -> int:
    return abs(cfg.train.np)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
