"""A Spark session the pipeline did not create survives `spark_session(cfg)` with its conf unchanged; one it creates is configured and stopped."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.datapath, pytest.mark.timeout(300)]

# Each case runs in its own Python: a JVM holds one SparkContext, and the session-wide `spark` fixture must not be
# the one under test.
FOREIGN = textwrap.dedent("""
    import json, os
    os.environ.pop("DATABRICKS_RUNTIME_VERSION", None)
    from pyspark.sql import SparkSession
    from pipeline.config import load_config
    from pipeline.lakehouse.spark import spark_session

    outer = (SparkSession.builder.master("local[1]").appName("not-the-pipeline")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.sql.shuffle.partitions", "3").getOrCreate())
    keys = ["spark.sql.shuffle.partitions", "spark.sql.execution.arrow.pyspark.enabled", "spark.app.name",
            "spark.master", "spark.sql.parquet.compression.codec"]
    before = {k: outer.conf.get(k, None) for k in keys}
    cfg = load_config("conf/local.yaml", ["spark.app_name=pipeline", "spark.master=local[2]",
                                          "spark.conf.spark.sql.session.timeZone=Pacific/Apia"])
    with spark_session(cfg) as inner:
        same = inner is outer
        inside = {k: inner.conf.get(k, None) for k in keys}
        rows = inner.range(5).count()
    after = {k: outer.conf.get(k, None) for k in keys}
    alive = outer.sparkContext._jsc is not None and outer.range(3).count() == 3
    print(json.dumps({"same": same, "before": before, "inside": inside, "after": after, "alive": alive, "rows": rows,
                      "tz": outer.conf.get("spark.sql.session.timeZone")}))
    outer.stop()
""")

OWNED = textwrap.dedent("""
    import json, os
    os.environ.pop("DATABRICKS_RUNTIME_VERSION", None)
    from pyspark.sql import SparkSession
    from pipeline.config import load_config
    from pipeline.lakehouse.spark import spark_session

    cfg = load_config("conf/local.yaml", ["spark.app_name=pipeline-owned", "spark.master=local[1]"])
    assert SparkSession.getActiveSession() is None
    with spark_session(cfg) as spark:
        inside = {"partitions": spark.conf.get("spark.sql.shuffle.partitions"), "app": spark.conf.get("spark.app.name"),
                  "rows": spark.range(4).count()}
        ctx = spark.sparkContext
    print(json.dumps({**inside, "stopped": ctx._jsc is None, "active_after": SparkSession.getActiveSession() is not None}))
""")


def run(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_session_created_outside_survives_the_pipeline_with_its_conf_unchanged():
    out = run(FOREIGN)
    assert out["same"], "the pipeline made its own session beside the caller's"
    assert out["before"]["spark.sql.shuffle.partitions"] == "3"
    assert out["inside"] == out["before"] and out["after"] == out["before"], out
    assert out["alive"] and out["rows"] == 5
    # a setting the config asks for is not forced onto the caller's session (it is named in a warning instead)
    assert out["tz"] != "Pacific/Apia"


def test_a_session_the_pipeline_creates_is_configured_and_stopped():
    out = run(OWNED)
    assert out == {"partitions": "8", "app": "pipeline-owned", "rows": 4, "stopped": True, "active_after": False}
