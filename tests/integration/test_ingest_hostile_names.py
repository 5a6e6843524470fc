"""Hostile names end to end (real Spark local[2] and delta-rs): a table under a folder with Hadoop glob characters is
written, appended to and read back file by file, and a source file whose name is not UTF-8 is skipped naming its
bytes while the others are ingested."""
import os

import pytest

from conftest import make_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _png(path, shade):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (8, 8), shade).save(path)
    return str(path)


def test_a_table_under_glob_characters_is_appended_to_and_read_back(spark, tmp_path):
    """spark.read.parquet globs every path it is given: `exp[1]` was read as `exp1` and the append failed."""
    from pipeline.lakehouse.delta import get_engine
    from pipeline.lakehouse.ingest import ingest_folder

    first = [_png(tmp_path / "a" / "cat" / "1.png", 10), _png(tmp_path / "a" / "dog" / "2.png", 20)]
    second = [_png(tmp_path / "b" / "cat" / "3.png", 30), _png(tmp_path / "b" / "bird" / "4.png", 40)]
    table = tmp_path / "exp[1] {a,b} *" / "digits"
    cfg = make_config(tmp_path / "w", f"delta.table={table}")
    assert ingest_folder(spark, cfg, str(tmp_path / "a"), "append").version == 0
    res = ingest_folder(spark, cfg, str(tmp_path / "b"), "append")  # reads the table: its classes and content
    assert (res.version, res.rows_written, res.classes) == (1, 2, {"cat": 0, "dog": 1, "bird": 2})
    df, pinned = get_engine("delta-rs").read(spark, str(table))
    assert pinned.version == 1 and sorted(r["path"] for r in df.select("path").collect()) == sorted(first + second)


def test_a_source_file_whose_name_is_not_utf8_is_skipped_naming_its_bytes(spark, tmp_path):
    from pipeline.lakehouse.ingest import ingest_folder, ingest_report

    ok = _png(tmp_path / "src" / "cat" / "ok.png", 10)
    bad = os.path.join(os.fsencode(tmp_path / "src" / "cat"), b"caf\xe9.png")
    with open(bad, "wb") as fh, open(ok, "rb") as src:
        fh.write(src.read()[:-1] + b"\x01")  # other bytes, not a duplicate
    cfg = make_config(tmp_path / "w")
    res = ingest_folder(spark, cfg, str(tmp_path / "src"), "append")
    shown = f"{tmp_path}/src/cat/caf\\xe9.png"
    assert res.rows_written == 1 and [(s.path, s.reason) for s in res.skipped] == [(shown, "bad_name")]
    report = ingest_report(spark, cfg, res.version)  # the Delta commit carries the printable path
    assert report["skipped_counts"] == {"bad_name": 1} and report["skipped"][0]["path"] == shown
