"""Tune registers its best trial's model once per study: two sweeps on one study ending at once (a documented use), or a
sweep resumed after a crash between registering and recording it, leave one version of those weights."""
from __future__ import annotations

import threading

import pytest


def _study_with_a_best_trial(tmp_path):
    import optuna
    from mlflow import MlflowClient
    from optuna.distributions import FloatDistribution

    from pipeline.config import load_config
    from pipeline.tune.study import ATTR_METRICS, ATTR_MODEL_URI, ATTR_RUN_ID, quiet_optuna

    quiet_optuna()
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config("conf/local.yaml", [f"mlflow.tracking_uri={uri}", "mlflow.promote=false",
                                          "mlflow.registered_model=tuned"])
    client = MlflowClient(uri)
    exp = client.create_experiment("e", artifact_location=f"file://{tmp_path}/art")
    run = client.create_run(exp, tags={"delta_table": str(tmp_path / "t"), "delta_version": "0"})
    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    study.add_trial(optuna.trial.create_trial(
        params={"lr": 0.1}, distributions={"lr": FloatDistribution(0.01, 1)}, value=0.9,
        user_attrs={ATTR_RUN_ID: run.info.run_id, ATTR_MODEL_URI: f"runs:/{run.info.run_id}/model",
                    ATTR_METRICS: {"val_acc": 0.9}}))
    return cfg, uri, storage, run.info.run_id


@pytest.mark.timeout(120)
def test_two_sweeps_ending_at_once_register_the_best_trial_once(tmp_path):
    import optuna
    from mlflow import MlflowClient

    from pipeline.tune.sweep import _register_best

    cfg, uri, storage, run_id = _study_with_a_best_trial(tmp_path)
    barrier, got, errors = threading.Barrier(2), [], []

    def sweep():  # its own study handle and client, as a second `lakehouse tune` on the study has
        try:
            study = optuna.load_study(study_name="s", storage=storage)
            barrier.wait()
            got.append(_register_best(cfg, MlflowClient(uri), study, study.best_trial))
        except Exception as exc:  # noqa: BLE001 - shown by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=sweep) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    versions = MlflowClient(uri).search_model_versions("name='tuned'")
    assert [(v.run_id, v.tags["optuna.trial"]) for v in versions] == [(run_id, "0")]  # one version of those weights
    assert {d["version"] for d in got} == {str(versions[0].version)}  # both sweeps report it


@pytest.mark.timeout(120)
def test_a_resumed_sweep_finds_the_version_its_crashed_run_registered(tmp_path):
    import optuna
    from mlflow import MlflowClient

    from pipeline.tune.study import ATTR_REGISTERED
    from pipeline.tune.sweep import _register_best

    cfg, uri, storage, run_id = _study_with_a_best_trial(tmp_path)
    study = optuna.load_study(study_name="s", storage=storage)
    first = _register_best(cfg, MlflowClient(uri), study, study.best_trial)
    study.set_user_attr(ATTR_REGISTERED, None)  # the crash: registered, the study never told
    again = _register_best(cfg, MlflowClient(uri), study, study.best_trial)
    assert again["version"] == first["version"] == "1"
    assert len(MlflowClient(uri).search_model_versions("name='tuned'")) == 1
