"""The tracking server going away mid-run: a real loopback `mlflow server` killed (and restarted) by PID while a real
`lakehouse train` runs; the run ends with its true status, every epoch's metrics and the model, or is left in a
folder that `lakehouse sync-run` uploads."""
from __future__ import annotations

import json
import os
import re
import signal
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from conftest import ROOT, cli, free_port, start_mlflow_server, stop_mlflow_server

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

EPOCHS = 6


@pytest.fixture
def table(digits_table, tmp_path) -> Path:
    dst = tmp_path / "table"
    shutil.copytree(digits_table, dst)
    return dst


def _start_train(tmp: Path, table: Path, uri: str, *extra: str) -> subprocess.Popen:
    args = [f"delta.table={table}", f"data.cache_dir={tmp}/cache", f"train.checkpoint_dir={tmp}/ckpt",
            f"mlflow.tracking_uri={uri}", "mlflow.artifact_location=null", f"mlflow.unended_runs={tmp}/unended.jsonl",
            "mlflow.experiment=outage", "mlflow.retries=1", "mlflow.retry_wait_s=0.5", "data.batch_size=16",
            "train.backend=single", "train.np=1", "train.threads_per_rank=1", f"train.max_epochs={EPOCHS}",
            "train.early_stopping.enabled=false", "train.warmup_epochs=0"]
    log = open(tmp / "train.log", "wb")
    return subprocess.Popen(cli("train", "--conf", str(ROOT / "conf/local.yaml"), *args, *extra),
                            stdout=subprocess.PIPE, stderr=log, cwd=tmp, start_new_session=True)


def _log(tmp: Path) -> str:
    path = tmp / "train.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _wait_epoch(proc: subprocess.Popen, tmp: Path, epoch: int, timeout: float = 400) -> None:
    """Until rank 0 has logged the end of `epoch` (its log line)."""
    pattern = re.compile(rf"\bepoch {epoch}: train_loss")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pattern.search(_log(tmp)):
            return
        if proc.poll() is not None:
            pytest.fail(f"training exited ({proc.returncode}) before epoch {epoch}:\n{_log(tmp)[-4000:]}")
        time.sleep(0.3)
    pytest.fail(f"no epoch {epoch} within {timeout} s:\n{_log(tmp)[-4000:]}")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


class _Outage:
    """A loopback `mlflow server` (its own store, a fixed port) and a `lakehouse train` against it; both stopped by
    PID at the end."""

    def __init__(self, tmp: Path, table: Path, *extra: str) -> None:
        self.store = tmp / "server"
        self.store.mkdir()
        self.port = free_port()
        self.server, self.uri = start_mlflow_server(self.store, self.port)
        self.proc = _start_train(tmp, table, self.uri, *extra)

    def restart_server(self) -> None:  # same backend store, same port
        self.server, _ = start_mlflow_server(self.store, self.port)

    def close(self) -> None:
        _kill(self.proc)
        stop_mlflow_server(self.server)


def _finish(proc: subprocess.Popen, timeout: float) -> dict:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        _kill(proc)
    lines = [line for line in out.decode().splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def _check_run(client: MlflowClient, run_id: str) -> None:
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    for metric in ("train_loss", "val_loss", "val_acc"):
        steps = [m.step for m in client.get_metric_history(run_id, metric)]
        assert sorted(steps) == list(range(EPOCHS)), (metric, steps)
    versions = client.search_model_versions("name='lakehouse_classifier'")
    assert [v.run_id for v in versions] == [run_id]
    assert run.data.tags["precision"] and run.data.tags["rank_0_host"]


def test_server_killed_at_epoch_1_and_back_at_epoch_3_loses_nothing(table, tmp_path):
    outage = _Outage(tmp_path, table, "mlflow.reconnect_wait_s=300")
    proc, uri = outage.proc, outage.uri
    try:
        _wait_epoch(proc, tmp_path, 0)
        stop_mlflow_server(outage.server)  # gone during epoch 1
        _wait_epoch(proc, tmp_path, 2)
        outage.restart_server()  # back during epoch 3
        summary = _finish(proc, timeout=600)
        assert proc.returncode == 0, _log(tmp_path)[-4000:]
        assert "buffered" in _log(tmp_path)  # the outage was seen and bridged
        client = MlflowClient(uri)
        _check_run(client, summary["run_id"])
        assert summary["model_version"] == 1 and "offline_run" not in summary
    finally:
        outage.close()


def test_server_that_never_comes_back_leaves_the_run_for_sync_run(table, tmp_path):
    outage = _Outage(tmp_path, table, "mlflow.reconnect_wait_s=3")
    proc, uri = outage.proc, outage.uri
    try:
        _wait_epoch(proc, tmp_path, 0)
        stop_mlflow_server(outage.server)  # gone during epoch 1, for good
        t0 = time.monotonic()
        summary = _finish(proc, timeout=600)
        assert proc.returncode == 3, _log(tmp_path)[-4000:]  # trained, but the run is offline: nothing registered
        assert time.monotonic() - t0 < 400
        folder = Path(summary["offline_run"])
        assert summary["model_version"] is None and folder.is_dir()
        assert (folder / "model" / "network.pt").exists() and (folder / "config.yaml").exists()
        assert (folder / "artifacts" / "plots" / "learning_curves.png").exists()
        assert (folder / "artifacts" / "ranks.json").exists()
        info = json.loads((folder / "run.json").read_text())
        assert info["status"] == "FINISHED" and info["register"] and info["run_id"] == summary["run_id"]
        lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert sorted({m["step"] for m in lines if m["key"] == "val_loss"}) == list(range(EPOCHS))
        assert [m["step"] for m in lines if m["key"] == "val_loss" and m["sent"]] == [0]  # the rest never got there
        # the driver could not end the run: recorded, to be ended FINISHED at the next connection
        journal = [json.loads(line) for line in (tmp_path / "unended.jsonl").read_text().splitlines()]
        assert [(j["run_id"], j["status"]) for j in journal] == [(summary["run_id"], "FINISHED")]

        outage.restart_server()
        out = subprocess.run(cli("sync-run", str(folder)), capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-4000:]
        synced = json.loads(out.stdout.strip().splitlines()[-1])
        assert synced["run_id"] == summary["run_id"] and synced["continued"] and synced["model_version"] == 1
        client = MlflowClient(uri)
        _check_run(client, summary["run_id"])
        for metric in ("val_loss", "train_loss"):  # no epoch twice
            assert len(client.get_metric_history(summary["run_id"], metric)) == EPOCHS
        artifacts = {a.path for a in client.list_artifacts(summary["run_id"], "plots")}
        assert "plots/learning_curves.png" in artifacts
        assert str(client.get_model_version_by_alias("lakehouse_classifier", "champion").version) == "1"
        # uploaded once: a second sync-run refuses, registering nothing twice
        again = subprocess.run(cli("sync-run", str(folder)), capture_output=True, text=True, timeout=300,
                               cwd=tmp_path)
        assert again.returncode == 1 and "uploaded already" in again.stderr
        assert len(client.search_model_versions("name='lakehouse_classifier'")) == 1
    finally:
        outage.close()
