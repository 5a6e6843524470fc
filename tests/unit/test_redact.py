"""The secrets rule (pipeline/redact.py): which keys are secrets, what of a URL is hidden, and where it is applied
(the config as params and YAML, tune's stored config, what executors and ranks other than 0 get)."""
import os
import sys

import pytest
import yaml

from pipeline.config import load_config
from pipeline.redact import (REDACTED, TRACKING_CREDENTIALS, is_secret_key, redact_url, redact_value, redacted,
                             word_parts)


@pytest.mark.parametrize("key", [
    "spark.conf.spark.hadoop.fs.s3a.secret.key",
    "spark.hadoop.fs.s3a.access.key",
    "fs.azure.account.key.myaccount.dfs.core.windows.net",
    "spark.hadoop.fs.azure.account.oauth2.client.secret",
    "spark.ssl.keyStorePassword",
    "spark.ssl.keyPassword",
    "spark.authenticate.secret",
    "fs.s3a.secretKey",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "DATABRICKS_TOKEN",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_ACCESS_KEY_ID",
    "HOROVOD_SECRET_KEY",
    "api_key", "apiKey", "APIKEY", "x-api-key",
    "db.password", "db.passwd", "my-credentials", "GOOGLE_APPLICATION_CREDENTIALS", "service.credential",
    "fs.s3a.server-side-encryption.key",
])
def test_secret_keys(key):
    assert is_secret_key(key), word_parts(key)


@pytest.mark.parametrize("key", [
    "data.key_column",       # key followed by what it describes
    "data.cache_dir",
    "cache_key",             # a data key, not a credential
    "partition_key", "sort_keys", "primary.key",
    "spark.io.encryption.keySizeBits",
    "spark.ssl.keyStore",     # a path; its password is keyStorePassword (a secret above)
    "monkey", "keyboard.layout", "hotkey", "turkey_count",  # 'key' only inside a word
    "tokenizer.name", "passage.limit", "secretary",           # the words only inside other words
    "mlflow.tracking_uri", "tune.storage", "spark.jars.packages", "train.np", "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME",
])
def test_non_secret_keys_stay(key):
    assert not is_secret_key(key), word_parts(key)


def test_no_key_of_the_config_is_a_secret_by_name():
    """Every key the config defines stays visible in params (none of them is a credential)."""
    cfg = load_config("conf/local.yaml")
    assert [k for k in cfg.flat() if is_secret_key(k)] == []
    assert redacted(cfg.flat()) == cfg.flat()  # nothing to hide in the defaults: unchanged


@pytest.mark.parametrize("url, shown", [
    ("postgresql://optuna:s3cr3t@db.example.com:5432/optuna", "postgresql://optuna:***@db.example.com:5432/optuna"),
    ("mysql+pymysql://u:p%40ss@h/db", "mysql+pymysql://u:***@h/db"),
    ("https://user:pa@ss@host/path", "https://user:***@host/path"),  # the last '@' ends the user-info
    ("https://ghp_TOKEN123@github.com/org/repo.git", "https://***@github.com/org/repo.git"),  # a user alone
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ("sqlite:////abs/path/mlflow.db", "sqlite:////abs/path/mlflow.db"),
    ("databricks://scope:prefix", "databricks://scope:prefix"),
    ("s3://bucket/key/with/@sign", "s3://bucket/key/with/@sign"),  # '@' in the path is not user-info
    ("https://h/p?token=abc&page=2", "https://h/p?token=***&page=2"),
    ("https://a.blob.core.windows.net/c/f?sv=2021&sig=AbC%3D", "https://a.blob.core.windows.net/c/f?sv=2021&sig=***"),
    ("cannot reach http://a:b@h:1/x and https://c:d@e/f", "cannot reach http://a:***@h:1/x and https://c:***@e/f"),
    ("user@example.com is not a URL", "user@example.com is not a URL"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_redact_url_leaves_non_strings():
    assert redact_url(None) is None and redact_url(3) == 3


def test_redacted_nested_and_flat():
    nested = {"spark": {"master": "local[2]", "conf": {"spark.hadoop.fs.s3a.secret.key": "SUPERSECRET",
                                                        "spark.hadoop.fs.s3a.access.key": "AKIA",
                                                        "spark.sql.shuffle.partitions": "8"}},
              "tune": {"storage": "postgresql://optuna:pw@db/optuna", "n_trials": 3},
              "data": {"key_column": "path", "extensions": [".png", "http://u:pw@h/x"]},
              "api": {"token": None, "password": ""}}
    out = redacted(nested)
    assert out["spark"]["conf"] == {"spark.hadoop.fs.s3a.secret.key": REDACTED,
                                    "spark.hadoop.fs.s3a.access.key": REDACTED, "spark.sql.shuffle.partitions": "8"}
    assert out["spark"]["master"] == "local[2]"
    assert out["tune"] == {"storage": "postgresql://optuna:***@db/optuna", "n_trials": 3}
    assert out["data"] == {"key_column": "path", "extensions": [".png", "http://u:***@h/x"]}
    assert out["api"] == {"token": None, "password": ""}  # unset stays visible as unset
    assert nested["spark"]["conf"]["spark.hadoop.fs.s3a.secret.key"] == "SUPERSECRET"  # the input is not changed
    flat = {"spark.conf": nested["spark"]["conf"], "tune.storage": "mysql://a:b@h/d", "credentials": {"x": "y"}}
    out = redacted(flat)
    assert out["spark.conf"]["spark.hadoop.fs.s3a.secret.key"] == REDACTED
    assert out["spark.conf"]["spark.sql.shuffle.partitions"] == "8"
    assert out["tune.storage"] == "mysql://a:***@h/d"
    assert out["credentials"] == REDACTED  # a mapping under a secret key is hidden whole


def test_redact_value():
    assert redact_value("spark.hadoop.fs.s3a.secret.key", "S") == REDACTED
    assert redact_value("spark.sql.shuffle.partitions", "8") == "8"
    assert redact_value("spark.hadoop.fs.s3a.endpoint", "http://u:p@minio:9000") == "http://u:***@minio:9000"


def _secret_config():
    # one spark.conf override: a later `spark.conf.*=` override replaces the whole mapping (config._merge)
    return load_config("conf/local.yaml", ["spark.conf.spark.hadoop.fs.s3a.secret.key=SUPERSECRET123",
                                           "tune.storage=postgresql://optuna:PW789@db.example.com/optuna",
                                           "data.image_size=16"])


def test_config_params_and_yaml_hide_secrets_and_keep_the_rest(tmp_path):
    from pipeline.tracking.lineage import config_params, config_yaml

    cfg = _secret_config()
    assert cfg.spark.conf["spark.hadoop.fs.s3a.secret.key"] == "SUPERSECRET123"
    params = config_params(cfg)
    text = config_yaml(cfg)
    for shown in (repr(params), text):
        assert "SUPERSECRET123" not in shown and "PW789" not in shown
    assert params["spark.conf"]["spark.hadoop.fs.s3a.secret.key"] == REDACTED
    assert params["tune.storage"] == "postgresql://optuna:***@db.example.com/optuna"
    assert params["data.image_size"] == 16 and params["train.np"] == cfg.train.np
    data = yaml.safe_load(text)
    assert data["spark"]["conf"]["spark.hadoop.fs.s3a.secret.key"] == REDACTED
    assert data["data"]["image_size"] == 16
    # the redacted YAML is still a valid config (lakehouse sync-run reloads the offline folder's config.yaml)
    path = tmp_path / "config.yaml"
    path.write_text(text)
    again = load_config(str(path))
    assert again.data.image_size == 16 and again.spark.conf["spark.hadoop.fs.s3a.secret.key"] == REDACTED


def test_tune_stores_the_config_redacted():
    from pipeline.tune.study import comparable_config

    cfg = _secret_config()
    stored = comparable_config(cfg)
    assert "SUPERSECRET123" not in repr(stored)
    assert "data.image_size" in stored and REDACTED in stored["spark.conf"]


def test_executors_get_tracking_credentials_but_no_other_secret(caplog):
    from pipeline.distributed.rank_env import executor_env

    env = {"MLFLOW_TRACKING_URI": "http://h:5000", "MLFLOW_TRACKING_USERNAME": "u",
           "MLFLOW_TRACKING_PASSWORD": "SUPERSECRET456", "MLFLOW_TRACKING_TOKEN": "T",
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "30", "LAKEHOUSE_API_TOKEN": "L", "MLFLOW_MY_SECRET": "M",
           "HOROVOD_SECRET_KEY": "H", "HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "AWS_SECRET_ACCESS_KEY": "A",
           "PYTHONPATH": "/p"}
    with caplog.at_level("INFO"):
        out = executor_env(env)
    assert set(out) == {"MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                        "MLFLOW_TRACKING_TOKEN", "MLFLOW_HTTP_REQUEST_TIMEOUT", "HOROVOD_STALL_CHECK_TIME_SECONDS",
                        "PYTHONPATH"}
    assert "LAKEHOUSE_API_TOKEN" in caplog.text  # withheld names are said ...
    assert "SUPERSECRET456" not in caplog.text and "=L" not in caplog.text  # ... never values


@pytest.mark.parametrize("rank, kept", [(0, True), (1, False)])
def test_ranks_but_zero_drop_the_tracking_credentials(tmp_path, monkeypatch, rank, kept):
    from pipeline.distributed.loop import TrainJob
    from pipeline.distributed.rank_process import rank_record

    for name in TRACKING_CREDENTIALS:
        monkeypatch.setenv(name, "SUPERSECRET456")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://h:5000")
    job = TrainJob(cfg=None, data=None, delta_table="t", delta_version=0, job_dir=str(tmp_path))
    with rank_record(job, rank):
        assert all((name in os.environ) == kept for name in TRACKING_CREDENTIALS)
        # it may hold the credentials (http://user:password@host), and only rank 0 uses MLflow: rank 0 alone keeps it
        assert (os.environ.get("MLFLOW_TRACKING_URI") == "http://h:5000") is kept
    assert (tmp_path / f"rank{rank}.done").exists()


def test_a_rank_error_in_the_job_folder_hides_url_passwords(tmp_path):
    from pipeline.distributed.loop import TrainJob
    from pipeline.distributed.rank_process import rank_record

    job = TrainJob(cfg=None, data=None, delta_table="t", delta_version=0, job_dir=str(tmp_path))
    with pytest.raises(RuntimeError):
        with rank_record(job, 0):
            raise RuntimeError("cannot reach https://user:SUPERSECRET456@tracking.example.com/api")
    text = (tmp_path / "rank0.error").read_text()
    assert "SUPERSECRET456" not in text and "https://user:***@tracking.example.com/api" in text


def test_a_run_left_offline_keeps_no_secret(tmp_path):
    """The offline folder (`record_job`, what `lakehouse sync-run` uploads): config.yaml and run.json redacted, and
    the redacted config.yaml still loads."""
    from types import SimpleNamespace

    from pipeline.tracking.offline import OfflineRun, record_job

    cfg = _secret_config()
    off = OfflineRun(str(tmp_path / "offline_run"))
    run = SimpleNamespace(run_id="r1", experiment_id="1", tracking_uri="https://bob:SUPERSECRET456@mlflow.example.com")
    r0 = SimpleNamespace(metrics={"val_acc": 0.5}, epochs=1, stopped_early=False)
    record_job(off, run, cfg, SimpleNamespace(table="t", version=0), {"train": 8, "val": 2}, {"np": -2}, r0)
    texts = [p.read_text() for p in (tmp_path / "offline_run").rglob("*") if p.is_file()]
    assert texts and not [t for t in texts if any(s in t for s in ("SUPERSECRET123", "SUPERSECRET456", "PW789"))]
    info = off.read()
    assert info["tracking_uri"] == "https://bob:***@mlflow.example.com" and info["tags"] == {"np": "-2"}
    again = load_config(str(tmp_path / "offline_run" / "config.yaml"))
    assert again.tune.storage == "postgresql://optuna:***@db.example.com/optuna" and again.data.image_size == 16


def test_a_log_line_and_its_traceback_hide_url_passwords():
    """The project's log handler (`setup_logging`) writes every line with `redact_url` applied, the traceback too: a
    library's error quotes the URL it failed on, and `log.warning("...: %s", exc)` passes it on."""
    import logging

    from pipeline.log import setup_logging

    setup_logging()
    (handler,) = [h for h in logging.getLogger().handlers if getattr(h, "_lakehouse", False)]
    url = "http://alice:s3cretPW@127.0.0.1:9/api/2.0/mlflow/runs/get"
    try:
        raise ConnectionError(f"API request to {url} failed")
    except ConnectionError as exc:
        record = logging.LogRecord("pipeline.tracking.offline", logging.WARNING, __file__, 1,
                                   "MLflow still unreachable: %s (token %s)", (exc, "https://tok123@host/x"),
                                   exc_info=sys.exc_info())
    assert handler.filter(record)  # the rank field
    line = handler.format(record)
    assert "s3cretPW" not in line and "tok123" not in line, line
    assert "http://alice:***@127.0.0.1:9/api/2.0/mlflow/runs/get" in line and "Traceback" in line
    assert line.count("alice:***@") == 2  # the message and the traceback's last line


def test_mlflows_own_log_lines_and_its_run_url_print_are_kept_from_passwords(tmp_path):
    """MLflow configures its loggers at import with a handler of its own that does not propagate, and its REST client
    prints the tracking URI (credentials and all) to stdout when a run ends: after `setup_logging`, MLflow's lines go
    through the project's redacting handler and the print is off (a fresh process: MLflow imported after it)."""
    import subprocess
    import textwrap

    script = textwrap.dedent("""
        import logging, os
        from pipeline.log import setup_logging
        setup_logging()
        import mlflow
        from mlflow.environment_variables import MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT
        logging.getLogger("mlflow.tracking.fluent").warning("API request to http://u:s3cretPW@h:5000/api failed")
        print("suppressed", MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT.get())
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                          cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "s3cretPW" not in done.stderr + done.stdout
    assert "http://u:***@h:5000/api" in done.stderr and "suppressed True" in done.stdout


def test_an_errors_one_line_keeps_its_type_and_first_line_and_hides_the_password():
    from pipeline.redact import error_line

    exc = ConnectionError("API request to http://alice:s3cretPW@mlflow.example:5000/api failed\nretry 1\nretry 2")
    line = error_line(exc, 500)
    assert line == "ConnectionError: API request to http://alice:***@mlflow.example:5000/api failed", line
    assert error_line(exc, 19) == "ConnectionError: API request to http", error_line(exc, 19)
    assert error_line(ValueError()) == "ValueError: "
    # a cut that falls inside the password: redacted before it is cut
    long = ConnectionError("x" * 460 + " postgresql://optuna:supersecretpassword@db.example/optuna failed")
    assert "supersecret" not in error_line(long, 500) and "supersecret" not in error_line(long, 490)
