"""The delta-rs engine (no JVM jars): the Delta log read and committed by `deltalake`, the Parquet files written by
Spark's executors; conditional writes through app transactions."""
from __future__ import annotations

import json
import os
import re
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

from pipeline.lakehouse.delta_common import (COMMIT_RETRIES, SAFE_READER_FEATURES, DeltaEngine, DeltaError,
                                             NoSuchTableError, PinnedTable, _lost_race, _user_metadata, claims_after,
                                             files_digest, local_path, own_commit, refuse_catalog_name, table_uri)
from pipeline.lakehouse.delta_files import log_file_uri
from pipeline.log import get_logger

log = get_logger(__name__)

HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"  # the folder name of a null partition value
_HIVE_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
_COMMIT_FILE = re.compile(r"^(\d{20})\.json$")  # a commit in _delta_log: its version, zero-padded


def hive_unescape(name: str) -> str:
    """A Hive-style folder name's text: Spark escapes '%', '#', ':', '/', '=' and a few more of a partition column's
    name or value as %XX (ExternalCatalogUtils.escapePathName), and this undoes it (its unescapePathName)."""
    return _HIVE_ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), name)


_HADOOP_GLOB = re.compile(r"([\\\[\]{}*?])")


def hadoop_glob_escape(path: str) -> str:
    """`path` with Hadoop's glob metacharacters (`[ ] { } * ? \\`) escaped by a backslash, so that
    `spark.read.parquet(path)`, which globs every path it is given, reads exactly that file: a table under
    `exp[1]/digits` is otherwise read as the pattern `exp1/digits`, and fails as a path that does not exist."""
    return _HADOOP_GLOB.sub(r"\\\1", path)


def hive_partition_values(rel_dir: str) -> Dict[str, Optional[str]]:
    """The partition values of the files in `rel_dir`, a folder of Spark's partitioned write (relative to the write's
    root, e.g. `source=50%25/day=2024-01-01 10%3A00%3A00`), unescaped as the Delta log keeps them ("50%"); a null
    is None."""
    parts: Dict[str, Optional[str]] = {}
    for seg in rel_dir.split(os.sep):
        if "=" in seg:
            k, v = seg.split("=", 1)
            parts[hive_unescape(k)] = None if v == HIVE_NULL else hive_unescape(v)
    return parts


def _log_names_writer(root: str, writer_id: str, start: int, target: str) -> bool:
    """Whether a commit of `writer_id` after version `start` may be in the Delta log at `root` (read as files, not
    through delta-rs, which may fail to read it back): True when a commit file names it, or when the log cannot be
    read to say it does not. A failed write keeps its files then (logged, naming them): a commit may use them."""
    log_dir = os.path.join(root, "_delta_log")
    try:
        names = os.listdir(log_dir)
    except FileNotFoundError:
        return False  # no log at all: no commit
    except OSError as exc:
        log.warning("Delta table %s: its log cannot be listed (%s); the files of the failed write are kept in %s, "
                    "as a commit of them may exist", root, exc, target)
        return True
    for name in names:
        match = _COMMIT_FILE.match(name)
        if not match or int(match.group(1)) <= start:
            continue
        try:
            with open(os.path.join(log_dir, name), encoding="utf-8", errors="replace") as fh:
                found = writer_id in fh.read()
        except OSError as exc:
            log.warning("Delta table %s: commit file %s cannot be read (%s); the files of the failed write are kept "
                        "in %s, as it may be a commit of them", root, name, exc, target)
            return True
        if found:
            log.warning("Delta table %s: commit %s holds this write's files (writer %s) though the write failed; "
                        "they are kept in %s", root, name, writer_id, target)
            return True
    return False


class DeltaRsEngine(DeltaEngine):
    """delta-rs (no JVM jars): the log is read and committed by `deltalake`, the Parquet files by Spark."""

    name = "delta-rs"

    def _open(self, table: str, version: Optional[int] = None):
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        refuse_catalog_name(table, self.name)
        try:
            return DeltaTable(table_uri(table), version=version) if version is not None else DeltaTable(table_uri(table))
        except TableNotFoundError:
            raise NoSuchTableError(table) from None
        except Exception as exc:
            if version is not None:
                try:
                    latest = DeltaTable(table_uri(table)).version()
                except Exception:
                    latest = None
                if latest is not None and (version > latest or version < 0):
                    raise NoSuchTableError(table, version, latest) from None
                if latest is not None:
                    raise DeltaError(f"Delta table {table}: version {version} cannot be loaded "
                                     f"(its log may have been cleaned up): {exc}") from None
            raise DeltaError(f"Delta table {table} cannot be opened: {exc}") from None

    def exists(self, spark, table: str) -> bool:
        from deltalake import DeltaTable

        refuse_catalog_name(table, self.name)
        return DeltaTable.is_deltatable(table_uri(table))

    def check_location(self, table: str) -> None:
        refuse_catalog_name(table, self.name)
        table_uri(table)  # refuses a local path delta-rs cannot read back (a percent escape, ?, #, a backslash)

    def latest_version(self, spark, table: str) -> int:
        return self._open(table).version()

    def history(self, spark, table: str) -> List[dict]:
        return self._open(table).history()

    @staticmethod
    def check_readable(dt, table: str) -> None:
        """Refuse a table whose protocol needs something a plain Parquet read would get wrong."""
        proto = dt.protocol()
        features = set(proto.reader_features or [])
        unsafe = sorted(features - SAFE_READER_FEATURES)
        config = dt.metadata().configuration or {}
        if config.get("delta.columnMapping.mode", "none") not in ("none", None):
            unsafe.append(f"columnMapping (mode {config['delta.columnMapping.mode']})")
        if proto.min_reader_version > 3:
            unsafe.append(f"minReaderVersion {proto.min_reader_version}")
        if unsafe:
            raise DeltaError(f"Delta table {table} uses reader feature(s) {', '.join(sorted(set(unsafe)))} that the "
                             f"delta-rs engine does not read; it is refused rather than read wrongly. "
                             f"Use delta.engine=spark on a cluster with the Delta jars.")

    def _snapshot(self, table: str, version: Optional[int]):
        """The table at `version` from its log: (DeltaTable, data files by partition values, PinnedTable)."""
        import pyarrow as pa

        dt = self._open(table, version)
        self.check_readable(dt, table)
        pinned_version = dt.version()
        partition_cols = list(dt.metadata().partition_columns or [])
        actions = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
        root = table_uri(table)
        missing = []
        groups: Dict[Tuple, List[str]] = {}
        for act in actions:
            full = log_file_uri(root, act["path"])
            lp = local_path(full)
            if lp is not None and not os.path.exists(lp):
                missing.append(lp)
            key = tuple((c, act.get(f"partition.{c}")) for c in partition_cols)
            groups.setdefault(key, []).append(full)
        if missing:
            raise DeltaError(f"Delta table {table} version {pinned_version} references {len(missing)} data file(s) "
                             f"that do not exist, e.g. {missing[0]}; restore them or time-travel to another version")
        num_rows = sum(int(a.get("num_records") or 0) for a in actions) if all(
            a.get("num_records") is not None for a in actions) else None
        return dt, groups, PinnedTable(table=table, version=pinned_version, num_files=len(actions), num_rows=num_rows,
                                       files_digest=files_digest([f for fs in groups.values() for f in fs]))

    def pin(self, table: str, version: Optional[int] = None) -> PinnedTable:
        return self._snapshot(table, version)[2]

    def read(self, spark, table: str, version: Optional[int] = None):
        import pyarrow as pa
        from pyspark.sql import functions as F
        from pyspark.sql.pandas.types import from_arrow_schema

        dt, groups, pinned = self._snapshot(table, version)
        schema = pa.schema(dt.schema().to_arrow())
        partition_cols = list(dt.metadata().partition_columns or [])
        data_schema = pa.schema([f for f in schema if f.name not in partition_cols])
        spark_schema = from_arrow_schema(data_schema)

        full_spark_schema = from_arrow_schema(schema)
        frames = []
        for key, files in groups.items():
            frame = spark.read.schema(spark_schema).parquet(*[hadoop_glob_escape(f) for f in files])
            for col, value in key:
                frame = frame.withColumn(col, F.lit(value).cast(full_spark_schema[col].dataType))
            frames.append(frame.select(*schema.names))
        if not frames:
            df = spark.createDataFrame([], full_spark_schema)
        else:
            df = frames[0]
            for frame in frames[1:]:
                df = df.unionByName(frame)
        return df, pinned

    def write(self, df, table: str, mode: str, partition_by: Sequence[str] = (),
              commit_metadata: Optional[Dict[str, Any]] = None, read_version: Optional[int] = None,
              claim: Optional[str] = None) -> int:
        """Executors write Parquet into the table folder; the driver commits those files in one transaction.

        Files written by an attempt that does not commit are removed again; readers never see them. A conditional
        write (`claim`) commits from a snapshot at `read_version` with a Delta app transaction (`txn`) whose id is
        the claim: delta-rs's conflict checker fails a commit whose app ids a commit after its read version also
        set, which is exactly "another claimant committed after what I read".

        A conditional write loses only to a claimant. When its commit fails for another reason (the table was
        created meanwhile by another writer, or an overwrite landed after the snapshot), the history since
        `read_version` is searched for the claim: none there, the same files are committed again from the latest
        version (the app transaction still guards what comes after it), at most COMMIT_RETRIES times, so a
        writer whose files cost minutes to compute (predict's scoring) never recomputes them for a race it did
        not lose.
        """
        import shutil

        import pyarrow.parquet as pq
        from deltalake import DeltaTable, Schema
        from deltalake.exceptions import CommitFailedError
        from deltalake.transaction import AddAction, CommitProperties, Transaction, create_table_with_add_actions

        if mode not in ("append", "overwrite"):
            raise DeltaError(f"write mode {mode!r} is not append or overwrite")
        root = table_uri(table)
        if local_path(table) is None:
            raise DeltaError(f"the delta-rs engine writes local tables only; {table} needs delta.engine=spark")
        exists = self.exists(None, table)
        if claim is not None and read_version is not None and not exists:
            raise DeltaError(f"Delta table {table} does not exist, but the write was derived from its version "
                             f"{read_version}")
        base = read_version  # the version a conditional write commits from
        if claim is not None and read_version is None and exists:  # created by another writer since it was read
            base = self._unclaimed_since(table, claim, None, None)  # raises the race when a claimant created it
        if exists and mode == "append":
            self.check_append_schema(df.sparkSession, table, df)
        start = DeltaTable(root).version() if exists else -1
        writer_id = uuid.uuid4().hex
        batch_dir = f"ingest-{time.strftime('%Y%m%dT%H%M%S')}-{writer_id[:8]}"
        target = os.path.join(root, batch_dir)
        writer = df.write.mode("error")
        if partition_by:
            writer = writer.partitionBy(*partition_by)
        writer.parquet("file://" + target)

        adds: List[AddAction] = []
        arrow_schema = None
        now_ms = int(time.time() * 1000)
        for dirpath, _, files in os.walk(target):
            for fname in sorted(files):
                if not fname.endswith(".parquet"):
                    continue
                full = os.path.join(dirpath, fname)
                meta = pq.read_metadata(full)
                if arrow_schema is None:
                    arrow_schema = meta.schema.to_arrow_schema()
                # the real path on disk: delta-rs URL-encodes an add's path as it writes the log (a folder
                # `source=50%25` is `source=50%2525` there), so an encoded one here would be encoded twice
                rel = os.path.relpath(full, root)
                parts = hive_partition_values(os.path.relpath(dirpath, target))
                adds.append(AddAction(rel, os.path.getsize(full), parts, now_ms, True,
                                      json.dumps({"numRecords": meta.num_rows})))
        if arrow_schema is None:
            raise DeltaError(f"nothing was written to {target}")
        import pyarrow as pa
        from pyspark.sql.pandas.types import to_arrow_schema

        # The table schema comes from Spark's (with partition columns), not from one file's footer.
        full_schema = to_arrow_schema(df.schema)
        full_schema = pa.schema([f.with_nullable(True) for f in full_schema])
        props = CommitProperties(
            custom_metadata={"userMetadata": _user_metadata(commit_metadata, writer_id, claim, read_version)},
            app_transactions=[Transaction(claim, (read_version if read_version is not None else -1) + 1, now_ms)]
            if claim is not None else None)
        committed = False
        try:
            for attempt in range(1, COMMIT_RETRIES + 1):
                try:
                    if not exists:
                        create_table_with_add_actions(root, Schema.from_arrow(full_schema), adds, mode="error",
                                                      partition_by=list(partition_by) or None,
                                                      commit_properties=props)
                    else:
                        dt = DeltaTable(root, version=base) if claim is not None else DeltaTable(root)
                        dt.create_write_transaction(adds, mode=mode, schema=dt.schema() if mode == "append"
                                                    else Schema.from_arrow(full_schema),
                                                    partition_by=list(partition_by) or None, commit_properties=props)
                    committed = True
                    break
                except Exception as exc:
                    if self._find_own(table, writer_id, start) is not None:  # it landed; what failed came after
                        log.warning("Delta table %s: the commit landed, then delta-rs raised: %s", table, exc)
                        committed = True
                        break
                    created_meanwhile = not exists and self.exists(None, table)
                    if claim is None or not (isinstance(exc, CommitFailedError) or created_meanwhile):
                        raise
                    # raises the lost race when a claimant committed after read_version
                    latest = self._unclaimed_since(table, claim, read_version, writer_id, cause=exc)
                    if attempt == COMMIT_RETRIES:
                        raise DeltaError(f"Delta table {table}: {attempt} commits of this write failed on conflicts "
                                         f"with commits claiming nothing of its own ({claim!r}); last: {exc}") from exc
                    if not exists and mode == "append":
                        self.check_append_schema(df.sparkSession, table, df)  # created by another writer
                    log.info("Delta table %s: commit from version %s failed (%s); no commit since claims %r, "
                             "committing the same files from version %d", table, base, exc, claim, latest)
                    exists, base = True, latest
        finally:
            # ours alone (a fresh uuid): removed only when the log proves no commit of them, never from under one
            if not committed and not _log_names_writer(root, writer_id, start, target):
                shutil.rmtree(target, ignore_errors=True)
        version = self._own_version(table, writer_id, start)
        log.info("committed %d file(s) to Delta table %s as version %d", len(adds), table, version)
        return version

    def _unclaimed_since(self, table: str, claim: str, read_version: Optional[int], writer: Optional[str],
                         cause: Optional[BaseException] = None) -> int:
        """The table's latest version, after checking that no commit after `read_version` up to it carries `claim`
        (else the lost race is raised, naming them): a conditional write may commit from that version."""
        dt = self._open(table)
        latest = dt.version()
        floor = -1 if read_version is None else read_version
        history = dt.history(limit=latest - floor) if latest > floor else []
        winners = claims_after(history, claim, read_version, before=latest + 1, writer=writer)
        if winners:
            lost = _lost_race(table, claim, read_version, winners)
            if cause is not None:
                raise lost from cause
            raise lost
        return latest

    def _find_own(self, table: str, writer_id: str, start: int) -> Optional[int]:
        if not self.exists(None, table):
            return None
        dt = self._open(table)
        latest = dt.version()
        return own_commit(dt.history(limit=max(1, latest - start)), writer_id) if latest > start else None

    def _own_version(self, table: str, writer_id: str, start: int) -> int:
        dt = self._open(table)
        latest = dt.version()
        version = own_commit(dt.history(limit=max(1, latest - start)), writer_id)
        if version is None:
            raise DeltaError(f"Delta table {table}: the commit of writer {writer_id} is not in the history of "
                             f"versions {start + 1} to {latest} (was the log rewritten meanwhile?)")
        return version

    def claimed_versions(self, spark, table: str, claim: str) -> List[int]:
        """The snapshot's app transaction for `claim` says whether any commit carries it (no history read when
        none does); its version (the claimant's read version + 1) bounds how far back the history is searched."""
        if not self.exists(spark, table):
            return []
        dt = self._open(table)
        since = dt.transaction_version(claim)
        if since is None:
            return []
        latest = dt.version()
        found = claims_after(dt.history(limit=max(1, latest - since + 1)), claim, since - 1, before=latest + 1)
        if not found:
            raise DeltaError(f"Delta table {table}: app transaction {claim!r} is recorded (version {since}), but no "
                             f"commit from version {since} to {latest} carries it (was the log cleaned up?)")
        return found
