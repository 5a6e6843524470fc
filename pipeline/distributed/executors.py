"""What the driver knows of the Spark cluster's executors: their addresses, which of them answer now, the rank slots
left on those that do, the driver's own interface that they reach it on, and cancelling the ranks' Spark jobs."""
from __future__ import annotations

import socket
from typing import List, Optional, Sequence

from pipeline.log import get_logger

log = get_logger(__name__)


def spark_context():
    from pyspark import SparkContext

    return SparkContext._active_spark_context


def _executors(sc) -> List[tuple]:
    """(id, host, block manager port) of each executor the driver knows of (the lost ones too, until Spark's own
    timeouts remove them)."""
    keys = sc._jsc.sc().env().blockManager().master().getMemoryStatus().keys().iterator()
    found = []
    while keys.hasNext():
        bm = keys.next()
        if bm.executorId() != "driver":
            found.append((bm.executorId(), bm.host(), bm.port()))
    return found


def _answers(host: str, port: int, timeout_s: float) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def executor_addresses() -> List[str]:
    """host:port of the block manager of each executor the driver knows of now ([] without a Spark context)."""
    sc = spark_context()
    try:
        return [f"{host}:{port}" for _, host, port in _executors(sc)] if sc is not None else []
    except Exception:  # the context stopping
        return []


def unanswering_executors(timeout_s: float = 2.0, known: Sequence[str] = ()) -> List[str]:
    """The executors (host:port of their block managers) that do not accept a connection now: a host lost, its link
    cut, its machine stopped. Spark itself learns it only after `spark.network.timeout` (120 s by default). `known`:
    executors seen earlier, checked too: a standalone master may have dropped a lost host's executor from the list
    already (its worker silent for `spark.worker.timeout`, 60 s)."""
    wanted = list(dict.fromkeys([*known, *executor_addresses()]))
    return [a for a in wanted if not _answers(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1]), timeout_s)]


def _number(conf, key: str) -> Optional[float]:
    """Spark setting `key` as a number; None when it is unset or not a number."""
    try:
        value = conf.get(key, None)
        return float(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


def is_local_master(master: str) -> bool:
    """Whether Spark master `master` runs its tasks in the driver's JVM (`local`, `local[4]`, `local[*]`,
    `local[4,2]`); `local-cluster[...]` starts real executors."""
    return master == "local" or master.startswith("local[")


def slots_per_executor(task_cpus: int, cores: Optional[float], gpus: Optional[float],
                       task_gpus: Optional[float]) -> int:
    """The tasks one executor runs at once: its `cores` // `task_cpus`, and where tasks ask for GPUs
    (`spark.task.resource.gpu.amount` = `task_gpus` > 0) no more than its `gpus` // `task_gpus`."""
    per = int(cores or 0) // max(1, task_cpus)
    if task_gpus and task_gpus > 0 and gpus is not None:
        per = min(per, int(gpus // task_gpus))
    return max(0, per)


def cluster_slots(timeout_s: float = 2.0) -> int:
    """Rank slots left on the cluster for an elastic relaunch (train.min_np): task slots on the executors that answer
    now. Executors that do not are removed from the application first, so no task of the relaunch waits on them. On a
    local master (`local[N]`) the driver runs the tasks: its `defaultParallelism` // `spark.task.cpus`. Where tasks ask
    for GPUs (`spark.task.resource.gpu.amount`), an executor's slots are capped by its GPUs
    (`spark.executor.resource.gpu.amount`; the driver's on a local master)."""
    sc = spark_context()
    if sc is None:
        return 0
    conf = sc.getConf()
    task_cpus = max(1, int(_number(conf, "spark.task.cpus") or 1))
    task_gpus = _number(conf, "spark.task.resource.gpu.amount")
    if is_local_master(sc.master):
        return slots_per_executor(task_cpus, sc.defaultParallelism, _number(conf, "spark.driver.resource.gpu.amount"),
                                  task_gpus)
    executors = _executors(sc)
    cores = _number(conf, "spark.executor.cores") or sc.defaultParallelism // max(1, len(executors))
    per = slots_per_executor(task_cpus, cores, _number(conf, "spark.executor.resource.gpu.amount"), task_gpus)
    if not task_gpus:
        per = max(1, per)  # an executor that answers runs at least one task that asks no GPU
    live = 0
    for executor_id, host, port in executors:
        if _answers(host, port, timeout_s):
            live += 1
        else:
            log.warning("executor %s on %s:%d does not answer: removed from the application", executor_id, host,
                        port)
            sc._jsc.sc().killExecutor(executor_id)
    return live * per


def cancel_spark_jobs() -> None:
    """Cancel the Spark jobs running the ranks' tasks (what stops ranks on executors, which are not the driver's
    processes): every job of this application, since Horovod's and TorchDistributor's launches run theirs in job groups
    of their own making. The launch is the only Spark work the driver does while its ranks run. Nothing without a
    Spark context."""
    sc = spark_context()
    if sc is not None:
        sc.cancelAllJobs()


def driver_nics() -> Optional[set]:
    """The driver's network interface that the executors reach it on (the one holding `spark.driver.host`'s address),
    for a Horovod launch of one Spark task: Horovod then takes the common interfaces of that one task alone, loopback
    among them, and its rank would look for the rendezvous server on 127.0.0.1. None: not found (Horovod decides)."""
    import psutil

    sc = spark_context()
    host = sc.getConf().get("spark.driver.host", "") if sc is not None else ""
    try:
        address = socket.gethostbyname(host) if host else ""
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs) and not address.startswith("127."):
            return {name}
    return None
