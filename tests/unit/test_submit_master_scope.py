"""The spark-submit master check's reach: only the commands that make a Spark session are refused on a master the
config does not name (doctor, promote, export and cache run, and doctor reports); a gateway port left in the
environment with no JVM behind it is a warning, not a crash."""
import pytest

from pipeline import cli
from pipeline.lakehouse import spark as spark_mod


@pytest.fixture
def submitted_elsewhere(monkeypatch):
    monkeypatch.setattr(spark_mod, "submitted_master", lambda: "spark://elsewhere:7077")


def test_a_command_that_makes_a_session_is_refused_on_another_master(submitted_elsewhere, tmp_path, caplog):
    rc = cli.main(["train", "--conf", "conf/local.yaml", f"delta.table={tmp_path}/t"])
    assert rc == 2 and "spark://elsewhere:7077" in caplog.text and "'spark.master' is 'local[2]'" in caplog.text


def test_a_command_without_a_session_runs_on_another_master(submitted_elsewhere, tmp_path, capsys):
    rc = cli.main(["cache", "ls", "--conf", "conf/local.yaml", f"data.cache_dir={tmp_path}/cache"])
    assert rc == 0 and '"entries": []' in capsys.readouterr().out


def test_a_gateway_port_without_a_jvm_is_not_a_crash(monkeypatch, caplog):
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "1")
    monkeypatch.delenv("PYSPARK_GATEWAY_SECRET", raising=False)
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    from pyspark import SparkContext

    # a gateway an earlier test of this process opened (a local session) would answer instead of the port's
    monkeypatch.setattr(SparkContext, "_gateway", None)
    monkeypatch.setattr(SparkContext, "_jvm", None)
    assert spark_mod.submitted_master() is None
    assert "no spark-submit JVM answers there" in caplog.text
