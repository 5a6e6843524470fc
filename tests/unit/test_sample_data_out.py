"""`lakehouse sample-data --out D` reports what D holds: a folder holding files the command would not write is
refused naming it, nothing written; the same command again (or a larger one) rewrites its own files."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.lakehouse.sample_data import OutputFolderError, render_sample


def _tree(root: Path):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_digits_into_a_folder_of_other_images_is_refused_and_nothing_written(tmp_path):
    out = tmp_path / "digits"
    _, counts = render_sample("digits", str(out), 20)
    assert sum(counts.values()) == len(_tree(out)) == 20
    before = {f: (out / f).read_bytes() for f in _tree(out)}
    with pytest.raises(OutputFolderError) as err:
        render_sample("digits", str(out), 5)  # would report 5 while the folder keeps 20
    assert f"--out {out} already holds 15 file(s) this command would not write" in str(err.value)
    assert "nothing written" in str(err.value)
    assert {f: (out / f).read_bytes() for f in _tree(out)} == before
    _, counts = render_sample("digits", str(out), 20)  # the same command again
    assert sum(counts.values()) == len(_tree(out)) == 20
    _, counts = render_sample("digits", str(out), 30)  # a larger one: its own files are a part of it
    assert sum(counts.values()) == len(_tree(out)) == 30


def test_photos_into_a_folder_holding_another_file_is_refused_naming_it(tmp_path):
    out = tmp_path / "photos"
    (out / "stripes").mkdir(parents=True)
    (out / "stripes" / "mine.jpg").write_bytes(b"not the command's")
    with pytest.raises(OutputFolderError, match=r"already holds 1 file\(s\) .*\(e\.g\. stripes/mine\.jpg\)"):
        render_sample("photos", str(out), 4, classes=2)
    assert _tree(out) == ["stripes/mine.jpg"]
    _, counts = render_sample("photos", str(tmp_path / "empty"), 4, classes=2)
    assert counts == {"stripes": 2, "rings": 2} and len(_tree(tmp_path / "empty")) == 4


def test_an_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        render_sample("photos", str(tmp_path / "f"), 1)
