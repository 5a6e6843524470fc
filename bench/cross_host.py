"""Cross-host cost: a 2-rank epoch with one rank on each of two worker hosts / the same epoch with both on 127.0.0.1.

Needs the three-host cluster of `scripts/multihost.sh up` (network namespaces on a private bridge, docs/multi-host.md):
its addresses are read from the harness's `state.json` (`LAKEHOUSE_MH_ROOT`, `LAKEHOUSE_MH_NAME`), and every command
runs on a host through `scripts/multihost.sh exec`. Both runs are the product's `lakehouse train` (jobs/train.py,
spark-submit from the driver host, Horovod ranks as Spark tasks, train.np=2, one core per executor) on the same Delta
table, cache and SQLite store in the cluster's shared folder:

- cross-host: the cluster's master; one executor on each worker host, so every allreduce crosses the bridge;
- loopback: a master and two one-core workers started for the measurement on the driver host's 127.0.0.1 (its own
  loopback: no port taken on the machine's), stopped after it.

An epoch's time is the run's `epoch_time_s` (steps and validation, rank 0), the first epoch left out (warm-up); the
two kinds of run alternate, so drifting load on a shared machine falls on both.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

from bench.core import Result, Sizes, interleaved, median, ratio
from pipeline.config import ConfigError
from pipeline.log import get_logger

log = get_logger(__name__)

ROOT = Path(__file__).resolve().parents[1]  # the checkout: jobs/, conf/, scripts/multihost.sh
LOOPBACK_PORT, LOOPBACK_UI = 7079, 8089
JOB_TIMEOUT_S = 900
START_TIMEOUT_S = 120


def cluster_state() -> Dict[str, Any]:
    """The running multi-host cluster's hosts, master and shared folder (the harness's state.json).

    Raises:
        ConfigError: no cluster is up (with how to start one)."""
    root = Path(os.environ.get("LAKEHOUSE_MH_ROOT", "/var/tmp/lakehouse-multihost"))
    state_file = root / os.environ.get("LAKEHOUSE_MH_NAME", "lhmh") / "state.json"
    script = ROOT / "scripts" / "multihost.sh"
    try:
        state = json.loads(state_file.read_text())
        hosts = state["hosts"]
    except (OSError, ValueError, KeyError):
        raise ConfigError(f"bench cross_host needs the three-host cluster: run `{script} up` first (as root); no "
                          f"cluster state at {state_file}") from None
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    missing = [h["netns"] for h in hosts.values() if h["netns"] not in netns]
    if missing or not state.get("procs"):
        raise ConfigError(f"bench cross_host: the cluster of {state_file} is not up (namespaces missing: "
                          f"{missing or 'none'}, services: {len(state.get('procs', {}))}); run `{script} up`")
    return {**state, "script": str(script)}


def _on_host(state: Dict[str, Any], host: str, argv: List[str], env: Dict[str, str]) -> List[str]:
    return ["bash", state["script"], "exec", host, *(f"{k}={v}" for k, v in env.items()), "--", *argv]


@contextlib.contextmanager
def loopback_cluster(state: Dict[str, Any], logs: Path) -> Iterator[str]:
    """A Spark master and two one-core workers on the driver host's 127.0.0.1 while the block runs; its master URL."""
    import pyspark

    spark_class = str(Path(pyspark.__file__).parent / "bin" / "spark-class")
    url = f"spark://127.0.0.1:{LOOPBACK_PORT}"
    env = {"SPARK_LOCAL_IP": "127.0.0.1"}
    commands = {"master": [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port",
                           str(LOOPBACK_PORT), "--webui-port", str(LOOPBACK_UI)]}
    for i in (1, 2):
        commands[f"worker{i}"] = [spark_class, "org.apache.spark.deploy.worker.Worker", "--cores", "1", "--memory",
                                  "2g", "--host", "127.0.0.1", "--webui-port", str(LOOPBACK_UI + i), "--work-dir",
                                  f"/tmp/loopback-work-{i}", url]
    procs: List[subprocess.Popen] = []
    logs.mkdir(parents=True, exist_ok=True)
    try:
        for name, argv in commands.items():
            with open(logs / f"loopback-{name}.log", "wb") as out:
                procs.append(subprocess.Popen(_on_host(state, "drv", argv, env), stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + START_TIMEOUT_S
        master_log = logs / "loopback-master.log"
        while master_log.read_text(errors="replace").count("Registering worker") < 2:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the loopback cluster did not start within {START_TIMEOUT_S} s; see {logs}")
            time.sleep(1.0)
        yield url
    finally:
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.2)


def _submit(state: Dict[str, Any], master: str, local_ip: str, script: str, args: List[str], log_path: Path) -> dict:
    """spark-submit jobs/<script> from the driver host against `master`; its JSON line."""
    import pyspark

    submit = str(Path(pyspark.__file__).parent / "bin" / "spark-submit")
    argv = [submit, "--master", master, "--conf", "spark.executor.cores=1", "--conf", "spark.task.cpus=1", "--conf",
            "spark.executor.memory=1g", "--conf", "spark.ui.enabled=false", str(ROOT / "jobs" / script), *args]
    done = subprocess.run(_on_host(state, "drv", argv, {"SPARK_LOCAL_IP": local_ip}), capture_output=True,
                          text=True, timeout=JOB_TIMEOUT_S)
    log_path.write_text(done.stdout + "\n---- stderr\n" + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{script} on {master} exited {done.returncode}; output in {log_path}")
    return json.loads(lines[-1])


def _settings(state: Dict[str, Any], folder: Path, master: str) -> List[str]:
    shared = state["shared"]
    return ["--conf", str(ROOT / "conf" / "local.yaml"), f"spark.master={master}", f"spark.shared_paths=[{shared}]",
            f"delta.table={folder}/delta", f"data.cache_dir={folder}/cache",
            f"mlflow.tracking_uri=sqlite:///{folder}/mlflow.db", f"mlflow.artifact_location={folder}/artifacts",
            f"mlflow.unended_runs={folder}/unended.jsonl", "mlflow.experiment=bench-cross-host",
            "mlflow.registered_model=bench_cross_host", "mlflow.promote=false"]


def _epoch_seconds(folder: Path, run_id: str) -> List[float]:
    """A run's epochs' `epoch_time_s`, the first (warm-up) left out."""
    from mlflow import MlflowClient

    history = MlflowClient(f"sqlite:///{folder}/mlflow.db").get_metric_history(run_id, "epoch_time_s")
    return [m.value for m in sorted(history, key=lambda m: m.step)][1:]


def measure_cross_host(sizes: Sizes, quick: bool = False) -> List[Result]:
    """The cross_host_epoch ratio: median epoch time with the 2 ranks on two hosts / on one host's 127.0.0.1."""
    state = cluster_state()
    folder = Path(state["shared"]) / "bench-cross-host"
    logs = folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    pairs, epochs = (1, 3) if quick else (2, 5)
    drv = state["hosts"]["drv"]["address"]
    if not (folder / "delta" / "_delta_log").exists():
        from pipeline.lakehouse.sample_data import render_digits

        render_digits(str(folder / "digits"))  # every image of scikit-learn's digits (1,797)
        _submit(state, state["spark"], drv, "ingest.py", ["--source", str(folder / "digits"), "--mode", "overwrite",
                                                          *_settings(state, folder, state["spark"])],
                logs / "ingest.out")
    train = ["train.np=2", "train.backend=horovod", f"train.max_epochs={epochs}", "train.warmup_epochs=0",
             "train.early_stopping.enabled=false", "data.batch_size=16", "train.threads_per_rank=1"]
    runs: Dict[str, List[Dict[str, Any]]] = {"cross_host": [], "loopback": []}

    with loopback_cluster(state, logs) as loopback:
        def one(kind: str, master: str, local_ip: str) -> float:
            n = len(runs[kind])
            out = _submit(state, master, local_ip, "train.py",
                          [*_settings(state, folder, master), *train,
                           f"train.checkpoint_dir={folder}/checkpoints/{kind}-{n}"], logs / f"train-{kind}-{n}.out")
            seconds = _epoch_seconds(folder, out["run_id"])
            runs[kind].append({"run_id": out["run_id"], "epoch_s": seconds, "world_size": out["world_size"]})
            log.info("cross_host: %s run %d: epochs %s s", kind, n, ", ".join(f"{s:.2f}" for s in seconds))
            return median(seconds)

        across, local = interleaved(lambda: one("cross_host", state["spark"], drv),
                                    lambda: one("loopback", loopback, "127.0.0.1"), pairs)
    per_pair = [ratio(a, b) for a, b in zip(across, local)]  # each pair's run medians
    epoch_across = median([s for r in runs["cross_host"] for s in r["epoch_s"]])  # every epoch of every run
    epoch_local = median([s for r in runs["loopback"] for s in r["epoch_s"]])
    value = ratio(epoch_across, epoch_local)
    log.info("cross_host_epoch: %.3f (epoch %.2f s across hosts, %.2f s on 127.0.0.1)", value, epoch_across,
             epoch_local)
    return [Result("cross_host_epoch", "digits", value,
                   {"epoch_s_cross_host": epoch_across, "epoch_s_loopback": epoch_local, "runs": runs,
                    "epochs_per_run": epochs, "ranks": 2, "batch_per_rank": 16, "backend": "horovod (gloo)",
                    "hosts": {h: v["address"] for h, v in state["hosts"].items()}},
                   pairs, per_pair)]
