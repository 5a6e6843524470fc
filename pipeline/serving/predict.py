"""Batch scoring: a pinned Delta table version scored by a registered model through `mlflow.pyfunc.spark_udf`, written as one Delta commit."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional
from urllib.parse import urlparse

from pipeline import redact
from pipeline.lakehouse.delta import (ConcurrentWriteError, NoSuchTableError, commit_files, get_engine, same_table,
                                      table_location)
from pipeline.lakehouse.delta_common import files_digest
from pipeline.log import get_logger

log = get_logger(__name__)

KEY_COLUMN = "path"
CONTENT_COLUMN = "content"
# The UDF's result: the pyfunc's columns with params on_error=null (an undecodable row gets nulls and its reason).
# Not label_index: spark_udf casts a struct field to numpy int64, which has no null for an undecodable row.
UDF_RESULT = "label string, probability double, probabilities array<double>, error string"
OUTPUT_COLUMNS = ("path", "label", "probability", "probabilities", "error", "model_name", "model_version",
                  "input_table", "input_version")


# Rows per Arrow batch sent to the scoring Python workers while predict runs (the session's value is put back after).
# Spark's default (10,000) hands a task's rows over in one batch, so the JVM's read and the Parquet write wait
# for the whole batch to be scored; batches of the pyfunc's own chunk size (pyfunc.PREDICT_BATCH_SIZE) overlap
# them with scoring, and bound a worker's memory whatever the image size.
ARROW_BATCH_ROWS = 256
ARROW_BATCH_KEY = "spark.sql.execution.arrow.maxRecordsPerBatch"


class PredictError(RuntimeError):
    """Batch scoring cannot run as asked; the message names the table, column or model."""


@contextlib.contextmanager
def session_conf(spark, settings: Dict[str, str]) -> Iterator[None]:
    """Set runtime SQL settings for the block; put the session's own values back (or unset them) afterwards."""
    before = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)


# A predict commit claims its job's identity (DeltaEngine.write's conditional write, the mechanism ingest's label
# claims use): a retry finds its earlier commit by that claim and writes nothing, and two jobs of one identity at once
# cannot both commit (delta-rs: the Delta app transaction whose id is the claim; delta.engine=spark: the history).
CLAIM_PREFIX = "lakehouse.predict."
METADATA_KEY = "lakehouse.predict"


def job_identity(pinned_model, input_table: str, input_version: int, mode: str, run_key: Optional[str],
                 input_files_digest: str) -> Dict[str, Any]:
    """What makes two predict runs the same job: the model version (and the run that made it: the same name and
    version in another registry is another model), the input table, its version and what that version holds, the
    mode and the run key. A scheduler's retry repeats all of them; a second, wanted run of the same job gives another
    run key.

    `input_files_digest` (input_digest: the digest of the pinned version's data files) tells a table deleted and
    created again apart from the one it replaced: both start again at version 0, and a staging table rebuilt each day
    would otherwise take the next day's append for a retry of yesterday's (nothing written, yesterday's commit
    reported). `input_table` is spelled as the `input_table` column is (`table_location`: the real path).

    Older commits' identities (recorded in their `lakehouse.predict` commit metadata) have no `input_files_digest`
    and spelled the table as its absolute path: they stay readable, but their claims are other digests, so a retry
    started before this change and run after it is not recognised and appends again."""
    return {"model_name": pinned_model.name, "model_version": str(pinned_model.version),
            "model_run_id": pinned_model.run_id, "input_table": table_location(input_table),
            "input_version": int(input_version), "input_files_digest": input_files_digest, "mode": mode,
            "run_key": run_key or ""}


def input_digest(pinned, df) -> str:
    """The digest of the data files of the pinned input version (`PinnedTable.files_digest`: its data files' URIs,
    which a Delta writer names afresh, so a table written again has other files): the engine's, read from the log
    (delta-rs), else of the files the DataFrame reads (delta.engine=spark: `inputFiles`, from the snapshot)."""
    if pinned.files_digest is not None:
        return pinned.files_digest
    return files_digest(list(df.inputFiles()))


def identity_claim(identity: Dict[str, Any]) -> str:
    """The claim (and Delta app id) of a job identity: a digest, so the id stays short and carries no path."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return CLAIM_PREFIX + digest


def count_commit(table: str, version: int) -> Optional[Dict[str, int]]:
    """Rows and error rows in the files that commit `version` of `table` added: this job's own output, whatever
    other writers added meanwhile (local tables; None elsewhere)."""
    import pyarrow.parquet as pq

    files = commit_files(table, version)
    if files is None:
        return None
    rows = errors = 0
    for path in files:
        col = pq.read_table(path, columns=["error"]).column("error")
        rows += len(col)
        errors += len(col) - col.null_count
    return {"rows": rows, "errors": errors, "files": len(files)}


def commit_rows_in_log(engine, spark, table: str, version: int) -> Optional[int]:
    """Rows that commit `version` of `table` wrote, as its commit info in the Delta log records them
    (`operationMetrics.numOutputRows`, which delta-spark writes for every write, from the engine's `history`): a
    count for a table that is not on this filesystem (an object store's, a catalog's), where its files cannot be read
    here. None when the commit records none (delta-rs commits of files it did not write, metrics turned off)."""
    for entry in engine.history(spark, table):
        if entry.get("version") is not None and int(entry["version"]) == int(version):
            metrics = entry.get("operationMetrics") or {}
            try:
                return int(metrics["numOutputRows"])
            except (KeyError, TypeError, ValueError):
                return None
    return None


def check_rows_written(engine, spark, table: str, out: str, pinned_version: int, out_version: int,
                       rows_in: int) -> Dict[str, Any]:
    """Compare the rows in the commit `out_version` of `out` with the `rows_in` read: {"errors": error rows or
    None, "rows_written": rows or None, "rows_check": how they were compared, or why they were not}.

    A local table: its files, read from the Delta log (`count_commit`), rows and error rows counted. Any other
    (`commit_files` reads local tables only): the rows its commit info records (`commit_rows_in_log`), error rows not
    counted (`errors` None, `rows_check` says so); a commit that records none is not compared: a WARNING and
    `rows_check` say why, never a silent skip.

    Raises:
        PredictError: the commit holds another number of rows than were read.
    """
    counts = count_commit(out, out_version)
    if counts is not None:
        rows, errors = counts["rows"], counts["errors"]
        how = f"passed: {rows} rows in the {counts['files']} data file(s) of the commit, as many as read"
    else:
        errors = None
        try:
            rows = commit_rows_in_log(engine, spark, out, out_version)
            missing = "its commit records no row count (operationMetrics.numOutputRows)"
        except Exception as exc:  # noqa: BLE001  # the check is reported as not run, the commit stays
            rows, missing = None, f"its history could not be read ({type(exc).__name__}: {exc})"
        if rows is None:
            how = (f"not run: {out} is not a table on this filesystem (its data files are not read here) and "
                   f"{missing}; the rows written were not compared with the {rows_in} read, and error rows were "
                   f"not counted")
            log.warning("predictions in %s version %s: the check rows written = rows read did %s", out, out_version,
                        how)
            return {"errors": None, "rows_written": None, "rows_check": how}
        how = (f"passed: {rows} rows in the commit's operationMetrics.numOutputRows (Delta log), as many as read; "
               f"error rows not counted ({out} is not a table on this filesystem)")
    if rows != rows_in:
        raise PredictError(f"predictions for Delta table {table} version {pinned_version}: {rows} rows in the commit "
                           f"of {out} version {out_version}, but the input has {rows_in}")
    return {"errors": errors, "rows_written": rows, "rows_check": how}


def scoring_partitions(current: int, cores: int, local: bool) -> int:
    """How many partitions to score: at least one per core (all cores score, even a table of one file); in local
    mode exactly one per core, since spark_udf loads the model once per task there (no per-process cache as on a
    cluster): more tasks than cores would mean more model loads and a second, partly idle wave of tasks."""
    cores = max(1, cores)
    if current < cores or (local and current > cores):
        return cores
    return current


def partitions_for_scoring(spark, df):
    """`df` spread over `scoring_partitions`: repartition to add partitions, coalesce (no shuffle) to merge them."""
    current = df.rdd.getNumPartitions()
    cores = spark.sparkContext.defaultParallelism
    local = str(spark.sparkContext.master).startswith("local")
    wanted = scoring_partitions(current, cores, local)
    if wanted > current:
        return df.repartition(wanted)
    if wanted < current:
        return df.coalesce(wanted)
    return df


def batch_model_config(model_uri: str) -> Optional[Dict[str, Any]]:
    """The model config that lifts the served model's per-call pixel budget for batch scoring (the rows are the
    table's own, in calls of ARROW_BATCH_ROWS rows: pyfunc.BATCH_MAX_PIXELS_PER_CALL, what such a call declares at
    most), for a model that records the budget; None for an older one (MLflow warns of a config key the model does
    not record, and its code has no budget). LAKEHOUSE_SERVING_MAX_PIXELS, where the executors run, still wins."""
    import mlflow.models

    from pipeline.tracking.pyfunc import BATCH_MAX_PIXELS_PER_CALL, MAX_PIXELS_CONFIG_KEY  # local: torch

    config = mlflow.models.get_model_info(model_uri).flavors.get("python_function", {}).get("config") or {}
    if MAX_PIXELS_CONFIG_KEY not in config:
        return None
    return {MAX_PIXELS_CONFIG_KEY: max(int(config[MAX_PIXELS_CONFIG_KEY]), BATCH_MAX_PIXELS_PER_CALL)}


@contextlib.contextmanager
def tracking_uri_withheld() -> Iterator[str]:
    """MLflow's tracking URI set, for the block, to its redacted form (`pipeline.redact.redact_url`: the password
    of `http://user:password@host`, a user alone, secret query values replaced); yields that. The URI and the
    MLFLOW_TRACKING_URI variable (which `mlflow.set_tracking_uri` sets too) are put back as they were afterwards.

    `mlflow.pyfunc.spark_udf` reads `mlflow.get_tracking_uri()` when it builds the UDF and ships it inside the UDF to
    every executor, which sets it there (for Spark Connect, whose executors download the model). With
    env_manager="local" and a model given as a local folder, the executors load the copy spark_udf ships (local
    mode: its folder; a cluster: an archive it broadcasts) and never reach the tracking server: they need no URI, and
    a password in it must not travel (DESIGN: secrets reach no executor that did not need them). The process's URI
    is changed for the block: nothing else in it may use MLflow meanwhile (`predict_table` builds the UDF alone)."""
    import mlflow

    before, env_before = mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")
    withheld = redact.redact_url(before)
    mlflow.set_tracking_uri(withheld)
    try:
        yield withheld
    finally:
        mlflow.set_tracking_uri(before)
        if env_before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = env_before


def model_udf(spark, pinned_model):
    """The scoring UDF of `pinned_model` (`mlflow.pyfunc.spark_udf`, env_manager=local, params on_error=null, the
    batch pixel budget), built without the tracking URI's credentials: the version is downloaded first, with them,
    into a folder of this call, and spark_udf builds from that folder while the URI is withheld
    (`tracking_uri_withheld`). spark_udf copies the folder (and, on a cluster, broadcasts it) before it returns: the
    executors load that copy, so the download is removed on return."""
    import mlflow.artifacts
    import mlflow.pyfunc

    with tempfile.TemporaryDirectory(prefix="lakehouse-predict-model-") as tmp:
        local = mlflow.artifacts.download_artifacts(artifact_uri=pinned_model.uri, dst_path=tmp)
        config = batch_model_config(local)
        with tracking_uri_withheld():
            # env_manager=local: executors use this Python; on a cluster the model is loaded once per Python worker
            # process (SparkModelCache, spark.python.worker.reuse), in local mode once per task (see
            # scoring_partitions); it is fed Arrow batches of rows (spark.sql.execution.arrow.maxRecordsPerBatch).
            return mlflow.pyfunc.spark_udf(spark, local, result_type=UDF_RESULT, env_manager="local",
                                           params={"on_error": "null"}, model_config=config)


def scored_frame(spark, df, pinned_model, input_table: str, input_version: int):
    """`df` (path, content, ...) -> one output row per input row with the model's answer or the row's error."""
    from pyspark.sql import functions as F

    missing = [c for c in (KEY_COLUMN, CONTENT_COLUMN) if c not in df.columns]
    if missing:
        raise PredictError(f"Delta table {input_table} version {input_version} has no column(s) "
                           f"{', '.join(repr(c) for c in missing)} to score; it has {df.columns}")
    udf = model_udf(spark, pinned_model)
    df = partitions_for_scoring(spark, df)
    scored = df.select(F.col(KEY_COLUMN), udf(F.struct(F.col(CONTENT_COLUMN))).alias("_p"))
    # spark_udf casts a string field with str() in a batch where it is not all None: a batch mixing good and
    # undecodable rows gave a good row the error "None" and a bad row the label "None". `probabilities` (an array,
    # which it keeps null) is null exactly for an undecodable row: the nulls are taken from it.
    scored_ok = F.col("_p.probabilities").isNotNull()
    return scored.select(
        F.col(KEY_COLUMN),
        F.when(scored_ok, F.col("_p.label")).alias("label"),
        F.when(scored_ok, F.col("_p.probability")).alias("probability"),
        F.col("_p.probabilities").alias("probabilities"),
        F.when(~scored_ok, F.col("_p.error")).alias("error"),
        F.lit(pinned_model.name).alias("model_name"),
        F.lit(int(pinned_model.version)).cast("long").alias("model_version"),
        F.lit(input_table).alias("input_table"),
        F.lit(int(input_version)).cast("long").alias("input_version"),
    )


def refuse_output_onto_input(table: str, out: str) -> None:
    """Refuse an output table that is the input table, compared by location (`table_location`: a `file:` URI, a
    symbolic link, a relative path, a trailing slash all name the same folder) or, for catalog names, without case
    or backticks (`same_table`), not by how either was typed.

    Raises:
        PredictError: naming both as typed and the location they share.
    """
    if same_table(table, out):
        raise PredictError(f"--out {out!r} is the input table {table!r} (both are {table_location(table)}); write "
                           f"predictions to another table")


def predict_table(spark, cfg, model_uri: str, table: str, out: str, version: Optional[int] = None,
                  mode: str = "append", run_key: Optional[str] = None) -> Dict[str, Any]:
    """Score Delta `table` at `version` (latest when None) with `model_uri`; write `out` in one commit.

    The alias in `model_uri` is resolved once, at the start: every row is scored by the same version,
    recorded in each row. Returns what the CLI prints as its JSON line.

    The version and the row counts reported are those of this job's own commit (its files, read from the Delta
    log), whatever other writers commit to `out` meanwhile; `rows_check` says how rows written were compared with
    rows read (`check_rows_written`: a table not on this filesystem by its commit's recorded row count, its error
    rows not counted), or why they could not be. The commit claims the job's identity (`job_identity`:
    model version, input table, version and data files, mode, `run_key`): an append whose identity is already
    committed to `out` (a scheduler's retry after the commit, or the same job running twice at once) writes nothing
    and reports that commit with `already_in_table` true. An overwrite always writes (repeating it gives the same
    table).

    `table` and `version` are `lakehouse predict`'s --table and --version (never the config's delta.*): a table or
    version that is not there is a configuration error (NoSuchTableError, exit status 2) naming those options.
    """
    from pipeline.serving.models import resolve  # local: mlflow and torch, preloaded on a thread
    from pipeline.tracking.runs import configure  # local: mlflow, preloaded on a thread

    if mode not in ("append", "overwrite"):
        raise PredictError(f"--mode {mode!r} is not append or overwrite")
    refuse_output_onto_input(table, out)
    started = time.monotonic()
    client = configure(cfg.mlflow)
    pinned_model = resolve(client, model_uri)
    engine = get_engine(cfg.delta.engine)
    # read through its location (one spelling of the table, however it was typed): the data files' URIs, which the
    # job's identity holds (input_digest), are then the same through a symbolic link, a relative path or `file:`
    # (a `file:` URI keeps its scheme: on a cluster whose default filesystem is not the local one, a bare path would
    # name another table)
    where = table_location(table)
    try:
        df, pinned = engine.read(spark, f"file://{where}" if urlparse(table).scheme == "file" else where, version)
    except NoSuchTableError as exc:  # the engine names the config keys; here --table and --version gave the values
        raise exc.named_by("--table", "--version", table=table) from None
    rows_in = pinned.num_rows if pinned.num_rows is not None else df.count()
    identity = job_identity(pinned_model, pinned.table, pinned.version, mode, run_key, input_digest(pinned, df))
    claim = identity_claim(identity)
    result = {
        "model_name": pinned_model.name, "model_version": pinned_model.version, "model_uri": model_uri,
        "input_table": table, "input_version": pinned.version, "rows": rows_in, "out_table": out,
        "run_key": run_key, "claim": claim,
    }
    out_version: Optional[int] = None
    # read first, then look for the claim: a commit of this job up to read_version is found here, one after it
    # makes this write lose its race (and is reported the same way)
    read_version = engine.latest_version(spark, out) if engine.exists(spark, out) else None
    already: List[int] = engine.claimed_versions(spark, out, claim) if mode == "append" else []
    if already:
        out_version = already[0]
        log.info("predictions of model %r version %s for Delta table %s version %d (run key %r) are already in %s "
                 "version %d: nothing written", pinned_model.name, pinned_model.version, table, pinned.version,
                 run_key, out, out_version)
    else:
        log.info("scoring Delta table %s version %d (%d rows) with model %r version %s", table, pinned.version,
                 rows_in, pinned_model.name, pinned_model.version)
        scored = scored_frame(spark, df, pinned_model, pinned.table, pinned.version)  # its location, not as typed
        try:
            with session_conf(spark, {ARROW_BATCH_KEY: str(ARROW_BATCH_ROWS)}):
                out_version = engine.write(scored, out, mode, commit_metadata={METADATA_KEY: {**identity,
                                                                                             "rows": rows_in}},
                                           read_version=read_version, claim=claim)
        except ConcurrentWriteError as exc:  # the same job, started twice, committed first
            if exc.committed is not None:  # seen only after both committed (delta.engine=spark)
                raise PredictError(f"predictions for Delta table {table} version {pinned.version} by model "
                                   f"{pinned_model.name!r} version {pinned_model.version} (run key {run_key!r}) "
                                   f"are in {out} twice, versions {', '.join(map(str, exc.winners))} and "
                                   f"{exc.committed}: another run of this job committed them at the same time; "
                                   f"remove one") from exc
            out_version = exc.winners[0]
            log.warning("%s; its predictions of the same job are reported", exc)
            already = [out_version]
    checked = check_rows_written(engine, spark, table, out, pinned.version, out_version, rows_in)
    seconds = time.monotonic() - started
    result.update({
        **checked, "out_version": out_version,
        "already_in_table": bool(already), "seconds": round(seconds, 2),
        "rows_per_s": round(rows_in / seconds, 1) if seconds > 0 and not already else None,
    })
    if not already:
        undecodable = "not counted" if result["errors"] is None else result["errors"]
        log.info("wrote %d prediction rows (undecodable: %s) to %s version %d in %.1f s", rows_in, undecodable, out,
                 out_version, seconds)
    return result
