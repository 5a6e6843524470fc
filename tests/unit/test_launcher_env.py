"""The launcher's environment handling: ranks get their settings, the driver gets its environment back, executors
get only what ranks need."""
import os

from pipeline.config import load_config
from pipeline.distributed.rank_env import executor_env, rank_environment


def test_driver_environment_is_restored_after_the_ranks_ran(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.delenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", raising=False)
    cfg = load_config("conf/local.yaml", ["train.np=-2", "train.stall_timeout_s=33"])
    with rank_environment(cfg):
        assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["MKL_NUM_THREADS"] == "1"
        assert os.environ["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "33"
    assert os.environ["OMP_NUM_THREADS"] == "7"
    assert "MKL_NUM_THREADS" not in os.environ and "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" not in os.environ


def test_executors_get_no_credentials_or_notebook_variables():
    env = {"AWS_SECRET_ACCESS_KEY": "s", "DATABRICKS_TOKEN": "t", "HOME": "/root", "MY_VAR": "1",
           "MLFLOW_TRACKING_URI": "http://x", "HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "PYTHONPATH": "/p",
           "LAKEHOUSE_PROGRESS": "0", "NCCL_DEBUG": "INFO"}
    assert set(executor_env(env)) == {"MLFLOW_TRACKING_URI", "HOROVOD_STALL_CHECK_TIME_SECONDS", "PYTHONPATH",
                                      "LAKEHOUSE_PROGRESS", "NCCL_DEBUG"}


def test_only_launches_through_spark_need_the_driver_session():
    from pipeline.distributed.launcher import launch_needs_spark

    def needs(backend, np_):
        return launch_needs_spark(load_config("conf/local.yaml", [f"train.backend={backend}", f"train.np={np_}"]))

    assert not needs("horovod", -2)  # horovod.run starts its ranks itself
    assert not needs("horovod", 1) and not needs("ddp", 1) and not needs("single", 1)  # this process
    assert not needs("ddp", -2) and not needs("fsdp", -2)  # torchrun starts them here, no JVM
    assert needs("horovod", 2) and needs("ddp", 2)  # Spark tasks on a cluster
