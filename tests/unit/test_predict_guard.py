"""`lakehouse predict` refuses to write its output onto its input table however the two are spelled (issue 37,
defect 10): a `file:` URI, a path through a symbolic link, a trailing slash or a relative path name the same table."""
from __future__ import annotations

import os

import pytest

from pipeline.serving.predict import PredictError, predict_table


@pytest.fixture()
def table(tmp_path, monkeypatch):
    (tmp_path / "real" / "scores").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.chdir(tmp_path)
    return str(tmp_path / "real" / "scores")


@pytest.mark.parametrize("spell", [
    lambda t, tmp: "file://" + t,  # file:///.../real/scores
    lambda t, tmp: str(tmp / "link" / "scores"),  # through the symbolic link
    lambda t, tmp: "file://" + str(tmp / "link" / "scores") + "/",
    lambda t, tmp: t + "/",
    lambda t, tmp: "real/../real/scores",  # relative to the working directory
], ids=["file-uri", "symlink", "file-uri-symlink-slash", "trailing-slash", "relative"])
@pytest.mark.parametrize("mode", ["append", "overwrite"])
def test_output_onto_the_input_table_is_refused_however_spelled(table, tmp_path, spell, mode):
    out = spell(table, tmp_path)
    for a, b in ((table, out), (out, table)):
        # refused before anything else runs: no Spark session, config or model is needed to get here
        with pytest.raises(PredictError, match=f"--out {b!r} is the input table {a!r}"):
            predict_table(None, None, "models:/m@champion", a, b, mode=mode)


def test_another_table_passes_the_guard(table, tmp_path):
    from pipeline.serving.predict import refuse_output_onto_input

    (tmp_path / "real" / "scores_out").mkdir()
    refuse_output_onto_input(table, str(tmp_path / "link" / "scores_out"))
    refuse_output_onto_input(table, "file://" + table + "_out")
    refuse_output_onto_input("s3://bucket/scores", "s3://bucket/scores_out")
    with pytest.raises(PredictError):
        refuse_output_onto_input("s3://bucket/scores", "S3://bucket/scores/")
    assert os.path.isdir(table)


@pytest.mark.parametrize("out", ["main.ml.DIGITS", "Main.ML.`digits`", "`main`.`ml`.`digits`"])
def test_a_catalog_table_is_refused_in_any_case_or_quoting(out):
    """Unity Catalog (and Spark's catalog) compare identifiers without case, and `digits` quoted is digits: each of
    these names the input table main.ml.digits, which --mode overwrite would replace."""
    from pipeline.serving.predict import refuse_output_onto_input

    with pytest.raises(PredictError, match="is the input table"):
        refuse_output_onto_input("main.ml.digits", out)
    refuse_output_onto_input("main.ml.digits", "main.ml.digits_out")
