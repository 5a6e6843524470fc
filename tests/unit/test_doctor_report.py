"""`lakehouse doctor`'s printed report: a supported Java passes whatever its version's form, a table the direct path
cannot take (a catalog name) is a line of the report rather than a crash, and no secret of the config is printed."""
from __future__ import annotations

import pytest

from pipeline import doctor
from pipeline.config import ConfigError, load_config
from pipeline.doctor import GpuFacts, HorovodBuild, known_problems

CLASSIC = {"torch": "2.13.0+cpu", "pytorch_lightning": "2.6.6", "pyspark": "4.0.5", "delta": "4.0.1",
           "deltalake": "1.6.6", "petastorm": "0.12.1", "pyarrow": "14.0.2", "numpy": "1.26.4", "pandas": "2.2.3",
           "mlflow": "3.17.2", "horovod": "0.28.1"}


@pytest.mark.parametrize("java", ["17", "17.0.15", "21", "21.0.1", "25-ea", "17.0.2+8"])
def test_a_java_17_or_newer_passes_whatever_the_form_of_its_version(java):
    assert known_problems(CLASSIC, java) == []


@pytest.mark.parametrize("java,major", [("1.8.0_392", 8), ("11.0.21", 11), ("16", 16)])
def test_a_java_older_than_17_is_named(java, major):
    assert doctor.java_major(java) == major
    assert f"java {java}: Spark 4.0 needs Java 17 or newer" in known_problems(CLASSIC, java)


@pytest.fixture
def quick_facts(monkeypatch):
    """This machine's facts but for the slow ones (java's start, Horovod's and torch's imports)."""
    monkeypatch.setattr(doctor, "java_version", lambda: "21")
    monkeypatch.setattr(doctor, "horovod_build", lambda: HorovodBuild(installed=True, pytorch=True, gloo=True))
    monkeypatch.setattr(doctor, "gpu_facts", lambda: GpuFacts(torch="2.13.0+cpu"))


def test_a_catalog_table_name_is_reported_as_not_readable_by_the_direct_path(quick_facts, capsys):
    cfg = load_config(None, ["delta.engine=spark", "delta.table=main.ml.images",
                             "spark.conf.spark.jars.packages=io.delta:delta-spark_2.13:4.0.0"])
    rc = doctor.run_doctor(cfg)
    out = capsys.readouterr().out
    assert out.startswith("lakehouse doctor")
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("direct path"))
    assert line.split()[2] == "no:" and "main.ml.images" in line and "catalog" in line
    assert "java               21" in out and rc in (0, 1)  # the whole report is printed either way


@pytest.mark.parametrize("table,secret,kept", [
    ("s3a://AKIAEXAMPLE:Secr3tValue@bucket/t", "Secr3tValue", "bucket/t"),
    ("abfss://data@acct.dfs.core.windows.net/t?sv=2020-08-04&sig=SIGSECRET123", "SIGSECRET123",
     "acct.dfs.core.windows.net/t?sv=2020-08-04&sig=***"),
])
def test_the_report_prints_no_secret_of_the_table_url(quick_facts, monkeypatch, capsys, table, secret, kept):
    import pipeline.data.source as source

    def pin_files(t, version=None):  # delta-rs's refusal names the table as given, as pin_files' does
        raise ConfigError(f"config key 'delta.table': Delta table {t} cannot be opened by delta-rs (OSError: no)")

    monkeypatch.setattr(source, "pin_files", pin_files)
    cfg = load_config(None, [f"delta.table={table}", "data.source=direct", "data.decode=cpu"])
    assert doctor.run_doctor(cfg) == 1  # data.source=direct cannot read it: a problem, named with the table
    out = capsys.readouterr().out
    assert secret not in out
    assert out.count(kept) == 2 and "cannot be opened by delta-rs" in out  # the direct path line and the problem
    assert "config data.source=direct but the direct path cannot read delta.table" in out
