"""`--trials` and `--timeout` are checked as their config keys are (at least one trial, a timeout above 0, the error
naming the option), set `tune.n_trials` and `tune.timeout_s` before anything logs the config, and a resume keeps the
study's count unless one is asked for; the parent run shows the count and timeout in use. `run_tune` runs here for
real (Optuna and MLflow on SQLite) with the trials' training stood in for: each trial fails at once, no Spark."""
from __future__ import annotations

import pytest

from pipeline.config import Config, ConfigError, apply_overrides

# data.image_size is a conversion key: no data is converted before the first trial, whose stand-in fails it
SPACE = "params:\n  data.image_size: {type: categorical, choices: [16, 32]}\n"


def _cfg(tmp_path, **values):
    return apply_overrides(Config(), {
        "mlflow.tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "mlflow.artifact_location": str(tmp_path / "art"),
        "mlflow.experiment": "tune", "mlflow.unended_runs": str(tmp_path / "unended.jsonl"),
        "tune.storage": f"sqlite:///{tmp_path}/optuna.db", "tune.study": "s", "tune.pruner": "none",
        "data.cache_dir": str(tmp_path / "cache"), "train.checkpoint_dir": str(tmp_path / "ckpt"), **values})


@pytest.fixture
def seen(monkeypatch):
    """The `tune.*` config each trial ran with; the trial itself fails at once (no training here)."""
    from pipeline.tune import sweep

    configs = []

    def run_trial(trial, cfg, overrides, shared, parent_run_id, study_name):
        configs.append((cfg.tune.n_trials, cfg.tune.timeout_s))
        raise RuntimeError("no training in this test")

    monkeypatch.setattr(sweep, "run_trial", run_trial)
    return configs


def _parent(summary):
    from mlflow import MlflowClient

    return MlflowClient(summary["tracking_uri"]).get_run(summary["parent_run_id"]).data


@pytest.mark.parametrize("n_trials, timeout_s, match", [
    (0, None, r"--trials \(config key 'tune\.n_trials'\) must be a whole number >= 1, got 0"),
    (-3, None, r"--trials .* got -3"),
    (None, 0.0, r"--timeout \(config key 'tune\.timeout_s'\) must be a number of seconds > 0, got 0\.0"),
    (None, -5.0, r"--timeout .* got -5\.0"),
    (None, float("nan"), r"--timeout .* got nan"),
])
def test_a_bad_trial_count_or_timeout_is_refused_naming_the_option(tmp_path, seen, n_trials, timeout_s, match):
    from pipeline.tune.sweep import run_tune

    space = tmp_path / "s.yaml"
    space.write_text(SPACE)
    with pytest.raises(ConfigError, match=match):
        run_tune(None, _cfg(tmp_path), str(space), n_trials=n_trials, timeout_s=timeout_s)
    assert seen == [] and not (tmp_path / "optuna.db").exists()  # refused before any study or trial


@pytest.mark.timeout(300)
def test_the_count_and_timeout_in_use_are_the_ones_run_logged_and_kept_on_resume(tmp_path, seen):
    from pipeline.tune.sweep import run_tune

    space = tmp_path / "s.yaml"
    space.write_text(SPACE)
    cfg = _cfg(tmp_path)  # tune.n_trials 10, no timeout, as configured
    first = run_tune(None, cfg, str(space), n_trials=1, timeout_s=600.0)
    assert (first["trials"], first["asked"], first["failed"]) == (1, 1, 1)
    assert seen == [(1, 600.0)]  # the trial's config: the values the sweep ran with
    parent = _parent(first)
    assert (parent.params["tune.n_trials"], parent.params["tune.timeout_s"]) == ("1", "600.0")  # logged as run
    assert (parent.tags["tune.n_trials"], parent.tags["tune.timeout_s"]) == ("1", "600.0")

    again = run_tune(None, cfg, resume="s")  # no count asked: the study's own 1, not the config's 10
    assert (again["trials"], again["asked"]) == (1, 1) and len(seen) == 1

    more = run_tune(None, cfg, resume="s", n_trials=2)  # --trials 2 on resume: one more trial
    assert (more["trials"], more["asked"]) == (2, 2) and seen[-1] == (2, None)
    parent = _parent(more)
    assert parent.params["tune.n_trials"] == "1"  # a param keeps its first value; the tags show the one in use
    assert (parent.tags["tune.n_trials"], parent.tags["tune.timeout_s"]) == ("2", "null")  # as a param says it

    kept = run_tune(None, cfg, resume="s")  # the count set on the last resume stays the study's
    assert (kept["trials"], kept["asked"]) == (2, 2) and len(seen) == 2


def test_an_explicit_tune_n_trials_on_the_command_line_is_a_count_asked():
    from pipeline.tune.sweep import trials_asked

    cfg = apply_overrides(Config(), {"tune.n_trials": 20})
    assert trials_asked(None, ["tune.n_trials=20", "train.np=-2"], cfg) == 20  # replaces a resumed study's count
    assert trials_asked(5, ["tune.n_trials=20"], cfg) == 5  # --trials first
    assert trials_asked(None, ["train.np=-2"], cfg) is None  # the config's (or profile's) count is not asked for
