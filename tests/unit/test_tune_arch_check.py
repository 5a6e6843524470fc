"""A sweep whose space (or config) names a timm/<name> network this install cannot build is refused before its first
trial, naming `model.arch` and the network: each trial failed in its ranks instead, after its data was prepared, one
failed trial after another. `run_tune` runs for real (Optuna and MLflow on SQLite); the trials are stood in for, and
timm's absence is made where it is installed (the vision venv)."""
from __future__ import annotations

import importlib.util

import optuna
import pytest

from pipeline.config import ConfigError

from test_tune_counts import _cfg  # the sweep's config on SQLite stores under tmp_path


@pytest.fixture
def trials(monkeypatch):
    """The trials started (none should be); timm made absent."""
    from pipeline.tune import sweep

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "timm" else find_spec(name, *a))
    started = []
    monkeypatch.setattr(sweep, "run_trial", lambda trial, *a: started.append(trial.number))
    return started


@pytest.mark.parametrize("space", [
    "params:\n  model.arch: {type: categorical, choices: [cnn, timm/resnet18]}\n",
    "params:\n  model.lr: {type: float, low: 0.01, high: 0.1}\nfixed:\n  model.arch: timm/resnet18\n",
])
def test_a_space_that_may_pick_a_timm_network_without_timm_is_refused_before_any_trial(tmp_path, trials, space):
    from pipeline.tune.sweep import run_tune

    path = tmp_path / "s.yaml"
    path.write_text(space)
    with pytest.raises(ConfigError, match=r"config key 'model\.arch': 'timm/resnet18' needs the timm package"):
        run_tune(None, _cfg(tmp_path), str(path), n_trials=2)
    assert trials == []
    # no study made: the same command, once timm is installed, is not told the study exists (--resume)
    assert not (tmp_path / "optuna.db").exists() or optuna.study.get_all_study_names(
        storage=f"sqlite:///{tmp_path}/optuna.db") == []


def test_a_config_arch_the_space_does_not_search_is_checked_too(tmp_path, trials):
    from pipeline.tune.sweep import run_tune

    path = tmp_path / "s.yaml"
    path.write_text("params:\n  model.lr: {type: float, low: 0.01, high: 0.1}\n")
    with pytest.raises(ConfigError, match=r"'timm/resnet18' needs the timm package"):
        run_tune(None, _cfg(tmp_path, **{"model.arch": "timm/resnet18"}), str(path), n_trials=2)
    assert trials == []
