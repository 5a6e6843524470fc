"""`predict` beside other writers of its output table and after a retry (real Spark local[2], real delta-rs tables, a
registered pyfunc in a real SQLite MLflow store): each job reports the version and rows of its own commit, two
appends at once both land, and a job whose predictions are already in the table (a retry, or the same job started
twice) writes nothing and says where they are."""
from __future__ import annotations

import json
import os
import subprocess
import threading

import pyarrow as pa
import pytest

from conftest import ROOT, cli
from test_serving import CORRUPT_BYTES, CORRUPT_PATH, NAME, registered, rows  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MODEL = f"models:/{NAME}@champion"


@pytest.fixture(scope="module")
def input_table(rows, tmp_path_factory):
    """An input table with two versions: 0 holds the 600 digits, 1 adds one undecodable row (601 rows)."""
    from deltalake import write_deltalake

    table = tmp_path_factory.mktemp("predict_races") / "input"
    write_deltalake(str(table), rows)
    corrupt = {name: None for name in rows.schema.names}
    corrupt.update({"path": CORRUPT_PATH, "label": "?", "label_index": -1, "content": CORRUPT_BYTES})
    write_deltalake(str(table), pa.Table.from_pylist([corrupt], schema=rows.schema), mode="append")
    return str(table)


def _predict(spark, cfg, table, out, version, **kw):
    from pipeline.serving.predict import predict_table

    return predict_table(spark, cfg, MODEL, table, out, version, **kw)


def _at_once(spark, monkeypatch, jobs):
    """Run `jobs` ({name: kwargs of predict_table}) from one thread each; every job has read the output table
    before any of them writes it. Returns ({name: result}, {name: error})."""
    from pipeline.lakehouse.delta import DeltaRsEngine

    real_write = DeltaRsEngine.write
    barrier = threading.Barrier(len(jobs), timeout=300)

    def write(self, df, table, mode, **kwargs):
        barrier.wait()
        return real_write(self, df, table, mode, **kwargs)

    monkeypatch.setattr(DeltaRsEngine, "write", write)
    results, errors = {}, {}

    def run(name, kwargs):
        try:
            results[name] = _predict(spark, **kwargs)
        except Exception as exc:  # reported by the test
            errors[name] = exc

    threads = [threading.Thread(target=run, args=item, name=item[0]) for item in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=500)
    assert not any(t.is_alive() for t in threads)
    return results, errors


def _folder(table, uri):
    """The top folder under `table` of a data file (one per write)."""
    return os.path.relpath(uri.replace("file://", ""), table).split(os.sep)[0]


def _commit_rows(out, version):
    import pyarrow.parquet as pq

    from pipeline.lakehouse.delta import commit_files

    return pa.concat_tables([pq.read_table(f) for f in commit_files(out, version)])


@pytest.mark.parametrize("out_exists", [False, True], ids=["new_output", "existing_output"])
def test_two_appends_at_once_both_land_and_each_reports_its_own_commit(spark, registered, input_table, tmp_path,
                                                                        monkeypatch, out_exists):
    """Two jobs (input versions 0 and 1: 600 and 601 rows) append to one output table at once. Before, each counted
    the other's files as its own and failed its row check after committing."""
    from deltalake import DeltaTable

    cfg, pinned = registered
    out = str(tmp_path / "predictions")
    first = 0
    if out_exists:
        assert _predict(spark, cfg, input_table, out, 0, run_key="earlier")["out_version"] == 0
        first = 1
    jobs = {v: {"cfg": cfg, "table": input_table, "out": out, "version": v} for v in (0, 1)}
    results, errors = _at_once(spark, monkeypatch, jobs)
    assert errors == {}
    assert {v: (r["rows"], r["errors"], r["already_in_table"]) for v, r in results.items()} == {
        0: (600, 0, False), 1: (601, 1, False)}
    assert sorted(r["out_version"] for r in results.values()) == [first, first + 1]
    dt = DeltaTable(out)
    assert dt.version() == first + 1 and len(dt.to_pyarrow_table(columns=["path"])) == 600 * (1 + out_exists) + 601
    for v, r in results.items():  # the version each reports holds its own predictions, and only those
        own = _commit_rows(out, r["out_version"])
        assert set(own.column("input_version").to_pylist()) == {v} and len(own) == r["rows"]
        meta = json.loads(dt.history()[-1 - r["out_version"]]["userMetadata"])["lakehouse.predict"]
        assert (meta["input_version"], meta["model_version"], meta["rows"]) == (v, pinned.version, r["rows"])


def test_a_retry_after_the_commit_writes_nothing_and_a_new_run_key_appends(spark, registered, input_table, tmp_path):
    """The scheduler retries a predict that committed (it died before reporting): the same command finds its
    predictions in the table and appends nothing; the same job with another run key appends them again."""
    from deltalake import DeltaTable

    cfg, pinned = registered
    out = str(tmp_path / "predictions")
    first = _predict(spark, cfg, input_table, out, 1)
    assert (first["out_version"], first["rows"], first["already_in_table"]) == (0, 601, False)

    args = ["predict", "--model", MODEL, "--table", input_table, "--version", "1", "--out", out,
            "--conf", str(ROOT / "conf/local.yaml"), f"mlflow.tracking_uri={cfg.mlflow.tracking_uri}",
            f"mlflow.experiment={cfg.mlflow.experiment}", "spark.app_name=lakehouse-predict-retry"]
    res = subprocess.run(cli(*args), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    retry = json.loads(res.stdout.strip().splitlines()[-1])
    assert (retry["out_version"], retry["rows"], retry["errors"], retry["already_in_table"]) == (0, 601, 1, True)
    assert retry["claim"] == first["claim"]
    assert "are already in" in res.stderr and "nothing written" in res.stderr
    dt = DeltaTable(out)
    assert dt.version() == 0 and len(dt.to_pyarrow_table(columns=["path"])) == 601  # not duplicated

    again = _predict(spark, cfg, input_table, out, 1, run_key="second")
    assert (again["out_version"], again["rows"], again["already_in_table"]) == (1, 601, False)
    assert again["claim"] != first["claim"]
    assert len(DeltaTable(out).to_pyarrow_table(columns=["path"])) == 2 * 601
    # an overwrite always writes: repeating it gives the same table
    over = [_predict(spark, cfg, input_table, out, 0, mode="overwrite") for _ in range(2)]
    assert [(o["out_version"], o["rows"], o["already_in_table"]) for o in over] == [(2, 600, False),
                                                                                   (3, 600, False)]
    assert len(DeltaTable(out).to_pyarrow_table(columns=["path"])) == 600


def test_the_same_job_started_twice_at_once_commits_once(spark, registered, input_table, tmp_path, monkeypatch):
    """A job and its premature retry (same identity) both read the output table, then both write: one commits, the
    other loses the race on the job's claim and reports the winner's commit as where its predictions are."""
    from deltalake import DeltaTable

    cfg, _ = registered
    out = str(tmp_path / "predictions")
    assert _predict(spark, cfg, input_table, out, 0, run_key="other job")["out_version"] == 0
    job = {"cfg": cfg, "table": input_table, "out": out, "version": 1, "run_key": "nightly"}
    results, errors = _at_once(spark, monkeypatch, {"a": job, "b": job})
    assert errors == {}
    assert sorted(r["already_in_table"] for r in results.values()) == [False, True]
    assert {(r["out_version"], r["rows"], r["errors"]) for r in results.values()} == {(1, 601, 1)}
    dt = DeltaTable(out)
    assert dt.version() == 1 and len(dt.to_pyarrow_table(columns=["path"])) == 600 + 601
    assert {d for d in os.listdir(out) if d != "_delta_log"} == {_folder(out, f) for f in dt.file_uris()}


def test_a_conditional_write_loses_only_to_a_claimant(spark, tmp_path, monkeypatch):
    """The output table is created by another writer between this write's files and its commit: with no claimant
    among the commits since, the same files are committed on the new table (nothing rewritten); created by a
    claimant, the write loses naming it and leaves nothing behind."""
    import deltalake.transaction as transaction
    from deltalake import DeltaTable, write_deltalake

    from pipeline.lakehouse.delta import ConcurrentWriteError, get_engine

    engine = get_engine("delta-rs")
    df = spark.createDataFrame([(1, "a")], "n int, s string")
    real_create = transaction.create_table_with_add_actions
    meanwhile = []

    def create(*args, **kwargs):  # another writer creates the table first
        if meanwhile:
            meanwhile.pop()()
        return real_create(*args, **kwargs)

    monkeypatch.setattr(transaction, "create_table_with_add_actions", create)
    table = str(tmp_path / "t")
    meanwhile.append(lambda: write_deltalake(table, pa.table({"n": pa.array([7], pa.int32()), "s": ["z"]})))
    assert engine.write(df, table, "append", read_version=None, claim="k") == 1
    assert sorted(DeltaTable(table).to_pyarrow_table().column("n").to_pylist()) == [1, 7]
    assert DeltaTable(table).transaction_version("k") == 0 and engine.claimed_versions(spark, table, "k") == [1]

    other = str(tmp_path / "u")
    meanwhile.append(lambda: engine.write(df, other, "append", read_version=None, claim="k"))  # a claimant
    with pytest.raises(ConcurrentWriteError, match="lost the race to version 0") as err:
        engine.write(df, other, "append", read_version=None, claim="k")
    assert err.value.committed is None and DeltaTable(other).version() == 0
    assert {d for d in os.listdir(other) if d != "_delta_log"} == {_folder(other, f)
                                                                   for f in DeltaTable(other).file_uris()}


def test_an_input_table_written_again_from_scratch_is_another_job(spark, registered, rows, tmp_path):
    """A staging table deleted and written again each day is back at version 0: the next day's append was taken for
    a retry of the day before (nothing written, the earlier commit reported). The job's identity holds the pinned
    version's data files and the table's location (a retry through a symbolic link to it is the same job). An
    undecodable row's label and probability are stored as null, and a good row's error too, in a batch that mixes
    both (spark_udf made the string "None" of a None there)."""
    import shutil

    from deltalake import DeltaTable, write_deltalake

    cfg, _ = registered
    staging, link, out = tmp_path / "staging", tmp_path / "staging_link", str(tmp_path / "predictions")
    link.symlink_to(staging, target_is_directory=True)
    corrupt = {name: None for name in rows.schema.names}
    corrupt.update({"path": CORRUPT_PATH, "label": "?", "label_index": -1, "content": CORRUPT_BYTES})
    monday = pa.concat_tables([rows.slice(0, 20), pa.Table.from_pylist([corrupt], schema=rows.schema)])
    write_deltalake(str(staging), monday)
    first = _predict(spark, cfg, str(link), out, None)
    assert (first["input_version"], first["rows"], first["errors"], first["out_version"],
            first["already_in_table"]) == (0, 21, 1, 0, False)
    retry = _predict(spark, cfg, str(staging), out, None)  # the same job, the table spelled by its real path
    assert (retry["out_version"], retry["already_in_table"], retry["claim"]) == (0, True, first["claim"])

    shutil.rmtree(staging)
    write_deltalake(str(staging), rows.slice(20, 30))  # Tuesday's rows: version 0 again
    second = _predict(spark, cfg, str(staging), out, None)
    assert (second["input_version"], second["rows"], second["out_version"], second["already_in_table"]) == (
        0, 30, 1, False)
    assert second["claim"] != first["claim"]
    dt = DeltaTable(out)
    got = dt.to_pyarrow_table(columns=["path", "probability", "label", "input_table"])
    assert sorted(got.column("path").to_pylist()) == sorted(monday.column("path").to_pylist()
                                                            + rows.slice(20, 30).column("path").to_pylist())
    assert set(got.column("input_table").to_pylist()) == {os.path.realpath(staging)}
    assert got.column("probability").null_count == got.column("label").null_count == 1  # null, not NaN
    meta = json.loads(dt.history()[0]["userMetadata"])["lakehouse.predict"]
    assert meta["input_table"] == os.path.realpath(staging) and len(meta["input_files_digest"]) == 64
