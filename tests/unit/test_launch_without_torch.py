"""The driver reaches a Horovod launch without torch: Horovod's Gloo check is left to each rank's own build, and the
tracking URI reaches MLflow without rebuilding its tracing provider."""
import os
import sys
import types

import mlflow
import pytest
from mlflow.tracking._tracking_service import utils as tracking_service

from pipeline.config import ConfigError
from pipeline.distributed import restart
from pipeline.distributed.backends.horovod import gloo_checked_by_the_ranks, horovod_with_gloo
from pipeline.tracking.runs import use_tracking_uri
from test_rank_start_and_exit import _modules_after


def test_the_driver_modules_up_to_the_launch_import_no_torch_and_rank_zero_tracker_no_mlflow():
    loaded = _modules_after("import pipeline.cli, pipeline.workflow, pipeline.distributed.launcher, pipeline.distributed.restart, "
                            "pipeline.tracking.runs, pipeline.lakehouse.spark")
    assert "torch" not in loaded and "horovod" not in loaded
    # every rank unpickles the tracker's class with its job: only rank 0, which makes one, may pay for MLflow
    assert "mlflow" not in _modules_after("from pipeline.tracking.rank_zero import RankZeroTracker")


def test_the_launch_skips_the_drivers_forked_gloo_check_and_restores_it(monkeypatch):
    import horovod.runner.launch as horovod_launch

    original = horovod_launch.gloo_built

    def no_fork():
        raise AssertionError("the driver forked for Horovod's build check")

    monkeypatch.setattr(os, "fork", no_fork)
    with gloo_checked_by_the_ranks():
        assert horovod_launch.gloo_built(verbose=False) is True
    assert horovod_launch.gloo_built is original


def test_a_rank_whose_horovod_has_no_gloo_fails_with_a_config_error_naming_the_key(monkeypatch):
    import horovod

    hvd = types.ModuleType("horovod.torch")
    hvd.gloo_built = lambda: False
    monkeypatch.setitem(sys.modules, "horovod.torch", hvd)
    # `import horovod.torch as hvd` reads the package's attribute once the real one was imported (by an earlier test)
    monkeypatch.setattr(horovod, "torch", hvd, raising=False)
    with pytest.raises(ConfigError, match=r"train\.backend.*without Gloo.*HOROVOD_WITH_GLOO=1"):
        horovod_with_gloo("/opt/venv/bin/python")
    hvd.gloo_built = lambda: True
    assert horovod_with_gloo() is hvd


def test_a_rank_where_horovod_torch_does_not_import_fails_with_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod.torch", None)  # the import system then raises ImportError
    with pytest.raises(ConfigError, match=r"train\.backend.*does not import in /opt/venv/bin/python"):
        horovod_with_gloo("/opt/venv/bin/python")
    # the launcher decides restartability from the class: a broken install is not retried
    assert not restart.is_restartable(ConfigError("x"))


@pytest.fixture
def no_tracking_uri_chosen(monkeypatch):
    monkeypatch.setattr(tracking_service, "_tracking_uri", None)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield
    monkeypatch.setattr(tracking_service, "_tracking_uri", None)


def test_a_uri_reaches_mlflow_through_its_variable_where_none_was_chosen(no_tracking_uri_chosen, monkeypatch, tmp_path):
    resets = []
    monkeypatch.setattr(tracking_service, "reset", lambda: resets.append(1))
    uri = f"sqlite:///{tmp_path}/a.db"
    use_tracking_uri(uri)
    assert os.environ["MLFLOW_TRACKING_URI"] == uri == mlflow.get_tracking_uri()
    assert tracking_service._tracking_uri is None and not resets  # the tracing provider was left alone


def test_a_uri_chosen_earlier_in_the_process_is_replaced(no_tracking_uri_chosen, tmp_path):
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/notebook.db")
    uri = f"sqlite:///{tmp_path}/job.db"
    use_tracking_uri(uri)
    assert mlflow.get_tracking_uri() == uri  # the variable alone would have lost to the notebook's choice

