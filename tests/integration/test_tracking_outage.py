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


def _logs(tmp: Path) -> str:
    """The tails of rank 0's log and of the server's (when there is one), for a failure's message."""
    server = tmp / "server" / "server.log"
    tail = server.read_text(errors="replace")[-3000:] if server.exists() else "(none)"
    return f"{_log(tmp)[-6000:]}\n--- server.log ---\n{tail}"


def _wait_log(proc: subprocess.Popen, tmp: Path, pattern: str, what: str, timeout: float = 400) -> None:
    """Until rank 0's log matches `pattern` (`what` it shows, for the failure's message)."""
    found = re.compile(pattern)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found.search(_log(tmp)):
            return
        if proc.poll() is not None:
            pytest.fail(f"training exited ({proc.returncode}) before {what}:\n{_logs(tmp)}")
        time.sleep(0.3)
    pytest.fail(f"no {what} within {timeout} s:\n{_logs(tmp)}")


def _wait_epoch(proc: subprocess.Popen, tmp: Path, epoch: int, timeout: float = 400) -> None:
    """Until rank 0 has logged the end of `epoch` (its log line)."""
    _wait_log(proc, tmp, rf"\bepoch {epoch}: train_loss", f"the end of epoch {epoch}", timeout)


def _refuses(port: int, timeout: float = 10) -> bool:
    """Whether 127.0.0.1:`port` refuses connections within `timeout` s (a killed server is really gone)."""
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
        except ConnectionRefusedError:
            return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def _last_epoch(tmp: Path) -> int:
    """The last epoch whose end rank 0 has logged."""
    return max(int(m) for m in re.findall(r"\bepoch (\d+): train_loss", _log(tmp)))


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

    def kill_server(self, tmp: Path) -> int:
        """The server gone at once (SIGKILL to its group: a SIGTERM's graceful stop outlasted two epochs of a
        single-process job on a loaded CI machine) and its port refusing; returns the last epoch rank 0 had logged
        by then, after which the server took nothing."""
        os.killpg(self.server.pid, signal.SIGKILL)
        self.server.wait(timeout=30)
        assert _refuses(self.port), f"port {self.port} still takes connections after the server's group was killed"
        return _last_epoch(tmp)

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
        gone_after = outage.kill_server(tmp_path)  # gone during epoch 1, then two epoch ends with no server
        assert gone_after + 2 < EPOCHS - 1, f"the server went away only after epoch {gone_after}"
        _wait_epoch(proc, tmp_path, gone_after + 2)
        # the outage seen by rank 0 (an epoch's metrics refused) before the server is back: a fresh-clone CI once
        # finished this job with no such warning (not reproduced since); this wait names what the log showed instead
        _wait_log(proc, tmp_path, r"MLflow did not take epoch\(s\)", "rank 0 seeing the outage")
        outage.restart_server()  # back before the last epoch
        summary = _finish(proc, timeout=600)
        assert proc.returncode == 0, _log(tmp_path)[-4000:]
        assert "buffered" in _log(tmp_path)  # the outage was seen and bridged
        client = MlflowClient(uri)
        _check_run(client, summary["run_id"])
        assert summary["model_version"] == 1 and "offline_run" not in summary
    finally:
        outage.close()


def _sync_and_check(folder, cwd, uri: str, run_id: str, metrics) -> MlflowClient:
    """`lakehouse sync-run <folder>` against the server back: the same run continued, version 1, each of `metrics`
    once per epoch; returns the client that checked it."""
    out = subprocess.run(cli("sync-run", str(folder)), capture_output=True, text=True, timeout=300, cwd=cwd)
    assert out.returncode == 0, out.stderr[-4000:]
    synced = json.loads(out.stdout.strip().splitlines()[-1])
    assert synced["run_id"] == run_id and synced["continued"] and synced["model_version"] == 1
    client = MlflowClient(uri)
    _check_run(client, run_id)
    for metric in metrics:  # every epoch, once
        assert len(client.get_metric_history(run_id, metric)) == EPOCHS, metric
    return client


def test_server_that_never_comes_back_leaves_the_run_for_sync_run(table, tmp_path):
    outage = _Outage(tmp_path, table, "mlflow.reconnect_wait_s=3")
    proc, uri = outage.proc, outage.uri
    try:
        _wait_epoch(proc, tmp_path, 0)
        gone_after = outage.kill_server(tmp_path)  # gone during epoch 1, for good
        assert gone_after < EPOCHS - 1, f"the server went away only after epoch {gone_after}"
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
        sent = [m["step"] for m in lines if m["key"] == "val_loss" and m["sent"]]
        assert sent == list(range(len(sent))) and len(sent) <= gone_after + 1  # the rest never got there
        # the driver could not end the run: recorded, to be ended FINISHED at the next connection
        journal = [json.loads(line) for line in (tmp_path / "unended.jsonl").read_text().splitlines()]
        assert [(j["run_id"], j["status"]) for j in journal] == [(summary["run_id"], "FINISHED")]

        outage.restart_server()
        client = _sync_and_check(folder, tmp_path, uri, summary["run_id"], ("val_loss", "train_loss"))
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


class _Silent:
    """A tracking server that accepts connections and never answers: a TCP socket on 127.0.0.1:`port` whose
    connections are held open, unread (a hung server, a proxy whose backend is gone)."""

    def __init__(self, port: int) -> None:
        import socket
        import threading

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.connections: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        import socket

        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.connections.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for conn in self.connections:
            conn.close()
        self.sock.close()


def test_rank_zero_never_waits_on_a_server_that_accepts_and_never_answers(tmp_path, monkeypatch):
    """A real MlflowClient and MLflow's own asynchronous logging against a server that never answers: the epoch
    ends cost nothing, the end waits at most one call's bound, and every epoch is kept."""
    from pipeline.tracking.rank_zero import RankZeroTracker
    from pipeline.tracking.sending import http_call_bound_s

    for key, value in {"MLFLOW_HTTP_REQUEST_TIMEOUT": "2", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
                       "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0"}.items():
        monkeypatch.setenv(key, value)
    bound = http_call_bound_s()
    assert bound == 2 * 2 + 1 + 1
    silent = _Silent(free_port())
    try:
        tracker = RankZeroTracker(f"http://127.0.0.1:{silent.sock.getsockname()[1]}", "a" * 32,
                                  local_dir=str(tmp_path))
        t0 = time.monotonic()
        tracker.record_precision("32-true")
        for step in range(4):
            tracker.log_epoch({"train_loss": 1.0 / (step + 1), "val_acc": 0.2 * step}, step)
        assert time.monotonic() - t0 < 4.0  # one synchronous call is 2 x 2 s + backoff; all five, 25 s and more
        deadline = time.monotonic() + 10
        while not silent.connections and time.monotonic() < deadline:  # the batch really went out
            time.sleep(0.05)
        assert silent.connections
        t0 = time.monotonic()
        tracker.close()
        assert time.monotonic() - t0 < bound + 5  # one call's bound (6 s), not two
        lines = [json.loads(x) for x in (tmp_path / f"unsent_metrics_{'a' * 32}.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == [0, 1, 2, 3] and tracker.sent == set()
        assert [s for s, _ in tracker.pending] == [0, 1, 2, 3]  # finish(): the server waited for, else left offline
    finally:
        silent.close()


def test_two_ranks_finish_while_the_server_accepts_and_never_answers(table, tmp_path, monkeypatch):
    """Issue 25 item 8: rank 0 blocked (retries + 1) x timeout in each epoch end and rank 1 met the stall timeout in
    the next collective. Now: 2 Horovod ranks train every epoch against a server that never answers (one blocked call
    would be 3 x 5 s + backoff > train.stall_timeout_s=15), the run is left offline with every metric, and sync-run
    uploads it. (The HTTP timeout sets how long the job's bounded waits after training take: ~12 of them in all.)"""
    from pipeline.tracking.sending import http_call_bound_s

    timeout_s = 5
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", str(timeout_s))  # inherited by the job and its ranks
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0")
    bound = http_call_bound_s({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout_s),
                               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0"})
    assert bound > 15  # one synchronous call would outlast the stall timeout
    outage = _Outage(tmp_path, table, "train.backend=horovod", "train.np=-2", "train.stall_timeout_s=15",
                     "mlflow.retries=2", "mlflow.reconnect_wait_s=3")
    proc, uri = outage.proc, outage.uri
    silent = None
    try:
        _wait_epoch(proc, tmp_path, 0)
        gone_after = outage.kill_server(tmp_path)
        silent = _Silent(outage.port)  # the same address now accepts and never answers
        assert gone_after < EPOCHS - 1, f"the server went away only after epoch {gone_after}"
        t0 = time.monotonic()
        summary = _finish(proc, timeout=600)
        took = time.monotonic() - t0
        log = _log(tmp_path)
        assert proc.returncode == 3, log[-4000:]  # every epoch trained; the run offline, nothing registered
        assert silent.connections and "within train.stall_timeout_s" not in log
        assert re.search(r"metrics \(\d+ value\(s\) the server never took\)", log)  # the count, named
        assert summary["epochs"] == EPOCHS and summary["model_version"] is None
        folder = Path(summary["offline_run"])
        lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert sorted({m["step"] for m in lines if m["key"] == "val_loss"}) == list(range(EPOCHS))
        assert {m["step"] for m in lines if m["sent"]} <= set(range(gone_after + 1))  # nothing after it hung was taken
        info = json.loads((folder / "run.json").read_text())
        left = int(info["tags"]["lakehouse.metrics_left_offline"])
        assert left >= (EPOCHS - 1 - gone_after) * 4  # named, in the run's tags
        # the training thread never waited on the server: from one epoch end to the next, no more than the epoch
        # itself and its end's own work (checkpoint, collectives: a few seconds on a loaded machine), less than one
        # blocked synchronous call (3 x 5 s + backoff) would add
        ends = {m["step"]: m["timestamp"] for m in lines if m["key"] == "val_loss"}
        took_epoch = {m["step"]: m["value"] for m in lines if m["key"] == "epoch_time_s"}
        for step in range(1, EPOCHS):
            overhead = (ends[step] - ends[step - 1]) / 1000 - took_epoch[step]
            assert overhead < 12, (step, overhead)
        # after the last epoch: rank 0's bounded flush, its probe, the driver's bounded end of the run
        assert took < 300, took
        silent.close()
        silent = None
        outage.restart_server()
        _sync_and_check(folder, tmp_path, uri, summary["run_id"], ("val_loss", "train_loss", "rows_read_rank_1"))
    finally:
        if silent is not None:
            silent.close()
        outage.close()
