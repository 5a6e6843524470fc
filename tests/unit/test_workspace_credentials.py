"""Databricks workspace credentials for the rank that logs: when MLflow tracks to a Databricks workspace and the
driver's environment lacks DATABRICKS_HOST / DATABRICKS_TOKEN, exactly those two are resolved on the driver and travel
in the ranks' environment (Horovod on Spark: executor_env; TorchDistributor on the cluster: with_env), never in a log
line; ranks but 0 drop them (test_redact covers rank_record with every name of TRACKING_CREDENTIALS)."""
from __future__ import annotations

import os

import pytest

from pipeline.config import load_config
from pipeline.distributed.rank_env import executor_env, rank_environment, workspace_credentials
from pipeline.distributed.rank_process import with_env
from pipeline.redact import TRACKING_CREDENTIALS, WORKSPACE_CREDENTIALS

TOKEN = "dapiSUPERSECRET456"


def _resolver(calls):
    def resolve(uri):  # what mlflow.utils.databricks_utils.get_databricks_env_vars returns on a Databricks driver
        calls.append(uri)
        return {"MLFLOW_TRACKING_URI": "databricks", "DATABRICKS_HOST": "https://adb-1.2.azuredatabricks.net",
                "DATABRICKS_TOKEN": TOKEN, "DATABRICKS_USERNAME": "u", "DATABRICKS_PASSWORD": "p"}
    return resolve


def test_exactly_the_missing_workspace_credentials_are_resolved_for_a_databricks_tracking_uri(caplog):
    calls = []
    with caplog.at_level("INFO"):
        out = workspace_credentials("databricks", {}, _resolver(calls))
    assert out == {"DATABRICKS_HOST": "https://adb-1.2.azuredatabricks.net", "DATABRICKS_TOKEN": TOKEN}
    assert "DATABRICKS_TOKEN" in caplog.text and TOKEN not in caplog.text  # names, never values
    assert workspace_credentials("databricks://my-profile", {"DATABRICKS_HOST": "https://h"},
                                 _resolver(calls)) == {"DATABRICKS_TOKEN": TOKEN}
    assert calls == ["databricks", "databricks://my-profile"]


def test_nothing_is_resolved_when_the_driver_has_both_or_tracks_elsewhere():
    calls = []
    both = {"DATABRICKS_HOST": "https://h", "DATABRICKS_TOKEN": "t"}
    assert workspace_credentials("databricks", both, _resolver(calls)) == {}
    for uri in ("http://127.0.0.1:5000", "sqlite:///work/mlflow.db", "", None):
        assert workspace_credentials(uri, {}, _resolver(calls)) == {}
    assert calls == []


def test_a_driver_without_workspace_credentials_warns_with_the_names_and_forwards_nothing(caplog):
    def fails(uri):
        raise RuntimeError(f"no credentials, not even {TOKEN}")

    with caplog.at_level("WARNING"):
        assert workspace_credentials("databricks", {}, fails) == {}
    assert "DATABRICKS_HOST and DATABRICKS_TOKEN" in caplog.text and TOKEN not in caplog.text


def test_executors_get_the_workspace_credentials_only_when_tracking_to_databricks():
    env = {"DATABRICKS_HOST": "https://h", "DATABRICKS_TOKEN": TOKEN, "DATABRICKS_CLIENT_SECRET": "s",
           "MLFLOW_TRACKING_URI": "databricks", "AWS_SECRET_ACCESS_KEY": "a"}
    assert set(executor_env(env, "databricks")) == {"DATABRICKS_HOST", "DATABRICKS_TOKEN", "MLFLOW_TRACKING_URI"}
    assert set(executor_env(env, "http://127.0.0.1:5000")) == {"MLFLOW_TRACKING_URI"}
    assert set(executor_env(env)) == {"MLFLOW_TRACKING_URI"}
    assert set(WORKSPACE_CREDENTIALS) == {"DATABRICKS_HOST", "DATABRICKS_TOKEN"}
    assert set(WORKSPACE_CREDENTIALS) <= set(TRACKING_CREDENTIALS)  # ranks but 0 drop them (rank_process.rank_record)


def test_a_torchdistributor_rank_gets_what_it_lacks_and_keeps_what_it_has(monkeypatch):
    monkeypatch.delenv("DATABRICKS_TOKEN", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/executor/own")
    seen = {}

    def worker(job):
        seen.update(token=os.environ.get("DATABRICKS_TOKEN"), path=os.environ["PYTHONPATH"], job=job)
        return "result"

    assert with_env(worker, "job", {"DATABRICKS_TOKEN": TOKEN, "PYTHONPATH": "/driver"}) == "result"
    assert seen == {"token": TOKEN, "path": "/executor/own", "job": "job"}


@pytest.mark.parametrize("uri, forwarded", [("databricks", True), ("sqlite:///work/mlflow.db", False)])
def test_the_launcher_puts_them_in_the_ranks_environment_only_while_they_run(monkeypatch, uri, forwarded):
    import pipeline.distributed.rank_env as rank_env

    for name in WORKSPACE_CREDENTIALS:
        monkeypatch.delenv(name, raising=False)
    real = rank_env.workspace_credentials
    monkeypatch.setattr(rank_env, "workspace_credentials",
                        lambda tracking_uri, environ: real(tracking_uri, environ, _resolver([])))
    cfg = load_config("conf/local.yaml", ["train.np=-2", f"mlflow.tracking_uri={uri}"])
    with rank_environment(cfg):
        assert (os.environ.get("DATABRICKS_TOKEN") == TOKEN) == forwarded
        assert set(executor_env(dict(os.environ), uri)) >= (set(WORKSPACE_CREDENTIALS) if forwarded else set())
    assert not any(name in os.environ for name in WORKSPACE_CREDENTIALS)  # the driver's environment as it was
