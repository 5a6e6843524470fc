"""A Delta table's location is recorded and compared in one spelling (issue 37, defect 4): a local path as its absolute
real path wherever it was typed from, a URI without trailing slashes, a catalog name as the name."""
from __future__ import annotations

import os

import pyarrow as pa
import pytest
import torch

from pipeline.distributed.checkpoints.record import CheckpointLineageError, check_checkpoint_lineage
from pipeline.lakehouse.delta import DeltaRsEngine
from pipeline.tracking.heldout import _same_table, pinned_data


def _delta_table(path, labels):
    from deltalake import write_deltalake

    write_deltalake(str(path), pa.table({"path": [f"/img/{i}.png" for i in range(len(labels))],
                                         "content": [b"x"] * len(labels), "label": labels}))


def test_relative_paths_become_the_absolute_real_path_of_where_they_were_typed(tmp_path, monkeypatch):
    from pipeline.lakehouse.delta import table_location

    (tmp_path / "proj" / "work").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "proj")
    real = os.path.realpath(tmp_path / "proj" / "work" / "delta" / "digits")
    assert table_location("work/delta/digits") == real
    assert table_location("./work/../work/delta/digits/") == real  # `..`, `.` and a trailing slash
    assert table_location(real) == real and table_location(table_location("work/delta/digits")) == real


def test_file_uris_and_symbolic_links_are_the_path_they_name(tmp_path, monkeypatch):
    from pipeline.lakehouse.delta import table_location

    target = tmp_path / "real" / "digits"
    target.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    real = os.path.realpath(target)
    assert table_location(f"file://{target}") == real
    assert table_location(f"file:{target}/") == real
    assert table_location(f"file://localhost{target}") == real
    assert table_location(str(tmp_path / "link" / "digits")) == real
    monkeypatch.chdir(tmp_path)
    assert table_location("link/digits") == real


def test_uris_keep_their_scheme_and_lose_trailing_slashes_and_catalog_names_stay_names(tmp_path, monkeypatch):
    from pipeline.lakehouse.delta import table_location

    monkeypatch.chdir(tmp_path)
    assert table_location("s3://bucket/delta/digits/") == "s3://bucket/delta/digits"
    assert table_location("s3://bucket/delta/digits//") == "s3://bucket/delta/digits"
    assert table_location("S3A://bucket/x") == "s3a://bucket/x"
    assert table_location("abfss://c@acct.dfs.core.windows.net/t/") == "abfss://c@acct.dfs.core.windows.net/t"
    assert table_location("dbfs:/mnt/t/") == "dbfs:/mnt/t" and table_location("dbfs:/") == "dbfs:/"
    assert table_location("s3://bucket/") == "s3://bucket"
    assert table_location("main.db.t") == "main.db.t"  # a catalog name: no path here resolves it
    assert table_location("Main.ML.Images") == "Main.ML.Images"


def test_two_projects_relative_tables_are_two_tables(tmp_path, monkeypatch):
    """The same relative spelling in two projects pins two different tables, recorded as such."""
    pinned = []
    for project, labels in (("a", ["one", "two"]), ("b", ["three"])):
        (tmp_path / project).mkdir()
        _delta_table(tmp_path / project / "work" / "delta" / "digits", labels)
        monkeypatch.chdir(tmp_path / project)
        pinned.append(DeltaRsEngine().pin("work/delta/digits"))
    a, b = pinned
    assert a.table == os.path.realpath(tmp_path / "a" / "work" / "delta" / "digits")
    assert b.table == os.path.realpath(tmp_path / "b" / "work" / "delta" / "digits")
    assert not _same_table(a.table, b.table)
    monkeypatch.chdir(tmp_path)  # a third working directory: project a's table is still project a's
    assert DeltaRsEngine().pin(a.table).num_rows == 2


def test_same_table_compares_locations(tmp_path, monkeypatch):
    (tmp_path / "real" / "t").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert _same_table("file:///t", "/t") and _same_table("file:/t/", "/t")
    assert _same_table(str(tmp_path / "link" / "t"), str(tmp_path / "real" / "t"))
    assert not _same_table("s3://bucket/a", "/a") and _same_table("s3://bucket/a//", "s3://bucket/a")
    assert _same_table("Main.ML.Images", "main.ml.images")
    assert _same_table("main.ml.`images`", "Main.ML.images") and _same_table("`main`.ml.images", "main.ml.images")
    assert not _same_table("main.ml.images", "main.ml.images_v2") and not _same_table("main.ml.images", "/images")
    monkeypatch.chdir(tmp_path / "real")
    assert _same_table("t", str(tmp_path / "link" / "t"))  # an old relative record: against this directory


def test_a_version_s_recorded_table_is_read_as_its_location(tmp_path, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.chdir(tmp_path)
    mv = SimpleNamespace(version="1", tags={"delta_table": "file://" + str(tmp_path) + "/t/", "delta_version": "2"})
    assert pinned_data("m", mv) == (os.path.realpath(tmp_path / "t"), 2)


def test_checkpoint_lineage_compares_locations(tmp_path, monkeypatch):
    (tmp_path / "real" / "t").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    here = str(tmp_path / "real" / "t")

    def ckpt(table):
        path = str(tmp_path / f"{abs(hash(table))}.ckpt")
        torch.save({"global_step": 7, "state_dict": {}, "lakehouse": {"delta_table": table, "delta_version": 3}},
                   path)
        return path

    for same in (f"file://{here}", str(tmp_path / "link" / "t"), here + "/"):
        assert check_checkpoint_lineage(ckpt(same), {"delta_table": here, "delta_version": 3}, False) == 7
    monkeypatch.chdir(tmp_path / "real")  # a checkpoint before this fix recorded the table as typed: "t" here
    assert check_checkpoint_lineage(ckpt("t"), {"delta_table": here, "delta_version": 3}, False) == 7
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")  # ... and another project's relative "t" is another table
    with pytest.raises(CheckpointLineageError, match="trained on"):
        check_checkpoint_lineage(ckpt("t"), {"delta_table": here, "delta_version": 3}, False)
    with pytest.raises(CheckpointLineageError, match="version 2"):
        check_checkpoint_lineage(ckpt(here), {"delta_table": here, "delta_version": 2}, False)
    # a catalog table, as the catalog compares names: without case or backticks
    assert check_checkpoint_lineage(ckpt("main.ml.images"), {"delta_table": "Main.ML.`images`", "delta_version": 3},
                                    False) == 7
    with pytest.raises(CheckpointLineageError, match="trained on"):
        check_checkpoint_lineage(ckpt("main.ml.images"), {"delta_table": "main.ml.images2", "delta_version": 3}, False)
