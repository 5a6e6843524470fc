"""The jobs users run (ingest, train, promote, sync-run), wiring the planes in the one direction of the data flow."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from pipeline import preload
from pipeline.config import Config, ConfigError, world_size_of
from pipeline.data.convert import convert_for_training
from pipeline.data.leases import JobLeases
from pipeline.data.plan import start_batch_size
from pipeline.distributed.backends import backend_of, name_of
from pipeline.distributed.checkpoints.layout import resolve_restore_point, run_checkpoint_dir
from pipeline.distributed.early_start import ranks_started_early
from pipeline.distributed.job_folder import JobFolder
from pipeline.distributed.launcher import launch_needs_spark
from pipeline.distributed.loop import TrainJob, job_plan
from pipeline.distributed.restart import launch_with_restarts
from pipeline.errors import Terminated
from pipeline.lakehouse.cluster import require_reachable
from pipeline.lakehouse.delta import PinnedTable, get_engine, table_location
from pipeline.lakehouse.spark import SparkOnDemand, session_of
from pipeline.log import get_logger
from pipeline.model.arch_packages import require_arch_packages
from pipeline.redact import redact_url, redacted
from pipeline.tracking.offline import left_offline, record_job, sync_lock, upload
from pipeline.tracking.rank_zero import RankZeroTracker, log_rank_hosts
from pipeline.tracking.run_record import RunRecord

log = get_logger(__name__)


class TrainingStopped(RuntimeError):
    """Training ended without a model worth registering (non-finite loss); nothing was registered."""


def ingest(spark, cfg: Config, source: str, mode: str = "append") -> Dict[str, Any]:
    """Image folder -> one Delta commit; returns the summary (version, rows, skipped files)."""
    from pipeline.lakehouse.ingest import ingest_folder  # local: pandas and pyarrow, an ingest's alone

    return ingest_folder(spark, cfg, source, mode).summary()


def read_pinned(spark, cfg: Config, version: Optional[int] = None):
    """The Delta table at `version` (None: `delta.version`, latest when unset) and the version it is pinned to.
    `spark`: a session, or a `SparkOnDemand` (started here)."""
    return get_engine(cfg.delta.engine).read(session_of(spark), cfg.delta.table,
                                             cfg.delta.version if version is None else version)


def prepare_data(spark, cfg: Config, leases: Any = None, version: Optional[int] = None):
    """Pin the table, convert it for `abs(train.np)` ranks and plan the shards (fails before any rank starts).

    `spark`: a session, or a `SparkOnDemand`, started only when Spark has work to do: the table is pinned from its
    Delta log where the engine can (delta-rs), so a cache hit reads no DataFrame, and the session is started (ahead,
    on a thread) only for a launch that needs one (`launch_needs_spark`).

    `leases` (pipeline.data.leases.JobLeases, optional): the job's leases; the cache entry used is held in it, so no
    other job evicts or clears it until the job releases it (when its training ends).

    `version`: the Delta version to pin (a sweep's, which every trial reads); None: `delta.version`."""
    from pipeline.data.readers import require_reader  # local: numpy, out of `import pipeline.workflow`

    require_reachable(cfg)  # on a cluster: every path and address a rank or executor uses is on cluster storage
    if cfg.data.source == "direct":  # the table's own files, read by the ranks: no conversion, no cache entry
        from pipeline.data.source import prepare_direct  # local: numpy, out of `import pipeline.workflow`

        data, pinned = prepare_direct(cfg, version)
        if launch_needs_spark(cfg):
            session_of(spark)  # the launch itself needs one (its ranks as Spark tasks); the data needed none
        return data, pinned
    require_reader(cfg.data.reader)  # before any Spark work: the ranks could not read with it
    if isinstance(spark, SparkOnDemand) and launch_needs_spark(cfg) and not spark.started:
        spark.start_soon()  # the JVM starts while the table is pinned and the cache looked up
    engine = get_engine(cfg.delta.engine)
    version = cfg.delta.version if version is None else version
    pinned = engine.pin(cfg.delta.table, version)  # from the Delta log alone where the engine can
    if pinned is None:
        df, pinned = read_pinned(spark, cfg, version)
    else:
        def df():  # read only on a cache miss: the conversion's input
            return engine.read(session_of(spark), cfg.delta.table, pinned.version)[0]
    log.info("reading Delta table %s pinned at version %d", pinned.table, pinned.version)
    # the class names come with the conversion (a cache hit reads them from its manifest: no Spark job); the batch
    # in use is the plan's (data.batch_size: auto starts at data.auto_batch_start and an out-of-memory halves it in
    # the launcher); the user's config stays as given
    data = convert_for_training(spark, df, cfg, world_size_of(cfg), None, pinned, leases=leases,
                                batch_size=start_batch_size(cfg.data))
    if launch_needs_spark(cfg):
        session_of(spark)  # the launch finds it active
    return data, pinned


def require_model_arch(cfg: Config) -> None:
    """Fail, naming `model.arch` (ConfigError), when the network it names needs a package this install lacks (timm
    and torchvision for timm/<name>), wherever this process would build it: in the ranks on this machine (one process,
    horovod.run, torchrun), or in the promotion gate (`mlflow.promote`), which scores the model here. Ranks that run
    as Spark tasks with no gate after them build it on the executors alone, whose install may differ: not refused.
    The packages are looked up, not imported (the driver keeps torch out until the gate)."""
    if launch_needs_spark(cfg) and not cfg.mlflow.promote:
        return
    require_arch_packages(cfg.model.arch)


def job_dir_of(cfg: Config, run_id: str, root: Optional[str] = None) -> str:
    """The driver's and ranks' scratch folder of the run (pipeline.distributed.job_folder: rank markers, a run left
    offline), under `root` (None: `train.checkpoint_dir`)."""
    return JobFolder.of_run(root or cfg.train.checkpoint_dir, run_id).path


def train_in_run(run, cfg: Config, data, pinned, tags: Dict[str, Any], epoch_gate: Any = None,
                 marks: Optional[Dict[str, float]] = None, checkpoint_root: Optional[str] = None, early: Any = None):
    """One training inside the open MLflow run `run`: config, lineage and shard plan logged, the ranks launched.

    `epoch_gate` (optional) is a context manager with a `folder` attribute, entered while the ranks run: rank 0
    hands it each epoch's metrics there and obeys its verdict (`lakehouse tune` prunes this way). `marks` (optional):
    the job's timeline, which gets the launch's wall-clock time as `launch`. `checkpoint_root` (optional): the folder
    the run's checkpoint and job folders go under, instead of `train.checkpoint_dir` (a tune trial's own folder).
    `early` (optional): the ranks started before the job was made (`ranks_started_early`), handed it at the launch.
    Returns rank 0's RankResult.

    Raises:
        Terminated: SIGTERM reached the ranks.
        TrainingStopped: a non-finite loss stopped training.
    """
    rows_train, rows_val = data.rows
    record = RunRecord(run.client, run.run_id)
    job_dir = job_dir_of(cfg, run.run_id, checkpoint_root)
    # the run's own folder and the resolved restore point are the job's, not the config's (which stays the user's)
    checkpoint_dir = run_checkpoint_dir(cfg, run.run_id, checkpoint_root)
    # train.ckpt_restore as a path: `last` / `best` in this run's folder, `<run_id>/last` in that run's; refused here,
    # before any rank starts, when it does not exist
    restore_from = resolve_restore_point(cfg.train.ckpt_restore, checkpoint_dir,
                                         checkpoint_root or cfg.train.checkpoint_dir)
    record.start(cfg, pinned, {"train": rows_train, "val": rows_val}, tags, data.plan, checkpoint_dir, restore_from)
    ranks_cfg, ranks_uri = for_the_ranks(cfg, run.tracking_uri)  # no tracking credentials in what every rank gets
    job = TrainJob(cfg=ranks_cfg, data=data, delta_table=pinned.table, delta_version=pinned.version,
                   run_id=run.run_id, tracking_uri=ranks_uri, job_dir=job_dir, tracker=RankZeroTracker,
                   checkpoint_dir=checkpoint_dir, plan=job_plan(cfg, data, restore_from))
    if epoch_gate is not None:
        job.epoch_gate_dir = epoch_gate.folder
        job.epoch_gate_timeout_s = cfg.tune.verdict_timeout_s
    t0 = time.time()
    if marks is not None:
        marks["launch"] = t0
    # torch for the promotion gate, which scores the model: loaded once the first rank is done (a core is then idle
    # while rank 0 logs the model); before the launch it delayed the ranks' start, after their return it delays the gate
    torch_for_the_gate = preload.once(lambda: bool(job.folder.ranks_with("done")), ("torch",))
    with epoch_gate if epoch_gate is not None else contextlib.nullcontext(), torch_for_the_gate:
        results = launch_with_restarts(job, on_restart=record.restart, on_batch=record.batch, on_world=record.world,
                                       early=early)
    log.info("training finished in %.1f s", time.time() - t0)
    log_rank_hosts(left_offline(job_dir) or run.client, run.run_id, results)  # the server gone: into the folder
    r0 = next(r for r in results if r.rank == 0)
    if r0.stop_reason and r0.stop_reason.startswith("SIGTERM"):
        raise Terminated(r0.stop_reason)
    if r0.stop_reason and r0.stop_reason.startswith("non-finite"):
        raise TrainingStopped(f"training stopped: {r0.stop_reason}; nothing registered")
    return r0


def for_the_ranks(cfg: Config, tracking_uri: str) -> Tuple[Config, Optional[str]]:
    """The config and tracking URI a TrainJob hands every rank (pickled to each, written to the job folder for ranks
    started early): only rank 0 talks to MLflow, so a URI that holds credentials (`user:password@`, `?token=`) is not
    in them. The config then has `mlflow.tracking_uri` redacted (no rank connects with it), and the job carries no URI:
    rank 0 (pipeline.tracking.rank_zero.RankZeroTracker, given None) reaches MLflow through MLFLOW_TRACKING_URI, which
    this process set when it connected (pipeline.tracking.runs.use_tracking_uri) and the ranks inherit (local ranks
    from this process, ranks on Spark executors through rank_env.executor_env), and which every rank but 0 drops as it
    starts (pipeline.redact.TRACKING_CREDENTIALS, rank_process.rank_record). A URI without credentials is handed as
    it is.

    Nor do the ranks get what only the driver uses and may be secret: `spark.conf`'s secret values (the driver's
    session; a rank reads the table with the credentials of its environment) and the password of `tune.storage` (the
    sweep's study, opened by the driver) are redacted (pipeline.redact). The job reaches the ranks through their
    launcher (horovod.run's key-value store is plain HTTP; Spark's task serialisation) and, for ranks started early,
    through a file."""
    secret_uri = redact_url(tracking_uri) != tracking_uri
    conf = redacted({"spark.conf": dict(cfg.spark.conf)})["spark.conf"]  # judged by the full key, spark.conf.<k>
    cfg = dataclasses.replace(
        cfg, mlflow=dataclasses.replace(cfg.mlflow, tracking_uri=redact_url(cfg.mlflow.tracking_uri)),
        spark=dataclasses.replace(cfg.spark, conf=conf), tune=dataclasses.replace(cfg.tune,
                                                                                storage=redact_url(cfg.tune.storage)))
    if not secret_uri:
        return cfg, tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI") != tracking_uri:  # rank 0 would not find it there: handed as before
        log.warning("MLFLOW_TRACKING_URI is not the run's tracking URI %s: the ranks are handed the URI itself",
                    redact_url(tracking_uri))
        return cfg, tracking_uri
    return cfg, None


def register_and_promote(client, cfg: Config, model_uri: str, run_id: str, pinned, metrics: Dict[str, float],
                         extra_tags: Optional[Dict[str, Any]] = None):
    """Register `model_uri` (logged by run `run_id`) as a version of `mlflow.registered_model`, tagged with its
    lineage and logged gate metric; then, if `mlflow.promote`, the promotion gate (`gate_version`) decides the
    champion alias.

    Returns (version, PromotionDecision or None).
    """
    version = register_version(client, cfg, model_uri, run_id, pinned, metrics, extra_tags)
    return version, gate_version(client, cfg, version)


def register_version(client, cfg: Config, model_uri: str, run_id: str, pinned, metrics: Dict[str, float],
                     extra_tags: Optional[Dict[str, Any]] = None) -> str:
    """Register `model_uri` (logged by run `run_id`) as a version of `mlflow.registered_model`, tagged with its
    lineage, world size, backend and logged gate metric. Returns the version."""
    from pipeline.tracking.registry import register_model  # local: mlflow, out of `import pipeline.workflow`

    metric = cfg.mlflow.gate_metric  # the table by its location: the gate finds it from any working directory
    # ... and with any credentials in its URL redacted (the gate reads it through the config's `delta.table`)
    tags = {"run_id": run_id, "delta_table": redact_url(table_location(pinned.table)),
            "delta_version": str(pinned.version), metric: str(metrics.get(metric)),
            "world_size": str(world_size_of(cfg)), "backend": name_of(cfg)}
    tags.update({str(k): str(v) for k, v in (extra_tags or {}).items()})
    return register_model(client, model_uri, cfg.mlflow.registered_model, run_id, tags=tags, metrics=metrics)


def gate_version(client, cfg: Config, version: str):
    """The promotion gate (`gate`) on a registered `version` if `mlflow.promote`, else None. A gate that cannot judge
    the version (RegistryError) is logged as an error: the version stays unpromoted. Returns the PromotionDecision."""
    from pipeline.tracking.gate import PromotionDecision  # local: mlflow, out of `import pipeline.workflow`
    from pipeline.tracking.registry import RegistryError  # local: mlflow, out of `import pipeline.workflow`

    if not cfg.mlflow.promote:
        return None
    try:
        decision = gate(client, cfg, version)
    except RegistryError as exc:  # registered, but the gate could not judge it: visible, never promoted
        log.error("promotion gate: %s; version %s is registered but not promoted", exc, version)
        decision = PromotionDecision(False, str(version), cfg.mlflow.gate_metric, None, None, None,
                                     f"not promoted: {exc}", cfg.mlflow.gate_margin, error=str(exc))
    log.info("promotion: %s", decision.reason)
    return decision


def gate(client, cfg: Config, version: str):
    """The promotion gate on `version` with the config's metric, mode, margin and margin over chance
    (pipeline.tracking.gate.promote): the challenger and the champion scored on the rows both held out, of the
    challenger's pinned Delta version (read through the config's `delta.table` where the version records that table
    with its credentials redacted)."""
    from pipeline.tracking.gate import promote  # local: mlflow, out of `import pipeline.workflow`

    return promote(client, cfg.mlflow.registered_model, str(version), cfg.mlflow.gate_metric, cfg.mlflow.gate_mode,
                   margin=cfg.mlflow.gate_margin, val_fraction=cfg.data.val_fraction,
                   min_lift=cfg.mlflow.gate_min_lift, tables=(cfg.delta.table,))


def train(spark, cfg: Config, run_name: Optional[str] = None) -> Dict[str, Any]:
    """The main job: pinned Delta read -> converters -> ranks -> one MLflow run -> registered model (-> champion).

    The cache entry it trains from is leased from its choice until the job ends (`cache clear` and other jobs' size
    bound keep it). Returns the summary that `lakehouse train` prints as its last line of JSON.
    """
    with JobLeases("train" + (f" {run_name}" if run_name else "")) as leases:
        return _train(spark, cfg, run_name, leases)


def _train(spark, cfg: Config, run_name: Optional[str], leases: Any) -> Dict[str, Any]:
    from pipeline.tracking.runs import configure  # local: mlflow, out of `import pipeline.workflow`

    marks = {"train_called": time.time()}  # the job's timeline (wall clock), summed up in the summary's `phases`
    require_model_arch(cfg)  # before the run opens and any rank starts: the ranks could not build the network
    configure(cfg.mlflow)  # fail fast, before any Spark work, when MLflow is unreachable
    # the local ranks start now and import while the data is prepared and the run opened (train.early_start)
    backend = backend_of(cfg)
    with ranks_started_early(cfg, backend.start_local if backend.local_processes else None, backend.launcher_forks,
                             (lambda: session_of(spark)) if launch_needs_spark(cfg) else None) as early:
        return _train_from(spark, cfg, run_name, leases, marks, early)


def _train_from(spark, cfg: Config, run_name: Optional[str], leases: Any, marks: Dict[str, float],
                early: Any) -> Dict[str, Any]:
    from pipeline.tracking.runs import tracked_run  # local: mlflow, out of `import pipeline.workflow`

    data, pinned = prepare_data(spark, cfg, leases)
    marks["data_ready"] = time.time()
    rows_train, rows_val = data.rows
    world = world_size_of(cfg)
    # the converted data stays in the cache for the next job (`lakehouse cache ls|clear`)
    tags = {"world_size": world, "backend": name_of(cfg), "np": cfg.train.np, "data_source": cfg.data.source}
    with tracked_run(cfg, run_name=run_name, tags=tags) as run:
        r0 = train_in_run(run, cfg, data, pinned, tags, marks=marks, early=early)
        marks["ranks_returned"] = time.time()
        offline = left_offline(job_dir_of(cfg, run.run_id))
        if offline is not None:  # the server never came back: `lakehouse sync-run <folder>` uploads the run
            record_job(offline, run, cfg, pinned, {"train": rows_train, "val": rows_val}, tags, r0, run_name)
            # the line's keys as a registered run's: nothing registered nor gated yet (sync-run does both)
            return {**run_summary(run, cfg, pinned, (rows_train, rows_val), r0, marks, None, None),
                    "offline_run": offline.folder}
        if not r0.model_uri:
            raise RuntimeError("rank 0 returned no model; nothing registered")
        version, decision = register_and_promote(run.client, cfg, r0.model_uri, run.run_id, pinned, r0.metrics,
                                                 {"data_source": cfg.data.source})
        marks["gated"] = time.time()
        summary = run_summary(run, cfg, pinned, (rows_train, rows_val), r0, marks, int(version),
                              bool(decision and decision.promoted))
    return summary


def run_summary(run, cfg: Config, pinned, rows: Any, r0: Any, marks: Dict[str, float],
                model_version: Optional[int], champion: Optional[bool]) -> Dict[str, Any]:
    """The summary `lakehouse train` prints as its last line of JSON (the contract's keys and more), of a run
    registered as `model_version` (None: not registered, as a run left offline) that the gate made champion or not
    (None: not gated)."""
    rows_train, rows_val = rows
    return {
        "run_id": run.run_id,
        "model_name": cfg.mlflow.registered_model,
        "model_version": model_version,
        "delta_table": redact_url(pinned.table),
        "delta_version": pinned.version,
        "rows_train": rows_train,
        "rows_val": rows_val,
        "world_size": world_size_of(cfg),
        "world_size_used": r0.world_size,  # fewer after an elastic relaunch (train.min_np)
        "backend": name_of(cfg),
        "data_source": cfg.data.source,  # converted (Spark, the cache) or direct (the table's own files)
        "val_loss": r0.metrics.get("val_loss"),
        "val_acc": r0.metrics.get("val_acc"),
        "epochs": r0.epochs,
        "batch_size_used": r0.batch_size,
        "stopped_early": r0.stopped_early,
        "champion": champion,
        "tracking_uri": redact_url(run.tracking_uri),
        "phases": phases(marks),
    }


def phases(marks: Dict[str, float]) -> Dict[str, Any]:
    """Where a train job's time went, from its timeline: seconds pinning, converting and planning the data (MLflow's
    connection included), opening the run until the launch, in the ranks (their start, every epoch and rank 0's model
    logging), and registering and gating; with the timeline itself (wall clock, `launch` included) so a caller can
    place the ranks' own marks (their `epoch_time_s` metrics) in it (bench/job_phases.py)."""
    order = ("train_called", "data_ready", "launch", "ranks_returned", "gated")
    names = ("prepare_data_s", "run_setup_s", "ranks_s", "register_and_gate_s")
    out: Dict[str, Any] = {name: round(marks[b] - marks[a], 3) for name, a, b in zip(names, order, order[1:])
                           if a in marks and b in marks}
    out["at"] = {k: round(v, 3) for k, v in marks.items()}
    return out


def promote_version(cfg: Config, version: Optional[Any] = None) -> Dict[str, Any]:
    """Gate a registered version (latest when None) against the current champion, on the same held-out rows. MLflow's
    HTTP retries are bounded by `mlflow.retries` (pipeline.tracking.runs.http_bounds) as in `train`: a gate makes
    dozens of registry calls, each of which MLflow's defaults would retry for minutes.

    Raises:
        ConfigError: the model has no such version (`existing_version`), or no version at all.
    """
    from pipeline.tracking.registry import latest_version  # local: mlflow, out of `import pipeline.workflow`
    from pipeline.tracking.runs import configure, http_bounds, temporary_env  # local: mlflow, as above

    name = cfg.mlflow.registered_model
    with temporary_env(http_bounds(cfg.mlflow)):
        client = configure(cfg.mlflow)
        version = latest_version(client, name) if version is None else existing_version(client, name, version)
        return dict(gate(client, cfg, str(version)).__dict__)


def existing_version(client, name: str, version: Any) -> str:
    """`version` of registered model `name` as the registry spells it, or a ConfigError naming the versions the model
    has: a version given that does not exist is the command line's mistake, which the gate would report as a failed
    registry call to retry. The version is looked up by name and number (any name, quotes too); the model's versions
    are listed only to say which exist."""
    from mlflow.exceptions import MlflowException  # mlflow: out of `import pipeline.workflow`

    from pipeline.tracking.registry import model_versions  # local: mlflow, out of `import pipeline.workflow`

    try:
        number = int(str(version))
    except ValueError:
        number = None
    if number is not None and number >= 1:
        try:
            return str(client.get_model_version(name, str(number)).version)
        except MlflowException as exc:
            if "RESOURCE_DOES_NOT_EXIST" not in str(getattr(exc, "error_code", "")):
                raise
    have = sorted({int(mv.version) for mv in model_versions(client, name)})
    where = "config key 'mlflow.registered_model'"
    if not have:
        raise ConfigError(f"model {name!r} has no version {version}: it has no versions ({where})")
    raise ConfigError(f"model {name!r} has no version {version}; its versions: {number_ranges(have)} ({where})")


def number_ranges(numbers: List[int]) -> str:
    """Sorted distinct numbers as runs: [1, 2, 3, 4, 7, 9, 10] -> '1-4, 7, 9-10'."""
    runs: List[List[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def sync_run(folder: str, overrides: Optional[List[str]] = None) -> Dict[str, Any]:
    """`lakehouse sync-run`: upload a run left offline (pipeline.tracking.offline.upload: the folder's server, or
    `mlflow.tracking_uri=` in `overrides`), register its model through the same gate as `train` when the job would
    have registered it, then end the run with its true status. A folder already uploaded is not uploaded twice.

    Idempotent: each step is recorded in the folder as it completes (`Upload.record`), so a sync-run that failed
    part way is resumed by the next: the same run, no metric value twice, and never a second version for the run
    (the registry is asked for one too). The summary's `resumed` says which steps an earlier sync-run had done. One
    sync-run of a folder at a time: it holds the folder's lock (`sync_lock`) from start to end, and a second one
    started meanwhile fails at once. MLflow's HTTP retries are bounded by `mlflow.retries` throughout, as in `train`.

    Raises:
        SyncError: the folder is not a run left offline, or was uploaded already; another sync-run of it is under
            way (the message names its pid); the run an earlier sync-run of the folder created is no longer on the
            server.
    """
    from pipeline.tracking.runs import http_bounds, temporary_env  # local: mlflow, out of `import pipeline.workflow`

    with sync_lock(folder):
        up = upload(folder, overrides)
        with temporary_env(http_bounds(up.cfg.mlflow)):
            return _register_synced(up)


def _register_synced(up) -> Dict[str, Any]:
    """`sync_run`'s part after the upload: register and gate the model if the job would have, end the run."""
    if up.info.get("register") and up.summary["status"] == "FINISHED":  # nothing registered from a failed run
        name = up.cfg.mlflow.registered_model
        version = up.registered_version(name)
        if version is None:
            lineage = up.info.get("lineage") or {}
            pinned = PinnedTable(table=lineage.get("table"), version=lineage.get("version"), num_files=-1,
                                 num_rows=None)
            metrics = {k: float(v) for k, v in (up.info.get("gate_metrics") or {}).items()}
            version = register_version(up.client, up.cfg, up.summary["model_uri"], up.summary["run_id"], pinned,
                                       metrics)
            up.record(model_version=str(version))
        if "champion" in up.state:  # the gate judged this version in an earlier sync-run
            champion = bool(up.state["champion"])
            up.resumed("champion", champion)
        else:
            decision = gate_version(up.client, up.cfg, version)
            champion = bool(decision and decision.promoted)
            if decision is not None:
                up.record(champion=champion)
        up.summary.update(model_version=int(version), champion=champion)
    return up.end()
