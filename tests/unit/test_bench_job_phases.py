"""The job-phases bench's arithmetic: the driver's timeline and rank 0's epoch metrics placed into phases that add up
to the process's wall time; the summary's `phases` from the job's marks."""
from types import SimpleNamespace

import pytest

from bench.job_phases import PHASES, timeline
from pipeline.workflow import phases


def _metric(step, end_s, value):
    return SimpleNamespace(step=step, timestamp=int(end_s * 1000), value=value)


def test_phases_of_a_job_add_up_to_its_wall_time():
    marks = {"train_called": 105.0, "data_ready": 112.0, "launch": 113.5, "ranks_returned": 150.0, "gated": 153.0}
    summary = {"run_id": "r", "phases": phases(marks)}
    assert summary["phases"]["prepare_data_s"] == 7.0 and summary["phases"]["run_setup_s"] == 1.5
    assert summary["phases"]["ranks_s"] == 36.5 and summary["phases"]["register_and_gate_s"] == 3.0
    # three epochs of 10 s, 8 s, 8 s ending at 130, 138, 146 (logged out of order): the first step at 120
    epochs = [_metric(2, 146.0, 8.0), _metric(0, 130.0, 10.0), _metric(1, 138.0, 8.0)]
    got = timeline(summary, started=100.0, ended=154.0, epochs=epochs)
    assert got["process_and_spark_s"] == 5.0 and got["prepare_data_s"] == 7.0 and got["run_setup_s"] == 1.5
    assert got["rank_start_s"] == pytest.approx(6.5) and got["epochs_s"] == pytest.approx(26.0)
    assert got["model_logging_s"] == pytest.approx(4.0) and got["register_and_gate_s"] == 3.0
    assert got["exit_s"] == 1.0
    assert sum(got[k] for k in PHASES) == pytest.approx(154.0 - 100.0)
    assert got["steady_epoch_s"] == 8.0  # the first epoch (the ranks' warm-up) left out


def test_a_run_without_epoch_metrics_is_refused_naming_it():
    summary = {"run_id": "abc", "phases": phases({"train_called": 1.0})}
    with pytest.raises(ValueError, match="run abc: no epoch_time_s"):
        timeline(summary, 0.0, 2.0, [])


def test_the_summary_phases_skip_marks_a_job_never_reached():
    got = phases({"train_called": 1.0, "data_ready": 3.0})  # failed before the launch
    assert got["prepare_data_s"] == 2.0 and "ranks_s" not in got and got["at"]["data_ready"] == 3.0
