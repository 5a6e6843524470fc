"""Ingest: an image folder (one sub-folder per class) read by Spark, validated, written as one Delta commit that accounts for every file."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import pandas as pd

from pipeline.config import Config
from pipeline.lakehouse.delta import ConcurrentWriteError, get_engine
from pipeline.lakehouse.split import DIGEST, stored_digest_column
from pipeline.lakehouse.source import (SKIP_REASONS, IngestError, SkippedFile, SourceListing, label_rule,
                                       list_source, read_udf, skipped_counts)
from pipeline.log import get_logger

log = get_logger(__name__)

# DIGEST (sha256): the SHA-256 of `content` in lowercase hex, computed as the file is read. An append finds the bytes
# the table holds by it, and the content split key is read from it (pipeline.lakehouse.split): 64 bytes a row, where
# a table without the column has every byte of every row read and hashed on each append and each plan of the split.
TABLE_COLUMNS = ["path", "label", "label_index", "width", "height", "mode", DIGEST, "content"]
_READ_PARTITION_BYTES = 64 * 2**20  # files are read by executors in partitions of about this many bytes

# Every ingest commit claims this key (see DeltaEngine.write): two ingests that read the same version cannot both
# commit, so two new classes never get the same label_index. The loser re-reads and re-assigns.
LABELS_CLAIM = "lakehouse.ingest.labels"
COMMIT_ATTEMPTS = 5
_LOGGED_SKIPS = 20
_COMMIT_SKIPS = 10_000  # skipped files listed in the commit (the counts are always complete): the log stays small
# already_in_table files listed by path (the first, by path; the count is always complete): a daily re-run over a
# source of millions of files, most of them ingested before, collects and prints this many, not every one
_LISTED_ALREADY = 10_000


@dataclass
class IngestResult:
    table: str
    version: int
    rows_written: int
    skipped: List[SkippedFile] = field(default_factory=list)
    classes: Dict[str, int] = field(default_factory=dict)  # label -> label_index
    files_found: int = 0
    label_rule: str = ""
    not_listed: Dict[str, int] = field(default_factory=dict)  # reason -> skipped files beyond those in `skipped`

    def skipped_counts(self) -> Dict[str, int]:
        listed = skipped_counts(self.skipped)
        return {r: listed.get(r, 0) + self.not_listed.get(r, 0) for r in SKIP_REASONS
                if listed.get(r, 0) + self.not_listed.get(r, 0)}

    def summary(self) -> dict:
        out = {"delta_table": self.table, "delta_version": self.version, "rows_written": self.rows_written,
               "files_found": self.files_found, "skipped": len(self.skipped) + sum(self.not_listed.values()),
               "skipped_counts": self.skipped_counts(), "skipped_files": [s.path for s in self.skipped],
               "skipped_detail": [s._asdict() for s in self.skipped], "label_rule": self.label_rule,
               "classes": self.classes}
        if self.not_listed:
            out["skipped_not_listed"] = sum(self.not_listed.values())
        return out


def _counts_text(counts: Dict[str, int]) -> str:
    """{reason: files} as the log lines give it: `already_in_table=6, duplicate=1`, or `none`."""
    return ", ".join(f"{r}={n}" for r, n in counts.items()) or "none"


def _validate_udf():
    from pyspark.sql.functions import pandas_udf

    from pipeline.images import ImageDecodeError, inspect_image

    @pandas_udf("width int, height int, mode string, error string")
    def validate(content: pd.Series) -> pd.DataFrame:
        rows = []
        for blob in content:
            if blob is None:  # a listed file Spark did not return; reported as not_read
                rows.append((None, None, None, None))
                continue
            try:
                w, h, m = inspect_image(bytes(blob))
                rows.append((w, h, m, None))
            except ImageDecodeError as exc:
                rows.append((None, None, None, str(exc)))
        return pd.DataFrame(rows, columns=["width", "height", "mode", "error"])

    return validate


@dataclass
class _TableState:
    """The table as one ingest attempt read it: the version, its classes and which content it already holds."""

    version: Optional[int]  # None: no table yet
    classes: Dict[str, int]
    known: Optional["DataFrame"]  # sha256 -> _in_table (a path holding those bytes); None on overwrite
    columns: List[str] = field(default_factory=lambda: list(TABLE_COLUMNS))  # what this commit writes


def _table_state(engine, spark, table: str, mode: str) -> _TableState:
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    if not engine.exists(spark, table):
        return _TableState(None, {}, None)
    df, pinned = engine.read(spark, table)
    if mode == "overwrite":
        return _TableState(pinned.version, {}, None)
    classes: Dict[str, int] = {}
    if "label" in df.columns and "label_index" in df.columns:
        for r in df.select("label", "label_index").distinct().collect():
            if r["label"] is None or r["label_index"] is None:  # written by another writer: no index to extend
                column = "label" if r["label"] is None else "label_index"
                raise IngestError(f"Delta table {table} version {pinned.version}: column '{column}' is null in some "
                                  f"row(s) (label {r['label']!r}, label_index {r['label_index']!r}); an append "
                                  f"cannot assign label indices beside them: repair the table, or ingest with "
                                  f"--mode overwrite")
            if r["label_index"] in classes.values() and classes.get(r["label"]) != r["label_index"]:
                other = next(k for k, v in classes.items() if v == r["label_index"])
                raise IngestError(f"Delta table {table} version {pinned.version}: label_index {r['label_index']} "
                                  f"has two labels, {other!r} and {r['label']!r}; repair the table before appending")
            classes[r["label"]] = int(r["label_index"])
    known = None
    if DIGEST in df.columns:  # the digests stored; only rows without one (another writer's) have their bytes hashed
        stored = df.filter(stored_digest_column().isNotNull()).select(F.col(DIGEST).alias("sha256"), "path")
        # a null digest is a filter Parquet's statistics skip whole files and row groups by (their bytes unread); a
        # malformed one (another writer's, counted from the digest column alone) needs every row looked at
        malformed = df.filter(F.col(DIGEST).isNotNull() & stored_digest_column().isNull()).limit(1).count()
        lacking = stored_digest_column().isNull() if malformed else F.col(DIGEST).isNull()
        hashed = df.filter(lacking).select(F.sha2(F.col("content"), 256).alias("sha256"), "path")
        known = stored.unionByName(hashed)
    elif "content" in df.columns:
        log.warning("Delta table %s has no %s column (written before ingest stored one): this append hashes every "
                    "row's bytes to find those it already holds, and a plan of the content split reads them all; "
                    "an ingest with --mode overwrite writes the table with it", table, DIGEST)
        known = df.select(F.sha2(F.col("content"), 256).alias("sha256"), "path")
    if known is not None:  # kept for the attempt: counted, listed, anti-joined and written against, read once
        known = known.groupBy("sha256").agg(F.min("path").alias("_in_table")).persist(StorageLevel.MEMORY_AND_DISK)
    columns = [c for c in TABLE_COLUMNS if c != DIGEST or DIGEST in df.columns]  # an append keeps the table's own
    return _TableState(pinned.version, classes, known, columns)


def is_strict(cfg: Config) -> bool:
    """`ingest.strict`, or its older spelling `ingest.on_bad_file=fail`."""
    return bool(cfg.ingest.strict) or cfg.ingest.on_bad_file == "fail"


def _log_skipped(skipped: Sequence[SkippedFile]) -> None:
    for s in skipped[:_LOGGED_SKIPS]:
        log.warning("skipped %s: %s (%s)", s.path, s.reason, s.detail)
    if len(skipped) > _LOGGED_SKIPS:
        log.warning("... and %d more skipped file(s), all listed in the ingest report", len(skipped) - _LOGGED_SKIPS)


def ingest_folder(spark, cfg: Config, source: str, mode: str = "append") -> IngestResult:
    """Read `source/<class>/.../<image>` with Spark, validate every image and write one Delta commit.

    Every file under the source is either written as a row or listed, with its path and a reason (see
    SKIP_REASONS), in the result and in the commit's `userMetadata`. With `ingest.strict` (or the older
    `ingest.on_bad_file=fail`) any skipped file fails the ingest before anything is written. An append
    keeps the table's existing label indices and gives new classes the next free ones; it skips files whose
    bytes the table already holds (`already_in_table`, not a failure under strict), so a retried job does not
    double the table, and when nothing is new it commits nothing and reports the version read.

    Label indices are assigned from one version of the table and committed against it (LABELS_CLAIM): when
    another ingest commits in between, this one re-reads the table and assigns again, up to COMMIT_ATTEMPTS
    times. The version returned and logged is this ingest's own commit.

    Raises:
        IngestError: the folder is missing or has nothing to ingest, a file is skipped under strict, or every
            attempt lost the race to another ingest (the message names the versions).
        SchemaMismatchError: an append whose columns differ from the table's (table untouched).
    """
    from pyspark import StorageLevel
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if mode not in ("append", "overwrite"):
        raise IngestError(f"--mode {mode!r} is not append or overwrite")
    root = os.path.abspath(source)
    if not os.path.isdir(root):
        raise IngestError(f"ingest source {source} is not a folder")
    engine = get_engine(cfg.delta.engine)
    table = cfg.delta.table
    strict = is_strict(cfg)
    rule = label_rule(cfg.ingest.label_depth)
    log.info("ingesting %s: %s%s", root, rule, "; strict: any skipped file fails the ingest" if strict else "")

    engine.check_location(table)  # before anything is read: a path this engine would write but not read back
    max_file_bytes = int(cfg.ingest.max_file_mb * 2**20)
    listing = list_source(root, cfg.ingest.extensions, cfg.ingest.label_depth, max_file_bytes=max_file_bytes)
    if listing.files_found == 0:
        raise IngestError(f"ingest source {source} holds no files")
    skipped = list(listing.skipped)
    labels: List[str] = []
    checked = None
    try:
        if listing.candidates:
            try:
                parallelism = spark.sparkContext.defaultParallelism
            except Exception:  # a Spark Connect session has no SparkContext
                parallelism = 2
            slices = max(1, min(len(listing.candidates),
                                max(parallelism, -(-listing.candidate_bytes // _READ_PARTITION_BYTES))))
            # exactly the listed files are read, by path: Spark never lists the source itself (it would follow links)
            read = read_udf(os.path.realpath(root), max_file_bytes)
            files = (spark.createDataFrame(listing.candidates, "path string, label string, is_link boolean")
                     .repartition(slices).withColumn("_r", read(F.col("path"), F.col("is_link")))
                     .select("path", "label", "is_link", F.col("_r.content").alias("content"),
                             F.col("_r.error").alias("read_error")))
            checked = (files.withColumn("_v", _validate_udf()(F.col("content")))
                       .select("path", "label", "is_link", "content", "_v.width", "_v.height", "_v.mode",
                               F.when(F.col("content").isNull(), F.lit("not_read"))
                               .when(F.col("_v.error").isNotNull(), F.lit("undecodable")).alias("reason"),
                               F.when(F.col("content").isNull(), F.col("read_error"))
                               .otherwise(F.col("_v.error")).alias("detail"),
                               F.sha2(F.col("content"), 256).alias("sha256")))
            checked = checked.persist(StorageLevel.MEMORY_AND_DISK)
            skipped += [SkippedFile(r["path"], r["reason"], r["detail"]) for r in
                        checked.filter(F.col("reason").isNotNull()).select("path", "reason", "detail").collect()]
            # duplicates by content: the first path (a real file before a link to it) is kept
            by_hash = Window.partitionBy("sha256").orderBy("is_link", "path")
            ranked = (checked.filter(F.col("reason").isNull()).select("path", "sha256", "is_link")
                      .withColumn("_n", F.row_number().over(by_hash))
                      .withColumn("_kept", F.first("path").over(by_hash)))
            dups = ranked.filter(F.col("_n") > 1).select("path", "_kept").collect()
            skipped += [SkippedFile(r["path"], "duplicate", f"same content as {r['_kept']}") for r in dups]
            good = checked.filter(F.col("reason").isNull())
            if dups:
                good = good.join(spark.createDataFrame([(r["path"],) for r in dups], "path string"), "path",
                                 "left_anti")
            labels = sorted(r["label"] for r in good.select("label").distinct().collect())
        skipped.sort(key=lambda s: s.path)
        counts = _counts_text(skipped_counts(skipped))
        _log_skipped(skipped)
        if skipped and strict:
            first = "; ".join(f"{s.path} ({s.reason}: {s.detail})" for s in skipped[:5])
            raise IngestError(f"ingest.strict: {len(skipped)} of {listing.files_found} file(s) under {source} would "
                              f"be skipped ({counts}), nothing written. First: {first}"
                              f"{' ...' if len(skipped) > 5 else ''}")
        if not labels:
            raise IngestError(f"nothing to ingest in {source}: all {listing.files_found} file(s) skipped ({counts}); "
                              f"nothing written")
        lost: List[str] = []
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            result = _commit_attempt(spark, engine, table, mode, good, skipped, listing, root, rule)
            if isinstance(result, IngestResult):
                if lost:
                    log.info("ingest of %s committed on attempt %d, after losing to: %s", source, attempt,
                             "; ".join(lost))
                return result
            if result.committed is not None:  # seen only after committing (delta.engine=spark): no blind retry
                raise IngestError(f"ingest of {source}: {result}. Label indices of the classes new in it may "
                                  f"collide with the other commit's; check the table before using it") from result
            lost.append(str(result))
            log.warning("ingest of %s, attempt %d of %d: %s; re-reading the table and assigning labels again",
                        source, attempt, COMMIT_ATTEMPTS, result)
        raise IngestError(f"ingest of {source} into {table} lost the race to other ingests {COMMIT_ATTEMPTS} "
                          f"times, nothing written: {'; '.join(lost)}")
    finally:
        if checked is not None:
            checked.unpersist()


def _commit_attempt(spark, engine, table: str, mode: str, good, skipped: List[SkippedFile], listing: SourceListing,
                    root: str, rule: str):
    """One read-assign-commit of the validated rows `good`: an IngestResult, or the ConcurrentWriteError lost."""
    state = _table_state(engine, spark, table, mode)
    try:
        return _commit_against(state, spark, engine, table, mode, good, skipped, listing, root, rule)
    finally:
        if state.known is not None:
            state.known.unpersist()


def _commit_against(state: _TableState, spark, engine, table: str, mode: str, good, skipped: List[SkippedFile],
                    listing: SourceListing, root: str, rule: str):
    """`_commit_attempt` against the table as `state` read it."""
    from pyspark.sql import functions as F

    skipped = list(skipped)
    new = good
    not_listed: Dict[str, int] = {}
    if state.known is not None:
        # counted in full, listed up to _LISTED_ALREADY (first by path): nothing per file reaches the driver beyond
        already = good.join(state.known, "sha256").select("path", "_in_table")
        count = already.count()
        if count:
            skipped += [SkippedFile(r["path"], "already_in_table",
                                    f"same content as {r['_in_table']} in {table} version {state.version}")
                        for r in already.orderBy("path").limit(_LISTED_ALREADY).collect()]
            if count > _LISTED_ALREADY:
                not_listed["already_in_table"] = count - _LISTED_ALREADY
            new = good.join(state.known.select("sha256"), "sha256", "left_anti")
        skipped.sort(key=lambda s: s.path)
    classes = dict(state.classes)
    new_labels = sorted(r["label"] for r in new.select("label").distinct().collect())
    for label in new_labels:
        if label not in classes:
            classes[label] = max(classes.values(), default=-1) + 1
    result = IngestResult(table=table, version=state.version if state.version is not None else -1, rows_written=0,
                          skipped=skipped, classes=classes, files_found=listing.files_found, label_rule=rule,
                          not_listed=not_listed)
    counts = _counts_text(result.skipped_counts())
    n_skipped = len(skipped) + sum(not_listed.values())
    if not new_labels:  # every readable file is already in the table: a re-run, or a retry after a commit
        log.info("nothing new to ingest from %s: every readable file is already in %s version %d; nothing "
                 "committed (skipped %d: %s)", root, table, state.version, n_skipped, counts)
        return result
    mapping = spark.createDataFrame(sorted(classes.items()), "label string, label_index int")
    out = new.join(F.broadcast(mapping), on="label", how="left").select(*state.columns)
    rows = out.count()
    report = {"source": root, "files_found": listing.files_found, "rows_written": rows, "label_rule": rule,
              "read_version": state.version, "skipped_counts": result.skipped_counts(),
              "skipped": [s._asdict() for s in skipped[:_COMMIT_SKIPS]]}
    if n_skipped > _COMMIT_SKIPS:
        report["skipped_not_listed"] = n_skipped - min(len(skipped), _COMMIT_SKIPS)
    try:
        version = engine.write(out, table, mode, commit_metadata={"lakehouse.ingest": report},
                               read_version=state.version, claim=LABELS_CLAIM)
    except ConcurrentWriteError as exc:
        return exc
    log.info("ingested %d of %d file(s) from %s into %s version %d; skipped %d: %s", rows, listing.files_found,
             root, table, version, n_skipped, counts)
    result.version, result.rows_written = version, rows
    return result


def ingest_report(spark, cfg: Config, version: Optional[int] = None) -> Optional[dict]:
    """The ingest report recorded with a commit of `delta.table` (latest when `version` is None), or None."""
    engine = get_engine(cfg.delta.engine)
    return engine.commit_metadata(spark, cfg.delta.table, version).get("lakehouse.ingest")
