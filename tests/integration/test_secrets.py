"""No secret leaves where it was: a real `lakehouse train` (2 Horovod ranks, Spark, Delta, Petastorm/Arrow, an MLflow
SQLite store) with a secret in `spark.conf`, a password in the `tune.storage` URL, and MLflow credentials, a
secret-named variable and a URL with a password in the environment; none of them is found in any param, tag, artifact
or file the job wrote, nor in its output, while the other keys are still logged; none of the environment's is on the
command line of any of the job's processes while the ranks run (Horovod's launcher put the whole environment there,
which every user of the machine reads), while the ranks still have them, nor is spark.conf's on the command line of
the Spark session's JVM (PySpark's `spark-submit --conf`). The job runs once, for the module's tests."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from mlflow import MlflowClient

from conftest import ROOT, cli

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

SPARK_SECRET = f"SUPERSECRET123-{secrets.token_hex(6)}"
URL_SECRET = "SUPERSECRET789"
# the environment's, unique to this session: another session's job (on old code) must not be what a scan finds
ENV_SECRET = f"SUPERSECRET456-{secrets.token_hex(6)}"
TOKEN_SECRET = f"s3cr3t-{secrets.token_hex(6)}"
DB_SECRET = f"SUPERSECRET012-{secrets.token_hex(6)}"
JOB_ENV = {"MLFLOW_TRACKING_USERNAME": "tester", "MLFLOW_TRACKING_PASSWORD": ENV_SECRET,
           "LAKEHOUSE_TEST_SECRET_TOKEN": TOKEN_SECRET,  # named like a secret: a cloud key every rank may need
           "LAKEHOUSE_TEST_DATABASE_URL": f"postgresql://tester:{DB_SECRET}@db.example.com/x"}  # a URL's password
ENV_SECRETS = (ENV_SECRET, TOKEN_SECRET, DB_SECRET)
SECRETS = (SPARK_SECRET, URL_SECRET, *ENV_SECRETS)
REDACTED = "***redacted***"


def _files_with_secrets(root: Path) -> list:
    """Every file under `root` (binary files too: the SQLite store, checkpoints, Parquet) holding a secret."""
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder) / name
            try:
                data = path.read_bytes()
            except OSError:
                continue
            found += [f"{path}: {s}" for s in SECRETS if s.encode() in data]
    return found


def _watch_processes(stop: threading.Event, seen: SimpleNamespace, root: int) -> None:
    """Until `stop`, every 100 ms: the command line of every process of the job (`root` and its descendants: Horovod's
    middlemen and rank shells live as long as the ranks, the Spark JVM as long as the session), into
    `seen.on_command_line` (pid and program of each that holds one of ENV_SECRETS, or SPARK_SECRET in the JVM's), and
    the environment each Horovod rank process (`python -m horovod.runner.run_task`, once it has its HOROVOD_RANK)
    started with (`seen.ranks`: rank -> the names of JOB_ENV it had with their values), which /proc shows only to its
    own user."""
    import psutil

    while not stop.is_set():
        try:
            procs = psutil.Process(root).children(recursive=True)
        except psutil.Error:
            procs = []
        for proc in procs:
            try:
                argv = [arg.encode() for arg in proc.cmdline()]
            except psutil.Error:
                continue
            # spark.conf's secret is on the job's own command line (and its forks'), as the test gives it: only the
            # command line of the Spark session's JVM, which the job starts, must not hold it
            jvm = b"org.apache.spark.deploy.SparkSubmit" in argv
            seen.spark_jvm = seen.spark_jvm or jvm
            if any(s.encode() in arg for arg in argv for s in (*ENV_SECRETS, *((SPARK_SECRET,) if jvm else ()))):
                seen.on_command_line.add((proc.pid, argv[0].decode(errors="replace") if argv else "?"))
            if b"horovod.runner.run_task" not in argv or proc.pid in seen.rank_pids:
                continue
            try:
                environ = proc.environ()
            except psutil.Error:
                continue
            if "HOROVOD_RANK" in environ:  # the rank itself, not `env` before it ran python
                seen.rank_pids.add(proc.pid)
                seen.ranks.setdefault(int(environ["HOROVOD_RANK"]), set()).update(
                    name for name, value in JOB_ENV.items() if environ.get(name) == value)
        stop.wait(0.1)


@pytest.fixture(scope="module")
def secret_job(digits_table, tmp_path_factory) -> SimpleNamespace:
    """The job (`work`: its folder, `out`: its exit code and output, `summary`), every process watched while it ran
    (`_watch_processes`: `on_command_line`, `ranks`)."""
    work = tmp_path_factory.mktemp("secrets") / "job"
    work.mkdir()
    args = [f"delta.table={digits_table}", f"data.cache_dir={work}/cache", f"train.checkpoint_dir={work}/ckpt",
            f"mlflow.tracking_uri=sqlite:///{work}/mlflow.db", f"mlflow.artifact_location={work}/artifacts",
            f"mlflow.unended_runs={work}/unended.jsonl", "data.batch_size=16", "train.warmup_epochs=0",
            "train.max_epochs=1", "train.np=-2", "train.backend=horovod",
            f"spark.conf.spark.hadoop.fs.s3a.secret.key={SPARK_SECRET}",
            f"tune.storage=postgresql://optuna:{URL_SECRET}@db.example.com:5432/optuna"]
    env = {**os.environ, **JOB_ENV, "LAKEHOUSE_LOG_LEVEL": "DEBUG"}
    seen = SimpleNamespace(on_command_line=set(), ranks={}, rank_pids=set(), spark_jvm=False)
    stop = threading.Event()
    proc = subprocess.Popen(cli("train", "--conf", str(ROOT / "conf/local.yaml"), *args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=work, env=env)
    watcher = threading.Thread(target=_watch_processes, args=(stop, seen, proc.pid), daemon=True)
    watcher.start()
    try:
        stdout, stderr = proc.communicate(timeout=800)
    finally:
        stop.set()
        watcher.join()
        if proc.poll() is None:
            proc.kill()
    out = SimpleNamespace(returncode=proc.returncode, stdout=stdout, stderr=stderr)
    assert out.returncode == 0, out.stderr[-4000:]
    return SimpleNamespace(work=work, out=out, summary=json.loads(out.stdout.strip().splitlines()[-1]),
                           on_command_line=seen.on_command_line, ranks=seen.ranks, spark_jvm=seen.spark_jvm)


def test_no_command_line_holds_a_secret_of_the_environment_and_the_ranks_still_have_them(secret_job):
    """Horovod's Gloo launcher wrote every variable of the driver onto the command line of each rank's shell
    (`env K=V ... python -m horovod.runner.run_task`), for as long as the rank ran; the ranks still inherit them
    (rank 0 needs MLflow's credentials, every rank the cloud keys), and the job trained and registered."""
    assert secret_job.on_command_line == set(), f"secrets on the command line of {sorted(secret_job.on_command_line)}"
    assert secret_job.spark_jvm  # the job's Spark session was started (spark-submit's JVM seen), without the secret
    assert set(secret_job.ranks) == {0, 1}, f"the ranks' processes were not all seen: {secret_job.ranks}"
    assert secret_job.ranks[0] == set(JOB_ENV)  # what rank 0 started with: every one of them
    assert "LAKEHOUSE_TEST_SECRET_TOKEN" in secret_job.ranks[1]
    assert secret_job.summary["model_version"] is not None and "offline_run" not in secret_job.summary


def test_train_logs_no_secret_and_still_logs_the_rest(secret_job, digits_table, tmp_path):
    work, out, summary = secret_job.work, secret_job.out, secret_job.summary
    for secret in SECRETS:
        assert secret not in out.stdout and secret not in out.stderr, secret

    client = MlflowClient(f"sqlite:///{work}/mlflow.db")
    run = client.get_run(summary["run_id"])
    params, tags = run.data.params, run.data.tags
    for secret in SECRETS:
        assert not [k for k, v in {**params, **tags}.items() if secret in k or secret in v], secret
    # the keys are still there, their secrets replaced; every other key logged as it was
    assert f"'spark.hadoop.fs.s3a.secret.key': '{REDACTED}'" in params["spark.conf"]
    assert params["tune.storage"] == "postgresql://optuna:***@db.example.com:5432/optuna"
    assert params["train.np"] == "-2" and params["data.batch_size"] == "16"
    assert params["delta.table"] == str(digits_table) and tags["world_size"] == "2"
    for version in client.search_model_versions(f"name='{summary['model_name']}'"):
        assert not [v for v in version.tags.values() if any(s in v for s in SECRETS)]

    downloaded = tmp_path / "downloaded"
    client.download_artifacts(run.info.run_id, "", str(downloaded))
    config = yaml.safe_load((downloaded / "config.yaml").read_text())
    assert config["spark"]["conf"] == {"spark.hadoop.fs.s3a.secret.key": REDACTED}
    assert config["data"]["batch_size"] == 16 and config["train"]["np"] == -2
    assert {"config.yaml", "ranks.json", "shard_plan.json"} <= {p.name for p in downloaded.iterdir()}
    assert _files_with_secrets(downloaded) == []
    # everything the job wrote: the store, the artifacts (the logged model too), checkpoints, the job folder (rank
    # markers), the data cache
    assert (work / "ckpt" / ".job" / run.info.run_id).is_dir()
    assert _files_with_secrets(work) == []


SESSION = """
import sys
from pipeline.config import load_config
from pipeline.lakehouse.spark import get_spark
cfg = load_config(sys.argv[1], [f"spark.conf.spark.hadoop.fs.s3a.secret.key={sys.argv[2]}",
                                "spark.conf.spark.hadoop.fs.s3a.endpoint=http://127.0.0.1:9"])
spark = get_spark(cfg)
hadoop = spark._jsparkSession.sessionState().newHadoopConf()  # what a query's file system is given
print(hadoop.get("fs.s3a.secret.key") == sys.argv[2], hadoop.get("fs.s3a.endpoint"), flush=True)
sys.stdin.readline()  # the test reads the JVM's command line meanwhile
spark.stop()
"""


def test_the_projects_spark_session_gets_a_storage_secret_after_its_jvm_started(tmp_path):
    """PySpark starts the session's JVM with `spark-submit --conf key=value` for every setting the builder has, a
    command line every user of the machine reads: a `spark.hadoop.*` secret of `spark.conf` is set in the running
    session's Hadoop configuration instead (which queries copy), the other settings as before."""
    import psutil

    secret = f"SUPERSECRET345-{secrets.token_hex(6)}"
    err = open(tmp_path / "session.err", "w+")  # a file, not a pipe: Spark's start may write more than a pipe holds
    proc = subprocess.Popen([sys.executable, "-c", SESSION, str(ROOT / "conf/local.yaml"), secret], cwd=tmp_path,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline()
        assert line.split() == ["True", "http://127.0.0.1:9"], line or (tmp_path / "session.err").read_text()[-3000:]
        lines = []
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                lines.append(" ".join(child.cmdline()))
            except psutil.Error:  # spark-submit's shell wrappers, ended (zombies)
                continue
        jvms = [line for line in lines if "org.apache.spark.deploy.SparkSubmit" in line]
        assert jvms, f"the session's JVM was not found among {lines}"
        for cmdline in jvms:
            assert secret not in cmdline and "fs.s3a.endpoint=http://127.0.0.1:9" in cmdline, cmdline
        proc.communicate("\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        err.close()
    assert proc.returncode == 0
