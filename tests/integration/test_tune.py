"""`lakehouse tune` on real parts: Spark local[2], the Delta sample, 2 Horovod ranks per trial over gloo, Optuna's
SQLite storage and an MLflow SQLite store; pruning, a failing trial, the best registered, resume after a kill."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil
import pytest
from mlflow import MlflowClient

from conftest import ROOT, cli, make_config
from test_notebooks import kernel_name  # noqa: F401  (fixture: a kernelspec for this interpreter, in a tmp path)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

# data.min_steps_per_epoch=0 as make_config has it: a sweep started by the CLI and resumed in-process has one config
BASE = ("data.batch_size=16", "train.max_epochs=2", "train.warmup_epochs=0", "train.np=-2",
        "mlflow.experiment=tune", "tune.startup_trials=2", "tune.warmup_epochs=1", "data.min_steps_per_epoch=0")

# Trials 0 and 1 learn (2 complete before the pruner may act); trial 2 diverges at step 2 (the pipeline's non-finite
# stop: a failed trial); trial 3 is hopeless (Adam at lr 1: every step moves each weight by about 1, the val_loss
# goes far above ln 10 and stays finite): at the end of epoch 1 (the first the pruner judges) it is above the
# median of trials 0 and 1, so the median pruner must stop it there, on both ranks, one epoch before its last.
FORCED = """
params:
  model.lr: {type: float, low: 1.0e-4, high: 1.0, log: true}
  model.optimizer: {type: categorical, choices: [sgd, adam]}
  data.batch_size: {type: categorical, choices: [16, 32]}
  debug.nan_at_step: {type: categorical, choices: [null, 2]}
fixed:
  train.max_epochs: 3
enqueue:
  - {model.lr: 0.001, model.optimizer: adam, data.batch_size: 16, debug.nan_at_step: null}
  - {model.lr: 0.001, model.optimizer: adam, data.batch_size: 32, debug.nan_at_step: null}
  - {model.lr: 0.001, model.optimizer: adam, data.batch_size: 16, debug.nan_at_step: 2}
  - {model.lr: 1.0, model.optimizer: adam, data.batch_size: 16, debug.nan_at_step: null}
"""


def _overrides(tmp_path, table, *extra):
    return [f"delta.table={table}", f"data.cache_dir={tmp_path}/petastorm_cache",
            f"train.checkpoint_dir={tmp_path}/checkpoints", f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
            f"mlflow.artifact_location={tmp_path}/mlartifacts", *BASE, *extra]


def _children(client, parent_run_id):
    exp = client.get_experiment_by_name("tune")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'")
    return {int(r.data.tags["optuna.trial"]): r for r in runs}


def _study(tmp_path, name):
    import optuna

    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/optuna.db")


def test_sweep_two_ranks_prune_fail_best_registered(spark, digits_table, tmp_path):
    from optuna.trial import TrialState

    from pipeline.distributed.rank_signals import rank_processes
    from pipeline.tune.sweep import run_tune

    space = tmp_path / "forced.yaml"
    space.write_text(FORCED)
    cfg = make_config(tmp_path, *_overrides(tmp_path, digits_table, "tune.study=forced"))
    t0 = time.monotonic()
    summary = run_tune(spark, cfg, str(space), n_trials=4)
    elapsed = time.monotonic() - t0

    assert summary["study"] == "forced" and summary["trials"] == 4
    assert (summary["complete"], summary["pruned"], summary["failed"]) == (2, 1, 1), summary
    assert summary["conversions"] == 1  # converted once, every trial on the same files (re-planned for batch 32)
    assert summary["best_trial"] in (0, 1) and summary["model_version"] == 1 and summary["champion"] is True
    assert "non-finite training loss at step 2" in summary["failures"]["2"]
    assert rank_processes() == []  # no rank left behind

    study = _study(tmp_path, "forced")
    states = [t.state for t in study.trials]
    assert states == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED]
    # pruned at the first boundary where the median pruner's rule holds (its best value so far above the median of the
    # complete trials at that epoch, from epoch tune.warmup_epochs on): epoch 1 when trials 0 and 1 learned, as they
    # mostly do; a later one when one of them did not (CI saw trial 1 at chance, its median then above trial 3's)
    import statistics

    pruned, complete = study.trials[3], [t for t in study.trials if t.state == TrialState.COMPLETE]
    values = pruned.intermediate_values

    def rule(step):
        best = min(values[s] for s in values if s <= step)
        return step >= 1 and best > statistics.median(t.intermediate_values[step] for t in complete)

    assert max(values) == min(s for s in values if rule(s))

    client = MlflowClient(summary["tracking_uri"])
    parent = client.get_run(summary["parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["best_trial"] == str(summary["best_trial"])
    assert parent.data.params["tune.sampler"] == "tpe" and parent.data.params["study.pruner"].startswith("median")
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    plots = {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
    assert {"space.yaml", "trials.json", "best.json"} <= artifacts
    assert {"plots/optimization_history.png", "plots/param_importances.png"} <= plots

    children = _children(client, parent.info.run_id)
    assert sorted(children) == [0, 1, 2, 3]
    assert [children[i].info.status for i in range(4)] == ["FINISHED", "FINISHED", "FAILED", "FINISHED"]
    assert children[3].data.tags["pruned"] == "true" and children[0].data.tags["pruned"] == "false"
    assert "non-finite" in children[2].data.tags["error"]
    # the pruned trial stopped after epoch 1 of 3 on both ranks: two epochs of rows read by each, equal
    r0 = client.get_metric_history(children[3].info.run_id, "rows_read_rank_0")
    r1 = client.get_metric_history(children[3].info.run_id, "rows_read_rank_1")
    assert len(r0) == len(r1) == 2 and [m.value for m in r0] == [m.value for m in r1] and r0[0].value > 0
    assert children[3].data.tags["pruned_at_epoch"] == "1"
    # trial 1 trained on the shared files re-planned for its batch size
    plan_path = client.download_artifacts(children[1].info.run_id, "shard_plan.json", str(tmp_path))
    plan = json.load(open(plan_path))
    assert plan["train"]["batch_size"] == 32 and plan["train"]["steps_per_epoch"] == min(
        plan["train"]["rows_per_rank"]) // 32
    assert children[1].data.params["data.batch_size"] == "32"
    for n, child in children.items():  # the config logged is the user's; the trial's folder is the run's own fact
        assert child.data.params["train.checkpoint_dir"] == f"{tmp_path}/checkpoints"
        assert child.data.tags["checkpoint_dir"].endswith(f"/tune/{summary['study']}/trial-{n}/{child.info.run_id}")

    # only the best trial's model is registered, and the gate made it champion
    versions = client.search_model_versions(f"name='{cfg.mlflow.registered_model}'")
    assert len(versions) == 1
    best_run = children[summary["best_trial"]]
    assert versions[0].run_id == best_run.info.run_id == summary["best_run_id"]
    assert versions[0].tags["optuna.trial"] == str(summary["best_trial"])
    champion = client.get_model_version_by_alias(cfg.mlflow.registered_model, "champion")
    assert str(champion.version) == "1"
    print(f"4-trial sweep with 2 Horovod ranks per trial: {elapsed:.1f} s")


def _descendants(pid):
    try:
        proc = psutil.Process(pid)
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_resume_after_kill_runs_only_missing_trials(spark, digits_table, tmp_path):
    from optuna.trial import TrialState

    from pipeline.tune.study import INTERRUPTED, failure_reason
    from pipeline.tune.sweep import run_tune

    space = tmp_path / "lr.yaml"
    space.write_text("params:\n  model.lr: {type: float, low: 0.01, high: 0.1, log: true}\n")
    # 4 epochs: the sweep is killed after trial 1's first epoch, with 3 more left to see that (a loaded machine's
    # poll can lag by an epoch of the digits; with 2 epochs the trial could end before the kill)
    overrides = _overrides(tmp_path, digits_table, "tune.study=resumable", "tune.sampler=random",
                           "tune.pruner=none", "tune.heartbeat_s=1", "train.max_epochs=4")
    log_path = tmp_path / "sweep.log"
    with open(log_path, "wb") as log_fh:
        proc = subprocess.Popen(cli("tune", "--conf", str(ROOT / "conf/local.yaml"), "--space", str(space),
                                    "--trials", "3", *overrides),
                                cwd=tmp_path, stdout=log_fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "LAKEHOUSE_PROGRESS": "0"})
    try:
        deadline = time.monotonic() + 400
        while True:  # kill it while trial 1 (the second) is training: once its first epoch ended
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            if "trial 2/3 (#1) starts" in log_path.read_text() and \
                    list((tmp_path / "checkpoints").glob("tune/resumable/trial-1/*/*.ckpt")):
                break
            time.sleep(0.5)
    finally:
        victims = _descendants(proc.pid)
        for p in victims:  # the machine dies: driver, launcher and ranks at once
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        proc.wait(timeout=30)
        psutil.wait_procs(victims, timeout=30)
    study = _study(tmp_path, "resumable")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.RUNNING]
    time.sleep(3 * 1 + 1.5)  # the killed sweep's last heartbeat is now older than the grace period (3 x 1 s)

    cfg = make_config(tmp_path, *overrides)
    summary = run_tune(spark, cfg, resume="resumable")

    study = _study(tmp_path, "resumable")
    assert [t.number for t in study.trials] == [0, 1, 2]  # 3 asked, 3 in all: only trial 2 ran now
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert failure_reason(study.trials[1]) == INTERRUPTED == summary["failures"]["1"]
    assert summary["trials"] == 3 and summary["complete"] == 2 and summary["failed"] == 1
    assert summary["model_version"] == 1
    client = MlflowClient(summary["tracking_uri"])
    children = _children(client, summary["parent_run_id"])  # the same parent run, reopened
    assert sorted(children) == [0, 1, 2]
    assert children[1].info.status == "FAILED" and children[1].data.tags["error"] == INTERRUPTED
    assert children[0].info.status == children[2].info.status == "FINISHED"
    assert client.get_run(summary["parent_run_id"]).info.status == "FINISHED"
    lrs = [t.params["model.lr"] for t in study.trials]
    assert len(set(lrs)) == 3  # the resumed sampler did not replay the first sweep's draws


def test_tune_notebook_runs_a_sweep_and_shows_the_plots(digits_table, tmp_path, monkeypatch, kernel_name):
    import sys

    import nbformat
    from nbclient import NotebookClient

    space = tmp_path / "lr.yaml"
    space.write_text("params:\n  model.lr: {type: float, low: 0.001, high: 0.01, log: true}\n")
    overrides = [o for o in _overrides(tmp_path, digits_table, "train.max_epochs=1") if o != "train.np=-2"]
    monkeypatch.setenv("LAKEHOUSE_CONF", "conf/local.yaml")
    monkeypatch.setenv("LAKEHOUSE_OVERRIDES", " ".join(overrides + ["train.backend=single", "train.np=1",
                                                                   "spark.app_name=lakehouse-tune-notebook"]))
    monkeypatch.setenv("LAKEHOUSE_SPACE", str(space))
    monkeypatch.setenv("LAKEHOUSE_TRIALS", "2")
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    nb = nbformat.read(str(ROOT / "notebooks" / "04_tune.ipynb"), as_version=4)
    client = NotebookClient(nb, kernel_name=kernel_name, timeout=600, startup_timeout=120,
                            resources={"metadata": {"path": str(ROOT / "notebooks")}})
    try:
        client.execute()
    finally:
        nbformat.write(nb, str(tmp_path / "04_tune.ipynb"))
    history = [c for c in nb.cells if "plot_optimization_history" in c.source][0]
    assert any("image/png" in out.get("data", {}) for out in history.outputs), "no optimization history plot"
    importance = [c for c in nb.cells if "plot_param_importances" in c.source][0]
    assert any("image/png" in out.get("data", {}) for out in importance.outputs), "no importance plot"
    mlflow_client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (version,) = mlflow_client.search_model_versions("name='lakehouse_classifier'")
    parent_id = mlflow_client.get_run(version.run_id).data.tags["mlflow.parentRunId"]
    assert sorted(_children(mlflow_client, parent_id)) == [0, 1]
