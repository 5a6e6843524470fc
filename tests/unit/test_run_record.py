"""The driver's records in a training run (pipeline.tracking.run_record): what each change writes, that a failing
MLflow never fails the training, and that workflow.py leaves every MLflow call to the tracking layer."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from pipeline.tracking.run_record import CAUSE_CHARS, RunRecord


class _Client:
    def __init__(self, fail: bool = False) -> None:
        self.calls, self.fail = [], fail

    def __getattr__(self, name):
        def call(*args, **kwargs):
            if self.fail:
                raise ConnectionError("tracking server gone")
            self.calls.append((name, args[1:]))
        return call


def _plan(batch: int):
    return SimpleNamespace(train=SimpleNamespace(batch_size=batch, steps_per_epoch=3), val=SimpleNamespace(steps=1))


def test_each_change_is_recorded_with_its_cause_cut_to_a_tags_room():
    client = _Client()
    record = RunRecord(client, "r1")
    record.restart(1, "x" * 9000)
    record.world(2, "host b lost")
    record.batch(1, _plan(64), "CUDA out of memory")
    assert ("log_metric", ("restarts", 1)) in [(n, a[:2]) for n, a in client.calls]
    assert ("set_tag", ("restart_1_cause", "x" * CAUSE_CHARS)) in client.calls
    assert ("set_tag", ("world_size_used", 2)) in client.calls and ("set_tag", ("batch_size_used", 64)) in client.calls
    assert ("set_tag", ("oom_backoff_1_cause", "CUDA out of memory")) in client.calls
    plan_logs = [a for n, a in client.calls if n == "log_dict"]
    assert plan_logs == [({"train": {"batch_size": 64, "steps_per_epoch": 3}, "val": {"steps": 1}}, "shard_plan.json")]


def test_a_tracking_server_that_fails_never_fails_the_training(caplog):
    record = RunRecord(_Client(fail=True), "r1")
    record.restart(2, "rank 1 died")
    record.world(1, "host lost")
    record.batch(3, _plan(8), "oom")
    assert "could not record restart 2 in MLflow: tracking server gone" in caplog.text
    assert "could not record OOM back-off 3" in caplog.text


def test_workflow_makes_no_mlflow_call_itself():
    source = (Path(__file__).resolve().parents[2] / "pipeline" / "workflow.py").read_text()
    calls = re.findall(r"\.(set_tag|log_metric|log_param|log_dict|log_artifact|search_model_versions|"
                       r"set_registered_model_alias|create_run|set_terminated)\(", source)
    assert calls == [] and "import mlflow" not in source, calls
