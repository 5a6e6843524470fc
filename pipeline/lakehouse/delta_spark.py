"""The delta-spark engine: Spark reads and writes Delta itself (the Delta jars on the cluster, a catalog's own session);
a conditional write's race can only be seen after its commit, in the table's history."""
from __future__ import annotations

import uuid
from typing import Any, Dict, List, Optional, Sequence

from pipeline.lakehouse.delta_common import (DeltaEngine, DeltaError, NoSuchTableError, PinnedTable, _lost_race,
                                             _user_metadata, catalog_name, claims_after, own_commit)
from pipeline.log import get_logger

log = get_logger(__name__)


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
            raise NoSuchTableError(table)
        return int(self._table(spark, table).history(1).collect()[0]["version"])

    def history(self, spark, table: str) -> List[dict]:
        return [r.asDict() for r in self._table(spark, table).history().collect()]

    def read(self, spark, table: str, version: Optional[int] = None):
        latest = self.latest_version(spark, table)
        if version is not None and not 0 <= version <= latest:
            raise NoSuchTableError(table, version, latest)
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
        if mode == "overwrite":  # the new rows' columns replace the table's, as the delta-rs engine's overwrite does
            writer = writer.option("overwriteSchema", "true")
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
