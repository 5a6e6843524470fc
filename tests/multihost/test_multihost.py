"""The pipeline across three hosts (network namespaces with private disks, tests/multihost/harness.py): ingest, train
with each backend on two worker hosts, predict; a host-private path refused by key; a worker host's link cut and
restored (healed), lost for good, and lost with train.min_np (elastic)."""
from __future__ import annotations

import glob
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import List, Optional

import pytest

from harness import HOSTS, SPARK_BIN, Cluster, can_make_hosts

ROOT = Path(__file__).resolve().parents[2]
WHY_NOT = can_make_hosts()
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.skipif(WHY_NOT is not None, reason=f"no hosts here: {WHY_NOT}")]
SUBMIT_TIMEOUT_S = 420
# what a rank leaves behind, by name: none of it may be on a host's private disk
RANK_FILES = re.compile(r"(\.ckpt|rank\d+\.(started|done|error|class)|\.parquet|mlflow\.db)$")


@pytest.fixture(scope="module")
def cluster():
    made = Cluster(name="lhmt", net=232).up()
    try:
        yield made
    finally:
        left = made.down()
        assert left == [], f"teardown left {left}"


# A host lost: how long the driver's Spark waits on its executor (heartbeats, and the stop at the job's end); 120 s by
# default. The launcher's own bound does not depend on it (the lost-for-good test keeps the default).
LOST_HOST_CONF = ["--conf", "spark.network.timeout=30s", "--conf", "spark.network.timeoutInterval=10s",
                  "--conf", "spark.executor.heartbeatInterval=5s"]


def submit(cluster: Cluster, script: str, args: List[str], name: str, timeout: float = SUBMIT_TIMEOUT_S,
           spark_conf: List[str] = ()):
    """spark-submit jobs/<script> from the driver host; its output kept in the cluster's logs folder."""
    cmd = [str(SPARK_BIN / "spark-submit"), "--master", cluster.spark_url, "--conf", "spark.executor.cores=1",
           "--conf", "spark.task.cpus=1", "--conf", "spark.executor.memory=1g", "--conf", "spark.ui.enabled=false",
           *spark_conf, str(ROOT / "jobs" / script), *args]
    done = cluster.run("drv", cmd, timeout=timeout)
    (cluster.logs / f"{name}.out").write_text(done.stdout + "\n---- stderr\n" + done.stderr)
    return done


def settings(cluster: Cluster, run: str) -> List[str]:
    """conf/local.yaml with everything the ranks share on the cluster storage and MLflow on the driver host."""
    s = cluster.shared
    return ["--conf", str(ROOT / "conf/local.yaml"), f"spark.master={cluster.spark_url}",
            f"spark.shared_paths=[{s}]", f"delta.table={s}/delta/digits", f"data.cache_dir={s}/cache",
            f"train.checkpoint_dir={s}/checkpoints/{run}", f"mlflow.tracking_uri={cluster.mlflow_uri}",
            "mlflow.artifact_location=null", f"mlflow.experiment=multihost-{run}"]


def last_json(text: str) -> dict:
    lines = [line for line in text.strip().splitlines() if line.startswith("{")]
    assert lines, f"no JSON line in:\n{text[-3000:]}"
    return json.loads(lines[-1])


def client(cluster: Cluster):
    """The MLflow server's store, read from outside the hosts (it is on the driver host's private disk)."""
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{cluster.mlflow_db}")


def private_rank_files(cluster: Cluster) -> List[str]:
    """Files a rank writes (checkpoints, markers, converted data, a store) found on any host's private disk (the
    MLflow server's own store on the driver host's is where it belongs)."""
    found = []
    for host in HOSTS:
        for path in glob.glob(str(cluster.private(host) / "**" / "*"), recursive=True):
            if RANK_FILES.search(path) and "spark-work" not in path and path != str(cluster.mlflow_db):
                found.append(path)
    return found


def rank_processes(cluster: Cluster) -> List[str]:
    """Processes on any host still running a rank."""
    from harness import _netns_pids

    left = []
    for host in HOSTS:
        for pid in _netns_pids(cluster.ns(host)):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
            except OSError:
                continue
            if "horovod.spark.task" in argv or "torch.distributed.run" in argv or "pipeline" in argv:
                left.append(f"{host}: {pid} {argv[:120]}")
    return left


def cut_after_first_checkpoint(cluster: Cluster, host: str, ckpts: Path,
                               restore_after: Optional[float] = None) -> List[float]:
    """In the background: once a run under `ckpts` has written last.ckpt, cut `host`'s link (and with
    `restore_after`, bring it back that many seconds later); the list gets the time of the cut, then of the restore."""
    cut_at: List[float] = []

    def cutter() -> None:
        deadline = time.monotonic() + SUBMIT_TIMEOUT_S
        while not glob.glob(str(ckpts / "*" / "last.ckpt")) and time.monotonic() < deadline:
            time.sleep(0.2)
        cluster.cut(host)
        cut_at.append(time.monotonic())
        if restore_after is not None:
            time.sleep(restore_after)
            cluster.restore(host)
            cut_at.append(time.monotonic())

    threading.Thread(target=cutter, daemon=True).start()
    return cut_at


def artifact(cluster: Cluster, run_id: str, name: str) -> Path:
    """A run's artifact, in the MLflow server's artifact store on the driver host's private disk."""
    found = glob.glob(str(cluster.private("drv") / "tmp" / "mlflow" / "artifacts" / "**" / run_id / "artifacts" / name),
                      recursive=True)
    assert len(found) == 1, f"{name} of run {run_id}: {found}"
    return Path(found[0])


def weights(cluster: Cluster, run_id: str) -> List[str]:
    """Each rank's final weights digest (ranks.json), in rank order: what a healed run must share with a whole one."""
    return [r["weights_digest"] for r in json.loads(artifact(cluster, run_id, "ranks.json").read_text())]


# The horovod run of the backend test, and the healed run compared with it: the same training (mid-epoch checkpoints,
# the arrow reader, every epoch run), so a relaunch from a checkpoint must end on the very same weights.
TRAIN = ["train.np=2", "train.max_epochs=2", "train.warmup_epochs=0", "data.batch_size=16", "data.reader=arrow",
         "train.checkpoint_every_n_steps=2", "train.early_stopping.enabled=false"]


@pytest.fixture(scope="module")
def table(cluster):
    from pipeline.lakehouse.sample_data import render_digits

    render_digits(str(cluster.shared / "digits"), limit=600)
    done = submit(cluster, "ingest.py", ["--source", str(cluster.shared / "digits"), "--mode", "overwrite",
                                         *settings(cluster, "ingest")], "ingest")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert last_json(done.stdout)["rows_written"] == 600
    return cluster.shared / "delta" / "digits"


@pytest.fixture(scope="module")
def horovod_run(cluster, table):
    """The uninterrupted horovod run (TRAIN) on the two worker hosts."""
    return submit(cluster, "train.py", [*settings(cluster, "horovod"), "train.backend=horovod", *TRAIN],
                  "train-horovod")


def test_horovod_trains_on_two_worker_hosts_registers_and_predicts(cluster, table, horovod_run):
    backend, done = "horovod", horovod_run
    assert done.returncode == 0, f"train exited {done.returncode}:\n{done.stdout[-5000:]}\n{done.stderr[-2000:]}"
    summary = last_json(done.stdout)
    assert summary["world_size"] == 2 and summary["tracking_uri"] == cluster.mlflow_uri, summary

    mlflow = client(cluster)
    run = mlflow.get_run(summary["run_id"])
    assert run.info.status == "FINISHED"
    # ranks tag their host: one on each worker host, none on the driver's
    hosts = {run.data.tags["rank_0_host"], run.data.tags["rank_1_host"]}
    assert hosts == {cluster.ns("w1"), cluster.ns("w2")}, run.data.tags
    versions = mlflow.search_model_versions(f"name='{summary['model_name']}'")
    assert [v.run_id for v in versions if v.run_id == summary["run_id"]] == [summary["run_id"]]
    # everything the driver read back (markers, checkpoints, converted data) was on the cluster storage
    assert list((cluster.shared / "checkpoints" / backend / summary["run_id"]).glob("*.ckpt"))
    assert private_rank_files(cluster) == []

    # the registered version scores the table on the executors
    version = str(summary["model_version"])
    out = submit(cluster, "predict.py", ["--model", f"models:/{summary['model_name']}/{version}", "--table",
                                         str(table), "--version", "0", "--out",
                                         str(cluster.shared / "delta" / "predictions"),
                                         *settings(cluster, "predict")], "predict")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    predicted = last_json(out.stdout)
    assert (predicted["rows"], predicted["errors"]) == (600, 0), predicted


def test_tune_two_ddp_trials_on_two_worker_hosts_registers_the_best(cluster, table):
    """`lakehouse tune`, 2 trials of 1 epoch, each a ddp train of 2 ranks (one on each worker host) in an MLflow child
    run; the best trial's model registered; the study and every file the driver reads on the cluster storage."""
    space = cluster.shared / "tune-space.yaml"
    space.write_text("params:\n  model.lr: {type: float, low: 0.01, high: 0.1, log: true}\n"
                     "fixed:\n  train.max_epochs: 1\n  train.warmup_epochs: 0\n")
    done = submit(cluster, "tune.py", ["--space", str(space), "--trials", "2", *settings(cluster, "tune"),
                                       "train.backend=ddp", "train.np=2", "tune.pruner=none",
                                       f"tune.storage=sqlite:///{cluster.shared}/tune/optuna.db"], "tune")
    assert done.returncode == 0, f"tune exited {done.returncode}:\n{done.stdout[-5000:]}\n{done.stderr[-2000:]}"
    summary = last_json(done.stdout)
    assert (summary["complete"], summary["failed"], summary["pruned"]) == (2, 0, 0), summary
    mlflow = client(cluster)
    runs = mlflow.search_runs([mlflow.get_experiment_by_name("multihost-tune").experiment_id])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == summary["parent_run_id"]]
    assert len(children) == 2 and {r.info.status for r in runs} == {"FINISHED"}, [(r.info.run_id, r.info.status)
                                                                                   for r in runs]
    assert summary["best_run_id"] in {r.info.run_id for r in children}
    versions = mlflow.search_model_versions(f"name='{summary['model_name']}'")
    assert [int(v.version) for v in versions if v.run_id == summary["best_run_id"]] == [summary["model_version"]]
    assert (cluster.shared / "tune" / "optuna.db").exists()
    assert private_rank_files(cluster) == []


def test_a_host_private_path_is_refused_naming_its_key(cluster, table):
    t0 = time.monotonic()
    done = submit(cluster, "train.py", [*settings(cluster, "private"), "train.np=2", "data.cache_dir=/tmp/cache"],
                  "train-private", timeout=180)
    assert done.returncode != 0
    assert "config key 'data.cache_dir' is '/tmp/cache', a path on this host only" in done.stdout + done.stderr
    assert time.monotonic() - t0 < 120  # before any rank or conversion


# A lost host's ranks notice it after Gloo's collective timeout (train.start_timeout_s), which must also cover
# the ranks' start across hosts
COLLECTIVE_TIMEOUT_S = 30

# How long a healed run's worker host is off the network: less than its train.stall_timeout_s
HEAL_STALL_S, HEAL_CUT_S = 20, 12


def test_a_worker_host_cut_and_restored_heals_to_the_uninterrupted_weights(cluster, table, horovod_run):
    """A worker host's link cut after the first checkpoint and restored within train.stall_timeout_s: the run heals
    (within train.max_restarts=1), one MLflow run, FINISHED, every rank on exactly the weights of the uninterrupted
    horovod run of the same training."""
    whole = last_json(horovod_run.stdout)
    ckpts = cluster.shared / "checkpoints" / "healed"
    cut_at = cut_after_first_checkpoint(cluster, "w1", ckpts, restore_after=HEAL_CUT_S)
    try:
        done = submit(cluster, "train.py", [*settings(cluster, "healed"), "train.backend=horovod", *TRAIN,
                                            "train.max_restarts=1", f"train.stall_timeout_s={HEAL_STALL_S}",
                                            "train.start_timeout_s=60"], "train-healed")
    finally:
        cluster.restore("w1")
    output = done.stdout + done.stderr
    assert len(cut_at) == 2, "the link was not cut and restored before the job ended"
    assert done.returncode == 0, output[-6000:]
    healed = last_json(done.stdout)
    mlflow = client(cluster)
    run = mlflow.get_run(healed["run_id"])
    assert run.info.status == "FINISHED"
    assert [r.info.run_id for r in mlflow.search_runs([run.info.experiment_id])] == [healed["run_id"]]
    restarts = [m.value for m in mlflow.get_metric_history(healed["run_id"], "restarts")]
    assert restarts in ([], [1]), restarts  # within train.max_restarts
    digests = weights(cluster, healed["run_id"])
    assert len(digests) == 2 and digests[0] == digests[1] == weights(cluster, whole["run_id"])[0], digests


def test_a_worker_host_lost_for_good_fails_within_a_bound_naming_it(cluster, table):
    """A worker host's link cut after the first checkpoint and never restored: the job fails within the ranks'
    collective timeout plus the launcher's bound (train.stall_timeout_s), naming each rank with its host and the
    executor that no longer answers; the run FAILED, nothing registered, no rank left running.

    The collective timeout seen here is Gloo's (HOROVOD_GLOO_TIMEOUT_SECONDS = train.start_timeout_s: the ranks'
    first error came that long after the cut), not Horovod's stall check, so the bound below is that timeout + the
    launcher's 20 s + 20 s to exit (2 x stall + start). The 30 s start timeout still covers the ranks' start across
    hosts here (a few seconds) and makes the cut noticed sooner, which keeps the suite within its time."""
    stall, start = 20, COLLECTIVE_TIMEOUT_S
    ckpts = cluster.shared / "checkpoints" / "lost"
    cut_at = cut_after_first_checkpoint(cluster, "w1", ckpts)
    try:
        done = submit(cluster, "train.py", [*settings(cluster, "lost"), "train.np=2", "train.max_epochs=6",
                                            "train.warmup_epochs=0", "data.batch_size=16",
                                            "train.checkpoint_every_n_steps=2", "train.early_stopping.enabled=false",
                                            f"train.stall_timeout_s={stall}", f"train.start_timeout_s={start}"],
                      "train-lost")
        ended = time.monotonic()
        assert cut_at, "no checkpoint was written before the job ended"
        output = done.stdout + done.stderr
        assert done.returncode != 0, output[-4000:]
        took = ended - cut_at[0]
        assert took < 2 * stall + start, f"the job took {took:.0f} s after the cut"
        assert cluster.addr("w1") in output and "not answering" in output, output[-4000:]
        assert re.search(rf"rank \d: .*\(on host {cluster.ns('w1')}\)", output), output[-4000:]
        mlflow = client(cluster)
        runs = mlflow.search_runs([mlflow.get_experiment_by_name("multihost-lost").experiment_id])
        assert [r.info.status for r in runs] == ["FAILED"]
        assert not [v for v in mlflow.search_model_versions() if v.run_id == runs[0].info.run_id]
        deadline = time.monotonic() + 30
        while rank_processes(cluster) and time.monotonic() < deadline:
            time.sleep(1)
        assert rank_processes(cluster) == []
    finally:
        cluster.restore("w1")


def test_elastic_a_worker_host_lost_the_run_goes_on_with_the_rank_left(cluster, table):
    """train.min_np=1: the host of one rank cut for good after the first checkpoint; the job goes on from the last
    checkpoint on the one worker host left (the lost executor removed from the application), with the plan re-made
    for one rank (equal steps: a 1-rank plan's steps per epoch), the checkpoint restated for the smaller global
    batch, in the same MLflow run with world_size_used and the cause, and registers the model with its lineage."""
    from pipeline.distributed.checkpoints.record import trained_with
    from pipeline.lakehouse.partition import plan_split

    stall = 20
    ckpts = cluster.shared / "checkpoints" / "elastic"
    cut_at = cut_after_first_checkpoint(cluster, "w2", ckpts)
    try:
        done = submit(cluster, "train.py", [*settings(cluster, "elastic"), "train.np=2", "train.min_np=1",
                                            "train.max_restarts=1", "train.max_epochs=2", "train.warmup_epochs=0",
                                            "data.batch_size=16", "data.min_steps_per_epoch=0", "data.reader=arrow",
                                            "train.checkpoint_every_n_steps=2", "train.early_stopping.enabled=false",
                                            f"train.stall_timeout_s={stall}",
                                            f"train.start_timeout_s={COLLECTIVE_TIMEOUT_S}",
                                            "mlflow.gate_min_lift=null"],
                      "train-elastic", spark_conf=LOST_HOST_CONF)
    finally:
        cluster.restore("w2")
    output = done.stdout + done.stderr
    assert cut_at, "no checkpoint was written before the job ended"
    assert done.returncode == 0, output[-6000:]
    summary = last_json(done.stdout)
    assert (summary["world_size"], summary["world_size_used"], summary["epochs"]) == (2, 1, 2), summary

    mlflow = client(cluster)
    run = mlflow.get_run(summary["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["world_size_used"] == "1"
    assert f"(on host {cluster.ns('w2')})" in run.data.tags["world_size_1_cause"], run.data.tags
    assert [r.info.run_id for r in mlflow.search_runs([run.info.experiment_id])] == [summary["run_id"]]
    # the relaunch's plan is a 1-rank plan: its steps per epoch, recorded in the restated checkpoint it resumed from
    restated = glob.glob(str(ckpts / summary["run_id"] / "last-batch16-np1.ckpt"))
    assert restated, sorted(os.listdir(ckpts / summary["run_id"]))
    record = trained_with(restated[0])
    assert record["world_size"] == 1
    # the run's first plan (2 ranks), as logged: in the server's artifact store on the driver host's disk
    shard_plan = json.loads(artifact(cluster, summary["run_id"], "shard_plan.json").read_text())
    one_rank = plan_split("train", shard_plan["train"]["row_group_rows"], 1, 16)
    assert shard_plan["train"]["world_size"] == 2  # the run's first plan
    assert record["steps_per_epoch"] == one_rank.steps_per_epoch > shard_plan["train"]["steps_per_epoch"], record
    versions = mlflow.search_model_versions(f"name='{summary['model_name']}'")
    mine = [v for v in versions if v.run_id == summary["run_id"]]
    assert len(mine) == 1 and mine[0].tags.get("delta_version") == str(summary["delta_version"])


def test_bench_cross_host_without_a_cluster_says_how_to_start_one(monkeypatch, tmp_path):
    """`lakehouse bench --only cross_host` needs `scripts/multihost.sh up`: without its state it says so."""
    from bench.cross_host import cluster_state
    from pipeline.config import ConfigError

    monkeypatch.setenv("LAKEHOUSE_MH_ROOT", str(tmp_path))
    with pytest.raises(ConfigError, match=r"scripts/multihost.sh up. first .*no cluster state at"):
        cluster_state()
