"""A standalone Spark cluster on 127.0.0.1 (one master, two 1-core workers): ingest, train and predict through
spark-submit jobs/*.py. One cluster and one ingest (the table's version 0) serve the module's tests; each test trains
with its own cache, checkpoints and MLflow store."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

PYTHON = sys.executable
SPARK_BIN = Path(__import__("pyspark").__file__).parent / "bin"
WORKERS = 2
START_TIMEOUT_S = 180
SUBMIT_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_env(tmp: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env.update({
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": PYTHON,
        "PYSPARK_DRIVER_PYTHON": PYTHON,
        "SPARK_WORKER_DIR": str(tmp / "spark-work"),
        "SPARK_LOG_DIR": str(tmp / "spark-logs"),
        "LAKEHOUSE_PROGRESS": "0",
        "PATH": f"{Path(PYTHON).parent}{os.pathsep}{env.get('PATH', '')}",
    })
    env.pop("SPARK_HOME", None)  # the pyspark wheel's own scripts find their home
    return env


def _group_alive(pgid: int) -> List[int]:
    """PIDs still in process group `pgid`."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            alive.append(int(entry))
    return alive


def _stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the process group `proc` leads (the JVM and any executor/Python child), then SIGKILL."""
    pgid = proc.pid
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if not _group_alive(pgid):
            break
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _group_alive(pgid):
            try:
                proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _master_state(webui_port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{webui_port}/json/", timeout=5) as resp:
        return json.loads(resp.read().decode())


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@contextmanager
def standalone_cluster(tmp: Path) -> Iterator[dict]:
    """Start a master and WORKERS workers (1 core, 2g each) on 127.0.0.1; stop them all by PID afterwards."""
    env = _cluster_env(tmp)
    (tmp / "spark-work").mkdir(parents=True, exist_ok=True)
    logs = tmp / "spark-logs"
    logs.mkdir(parents=True, exist_ok=True)
    port, webui = _free_port(), _free_port()
    url = f"spark://127.0.0.1:{port}"
    spark_class = str(SPARK_BIN / "spark-class")
    procs: List[subprocess.Popen] = []
    log_files = []

    def start(name: str, args: List[str]) -> None:
        fh = open(logs / f"{name}.log", "wb")
        log_files.append(fh)
        procs.append(subprocess.Popen([spark_class, *args], env=env, cwd=str(tmp), stdout=fh,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))

    try:
        start("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                         "--webui-port", str(webui)])
        for i in range(WORKERS):
            start(f"worker{i}", ["org.apache.spark.deploy.worker.Worker", "--cores", "1", "--memory", "2g",
                                 "--host", "127.0.0.1", "--webui-port", str(_free_port()),
                                 "--work-dir", str(tmp / "spark-work" / f"worker{i}"), url])
        deadline = time.monotonic() + START_TIMEOUT_S
        state: dict = {}
        while True:
            dead = [p.args[1] for p in procs if p.poll() is not None]
            if dead:
                pytest.fail(f"{dead} exited while the cluster started; master log:\n{_tail(logs / 'master.log')}")
            try:
                state = _master_state(webui)
            except OSError:
                state = {}
            if state.get("aliveworkers") == WORKERS:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"only {state.get('aliveworkers', 0)} of {WORKERS} workers registered with {url} "
                            f"within {START_TIMEOUT_S} s; worker0 log:\n{_tail(logs / 'worker0.log')}")
            time.sleep(1.0)
        yield {"url": url, "webui": webui, "env": env, "logs": logs, "pids": [p.pid for p in procs]}
    finally:
        for proc in reversed(procs):  # workers first, then the master
            _stop_group(proc)
        for fh in log_files:
            fh.close()
        left = {p.pid: _group_alive(p.pid) for p in procs}
        assert not any(left.values()), f"cluster processes left running: {left}"


def _start_submit(cluster: dict, tmp: Path, script: str, args: List[str], name: str) -> subprocess.Popen:
    """spark-submit jobs/<script> to the cluster in its own process group; its output goes to <logs>/<name>.*"""
    cmd = [str(SPARK_BIN / "spark-submit"), "--master", cluster["url"], "--conf", "spark.executor.cores=1",
           "--conf", "spark.task.cpus=1", "--conf", "spark.executor.memory=1g", "--conf", "spark.ui.enabled=false",
           str(ROOT / "jobs" / script), *args]
    with open(cluster["logs"] / f"{name}.stdout", "wb") as out, open(cluster["logs"] / f"{name}.stderr", "wb") as err:
        return subprocess.Popen(cmd, env=cluster["env"], cwd=str(tmp), stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _finish_submit(cluster: dict, proc: subprocess.Popen, script: str, name: str) -> subprocess.CompletedProcess:
    """Wait for a submitted job (killed with its group past SUBMIT_TIMEOUT_S); it must have exited 0."""
    try:
        proc.wait(timeout=SUBMIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        pytest.fail(f"spark-submit {script} ran past {SUBMIT_TIMEOUT_S} s; stderr tail:\n"
                    f"{_tail(cluster['logs'] / f'{name}.stderr')}")
    finally:
        if _group_alive(proc.pid):
            _stop_group(proc)
    # The Python driver's own log lines come on stdout (spark-submit merges them), Spark's on stderr.
    out = (cluster["logs"] / f"{name}.stdout").read_text(errors="replace")
    err = (cluster["logs"] / f"{name}.stderr").read_text(errors="replace")
    assert proc.returncode == 0, (f"spark-submit {script} exited {proc.returncode}; output tail:\n{out[-6000:]}\n"
                                  f"Spark log tail:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _submit(cluster: dict, tmp: Path, script: str, args: List[str], name: str) -> subprocess.CompletedProcess:
    """spark-submit jobs/<script> to the cluster and wait for it (see _start_submit, _finish_submit)."""
    return _finish_submit(cluster, _start_submit(cluster, tmp, script, args, name), script, name)


def _last_json(stdout: str) -> dict:
    lines = [line for line in stdout.strip().splitlines() if line.strip()]
    assert lines, "no stdout"
    return json.loads(lines[-1])


def _job_settings(tmp: Path, table: Path) -> List[str]:
    """The jobs' config: conf/local.yaml with `table`, and the cache, checkpoints and MLflow store under `tmp`."""
    return ["--conf", str(ROOT / "conf/local.yaml"), f"delta.table={table}", f"data.cache_dir={tmp}/cache",
            f"train.checkpoint_dir={tmp}/checkpoints", f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db",
            f"mlflow.artifact_location={tmp}/mlartifacts"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, digits_dir) -> Iterator[dict]:
    """The module's cluster, with the digits folder ingested through it (spark-submit jobs/ingest.py) into a Delta
    table the tests read at version 0: `table` its path, `ingested` the ingest's summary. Started once (a cluster's
    start and an ingest through it cost ~a minute on 2 cores); stopped by PID after the module's last test, which
    then fails if any of its processes is left."""
    tmp = tmp_path_factory.mktemp("standalone")
    table = tmp / "delta" / "digits"
    with standalone_cluster(tmp / "cluster") as running:
        ingested = _last_json(_submit(running, tmp, "ingest.py",
                                      ["--source", str(digits_dir), "--mode", "overwrite", *_job_settings(tmp, table),
                                       f"spark.master={running['url']}"], "ingest").stdout)
        yield {**running, "table": table, "ingested": ingested}


def test_train_on_standalone_cluster_runs_ranks_in_two_executors_then_predict(tmp_path, cluster):
    from mlflow import MlflowClient

    table = cluster["table"]
    settings = _job_settings(tmp_path, table)
    master = [f"spark.master={cluster['url']}"]
    ingested = cluster["ingested"]
    assert ingested["delta_version"] == 0 and ingested["rows_written"] == 600, ingested

    # 3 epochs without warm-up: a model that beats the gate's chance floor (mlflow.gate_min_lift)
    done = _submit(cluster, tmp_path, "train.py",
                   [*settings, *master, "train.np=2", "train.max_epochs=3", "train.warmup_epochs=0",
                    "data.batch_size=16", "model.lr=0.02"], "train")
    summary = _last_json(done.stdout)
    assert summary["champion"], summary  # the first version: no champion to beat, and better than chance
    # the champion scores the table on the same cluster (spark_udf in the executors): one row per input row
    predicted = _last_json(_submit(cluster, tmp_path, "predict.py",
                                   ["--model", f"models:/{summary['model_name']}@champion",
                                    "--table", str(table), "--version", "0",
                                    "--out", f"{tmp_path}/delta/predictions", *settings, *master],
                                   "predict").stdout)

    assert summary["world_size"] == 2, summary
    assert summary["delta_version"] == 0, summary
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(summary["run_id"])
    tags = run.data.tags
    assert tags["rank_0_pid"] != tags["rank_1_pid"], f"both ranks ran in one process: {tags}"
    assert tags["rank_0_host"] and tags["rank_1_host"]
    assert tags.get("delta_version") == "0", tags
    runs = client.search_runs([run.info.experiment_id])
    assert [r.info.run_id for r in runs] == [summary["run_id"]]
    versions = client.search_model_versions(f"name='{summary['model_name']}'")
    assert len(versions) == 1 and versions[0].tags.get("delta_version") == "0", [v.tags for v in versions]
    assert str(versions[0].version) == str(summary["model_version"])

    from deltalake import DeltaTable

    assert (predicted["rows"], predicted["errors"], predicted["input_version"]) == (600, 0, 0), predicted
    assert predicted["model_version"] == str(summary["model_version"]), predicted
    out = DeltaTable(str(tmp_path / "delta" / "predictions"))
    assert out.version() == 0  # one commit
    got = out.to_pyarrow_table(columns=["path", "label", "error", "model_version"]).to_pydict()
    inputs = DeltaTable(str(table)).to_pyarrow_table(columns=["path"]).column("path")
    assert sorted(got["path"]) == sorted(inputs.to_pylist())  # one output row per input row, none twice
    assert all(label is not None for label in got["label"]) and not any(got["error"])
    assert set(got["model_version"]) == {int(summary["model_version"])}


def _rank_processes(cluster: dict) -> Dict[int, "psutil.Process"]:
    """The Horovod rank processes the cluster's executors run (horovod.spark.task), by HOROVOD_RANK."""
    import psutil

    ranks = {}
    for pid in cluster["pids"]:
        try:
            children = psutil.Process(pid).children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for child in children:
            try:
                if "horovod.spark.task" in " ".join(child.cmdline()):
                    ranks[int(child.environ()["HOROVOD_RANK"])] = child
            except (psutil.Error, KeyError, ValueError):
                pass
    return ranks


def test_a_rank_killed_on_the_cluster_is_relaunched_from_the_checkpoint_in_the_same_run(tmp_path, cluster):
    """train.np=2 on the cluster with train.max_restarts=1: rank 1's process (started by a Horovod task in an
    executor) is SIGKILLed once the run has a checkpoint; the launcher stops the ranks and relaunches both on the
    executors from that checkpoint, in the same MLflow run, which ends FINISHED with one restart recorded, every
    epoch's metrics and one model version registered."""
    from mlflow import MlflowClient

    settings = _job_settings(tmp_path, cluster["table"])
    restartable = ["data.reader=arrow", "data.batch_size=16", "train.max_epochs=3", "train.warmup_epochs=0",
                   "train.checkpoint_every_n_steps=2", "train.max_restarts=1", "train.early_stopping.enabled=false"]
    master = [f"spark.master={cluster['url']}"]
    # no rank of an earlier job on the shared cluster is still there to be taken for this job's rank 1
    deadline = time.monotonic() + 60
    while _rank_processes(cluster) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _rank_processes(cluster), "Horovod rank processes of an earlier job still run on the cluster"
    proc = _start_submit(cluster, tmp_path, "train.py", [*settings, *master, "train.np=2", *restartable],
                         "train-restarted")
    deadline = time.monotonic() + SUBMIT_TIMEOUT_S
    killed = None
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        ranks = _rank_processes(cluster) if list(tmp_path.glob("checkpoints/*/last.ckpt")) else {}
        if 1 in ranks:
            ranks[1].kill()
            killed = ranks[1].pid
        time.sleep(0.2)
    done = _finish_submit(cluster, proc, "train.py", "train-restarted")
    summary = _last_json(done.stdout)
    assert killed, "no rank 1 process was seen after the first checkpoint"

    assert summary["world_size"] == 2 and summary["epochs"] == 3, summary
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(summary["run_id"])
    assert run.info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "restarts")] == [1]
    # the killed rank wrote nothing; the cause names it beside what the other rank saw
    assert "rank 1: ended without reporting an error" in run.data.tags["restart_1_cause"], run.data.tags
    # every epoch's metrics once: the relaunch went on from the checkpoint, not from the start
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_loss")) == [0, 1, 2]
    assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [summary["run_id"]]
    versions = client.search_model_versions(f"name='{summary['model_name']}'")
    assert len(versions) == 1 and versions[0].run_id == summary["run_id"]
