"""Horovod's Gloo launcher on this machine writes what it hands the ranks onto their command line, which every user of
the machine reads: no secret stands there (rank_env.command_line_env, backends.horovod.secrets_off_the_command_line),
in every local launch (the ranks started early's, each relaunch's), while the ranks still inherit every variable."""
import os

import pytest

from pipeline.distributed.rank_env import command_line_env

SECRET_ENV = {
    "AWS_SECRET_ACCESS_KEY": "aws-secret",  # named like a secret
    "DATABRICKS_TOKEN": "dapi-token",
    "LAKEHOUSE_API_TOKEN": "api-token",
    "AZURE_STORAGE_KEY": "azure-key",
    "MLFLOW_TRACKING_PASSWORD": "mlflow-password",  # MLflow's (pipeline.redact.TRACKING_CREDENTIALS)
    "MLFLOW_TRACKING_USERNAME": "tester",
    "MLFLOW_TRACKING_URI": "https://tester:uri-password@mlflow.example.com",
    "DATABRICKS_HOST": "https://adb-1.azuredatabricks.net",
    "HTTPS_PROXY": "http://proxyuser:proxy-password@proxy.example.com:3128",  # a URL's credentials in the value
    "OPTUNA_STORAGE": "postgresql://optuna:db-password@db:5432/optuna",
    "SIGNED_URL": "https://bucket.example.com/x?sig=signature-value",
}
PUBLIC_ENV = {
    "PATH": "/usr/bin:/bin",
    "PYTHONPATH": "/work/main",
    "HOME": "/home/me",
    "OMP_NUM_THREADS": "1",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
    "LAKEHOUSE_PROGRESS": "0",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "LAKEHOUSE_SPLIT_KEY": "sha256",  # a data key, not a secret (pipeline.redact.DATA_KEY_OWNERS)
    "SPARK_MASTER_URL": "spark://host:7077",  # a URL without credentials
    "LS_COLORS": "rs=0:di=01;34:ln=01;36",
}


# what Horovod adds to the driver's environment for its ranks (horovod.runner.launch: config_parser.set_env_from_args)
HOROVOD_ADDS = {"HOROVOD_CYCLE_TIME": "(None,)", "HOROVOD_CACHE_CAPACITY": "(None,)"}


def test_the_command_line_gets_no_secret_named_variable_no_tracking_credential_and_no_url_credentials():
    public, withheld = command_line_env({**SECRET_ENV, **PUBLIC_ENV}, inherited={})  # nothing inherited
    assert public == PUBLIC_ENV
    assert withheld == sorted(SECRET_ENV)


def test_the_command_line_gets_only_what_the_ranks_do_not_inherit():
    """What the ranks inherit as it is needs no command line: a secret inside another variable's value (which no rule
    on names or URLs finds) stays off it too; a value Horovod changed is written there."""
    driver = {**SECRET_ENV, **PUBLIC_ENV, "PYSPARK_SUBMIT_ARGS": "--conf spark.hadoop.fs.s3a.secret.key=in-a-value"}
    public, withheld = command_line_env({**driver, **HOROVOD_ADDS, "OMP_NUM_THREADS": "4"}, inherited=driver)
    assert public == {**HOROVOD_ADDS, "OMP_NUM_THREADS": "4"}
    assert withheld == sorted(SECRET_ENV)
    # a secret is kept off even where the ranks would not inherit it as it is
    public, withheld = command_line_env({"DATABRICKS_TOKEN": "new-token"}, inherited={"DATABRICKS_TOKEN": "old"})
    assert public == {} and withheld == ["DATABRICKS_TOKEN"]


def test_mlflows_tracking_uri_is_withheld_even_without_credentials():
    """Only rank 0 uses it, which inherits it; a URI's credentials are not judged twice."""
    public, withheld = command_line_env({"MLFLOW_TRACKING_URI": "sqlite:///mlflow.db", "HOME": "/h"}, inherited={})
    assert public == {"HOME": "/h"} and withheld == ["MLFLOW_TRACKING_URI"]


def test_horovods_own_rank_command_holds_no_withheld_value():
    """What Horovod 0.28.1 builds from the public part (horovod.runner.gloo_run._slot_info_to_command_fn)."""
    pytest.importorskip("horovod.runner.gloo_run")  # a venv without Horovod (the vision one)
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.gloo_run import _slot_info_to_command_fn

    public, _ = command_line_env({**SECRET_ENV, **PUBLIC_ENV}, inherited={})
    command = _slot_info_to_command_fn("python -m horovod.runner.run_task 127.0.0.1 1234", public)(
        SlotInfo(hostname="localhost", rank=0, local_rank=0, cross_rank=0, size=2, local_size=2, cross_size=1))
    assert "OMP_NUM_THREADS=1" in command and "HOROVOD_RANK=0" in command
    for name, value in SECRET_ENV.items():
        assert f"{name}=" not in command and value not in command, name


@pytest.fixture
def horovods_gloo_run(monkeypatch):
    """Horovod's launch step that builds the ranks' commands, replaced by one that records the environment it got."""
    pytest.importorskip("horovod.runner.gloo_run")  # a venv without Horovod (the vision one)
    import horovod.runner.launch as horovod_launch

    seen = []

    def gloo_run(settings, nics, env, server_ip, command):
        seen.append(dict(env))

    monkeypatch.setattr(horovod_launch, "gloo_run", gloo_run)
    return seen


def test_inside_the_block_horovods_launch_gets_the_public_part_and_is_as_before_after(horovods_gloo_run,
                                                                                     monkeypatch):
    pytest.importorskip("horovod.runner.gloo_run")  # a venv without Horovod (the vision one)
    import horovod.runner.launch as horovod_launch

    from pipeline.distributed.backends.horovod import secrets_off_the_command_line

    original = horovod_launch.gloo_run
    for name in {**SECRET_ENV, **PUBLIC_ENV, **HOROVOD_ADDS}:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", "/driver/bin")  # the driver's, which the ranks inherit
    with secrets_off_the_command_line():
        horovod_launch.gloo_run(None, {"lo"}, {**SECRET_ENV, **PUBLIC_ENV, **HOROVOD_ADDS}, "127.0.0.1", ["python"])
    assert horovods_gloo_run == [{**PUBLIC_ENV, **HOROVOD_ADDS}]  # none of them the driver's as it is (PATH differs)
    assert horovod_launch.gloo_run is original
    with pytest.raises(RuntimeError), secrets_off_the_command_line():
        raise RuntimeError("the launch failed")
    assert horovod_launch.gloo_run is original


def test_every_local_launch_the_early_ones_and_each_relaunch_keeps_secrets_off(horovods_gloo_run, monkeypatch):
    """`start_local` is how the ranks started early (given a hand-off) and every launch after (given the job, a
    relaunch too) start: horovod.run (here its first steps: the driver's environment and its own settings, handed to
    gloo_run) writes only its own settings onto the command line, none of the driver's secrets."""
    pytest.importorskip("horovod.runner.gloo_run")  # a venv without Horovod (the vision one)
    import horovod
    import horovod.runner.launch as horovod_launch

    from pipeline.config import load_config
    from pipeline.distributed.backends.horovod import HOROVOD
    from pipeline.distributed.early_start import Handoff
    from pipeline.distributed.loop import TrainJob

    def run(fn, args=(), **kwargs):  # horovod.runner.launch._launch_job: os.environ.copy() and its settings
        horovod_launch.gloo_run(None, {"lo"}, {**os.environ, **HOROVOD_ADDS}, "127.0.0.1", ["python"])
        return []

    monkeypatch.setattr(horovod, "run", run)
    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    for name in HOROVOD_ADDS:
        monkeypatch.delenv(name, raising=False)
    cfg = load_config("conf/local.yaml", ["train.np=-2", "train.backend=horovod"])
    job = TrainJob(cfg=cfg, data=None, delta_table="t", delta_version=0)
    handoff = Handoff(path="/nonexistent", key=b"k" * 32, driver_pid=os.getpid())
    for arg in (handoff, job, job):  # started early, then two relaunches
        assert HOROVOD.start_local(cfg, arg) == []
    assert horovods_gloo_run == [HOROVOD_ADDS] * 3  # Horovod's settings; the ranks inherit the rest
