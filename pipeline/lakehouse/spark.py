"""The Spark session of the driver: built from `spark.*` config, Delta settings when the engine needs them."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator

from pipeline.config import Config
from pipeline.log import get_logger

log = get_logger(__name__)

# What the delta-spark engine needs in the session; the jars themselves come from spark.jars or
# spark.jars.packages in `spark.conf` (see the README, "Delta jars").
DELTA_SESSION_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}


def get_spark(cfg: Config):
    """Get or create the driver's SparkSession for this config."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder
    if cfg.spark.master != "databricks":  # on Databricks the cluster's own session is used as it is
        builder = builder.master(cfg.spark.master)
    builder = (builder.appName(cfg.spark.app_name)
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "8")
               .config("spark.sql.execution.arrow.pyspark.enabled", "true")
               .config("spark.sql.parquet.compression.codec", "snappy"))
    if cfg.spark.master.startswith("local"):
        builder = builder.config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    if cfg.delta.engine == "spark":
        for k, v in DELTA_SESSION_CONF.items():
            builder = builder.config(k, v)
    for k, v in cfg.spark.conf.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


@contextmanager
def spark_session(cfg: Config) -> Iterator:
    """A SparkSession that is stopped when the block ends."""
    spark = get_spark(cfg)
    try:
        yield spark
    finally:
        spark.stop()
