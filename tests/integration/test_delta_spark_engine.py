"""The delta-spark engine, where the Delta jars exist (set LAKEHOUSE_DELTA_JARS to their comma-separated paths).

Maven is unreachable on the project's machines, so this test skips there. With the jars it checks the same
contract as the delta-rs tests, in a separate process (the Delta session settings are static): one commit
per ingest, and a table delta-rs reads back at both versions.
"""
import json
import os
import subprocess

import pytest

from conftest import ROOT, cli

JARS = os.environ.get("LAKEHOUSE_DELTA_JARS")
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not JARS, reason="needs the Delta jars: set LAKEHOUSE_DELTA_JARS=/path/delta-spark.jar,...")]


def test_spark_engine_ingest_commits_and_time_travel(digits_dir, tmp_path):
    from deltalake import DeltaTable

    table = tmp_path / "delta_spark_table"
    args = ["--conf", str(ROOT / "conf/local.yaml"), "--source", str(digits_dir), "delta.engine=spark",
            f"spark.conf.spark.jars={JARS}", f"delta.table={table}"]
    versions = []
    for mode in ("overwrite", "append"):
        out = subprocess.run(cli("ingest", "--mode", mode, *args), capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        versions.append(json.loads(out.stdout.strip().splitlines()[-1])["delta_version"])
    assert versions == [0, 1]
    v0 = DeltaTable(str(table), version=0).to_pyarrow_table(columns=["path"]).num_rows
    v1 = DeltaTable(str(table)).to_pyarrow_table(columns=["path"]).num_rows
    assert v0 > 0 and v1 == 2 * v0
