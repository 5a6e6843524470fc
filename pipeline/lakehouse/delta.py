"""Delta Lake read (pinned to a version) and atomic write behind one interface, with two engines: delta-rs
(pipeline.lakehouse.delta_rs) and delta-spark (pipeline.lakehouse.delta_spark); what they share is in delta_common,
whose names are importable from here."""
from __future__ import annotations

from typing import Dict, List, Optional

from pipeline.lakehouse.delta_common import (COMMIT_KEY, COMMIT_RETRIES, SAFE_READER_FEATURES, ConcurrentWriteError,
                                             DeltaEngine, DeltaError, NoSuchTableError, PinnedTable,
                                             SchemaMismatchError, catalog_name, claims_after, describe_schema_diff,
                                             local_path, own_commit, refuse_catalog_name, same_table, table_location,
                                             table_uri)
from pipeline.lakehouse.delta_rs import DeltaRsEngine
from pipeline.lakehouse.delta_spark import SparkDeltaEngine

__all__ = ["COMMIT_KEY", "COMMIT_RETRIES", "SAFE_READER_FEATURES", "ConcurrentWriteError", "DeltaEngine", "DeltaError",
           "NoSuchTableError", "PinnedTable", "SchemaMismatchError", "catalog_name", "claims_after",
           "describe_schema_diff", "local_path", "own_commit", "refuse_catalog_name", "same_table", "table_location",
           "table_uri", "DeltaRsEngine", "SparkDeltaEngine", "ENGINES", "commit_files", "get_engine", "usable_engines"]


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
