"""Ingest: an image folder (one sub-folder per class) read by Spark, validated, written as one Delta commit."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import pandas as pd

from pipeline.config import Config
from pipeline.lakehouse.delta import DeltaError, get_engine
from pipeline.log import get_logger

log = get_logger(__name__)

TABLE_COLUMNS = ["path", "label", "label_index", "width", "height", "mode", "content"]


class IngestError(RuntimeError):
    """The ingest cannot proceed; nothing was written."""


@dataclass
class IngestResult:
    table: str
    version: int
    rows_written: int
    skipped: List[Tuple[str, str]] = field(default_factory=list)  # (path, reason)
    classes: Dict[str, int] = field(default_factory=dict)  # label -> label_index

    def summary(self) -> dict:
        return {"delta_table": self.table, "delta_version": self.version, "rows_written": self.rows_written,
                "skipped": len(self.skipped), "skipped_files": [p for p, _ in self.skipped], "classes": self.classes}


def _validate_udf():
    from pyspark.sql.functions import pandas_udf

    from pipeline.data.transforms import ImageDecodeError, inspect_image

    @pandas_udf("width int, height int, mode string, error string")
    def validate(content: pd.Series) -> pd.DataFrame:
        rows = []
        for blob in content:
            try:
                w, h, m = inspect_image(bytes(blob))
                rows.append((w, h, m, None))
            except ImageDecodeError as exc:
                rows.append((None, None, None, str(exc)))
        return pd.DataFrame(rows, columns=["width", "height", "mode", "error"])

    return validate


def _existing_classes(engine, spark, table: str) -> Dict[str, int]:
    if not engine.exists(spark, table):
        return {}
    df, _ = engine.read(spark, table)
    if "label" not in df.columns or "label_index" not in df.columns:
        return {}
    return {r["label"]: int(r["label_index"]) for r in df.select("label", "label_index").distinct().collect()}


def ingest_folder(spark, cfg: Config, source: str, mode: str = "append") -> IngestResult:
    """Read `source/<class>/<image>` with Spark, validate every image and write one Delta commit.

    Unreadable files are skipped and listed (`ingest.on_bad_file=skip`) or fail the ingest before
    anything is written (`fail`). An append keeps the table's existing label indices and gives new
    classes the next free ones.

    Raises:
        IngestError: the folder is missing or empty, or a bad file with on_bad_file=fail.
        SchemaMismatchError: an append whose columns differ from the table's (table untouched).
    """
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    if mode not in ("append", "overwrite"):
        raise IngestError(f"--mode {mode!r} is not append or overwrite")
    root = os.path.abspath(source)
    if not os.path.isdir(root):
        raise IngestError(f"ingest source {source} is not a folder")
    engine = get_engine(cfg.delta.engine)
    table = cfg.delta.table

    exts = tuple(e.lower() for e in cfg.ingest.extensions)
    files = (spark.read.format("binaryFile").option("recursiveFileLookup", "true").load("file://" + root))
    files = files.withColumn("path", F.regexp_replace("path", "^file:", ""))
    ext_ok = F.lit(False)
    for e in exts:
        ext_ok = ext_ok | F.lower(F.col("path")).endswith(e)
    files = files.filter(ext_ok)
    parts = F.split(F.col("path"), "/")
    rel_depth = F.size(parts) - len(root.rstrip("/").split("/"))
    files = (files.withColumn("label", F.element_at(parts, -2))
             .withColumn("_in_class_dir", rel_depth >= 2))
    checked = (files.withColumn("_v", _validate_udf()(F.col("content")))
               .select("path", "label", "content", "_in_class_dir", "_v.width", "_v.height", "_v.mode", "_v.error")
               .withColumn("error", F.when(~F.col("_in_class_dir"),
                                           F.lit("not inside a class folder (expected SOURCE/<class>/<file>)"))
                           .otherwise(F.col("error")))
               .drop("_in_class_dir"))
    checked = checked.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        bad = [(r["path"], r["error"]) for r in checked.filter(F.col("error").isNotNull())
               .select("path", "error").orderBy("path").collect()]
        good = checked.filter(F.col("error").isNull()).drop("error")
        labels = sorted(r["label"] for r in good.select("label").distinct().collect())
        if not labels and not bad:
            raise IngestError(f"ingest source {source} holds no image files ({', '.join(exts)}) in class folders")
        for path, reason in bad:
            log.warning("bad file %s: %s", path, reason)
        if bad and cfg.ingest.on_bad_file == "fail":
            listing = "; ".join(f"{p}: {r}" for p, r in bad[:10])
            raise IngestError(f"{len(bad)} bad file(s) in {source} and ingest.on_bad_file=fail, nothing written: "
                              f"{listing}{' ...' if len(bad) > 10 else ''}")
        if not labels:
            raise IngestError(f"every file in {source} is bad ({len(bad)}); nothing written")

        classes = _existing_classes(engine, spark, table) if mode == "append" else {}
        for label in labels:
            if label not in classes:
                classes[label] = max(classes.values(), default=-1) + 1
        mapping = spark.createDataFrame(sorted(classes.items()), "label string, label_index int")
        out = (good.join(F.broadcast(mapping), on="label", how="left")
               .select(*TABLE_COLUMNS))
        rows = out.count()
        try:
            version = engine.write(out, table, mode)
        except DeltaError:
            raise
        result = IngestResult(table=table, version=version, rows_written=rows, skipped=bad, classes=classes)
        log.info("ingested %d image(s) from %s into %s version %d (%d skipped)", rows, source, table, version,
                 len(bad))
        return result
    finally:
        checked.unpersist()
