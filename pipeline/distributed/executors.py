"""What the driver knows of the Spark cluster's executors: their addresses, which of them answer now, the rank slots
left on those that do, and the driver's own interface that they reach it on."""
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


def cluster_slots(timeout_s: float = 2.0) -> int:
    """Rank slots left on the cluster for an elastic relaunch (train.min_np): task slots on the executors that answer
    now. Executors that do not are removed from the application first, so no task of the relaunch waits on them."""
    sc = spark_context()
    if sc is None:
        return 0
    executors = _executors(sc)
    conf = sc.getConf()
    task_cpus = max(1, int(float(conf.get("spark.task.cpus", "1"))))
    cores = conf.get("spark.executor.cores", None)
    per = max(1, (int(cores) if cores else sc.defaultParallelism // max(1, len(executors))) // task_cpus)
    live = 0
    for executor_id, host, port in executors:
        if _answers(host, port, timeout_s):
            live += 1
        else:
            log.warning("executor %s on %s:%d does not answer: removed from the application", executor_id, host,
                        port)
            sc._jsc.sc().killExecutor(executor_id)
    return live * per


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
