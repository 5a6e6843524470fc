"""Shared test fixtures: one local[2] Spark session, a rendered digits folder and its Delta table, config factories."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("LAKEHOUSE_PROGRESS", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: real Spark / Delta / Petastorm / Horovod / MLflow (slower)")
    config.addinivalue_line("markers", "slow: multi-process training or a cluster; minutes")


def make_config(tmp: Path, *overrides: str, profile: str = "conf/local.yaml"):
    """The local profile with every path under `tmp`, plus overrides."""
    from pipeline.config import load_config

    base = [
        f"delta.table={tmp}/delta/digits",
        f"data.cache_dir={tmp}/petastorm_cache",
        f"train.checkpoint_dir={tmp}/checkpoints",
        f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db",
        f"mlflow.artifact_location={tmp}/mlartifacts",
    ]
    return load_config(str(ROOT / profile), base + list(overrides))


@pytest.fixture(scope="session")
def spark():
    from pipeline.config import load_config
    from pipeline.lakehouse.spark import get_spark

    session = get_spark(load_config(str(ROOT / "conf/local.yaml"), ["spark.app_name=lakehouse-tests"]))
    yield session
    session.stop()


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> Path:
    from pipeline.lakehouse.sample_data import render_digits

    out = tmp_path_factory.mktemp("digits")
    render_digits(str(out), limit=600)
    return out


@pytest.fixture(scope="session")
def digits_table(spark, digits_dir, tmp_path_factory) -> Path:
    """A Delta table (version 0) of the 600 rendered digits, shared read-only by the tests."""
    from pipeline.lakehouse.ingest import ingest_folder

    tmp = tmp_path_factory.mktemp("shared_table")
    cfg = make_config(tmp)
    ingest_folder(spark, cfg, str(digits_dir), mode="overwrite")
    return tmp / "delta" / "digits"


def cli(*args: str) -> List[str]:
    return [str(ROOT / ".venv/bin/lakehouse"), *args]
