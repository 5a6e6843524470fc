"""Ingest accounts for every file under the source (real Spark local[2] and delta-rs): rows, or skipped with a reason."""
import json
import os

import pytest

from conftest import make_config

pytestmark = [pytest.mark.integration, pytest.mark.datapath, pytest.mark.timeout(600)]

EXPECTED_SKIPS = {
    "cat/zero.png": "zero_byte",
    "cat/corrupt.png": "undecodable",
    "cat/notes.txt": "unsupported_extension",
    "root.png": "no_label",
    "cat/outside.png": "symlink_outside",
    "linked_out": "symlink_outside",
    "cat/gone.png": "broken_symlink",
    "dog/copy_of_c.png": "duplicate",
    "cat/link_to_a.png": "duplicate",
    "cat/_x.png": "hidden_name",
    "cat/.hidden.png": "hidden_name",
    "cat/fifo.png": "not_a_file",
    "cat/huge.png": "too_large",
}
EXPECTED_ROWS = {"cat/a.png": "cat", "cat/indoor/b.png": "cat", "cat/indoor/deeper/c.tif": "cat",
                 "dog/c.png": "dog", "dog/d.webp": "dog", "dog/e.BMP": "dog"}


def _image(path, shade, fmt=None):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (16, 16), shade).save(path, format=fmt)


@pytest.fixture
def messy_source(tmp_path):
    """One file of each case next to six good images (two classes, one of them nested)."""
    src, outside = tmp_path / "src", tmp_path / "outside"
    for shade, rel in enumerate(sorted(EXPECTED_ROWS)):
        _image(src / rel, 20 * shade + 10)
    (src / "cat" / "zero.png").write_bytes(b"")
    (src / "cat" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (src / "cat" / "notes.txt").write_text("not an image")
    _image(src / "root.png", 200)
    _image(outside / "o.png", 210)
    os.symlink(outside / "o.png", src / "cat" / "outside.png")
    os.symlink(outside, src / "linked_out")
    os.symlink(tmp_path / "missing.png", src / "cat" / "gone.png")
    (src / "dog" / "copy_of_c.png").write_bytes((src / "dog" / "c.png").read_bytes())
    os.symlink(src / "cat" / "a.png", src / "cat" / "link_to_a.png")
    _image(src / "cat" / "_x.png", 220)
    _image(src / "cat" / ".hidden.png", 230)
    os.mkfifo(src / "cat" / "fifo.png")
    with open(src / "cat" / "huge.png", "wb") as fh:  # sparse: over binaryFile's 2 GiB, no disk used
        fh.truncate(2**31)
    return src


def _ingest(spark, cfg, source, mode="append"):
    from pipeline.lakehouse.ingest import ingest_folder

    return ingest_folder(spark, cfg, str(source), mode=mode)


def _relative(src, skipped):
    return {os.path.relpath(s["path"] if isinstance(s, dict) else s.path, src):
            s["reason"] if isinstance(s, dict) else s.reason for s in skipped}


def test_every_file_accounted_in_report_and_commit(spark, tmp_path, messy_source):
    from deltalake import DeltaTable

    from pipeline.lakehouse.ingest import ingest_report

    cfg = make_config(tmp_path)
    res = _ingest(spark, cfg, messy_source)
    assert _relative(messy_source, res.skipped) == EXPECTED_SKIPS
    assert res.rows_written == len(EXPECTED_ROWS)
    assert res.files_found == len(EXPECTED_ROWS) + len(EXPECTED_SKIPS) == res.rows_written + len(res.skipped)
    # the label is the first folder under the source: cat/indoor/b.png is a cat, not a class 'indoor'
    assert sorted(res.classes) == ["cat", "dog"]
    assert "folder 1 under the source" in res.label_rule
    summary = res.summary()
    assert summary["skipped_counts"] == {"hidden_name": 2, "symlink_outside": 2, "broken_symlink": 1,
                                         "not_a_file": 1, "unsupported_extension": 1, "zero_byte": 1,
                                         "too_large": 1, "no_label": 1, "undecodable": 1, "duplicate": 2}
    assert summary["skipped"] == len(EXPECTED_SKIPS) and len(summary["skipped_files"]) == len(EXPECTED_SKIPS)
    detail = {os.path.relpath(d["path"], messy_source): d["detail"] for d in summary["skipped_detail"]}
    assert detail["dog/copy_of_c.png"] == f"same content as {messy_source / 'dog' / 'c.png'}"
    assert detail["cat/link_to_a.png"] == f"same content as {messy_source / 'cat' / 'a.png'}"  # the file, not the link
    assert "not a decodable image" in detail["cat/corrupt.png"]
    json.dumps(summary)  # what the CLI prints

    table = DeltaTable(cfg.delta.table)
    rows = table.to_pyarrow_table(columns=["path", "label", "width", "mode"]).to_pylist()
    assert {os.path.relpath(r["path"], messy_source): r["label"] for r in rows} == EXPECTED_ROWS
    assert all(r["width"] == 16 for r in rows)
    # the commit carries the same accounting, in userMetadata (what DESCRIBE HISTORY shows)
    commit = table.history(1)[0]
    report = json.loads(commit["userMetadata"])["lakehouse.ingest"]
    assert report == ingest_report(spark, cfg, 0)
    assert _relative(messy_source, report["skipped"]) == EXPECTED_SKIPS
    assert report["skipped_counts"] == summary["skipped_counts"]
    assert report["files_found"] == res.files_found and report["rows_written"] == len(EXPECTED_ROWS)
    assert report["source"] == str(messy_source) and report["label_rule"] == res.label_rule


def test_strict_writes_nothing(spark, tmp_path, messy_source):
    from deltalake import DeltaTable

    from pipeline.lakehouse.ingest import IngestError

    clean = tmp_path / "clean"
    _image(clean / "cat" / "a.png", 1)
    _image(clean / "dog" / "b.png", 2)
    cfg = make_config(tmp_path)
    assert _ingest(spark, cfg, clean).version == 0
    table_files = sorted(os.listdir(cfg.delta.table))
    for strict in ("ingest.strict=true", "ingest.on_bad_file=fail"):  # the older switch means the same
        with pytest.raises(IngestError) as err:
            _ingest(spark, make_config(tmp_path, strict), messy_source)
        msg = str(err.value)
        assert "nothing written" in msg and f"{len(EXPECTED_SKIPS)} of {len(EXPECTED_ROWS) + len(EXPECTED_SKIPS)}" in msg
        assert "duplicate=2" in msg and "hidden_name=2" in msg and "zero_byte=1" in msg
        first = sorted(str(messy_source / p) for p in EXPECTED_SKIPS)[:5]
        assert all(p in msg for p in first)
        assert DeltaTable(cfg.delta.table).version() == 0
        assert sorted(os.listdir(cfg.delta.table)) == table_files  # not even an uncommitted Parquet folder
    # strict with nothing to skip ingests as usual
    _image(clean / "bird" / "c.png", 3)
    res = _ingest(spark, make_config(tmp_path, "ingest.strict=true"), clean)
    assert res.version == 1 and res.files_found == 3 and res.rows_written == 1
    # files already in the table are not a failure under strict: a retried strict job passes
    assert [(os.path.basename(s.path), s.reason) for s in res.skipped] == [("a.png", "already_in_table"),
                                                                          ("b.png", "already_in_table")]


def test_label_depth_two(spark, tmp_path, messy_source):
    cfg = make_config(tmp_path, "ingest.label_depth=2")
    res = _ingest(spark, cfg, messy_source)
    rows = {os.path.relpath(p, messy_source) for p in (s.path for s in res.skipped)}
    assert sorted(res.classes) == ["indoor"] and res.rows_written == 2  # cat/indoor/b.png, .../deeper/c.tif
    assert {"cat/a.png", "dog/c.png", "dog/d.webp", "dog/e.BMP"} <= rows
    assert res.files_found == res.rows_written + len(res.skipped)
