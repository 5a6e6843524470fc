"""The delta-rs engine's partitioned write (real Spark local[2], real delta-rs): Spark names the partition folders
Hive-escaped ("50%" is `source=50%25`), the log's `add.path` is the URL-encoding of that path on disk
(`source=50%2525`) and `partitionValues` holds the real value, so delta-rs, the engine's pinned read and the direct
path's `pin_files` all see every file with its value."""
from __future__ import annotations

import json
import os
from urllib.parse import unquote

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# what Spark escapes in a folder name ('%', '#', ':', '/', '='), a space (not escaped on Linux), non-ASCII, a null
SOURCES = ["cam 1", "50%", "a#b", "2024-01-01 10:00:00", "x/y=z", "100% a#b:c d", "é ü", "plain", None]


def _log_adds(table: str):
    log = os.path.join(table, "_delta_log")
    for name in sorted(os.listdir(log)):
        if name.endswith(".json"):
            with open(os.path.join(log, name)) as fh:
                for line in fh:
                    action = json.loads(line)
                    if "add" in action:
                        yield action["add"]


def test_a_partitioned_write_keeps_values_that_need_escaping(spark, tmp_path):
    from deltalake import DeltaTable, QueryBuilder

    from pipeline.lakehouse.delta import DeltaRsEngine
    from pipeline.lakehouse.delta_files import pin_files

    engine = DeltaRsEngine()
    table = str(tmp_path / "t")
    rows = [(i, SOURCES[i % len(SOURCES)]) for i in range(2 * len(SOURCES))]
    df = spark.createDataFrame(rows, "n int, source string")
    assert engine.write(df.where("n < 9"), table, "append", partition_by=["source"]) == 0  # creates the table
    assert engine.write(df.where("n >= 9"), table, "append", partition_by=["source"]) == 1  # appends to it
    want = sorted(rows, key=repr)

    adds = list(_log_adds(table))
    assert len(adds) >= len(SOURCES)
    for add in adds:
        on_disk = os.path.join(table, unquote(add["path"]))  # the log's path, decoded once, is the file
        assert os.path.isfile(on_disk), add["path"]
        assert add["partitionValues"]["source"] in SOURCES
        # the value's own folder: Spark's Hive-escaped name for it (a null is its default partition)
        folder = os.path.basename(os.path.dirname(on_disk))
        value = add["partitionValues"]["source"]
        assert folder == ("source=__HIVE_DEFAULT_PARTITION__" if value is None else
                          "source=" + "".join(f"%{ord(c):02X}" if c in '%#:/=' else c for c in value))
    assert {a["partitionValues"]["source"] for a in adds} == set(SOURCES)

    # delta-rs's own readers: its file list, and its DataFusion scan (`to_pyarrow_table` is not used: deltalake
    # 1.6.6 fails on any partitioned table with the classic profile's pyarrow 14, in pyarrow.field)
    dt = DeltaTable(table)
    assert sorted(dt.file_uris()) == sorted(os.path.join(table, unquote(a["path"])) for a in adds)
    scan = QueryBuilder().register("t", dt).execute("select n, source from t").read_all()  # arro3: Utf8View
    assert sorted(zip(scan.column("n").to_pylist(), scan.column("source").to_pylist()), key=repr) == want

    read, pinned = engine.read(spark, table)
    assert sorted(((r.n, r.source) for r in read.collect()), key=repr) == want
    assert (pinned.version, pinned.num_files, pinned.num_rows) == (1, len(adds), len(rows))

    files = pin_files(table)
    assert files.num_rows == len(rows) and all(os.path.isfile(f.uri) for f in files.files)
    assert files.digest == pinned.files_digest
