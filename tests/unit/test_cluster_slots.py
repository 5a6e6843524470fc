"""The task slots an elastic relaunch (train.min_np) counts: on a local master the driver runs the tasks
(defaultParallelism // spark.task.cpus), on a cluster each executor that answers its cores // spark.task.cpus,
capped by its GPUs where tasks ask for them."""
from types import SimpleNamespace

import pytest

from pipeline.distributed import executors


class _Conf(dict):
    def get(self, key, default=None):
        return super().get(key, default)


class _BlockManagers:
    """What `sc._jsc.sc().env().blockManager().master().getMemoryStatus().keys().iterator()` walks."""

    def __init__(self, ids):
        self._ids = list(ids)

    def hasNext(self):
        return bool(self._ids)

    def next(self):
        executor_id = self._ids.pop(0)
        return SimpleNamespace(executorId=lambda: executor_id, host=lambda: "127.0.0.1", port=lambda: 7000)


def _context(master, parallelism, conf, block_managers=("driver",)):
    status = SimpleNamespace(keys=lambda: SimpleNamespace(iterator=lambda: _BlockManagers(block_managers)))
    jvm = SimpleNamespace(env=lambda: SimpleNamespace(blockManager=lambda: SimpleNamespace(
        master=lambda: SimpleNamespace(getMemoryStatus=lambda: status))))
    return SimpleNamespace(master=master, defaultParallelism=parallelism, getConf=lambda: _Conf(conf),
                           _jsc=SimpleNamespace(sc=lambda: jvm))


@pytest.mark.parametrize("master, parallelism, conf, slots", [
    ("local[4]", 4, {}, 4),
    ("local[*]", 8, {"spark.task.cpus": "2"}, 4),
    ("local", 1, {}, 1),
    ("local[4]", 4, {"spark.task.resource.gpu.amount": "1", "spark.driver.resource.gpu.amount": "2"}, 2),
])
def test_a_local_master_counts_the_driver_s_task_slots(monkeypatch, master, parallelism, conf, slots):
    monkeypatch.setattr(executors, "spark_context", lambda: _context(master, parallelism, conf))
    assert executors.cluster_slots() == slots


def test_executors_that_answer_count_their_cores_capped_by_their_gpus(monkeypatch):
    conf = {"spark.executor.cores": "8", "spark.task.cpus": "2"}
    sc = _context("spark://m:7077", 16, conf, ("driver", "1", "2"))
    monkeypatch.setattr(executors, "spark_context", lambda: sc)
    monkeypatch.setattr(executors, "_answers", lambda host, port, timeout_s: True)
    assert executors.cluster_slots() == 8  # 2 executors x 8 cores // 2 per task
    conf.update({"spark.task.resource.gpu.amount": "1", "spark.executor.resource.gpu.amount": "1"})
    sc = _context("spark://m:7077", 16, conf, ("driver", "1", "2"))
    assert executors.cluster_slots() == 2  # one GPU each


@pytest.mark.parametrize("task_cpus, cores, gpus, task_gpus, slots", [
    (1, 4, None, None, 4), (2, 5, None, None, 2), (1, 8, 2, 1, 2), (1, 8, 2, 0.5, 4), (1, 8, None, 1, 8),
    (1, 8, 0, 1, 0), (3, 2, None, None, 0),
])
def test_slots_per_executor(task_cpus, cores, gpus, task_gpus, slots):
    assert executors.slots_per_executor(task_cpus, cores, gpus, task_gpus) == slots
