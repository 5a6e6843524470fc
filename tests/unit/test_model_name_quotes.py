"""A registered model's name holding a quote (`o'brien`) against a real SQLite registry: `lakehouse promote` without
--version (`latest_version`) and `lakehouse sync-run` (`Upload.registered_version`) find its versions; a name holding
both quote characters, which no MLflow search filter can name, is refused naming `mlflow.registered_model` where only
the name could narrow the search."""
from __future__ import annotations

import pytest
from mlflow import MlflowClient

from pipeline.config import ConfigError
from pipeline.tracking.offline import OfflineRun, Upload
from pipeline.tracking.registry import latest_version

NAMES = ["o'brien", 'say "hi"', "plain", "naïve模型"]
BOTH = "o'brien \"the\" model"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('names')}/mlflow.db"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp = client.create_experiment("names")
    runs = {}
    for name in [*NAMES, BOTH]:
        client.create_registered_model(name)
        for _ in range(2):  # version 2 from its own run: the run's versions are the run's alone
            runs[name] = client.create_run(exp).info.run_id
            client.create_model_version(name, source="/tmp/x", run_id=runs[name])
    return client, runs


def test_name_filter_quotes_with_the_character_the_name_lacks():
    from pipeline.tracking.registry import name_filter

    assert name_filter("plain") == "name='plain'"
    assert name_filter("o'brien") == "name=\"o'brien\""
    assert name_filter('say "hi"') == "name='say \"hi\"'"
    assert name_filter(BOTH) is None


@pytest.mark.parametrize("name", NAMES)
def test_the_latest_version_and_a_runs_version_are_found_whatever_quote_the_name_holds(registry, tmp_path, name):
    client, runs = registry
    assert latest_version(client, name) == "2"
    up = Upload(off=OfflineRun(str(tmp_path)), info={}, cfg=None, client=client, summary={"run_id": runs[name]},
                state={})
    assert up.registered_version(name) == "2"  # registered by an earlier sync-run: not registered again


def test_a_name_with_both_quotes_is_found_by_its_run_or_by_paging_every_version(registry, tmp_path):
    from pipeline.tracking.registry import model_versions

    client, runs = registry
    assert sorted(mv.version for mv in model_versions(client, "o'brien")) == [1, 2]
    assert latest_version(client, BOTH) == "2"  # no filter names it: every version, paged, kept by its name
    assert [mv.version for mv in model_versions(client, BOTH, runs[BOTH])] == [2]
    up = Upload(off=OfflineRun(str(tmp_path)), info={}, cfg=None, client=client, summary={"run_id": runs[BOTH]},
                state={})
    assert up.registered_version(BOTH) == "2"
