"""`lakehouse tune --resume` beside other sweeps of the same study (Optuna's heartbeat, a real SQLite storage, a real
MLflow SQLite store, Spark local and a real 1-epoch trial on the sample table): a trial whose sweep process was
SIGKILLed is failed by the resume and its child run ended FAILED; a trial whose sweep was killed right after
`study.ask()`, before its first heartbeat, is failed by its age (issue 37, defect 12: it stayed RUNNING for good); a
trial still held, with its heartbeat, by a live process is left RUNNING (and the resume says so), and that process then
tells its own trial without a crash."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest
from mlflow import MlflowClient

from conftest import ROOT, make_config

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

HEARTBEAT_S = 3  # grace: 3 x 3 s; the holders beat at this interval (a trial is judged by its own sweep's), 6 s of
#                 slack for a loaded machine

# What a sweep does around one trial (pipeline/tune/sweep.py): ask it, open its child run under the study's parent run,
# keep its heartbeat while it "trains" (here: until the test releases it), then tell the study its own value.
HOLDER = """
import os, sys, time
import optuna
from mlflow import MlflowClient
from pipeline.tune.study import ATTR_RUN_ID, Heartbeat, StaleTrials, make_storage, quiet_optuna

url, name, tracking, parent, experiment, beat, release = sys.argv[1:]
quiet_optuna()
storage = make_storage(url, StaleTrials(int(beat)))
study = optuna.load_study(study_name=name, storage=storage)
trial = study.ask()
client = MlflowClient(tracking)
run = client.create_run(experiment, tags={"mlflow.parentRunId": parent, "optuna.study": name,
                                          "optuna.trial": str(trial.number)})
trial.set_user_attr(ATTR_RUN_ID, run.info.run_id)
with Heartbeat(storage, trial, int(beat)):
    print(trial.number, run.info.run_id, flush=True)
    while not os.path.exists(release):
        time.sleep(0.2)
    study.tell(trial, 0.123)
client.set_terminated(run.info.run_id, "FINISHED")
print("told", flush=True)
"""


def _hold(tmp_path, tag, summary, cfg):
    """A process holding a new trial of the study with its heartbeat; returns (process, trial number, run id)."""
    client = MlflowClient(summary["tracking_uri"])
    experiment = client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, f"sqlite:///{tmp_path}/optuna.db", summary["study"],
                             summary["tracking_uri"], summary["parent_run_id"], experiment, str(HEARTBEAT_S),
                             str(tmp_path / f"release-{tag}")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    line = proc.stdout.readline()
    assert line, proc.stderr.read()[-3000:]
    number, run_id = line.split()
    return proc, int(number), run_id


def test_resume_fails_the_killed_trial_and_leaves_the_live_one(spark, digits_table, tmp_path, caplog):
    import optuna
    from optuna.trial import TrialState

    from pipeline.tune.study import INTERRUPTED
    from pipeline.tune.sweep import run_tune

    space = tmp_path / "lr.yaml"
    space.write_text("params:\n  model.lr: {type: float, low: 0.01, high: 0.1, log: true}\n")
    cfg = make_config(tmp_path, f"delta.table={digits_table}", "train.backend=single", "train.np=1",
                      "train.max_epochs=1", "train.warmup_epochs=0", "data.batch_size=32", "mlflow.experiment=tune",
                      "tune.study=shared", "tune.sampler=random", "tune.pruner=none", f"tune.heartbeat_s={HEARTBEAT_S}")
    first = run_tune(spark, cfg, str(space), n_trials=1)  # the study, its parent run and trial 0
    assert first["complete"] == 1

    dead, dead_trial, dead_run = _hold(tmp_path, "dead", first, cfg)
    live, live_trial, live_run = _hold(tmp_path, "live", first, cfg)
    storage = f"sqlite:///{tmp_path}/optuna.db"
    lost = optuna.load_study(study_name="shared", storage=storage).ask()  # its sweep is killed here: it never beats
    try:
        os.killpg(dead.pid, signal.SIGKILL)  # the machine of that sweep dies: no Ctrl-C, no cleanup
        dead.wait(timeout=30)
        time.sleep(3 * HEARTBEAT_S + 2)  # its last heartbeat, and the lost trial's start, older than the grace period

        caplog.set_level(logging.INFO, logger="pipeline.tune")
        summary = run_tune(spark, cfg, resume="shared", n_trials=5)  # 4 started: one more trial runs here
    finally:
        (tmp_path / "release-live").touch()
        out, err = live.communicate(timeout=60)
    assert live.returncode == 0 and out.strip().endswith("told"), err[-3000:]  # it told its own trial, no crash

    assert (dead_trial, live_trial, lost.number) == (1, 2, 3)
    # the lost trial took its slot, as a killed one does (every trial started counts toward n_trials)
    assert (summary["trials"], summary["complete"], summary["failed"], summary["running"]) == (5, 2, 2, 1), summary
    assert summary["failures"] == {"1": INTERRUPTED, "3": INTERRUPTED}
    assert "trial 3 of study 'shared' started" in caplog.text and "never recorded a heartbeat" in caplog.text
    assert f"trial {live_trial} of study 'shared' is running in another sweep (its heartbeat is live); left alone" \
        in caplog.text

    study = optuna.load_study(study_name="shared", storage=storage)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE,
                                              TrialState.FAIL, TrialState.COMPLETE]
    assert study.trials[live_trial].value == 0.123  # the live sweep's own value, told after the resume ended
    client = MlflowClient(summary["tracking_uri"])
    killed = client.get_run(dead_run)
    assert killed.info.status == "FAILED" and killed.data.tags["error"] == INTERRUPTED
    assert client.get_run(live_run).info.status == "FINISHED"
    assert client.get_run(summary["parent_run_id"]).info.status == "FINISHED"
    assert summary["parent_run_id"] == first["parent_run_id"]  # the same parent run, reopened
