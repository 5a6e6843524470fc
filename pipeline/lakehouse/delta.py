"""Delta Lake read (pinned to a version) and atomic write behind one interface, with two engines: delta-rs and delta-spark."""
from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlparse

from pipeline.log import get_logger

log = get_logger(__name__)

# Reader features whose files can be read as plain Parquet without changing a row.
SAFE_READER_FEATURES = {"timestampNtz", "v2Checkpoint", "vacuumProtocolCheck", "checkpointProtection"}


class DeltaError(RuntimeError):
    """A Delta table cannot be read or written as asked; the message names the table and the reason."""


class SchemaMismatchError(DeltaError):
    """An append's schema differs from the table's; the message names the differing columns."""


class ConcurrentWriteError(DeltaError):
    """A conditional write lost a race: another writer's commit that claims the same key landed after the version
    this write was derived from. `committed` is None when nothing was committed (the caller may re-read and retry),
    or this write's own version when the engine could only detect the race after committing (delta.engine=spark)."""

    def __init__(self, message: str, winners: Sequence[int] = (), committed: Optional[int] = None):
        super().__init__(message)
        self.winners = list(winners)
        self.committed = committed


# The key under which every commit this project writes records who wrote it (inside `userMetadata`, as JSON):
# {"writer": a uuid per write, "claim": the claim of a conditional write, "read_version": what it was derived from}.
COMMIT_KEY = "lakehouse.commit"
# Commits of one conditional write's files after conflicts with commits that do not carry its claim (delta-rs).
COMMIT_RETRIES = 5


def _commit_record(entry: dict) -> dict:
    text = entry.get("userMetadata")
    if not text:
        return {}
    try:
        meta = json.loads(text)
    except (TypeError, ValueError):
        return {}
    record = meta.get(COMMIT_KEY) if isinstance(meta, dict) else None
    return record if isinstance(record, dict) else {}


def own_commit(history: Sequence[dict], writer: str) -> Optional[int]:
    """The version of the commit `writer` made, found in `history` (entries as DeltaTable.history gives them)."""
    for entry in history:
        if _commit_record(entry).get("writer") == writer and entry.get("version") is not None:
            return int(entry["version"])
    return None


def claims_after(history: Sequence[dict], claim: str, read_version: Optional[int], before: Optional[int] = None,
                 writer: Optional[str] = None) -> List[int]:
    """Versions after `read_version` (None: the table did not exist, so every version) and before `before` whose
    commit carries `claim` and was not made by `writer`, oldest first: the commits a write derived from
    `read_version` lost its race to."""
    floor = -1 if read_version is None else read_version
    out = []
    for entry in history:
        version = entry.get("version")
        if version is None or version <= floor or (before is not None and version >= before):
            continue
        record = _commit_record(entry)
        if record.get("claim") == claim and record.get("writer") != writer:
            out.append(int(version))
    return sorted(out)


def _lost_race(table: str, claim: str, read_version: Optional[int], winners: Sequence[int],
               committed: Optional[int] = None) -> ConcurrentWriteError:
    read = f"version {read_version}" if read_version is not None else "the table's absence (it did not exist)"
    won = (f"version{'s' if len(winners) > 1 else ''} {', '.join(map(str, winners))}" if winners
           else "a commit made meanwhile")
    done = (f"this write was committed as version {committed} before the race could be seen (delta.engine=spark)"
            if committed is not None else "nothing was committed")
    return ConcurrentWriteError(f"Delta table {table}: a write derived from {read} lost the race to {won}, "
                                f"committed meanwhile by another writer claiming {claim!r}; {done}",
                                winners=winners, committed=committed)


def _user_metadata(commit_metadata: Optional[Dict[str, Any]], writer: str, claim: Optional[str],
                   read_version: Optional[int]) -> str:
    record: Dict[str, Any] = {"writer": writer}
    if claim is not None:
        record.update(claim=claim, read_version=read_version)
    return json.dumps({**(commit_metadata or {}), COMMIT_KEY: record})


@dataclass(frozen=True)
class PinnedTable:
    """A Delta table resolved at one version: what every later step records."""

    table: str
    version: int
    num_files: int
    num_rows: Optional[int]


def local_path(table: str) -> Optional[str]:
    """The local filesystem path of a table URI, or None when it lives elsewhere (s3://, dbfs:/, a catalog name)."""
    if catalog_name(table):
        return None
    parsed = urlparse(table)
    if parsed.scheme in ("", "file"):
        return os.path.abspath(parsed.path if parsed.scheme else table)
    return None


_NAME_PART = r"(?:[A-Za-z_][A-Za-z0-9_]*|`[^`]+`)"
_CATALOG_NAME = re.compile(rf"^{_NAME_PART}\.{_NAME_PART}\.{_NAME_PART}$")


def catalog_name(table: str) -> Optional[str]:
    """`table` when it is a three-level catalog name (`catalog.schema.table`, Unity Catalog) rather than a path:
    no scheme, no slash, three identifiers, and no such folder here."""
    if "/" in table or urlparse(table).scheme or not _CATALOG_NAME.match(table) or os.path.exists(table):
        return None
    return table


def table_uri(table: str) -> str:
    path = local_path(table)
    return path if path is not None else table


def describe_schema_diff(existing: Dict[str, str], incoming: Dict[str, str]) -> List[str]:
    """Human-readable differences between two {column: type} schemas (empty when equal)."""
    diffs = []
    for name in incoming:
        if name not in existing:
            diffs.append(f"new column '{name}' ({incoming[name]})")
        elif existing[name] != incoming[name]:
            diffs.append(f"column '{name}' is {incoming[name]}, the table has {existing[name]}")
    for name in existing:
        if name not in incoming:
            diffs.append(f"missing column '{name}' ({existing[name]})")
    return diffs


def _spark_types(schema) -> Dict[str, str]:
    return {f.name: f.dataType.simpleString() for f in schema.fields}


class DeltaEngine:
    """The interface both engines implement."""

    name = "?"

    def exists(self, spark, table: str) -> bool:
        raise NotImplementedError

    def latest_version(self, spark, table: str) -> int:
        raise NotImplementedError

    def read(self, spark, table: str, version: Optional[int] = None) -> Tuple["DataFrame", PinnedTable]:
        """A DataFrame of the table at `version` (latest when None) and the version it is pinned to."""
        raise NotImplementedError

    def write(self, df, table: str, mode: str, partition_by: Sequence[str] = (),
              commit_metadata: Optional[Dict[str, Any]] = None, read_version: Optional[int] = None,
              claim: Optional[str] = None) -> int:
        """Write `df` in one atomic commit (`mode` append|overwrite); return the version of THIS commit.

        The version is this writer's own (found by a writer id recorded with the commit), never just the latest:
        another writer may commit right after. `commit_metadata` is recorded, as JSON, in the commit's
        `userMetadata` (what DESCRIBE HISTORY shows), beside `lakehouse.commit` (writer id, claim).

        A conditional write: with `claim`, `df` was derived from the table at `read_version` (None: the table did
        not exist), and the write must not land after another commit that carries the same `claim` and was made
        after `read_version`. Blind appends never conflict in Delta, so the claim is what makes two such writers
        conflict. Raises ConcurrentWriteError naming the winner's version.
        """
        raise NotImplementedError

    def history(self, spark, table: str) -> List[dict]:
        raise NotImplementedError

    def claimed_versions(self, spark, table: str, claim: str) -> List[int]:
        """The versions whose commit carries `claim` (a conditional write's), oldest first; [] when none does or the
        table does not exist. How a writer that claims its own identity (predict) finds that it already committed."""
        if not self.exists(spark, table):
            return []
        return claims_after(self.history(spark, table), claim, None)

    def commit_metadata(self, spark, table: str, version: Optional[int] = None) -> Dict[str, Any]:
        """The `commit_metadata` written with `version` (latest when None); {} when the commit has none."""
        version = self.latest_version(spark, table) if version is None else version
        for entry in self.history(spark, table):
            if entry.get("version") == version:
                text = entry.get("userMetadata")
                return json.loads(text) if text else {}
        raise DeltaError(f"Delta table {table} has no commit {version} in its history")

    def check_append_schema(self, spark, table: str, df) -> None:
        if not self.exists(spark, table):
            return
        existing, _ = self.read(spark, table)
        diffs = describe_schema_diff(_spark_types(existing.schema), _spark_types(df.schema))
        if diffs:
            raise SchemaMismatchError(f"append to Delta table {table} refused, the schema differs: {'; '.join(diffs)}. "
                                      f"The table was left at version {self.latest_version(spark, table)}.")


def refuse_catalog_name(table: str, engine: str) -> None:
    if catalog_name(table):
        raise DeltaError(f"config key 'delta.table': {table!r} is a catalog table name (catalog.schema.table), which "
                         f"delta.engine={engine} cannot resolve; use delta.engine=spark (the catalog's own Spark "
                         f"session, e.g. on Databricks) or give the table's path (e.g. /Volumes/<catalog>/<schema>/...)")


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
            raise DeltaError(f"Delta table {table} does not exist (config key 'delta.table')") from None
        except Exception as exc:
            if version is not None:
                try:
                    latest = DeltaTable(table_uri(table)).version()
                except Exception:
                    latest = None
                if latest is not None and (version > latest or version < 0):
                    raise DeltaError(f"Delta table {table} has no version {version} (config key 'delta.version'); "
                                     f"versions run from 0 to {latest}") from None
                if latest is not None:
                    raise DeltaError(f"Delta table {table}: version {version} cannot be loaded "
                                     f"(its log may have been cleaned up): {exc}") from None
            raise DeltaError(f"Delta table {table} cannot be opened: {exc}") from None

    def exists(self, spark, table: str) -> bool:
        from deltalake import DeltaTable

        refuse_catalog_name(table, self.name)
        return DeltaTable.is_deltatable(table_uri(table))

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

    def read(self, spark, table: str, version: Optional[int] = None):
        import pyarrow as pa
        from pyspark.sql import functions as F
        from pyspark.sql.pandas.types import from_arrow_schema

        dt = self._open(table, version)
        self.check_readable(dt, table)
        pinned_version = dt.version()
        schema = pa.schema(dt.schema().to_arrow())
        partition_cols = list(dt.metadata().partition_columns or [])
        actions = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
        root = table_uri(table)
        data_schema = pa.schema([f for f in schema if f.name not in partition_cols])
        spark_schema = from_arrow_schema(data_schema)

        missing = []
        groups: Dict[Tuple, List[str]] = {}
        for act in actions:
            rel = act["path"]
            full = rel if "://" in rel or os.path.isabs(rel) else f"{root.rstrip('/')}/{rel}"
            lp = local_path(full)
            if lp is not None and not os.path.exists(lp):
                missing.append(lp)
            key = tuple((c, act.get(f"partition.{c}")) for c in partition_cols)
            groups.setdefault(key, []).append(full)
        if missing:
            raise DeltaError(f"Delta table {table} version {pinned_version} references {len(missing)} data file(s) "
                             f"that do not exist, e.g. {missing[0]}; restore them or time-travel to another version")

        full_spark_schema = from_arrow_schema(schema)
        frames = []
        for key, files in groups.items():
            frame = spark.read.schema(spark_schema).parquet(*files)
            for col, value in key:
                frame = frame.withColumn(col, F.lit(value).cast(full_spark_schema[col].dataType))
            frames.append(frame.select(*schema.names))
        if not frames:
            df = spark.createDataFrame([], full_spark_schema)
        else:
            df = frames[0]
            for frame in frames[1:]:
                df = df.unionByName(frame)
        num_rows = sum(int(a.get("num_records") or 0) for a in actions) if all(
            a.get("num_records") is not None for a in actions) else None
        return df, PinnedTable(table=table, version=pinned_version, num_files=len(actions), num_rows=num_rows)

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
                rel = os.path.relpath(full, root)
                parts = {}
                for seg in os.path.relpath(dirpath, target).split(os.sep):
                    if "=" in seg:
                        k, v = seg.split("=", 1)
                        parts[k] = None if v == "__HIVE_DEFAULT_PARTITION__" else v
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
            if not committed:
                shutil.rmtree(target, ignore_errors=True)  # ours alone (a fresh uuid), never in the log
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


class SparkDeltaEngine(DeltaEngine):
    """delta-spark: Spark reads and writes Delta itself (needs the Delta jars on the cluster)."""

    name = "spark"

    @staticmethod
    def _table(spark, table: str):
        """delta-spark's DeltaTable for a path or a catalog name (`catalog.schema.table`)."""
        from delta.tables import DeltaTable

        return DeltaTable.forName(spark, table) if catalog_name(table) else DeltaTable.forPath(spark, table)

    def exists(self, spark, table: str) -> bool:
        from delta.tables import DeltaTable

        if catalog_name(table):
            return bool(spark.catalog.tableExists(table))
        return DeltaTable.isDeltaTable(spark, table)

    def latest_version(self, spark, table: str) -> int:
        if not self.exists(spark, table):
            raise DeltaError(f"Delta table {table} does not exist (config key 'delta.table')")
        return int(self._table(spark, table).history(1).collect()[0]["version"])

    def history(self, spark, table: str) -> List[dict]:
        return [r.asDict() for r in self._table(spark, table).history().collect()]

    def read(self, spark, table: str, version: Optional[int] = None):
        latest = self.latest_version(spark, table)
        if version is not None and not 0 <= version <= latest:
            raise DeltaError(f"Delta table {table} has no version {version} (config key 'delta.version'); "
                             f"versions run from 0 to {latest}")
        pinned = latest if version is None else version
        reader = spark.read.format("delta").option("versionAsOf", pinned)
        df = reader.table(table) if catalog_name(table) else reader.load(table)
        return df, PinnedTable(table=table, version=pinned, num_files=-1, num_rows=None)

    def write(self, df, table: str, mode: str, partition_by: Sequence[str] = (),
              commit_metadata: Optional[Dict[str, Any]] = None, read_version: Optional[int] = None,
              claim: Optional[str] = None) -> int:
        """delta-spark's DataFrame writer cannot commit against a chosen read version, so a conditional write is
        checked twice: before writing (the table still is at `read_version`'s line: no claimant since), and after,
        in the history between `read_version` and this commit; a race seen only after committing raises
        ConcurrentWriteError with `committed` set (the caller must not simply retry)."""
        spark = df.sparkSession
        exists = self.exists(spark, table)
        if claim is not None:
            if read_version is not None and not exists:
                raise DeltaError(f"Delta table {table} does not exist, but the write was derived from its version "
                                 f"{read_version}")
            if exists:  # (read_version None: created by another writer since; only a claimant among them wins)
                winners = claims_after(self.history(spark, table), claim, read_version)
                if winners:
                    raise _lost_race(table, claim, read_version, winners)
        if mode == "append":
            self.check_append_schema(spark, table, df)
        writer_id = uuid.uuid4().hex
        writer = (df.write.format("delta").mode(mode)
                  .option("userMetadata", _user_metadata(commit_metadata, writer_id, claim, read_version)))
        if partition_by:
            writer = writer.partitionBy(*partition_by)
        if catalog_name(table):
            writer.saveAsTable(table)
        else:
            writer.save(table)
        history = self.history(spark, table)
        version = own_commit(history, writer_id)
        if version is None:
            raise DeltaError(f"Delta table {table}: the commit of writer {writer_id} is not in its history")
        if claim is not None:
            winners = claims_after(history, claim, read_version, before=version, writer=writer_id)
            if winners:
                raise _lost_race(table, claim, read_version, winners, committed=version)
        return version


ENGINES = {"delta-rs": DeltaRsEngine, "spark": SparkDeltaEngine}


def commit_files(table: str, version: int) -> Optional[List[str]]:
    """The local paths of the data files commit `version` of `table` added (whichever engine wrote it), read from
    the Delta log: the files of the table at `version` that it did not hold at `version - 1`. None for a table that
    is not on this filesystem. What a writer counts as its own output, never "whatever appeared since it started"."""
    from deltalake import DeltaTable

    if local_path(table) is None:
        return None
    uri = table_uri(table)
    now = set(DeltaTable(uri, version=version).file_uris())
    before = set(DeltaTable(uri, version=version - 1).file_uris()) if version > 0 else set()
    return sorted(local_path(u) for u in now - before)


def get_engine(name: str) -> DeltaEngine:
    """The engine named by `delta.engine`."""
    if name not in ENGINES:
        raise DeltaError(f"config key 'delta.engine': {name!r} is not one of {', '.join(ENGINES)}")
    return ENGINES[name]()


def usable_engines() -> Dict[str, str]:
    """Which engines can run here, with the reason when one cannot (for `lakehouse doctor`)."""
    out = {}
    try:
        import deltalake  # noqa: F401

        out["delta-rs"] = f"usable (deltalake {deltalake.__version__})"
    except Exception as exc:
        out["delta-rs"] = f"not usable: {exc}"
    try:
        import delta  # noqa: F401
        import pyspark

        out["spark"] = (f"python package present (delta-spark for Spark {pyspark.__version__}); needs the "
                        "io.delta:delta-spark jars via spark.jars or spark.jars.packages")
    except Exception as exc:
        out["spark"] = f"not usable: {exc}"
    return out
