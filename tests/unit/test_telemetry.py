"""Telemetry: MLflow's system-metrics sampler into a real run (SQLite store), a bounded stop beside a server that never
answers, and the per-rank resource fields gathered at an epoch end."""
import socket
import threading
import time

import pytest
import torch
from mlflow.tracking import MlflowClient

from pipeline.distributed.telemetry import FIELDS, RankResources, peak_rss_mb
from pipeline.tracking.telemetry import SystemTelemetry


def _wait_points(client, run_id, n, key="system/cpu_utilization_percentage", timeout=30.0):
    """Until the run holds `n` points of `key` (a sampler descheduled on a loaded machine samples late, not never)."""
    deadline = time.monotonic() + timeout
    while len(client.get_metric_history(run_id, key)) < n and time.monotonic() < deadline:
        time.sleep(0.1)


def test_system_metrics_sampled_into_the_run_off_the_calling_thread(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("telemetry"))
    telemetry = SystemTelemetry(uri, run.info.run_id, interval_s=0.3)
    assert telemetry.start()
    assert telemetry.monitor._process.name == "SystemMetricsMonitor" and telemetry.monitor._process.daemon
    _wait_points(client, run.info.run_id, 2)
    _wait_points(client, run.info.run_id, 2, "system/system_memory_usage_megabytes")
    telemetry.stop()
    for key in ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"):
        history = client.get_metric_history(run.info.run_id, key)
        assert len(history) >= 2, key  # a series, one point per interval
        assert [m.step for m in history] == list(range(len(history)))
    memory = client.get_metric_history(run.info.run_id, "system/system_memory_usage_megabytes")
    assert all(m.value > 0 for m in memory)


def test_restart_resumes_the_steps_of_the_same_run(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("telemetry")).info.run_id
    for resume in (False, True):  # the first attempt, then a restart of the same run
        telemetry = SystemTelemetry(uri, run_id, interval_s=0.3, resume=resume)
        telemetry.start()
        _wait_points(client, run_id, 4 if resume else 2)
        telemetry.stop()
    steps = [m.step for m in client.get_metric_history(run_id, "system/cpu_utilization_percentage")]
    assert len(steps) == len(set(steps)) >= 4  # the second attempt did not log over the first one's steps


def test_stop_is_bounded_when_the_server_never_answers():
    """A tracking server that accepts connections and never answers: the sampler blocks in its call, and stop returns
    within its bound instead of waiting for MLflow's retries."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held = []
    stop_accepting = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop_accepting.is_set():
            try:
                held.append(listener.accept()[0])
            except socket.timeout:
                pass

    threading.Thread(target=accept, daemon=True).start()
    try:
        telemetry = SystemTelemetry(f"http://127.0.0.1:{listener.getsockname()[1]}", "0" * 32, interval_s=0.2)
        assert telemetry.start()
        time.sleep(0.8)  # the sampler is now inside get_run, waiting on the silent server
        t0 = time.perf_counter()
        telemetry.stop(timeout_s=1.0)
        assert time.perf_counter() - t0 < 10.0  # MLflow's own retries would take minutes
    finally:
        stop_accepting.set()
        for conn in held:
            conn.close()
        listener.close()


def test_off_when_the_interval_is_zero(tmp_path):
    assert not SystemTelemetry(f"sqlite:///{tmp_path}/m.db", "0" * 32, interval_s=0).start()


class _Strategy:
    """One process's strategy: all_gather of a tensor is the tensor (what Lightning's single-device strategy does)."""
    root_device = torch.device("cpu")

    @staticmethod
    def all_gather(t):
        return t


class _Trainer:
    strategy = _Strategy()


def test_rank_resources_on_cpu_report_host_and_process_memory_but_no_gpu_fields():
    res = RankResources()
    res.on_train_epoch_start(_Trainer(), None)
    _ = [x * x for x in range(200_000)]  # some CPU time in the epoch
    metrics = res.epoch_metrics(_Trainer())
    assert set(metrics) == {f"{f}_rank_0" for f in FIELDS[:3]}
    assert 0.0 <= metrics["host_cpu_percent_rank_0"] <= 100.0
    assert metrics["peak_rss_mb_rank_0"] == pytest.approx(peak_rss_mb(), rel=0.05) and metrics["peak_rss_mb_rank_0"] > 10
    assert metrics["host_memory_used_mb_rank_0"] > metrics["peak_rss_mb_rank_0"] * 0.5


def test_rank_resources_name_every_rank_of_a_gather():
    class TwoRanks(_Strategy):
        @staticmethod
        def all_gather(t):
            return torch.stack([t, t + 1])

    class Trainer:
        strategy = TwoRanks()

    metrics = RankResources().epoch_metrics(Trainer())
    assert metrics["peak_rss_mb_rank_1"] == pytest.approx(metrics["peak_rss_mb_rank_0"] + 1)
    assert len(metrics) == 6


def test_a_run_shorter_than_one_interval_still_gets_its_sample(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("telemetry")).info.run_id
    telemetry = SystemTelemetry(uri, run_id, interval_s=30)
    telemetry.start()
    time.sleep(0.5)  # the first sample is taken at the start; the interval never ends
    telemetry.stop()
    assert len(client.get_metric_history(run_id, "system/cpu_utilization_percentage")) == 1
