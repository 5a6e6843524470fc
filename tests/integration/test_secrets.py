"""No secret leaves where it was: a real `lakehouse train` (2 Horovod ranks, Spark, Delta, Petastorm/Arrow, an MLflow
SQLite store) with a secret in `spark.conf`, a password in the `tune.storage` URL and MLflow credentials in the
environment; none of them is found in any param, tag, artifact or file the job wrote, nor in its output, while the
other keys are still logged."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from conftest import ROOT, cli

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

SPARK_SECRET = "SUPERSECRET123"
ENV_SECRET = "SUPERSECRET456"
URL_SECRET = "SUPERSECRET789"
SECRETS = (SPARK_SECRET, ENV_SECRET, URL_SECRET)
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


def test_train_logs_no_secret_and_still_logs_the_rest(digits_table, tmp_path):
    work = tmp_path / "job"
    work.mkdir()
    args = [f"delta.table={digits_table}", f"data.cache_dir={work}/cache", f"train.checkpoint_dir={work}/ckpt",
            f"mlflow.tracking_uri=sqlite:///{work}/mlflow.db", f"mlflow.artifact_location={work}/artifacts",
            f"mlflow.unended_runs={work}/unended.jsonl", "data.batch_size=16", "train.warmup_epochs=0",
            "train.max_epochs=1", "train.np=-2", "train.backend=horovod",
            f"spark.conf.spark.hadoop.fs.s3a.secret.key={SPARK_SECRET}",
            f"tune.storage=postgresql://optuna:{URL_SECRET}@db.example.com:5432/optuna"]
    env = {**os.environ, "MLFLOW_TRACKING_USERNAME": "tester", "MLFLOW_TRACKING_PASSWORD": ENV_SECRET,
           "LAKEHOUSE_LOG_LEVEL": "DEBUG"}
    out = subprocess.run(cli("train", "--conf", str(ROOT / "conf/local.yaml"), *args), capture_output=True,
                         text=True, timeout=800, cwd=work, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
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
