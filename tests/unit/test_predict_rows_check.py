"""`lakehouse predict` checks rows written = rows read for every output table, and says how: an output table that is
not on this filesystem (an object store's, a catalog's: delta.engine=spark) was skipped silently (`errors` null, no
word of the check). It is now checked by the row count its commit records in the Delta log, and where the commit
records none the result's `rows_check` and a WARNING say the check did not run and why. No Spark: the engine, the
model and the scoring are stand-ins; predict_table's own logic runs."""
import logging
from types import SimpleNamespace

import pytest

import pipeline.serving.models as models
import pipeline.serving.predict as predict
import pipeline.tracking.runs as runs
from pipeline.lakehouse.delta_common import PinnedTable

ROWS = 601


class _Conf:
    def __init__(self):
        self.values = {}

    def get(self, key, default=None):
        return self.values.get(key, default)

    def set(self, key, value):
        self.values[key] = value

    def unset(self, key):
        self.values.pop(key, None)


class _Engine:
    """What predict_table asks of a Delta engine, for an output table on an object store (delta.engine=spark)."""

    def __init__(self, metrics):
        self.metrics = metrics

    def read(self, spark, table, version):
        return object(), PinnedTable(table, 4, 2, ROWS, files_digest="d1")

    def exists(self, spark, table):
        return False

    def claimed_versions(self, spark, table, claim):
        return []

    def write(self, df, table, mode, commit_metadata=None, read_version=None, claim=None):
        return 0

    def history(self, spark, table):  # as delta-spark's DESCRIBE HISTORY rows (asDict) give them
        return [{"version": 0, "operation": "WRITE", "operationMetrics": self.metrics, "userMetadata": "{}"}]


@pytest.fixture()
def run_predict(monkeypatch):
    pinned_model = SimpleNamespace(name="clf", version="3", run_id="r1", uri="models:/clf/3")
    monkeypatch.setattr(runs, "configure", lambda _cfg: object())
    monkeypatch.setattr(models, "resolve", lambda _client, _uri: pinned_model)
    monkeypatch.setattr(predict, "scored_frame", lambda *a, **k: object())

    def run(metrics):
        monkeypatch.setattr(predict, "get_engine", lambda _name: _Engine(metrics))
        cfg = SimpleNamespace(mlflow=None, delta=SimpleNamespace(engine="spark"))
        return predict.predict_table(SimpleNamespace(conf=_Conf()), cfg, "models:/clf@champion",
                                     "s3://bucket/digits", "s3://bucket/predictions")
    return run


def test_an_object_store_output_is_checked_by_its_commits_row_count(run_predict):
    result = run_predict({"numFiles": "2", "numOutputRows": str(ROWS), "numOutputBytes": "9000"})
    assert result["rows"] == result["rows_written"] == ROWS and result["out_version"] == 0
    assert result["errors"] is None
    assert result["rows_check"].startswith(f"passed: {ROWS} rows in the commit's operationMetrics.numOutputRows")
    assert "error rows not counted" in result["rows_check"]


def test_an_object_store_output_with_other_rows_fails_naming_both_counts(run_predict):
    with pytest.raises(predict.PredictError, match=rf"600 rows in the commit of s3://bucket/predictions version 0, "
                                                   rf"but the input has {ROWS}"):
        run_predict({"numOutputRows": "600"})


def test_where_the_check_cannot_run_the_result_and_a_warning_say_so(run_predict, caplog):
    with caplog.at_level(logging.WARNING, logger="pipeline.serving.predict"):
        result = run_predict({})  # a commit that records no row count
    assert result["errors"] is None and result["rows_written"] is None
    assert result["rows_check"].startswith("not run: s3://bucket/predictions is not a table on this filesystem")
    assert f"the rows written were not compared with the {ROWS} read" in result["rows_check"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("rows written = rows read did not run" in w for w in warnings), warnings


def test_a_local_output_is_still_checked_by_its_files(tmp_path):
    import pyarrow as pa
    from deltalake import write_deltalake

    out = tmp_path / "predictions"
    write_deltalake(str(out), pa.table({"path": ["a", "b", "c"], "error": [None, "bad", None]}))
    checked = predict.check_rows_written(_Engine({}), None, "t", str(out), 0, 0, 3)
    assert (checked["rows_written"], checked["errors"]) == (3, 1)
    assert checked["rows_check"].startswith("passed: 3 rows in the 1 data file(s) of the commit")
    with pytest.raises(predict.PredictError, match="3 rows in the commit"):
        predict.check_rows_written(_Engine({}), None, "t", str(out), 0, 0, 4)
