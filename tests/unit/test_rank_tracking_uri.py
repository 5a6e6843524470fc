"""The tracking URI's credentials reach rank 0 alone: the TrainJob every rank unpickles (and ranks started early read
from the job folder) carries neither the URI with its password nor a config holding it; rank 0 reaches MLflow through
MLFLOW_TRACKING_URI, which the driver set when it connected and which every other rank drops as it starts
(tests/unit/test_redact.py: test_ranks_but_zero_drop_the_tracking_credentials)."""
from __future__ import annotations

import contextlib
import pickle
from types import SimpleNamespace

from pipeline.config import Config, apply_overrides

SECRET = "s3cr3tPW"
URI = f"http://alice:{SECRET}@mlflow.example:5000"


class _Record:
    """RunRecord's calls, taken and dropped (no server here)."""

    def __init__(self, *args):
        pass

    def start(self, *args):
        pass

    restart = batch = world = start


def _job_of_train_in_run(monkeypatch, tmp_path, uri):
    """The TrainJob `train_in_run` hands the launcher (every heavy part replaced)."""
    import pipeline.workflow as workflow

    seen = {}

    def launch(job, **kwargs):
        seen["job"] = job
        return [SimpleNamespace(rank=0, stop_reason=None)]

    monkeypatch.setattr(workflow, "launch_with_restarts", launch)
    monkeypatch.setattr(workflow, "RunRecord", _Record)
    monkeypatch.setattr(workflow, "job_plan", lambda *args: object())
    monkeypatch.setattr(workflow, "log_rank_hosts", lambda *args: None)
    monkeypatch.setattr(workflow, "preload", SimpleNamespace(once=lambda *a, **k: contextlib.nullcontext()))
    cfg = apply_overrides(Config(), {"mlflow.tracking_uri": uri, "train.checkpoint_dir": str(tmp_path / "ckpt")})
    run = SimpleNamespace(run_id="r" * 32, client=object(), tracking_uri=uri)
    data = SimpleNamespace(rows=(8, 2), plan=None)
    workflow.train_in_run(run, cfg, data, SimpleNamespace(table="/t", version=0), {})
    return seen["job"]


def test_the_job_every_rank_gets_holds_no_tracking_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", URI)  # what the driver's connection set (runs.use_tracking_uri)
    job = _job_of_train_in_run(monkeypatch, tmp_path, URI)
    assert SECRET.encode() not in pickle.dumps(job)
    assert job.tracking_uri is None  # rank 0 takes MLFLOW_TRACKING_URI
    assert job.cfg.mlflow.tracking_uri == "http://alice:***@mlflow.example:5000"
    assert job.cfg.train == apply_overrides(Config(), {"train.checkpoint_dir": str(tmp_path / "ckpt")}).train


def test_a_tracking_uri_without_credentials_is_handed_as_it_is(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    job = _job_of_train_in_run(monkeypatch, tmp_path, uri)
    assert job.tracking_uri == uri and job.cfg.mlflow.tracking_uri == uri


def test_rank_zero_given_no_uri_reaches_the_one_in_its_environment(tmp_path, monkeypatch):
    """RankZeroTracker(None, ...) (the job's tracking_uri when it holds credentials): its client and MLflow's fluent
    API (the model's logging) use MLFLOW_TRACKING_URI, as in a rank process where nothing chose a URI yet."""
    import mlflow
    from mlflow.tracking._tracking_service import utils as tracking_service

    from pipeline.tracking.rank_zero import RankZeroTracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setattr(tracking_service, "_tracking_uri", None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    tracker = RankZeroTracker(None, "r1", local_dir=str(tmp_path))
    assert tracker.client.tracking_uri == uri and mlflow.get_tracking_uri() == uri
