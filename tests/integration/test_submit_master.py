"""spark-submit's --master against the config's spark.master: a job started on one master and configured for another
is refused at its start, naming both (the project's session sets its master in code, which Spark lets win over
--master: the job would run silently elsewhere); two local masters only warn. A real spark-submit of jobs/ingest.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.integration

SPARK_SUBMIT = Path(__import__("pyspark").__file__).parent / "bin" / "spark-submit"


def _submit(master: str, tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               SPARK_LOCAL_IP="127.0.0.1", LAKEHOUSE_PROGRESS="0")
    return subprocess.run([str(SPARK_SUBMIT), "--master", master, str(ROOT / "jobs/ingest.py"),
                           "--source", str(tmp_path / "no-such-folder"), "--conf", str(ROOT / "conf/local.yaml"),
                           f"delta.table={tmp_path}/delta/t", *overrides],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.timeout(600)
def test_a_submitted_master_the_config_does_not_name_is_refused_naming_both(tmp_path):
    # a standalone master no one listens at: the check comes before any session would connect to it
    proc = _submit("spark://127.0.0.1:9", tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "'spark://127.0.0.1:9'" in out and "'spark.master' is 'local[2]'" in out, out[-3000:]
    assert not (tmp_path / "delta").exists()  # nothing written

    # the same master on both sides passes the check: the job goes on to its own error (the missing source)
    agreed = _submit("local[2]", tmp_path)
    out = agreed.stdout + agreed.stderr
    assert "spark-submit started this job" not in out and "no-such-folder" in out, out[-3000:]

    # two local masters differ only in threads: a warning, then the job's own error
    local = _submit("local[1]", tmp_path)
    out = local.stdout + local.stderr
    assert "spark-submit started this job" not in out and "is not spark.master" in out, out[-3000:]
    assert "no-such-folder" in out, out[-3000:]
