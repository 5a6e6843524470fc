"""Unit tests of the promotion gate: the pure rule, and promote() against a real SQLite registry."""
from __future__ import annotations

import math

import mlflow
import pytest
from mlflow import MlflowClient

from pipeline.tracking.registry import PromotionDecision, decide, promote, register_model, version_metric


# --- the pure rule ---------------------------------------------------------------------------

def test_no_champion_promotes():
    d = decide("1", 0.8, None, None)
    assert d == PromotionDecision(True, "1", "val_acc", 0.8, None, None, d.reason)
    assert "no champion" in d.reason


def test_worse_is_refused_and_reason_names_both_values():
    d = decide("2", 0.7, "1", 0.8, metric="val_acc", mode="max")
    assert not d.promoted
    assert "0.7" in d.reason and "0.8" in d.reason and "version 1" in d.reason


def test_tie_promotes_at_least_as_good():
    assert decide("2", 0.8, "1", 0.8).promoted


def test_min_mode_lower_is_better():
    assert decide("2", 0.3, "1", 0.4, metric="val_loss", mode="min").promoted
    d = decide("2", 0.5, "1", 0.4, metric="val_loss", mode="min")
    assert not d.promoted and "lower is better" in d.reason


def test_nan_value_is_never_promoted():
    d = decide("2", math.nan, "1", 0.1)
    assert not d.promoted and "cannot be compared" in d.reason
    assert not decide("1", math.nan, None, None).promoted


def test_champion_without_metric_is_replaced():
    assert decide("2", 0.1, "1", None).promoted


def test_same_version_is_already_champion():
    d = decide("3", 0.5, "3", None)
    assert d.promoted and "already" in d.reason


def test_bad_mode_names_the_config_key():
    with pytest.raises(ValueError, match="mlflow.gate_mode"):
        decide("1", 0.5, None, None, mode="best")


# --- promote() against a real SQLite registry -----------------------------------------------

@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{root}/mlflow.db"
    old = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment("gate", artifact_location=(root / "artifacts").as_uri())
    try:
        yield client, exp_id
    finally:
        mlflow.set_tracking_uri(old)


def _version(client, exp_id, name, tags=None, run_metrics=None):
    run_id = client.create_run(exp_id).info.run_id
    for k, v in (run_metrics or {}).items():
        client.log_metric(run_id, k, v)
    client.set_terminated(run_id)
    model = mlflow.initialize_logged_model(name="model", source_run_id=run_id, experiment_id=exp_id)
    return register_model(client, f"models:/{model.model_id}", name, run_id, tags or {})


@pytest.mark.timeout(120)
def test_promote_sequence_and_metric_sources(registry):
    client, exp_id = registry
    name = "gate_seq"
    v1 = _version(client, exp_id, name, tags={"val_acc": "0.8"})
    assert client.get_model_version(name, v1).tags["run_id"]
    d1 = promote(client, name, v1)
    assert d1.promoted and d1.champion_version is None
    assert str(client.get_model_version_by_alias(name, "champion").version) == v1

    # metric read from the run when the version has no tag
    v2 = _version(client, exp_id, name, run_metrics={"val_acc": 0.7})
    assert version_metric(client, name, v2, "val_acc") == pytest.approx(0.7)
    d2 = promote(client, name, v2)
    assert not d2.promoted
    assert (d2.champion_version, d2.champion_value, d2.value) == (v1, pytest.approx(0.8), pytest.approx(0.7))
    assert "0.7" in d2.reason and "0.8" in d2.reason
    assert str(client.get_model_version_by_alias(name, "champion").version) == v1
    assert client.get_model_version(name, v2).tags["gate_decision"] == d2.reason

    v3 = _version(client, exp_id, name, tags={"val_acc": "0.9"})
    assert promote(client, name, v3).promoted
    assert str(client.get_model_version_by_alias(name, "champion").version) == v3


@pytest.mark.timeout(120)
def test_version_without_metric_is_refused_with_clear_error(registry):
    client, exp_id = registry
    name = "gate_missing"
    v1 = _version(client, exp_id, name, tags={"delta_version": "0"})
    with pytest.raises(ValueError, match=rf"version {v1} has no metric 'val_acc'"):
        promote(client, name, v1)
    with pytest.raises(ValueError, match="gate_mode"):
        promote(client, name, v1, mode="up")


@pytest.mark.timeout(120)
def test_custom_alias_and_min_mode(registry):
    client, exp_id = registry
    name = "gate_min"
    v1 = _version(client, exp_id, name, tags={"val_loss": "0.4"})
    v2 = _version(client, exp_id, name, tags={"val_loss": "0.5"})
    assert promote(client, name, v1, metric="val_loss", mode="min", alias="prod").promoted
    d = promote(client, name, v2, metric="val_loss", mode="min", alias="prod")
    assert not d.promoted
    assert str(client.get_model_version_by_alias(name, "prod").version) == v1
