"""delta-rs on hostile table paths, without Spark: a path it cannot read back (%XX, ?, #, a backslash) is refused before
anything is written, a failed write keeps the files a commit of it may name, Hadoop glob characters are escaped for
Spark's read, and another writer's plain-text commit metadata is none of ours."""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.lakehouse.delta import DeltaError, DeltaRsEngine, table_uri
from pipeline.lakehouse.delta_common import DeltaEngine
from pipeline.lakehouse.delta_rs import hadoop_glob_escape


@pytest.mark.parametrize("name, why", [("my tables %20/digits", "a percent escape"), ("c%41d/t", "a percent escape"),
                                       ("x/%2e%2E/t", "a percent escape"), ("run?1/t", "URL query or fragment"),
                                       ("exp#2/t", "URL query or fragment"), ("back\\slash/t", "folder separator")])
def test_a_local_table_path_delta_rs_cannot_read_back_is_refused_naming_it(tmp_path, name, why):
    """delta-rs writes these paths as given but reads them as URLs: the commit lands, is not found, and the old
    cleanup removed the files it names."""
    table = f"{tmp_path}/{name}"
    engine = DeltaRsEngine()
    calls = [lambda: engine.check_location(table), lambda: engine.exists(None, table), lambda: engine.pin(table),
             lambda: engine.write(None, table, "append")]
    if "?" not in name and "#" not in name:  # in a file: URI they do start its query or fragment
        calls.append(lambda: table_uri(f"file://{table}"))
    for call in calls:
        with pytest.raises(DeltaError) as err:
            call()
        assert repr(os.path.abspath(table)) in str(err.value) and why in str(err.value)
        assert "before writing anything" in str(err.value) and "delta.table" in str(err.value)
    assert os.listdir(tmp_path) == []  # nothing written


def test_a_percent_sign_that_is_no_escape_is_a_plain_path(tmp_path):
    from deltalake import write_deltalake

    table = f"{tmp_path}/100% e%zz/t"
    write_deltalake(table_uri(table), pa.table({"x": [1]}))
    assert DeltaRsEngine().exists(None, table) and DeltaRsEngine().pin(table).num_rows == 1


def test_an_ingest_into_a_percent_escape_path_is_refused_before_the_source_is_read(tmp_path):
    from pipeline.config import load_config
    from pipeline.lakehouse.ingest import ingest_folder

    (tmp_path / "src" / "cat").mkdir(parents=True)
    (tmp_path / "src" / "cat" / "a.png").write_bytes(b"x")
    cfg = load_config(None, [f"delta.table={tmp_path}/my tables %20/digits"])
    with pytest.raises(DeltaError, match="a percent escape"):
        ingest_folder(None, cfg, str(tmp_path / "src"))  # no Spark: refused before any read
    assert sorted(os.listdir(tmp_path)) == ["src"]


class _Writer:
    def __init__(self, data: pa.Table):
        self.data = data

    def mode(self, mode: str):
        assert mode == "error"
        return self

    def parquet(self, uri: str):
        folder = uri[len("file://"):]
        os.makedirs(folder)
        pq.write_table(self.data, os.path.join(folder, "part-00000.parquet"))


class _Frame:
    """What DeltaRsEngine.write uses of a Spark DataFrame when it creates a table: `write` and `schema`."""

    def __init__(self, data: pa.Table):
        from pyspark.sql.pandas.types import from_arrow_schema

        self.write = _Writer(data)
        self.schema = from_arrow_schema(data.schema)


def _batch_folders(table) -> list:
    return sorted(n for n in os.listdir(table) if n.startswith("ingest-"))


def test_a_write_that_fails_after_its_commit_landed_keeps_the_files_the_commit_names(tmp_path, monkeypatch):
    """The commit is in the log but cannot be read back (as under a percent-escape path, where delta-rs looked for
    it elsewhere): the write fails, and the data files stay, so the table's version is whole."""
    import deltalake.transaction as txn
    from deltalake import DeltaTable

    real = txn.create_table_with_add_actions

    def commit_then_fail(*args, **kwargs):
        real(*args, **kwargs)
        raise OSError("connection reset after the commit was written")

    monkeypatch.setattr(txn, "create_table_with_add_actions", commit_then_fail)
    monkeypatch.setattr(DeltaRsEngine, "_find_own", lambda self, *a: None)  # the read-back does not see it
    table = str(tmp_path / "t")
    with pytest.raises(OSError, match="connection reset"):
        DeltaRsEngine().write(_Frame(pa.table({"x": [1, 2, 3]})), table, "append")
    files = DeltaTable(table).file_uris()
    assert len(files) == 1 and all(os.path.exists(f) for f in files), files
    assert DeltaTable(table).to_pyarrow_table().num_rows == 3


def test_a_write_whose_commit_is_absent_removes_its_files(tmp_path, monkeypatch):
    import deltalake.transaction as txn

    def refuse(*args, **kwargs):
        raise OSError("disk full before the commit")

    monkeypatch.setattr(txn, "create_table_with_add_actions", refuse)
    with pytest.raises(OSError, match="disk full"):
        DeltaRsEngine().write(_Frame(pa.table({"x": [1]})), str(tmp_path / "new"), "append")
    assert _batch_folders(tmp_path / "new") == []  # its log holds no commit: the files are gone


@pytest.mark.parametrize("path, want", [
    ("/t/exp[1]/digits/part-0.parquet", r"/t/exp\[1\]/digits/part-0.parquet"),
    ("/t/a{b,c}/x*?.parquet", r"/t/a\{b,c\}/x\*\?.parquet"),
    ("/t/back\\slash/f", r"/t/back\\slash/f"),
    ("s3://bucket/plain/f.parquet", "s3://bucket/plain/f.parquet"),
    ("/t/100% a#b:c d/f", "/t/100% a#b:c d/f"),
])
def test_hadoop_glob_characters_are_escaped_with_a_backslash(path, want):
    assert hadoop_glob_escape(path) == want


class _History(DeltaEngine):
    def __init__(self, text):
        self.text = text

    def latest_version(self, spark, table):
        return 0

    def history(self, spark, table):
        return [{"version": 0, "userMetadata": self.text}]


@pytest.mark.parametrize("text, want", [("nightly load by the ETL team", {}), ("[1, 2]", {}), (None, {}),
                                        ('{"lakehouse.ingest": {"rows_written": 3}}',
                                         {"lakehouse.ingest": {"rows_written": 3}})])
def test_another_writers_plain_text_commit_metadata_is_none_of_ours(text, want):
    assert _History(text).commit_metadata(None, "t") == want
