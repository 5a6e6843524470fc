"""System telemetry of a run: rank 0's machine sampled in the background by MLflow's own system-metrics monitor (CPU,
memory, disk, network and, where NVML sees them, every GPU's utilisation and memory) into the run."""
from __future__ import annotations

import threading
from typing import Optional

from pipeline.log import get_logger

log = get_logger(__name__)

STOP_WAIT_S = 5.0  # how long the end of training waits for the sampler's thread (a hung server must not hold it)


class SystemTelemetry:
    """MLflow's SystemMetricsMonitor on the run `run_id`, sampling every `interval_s` seconds on its own daemon thread
    (never on the training thread), series named `system/<metric>` (`system/gpu_<i>_...` per device). `resume`
    continues the steps of an earlier attempt of the same run (a restart). `stop` is bounded: a sampler stuck in a
    call to an unresponsive server is left behind (a daemon thread), never waited for."""

    def __init__(self, tracking_uri: Optional[str], run_id: str, interval_s: float, resume: bool = False,
                 node_id: Optional[str] = None) -> None:
        self.tracking_uri, self.run_id, self.interval_s = tracking_uri, run_id, float(interval_s)
        self.resume, self.node_id = resume, node_id
        self.monitor = None
        self.gpus = 0

    def start(self) -> bool:
        """Start sampling; False (logged) when MLflow's monitor cannot start here, which never stops training."""
        if self.interval_s <= 0:
            return False
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self.monitor = SystemMetricsMonitor(self.run_id, sampling_interval=self.interval_s,
                                                samples_before_logging=1, resume_logging=self.resume,
                                                node_id=self.node_id, tracking_uri=self.tracking_uri)
            self.gpus = sum(getattr(m, "num_gpus", 0) for m in self.monitor.monitors)
            self.monitor.start()
        except Exception as exc:  # psutil missing, the server away at resume: telemetry is never worth a failed run
            log.warning("system metrics not logged for run %s (%s: %s)", self.run_id, type(exc).__name__, exc)
            self.monitor = None
            return False
        log.info("system metrics of this machine every %.3g s into run %s (%s)", self.interval_s, self.run_id,
                 f"{self.gpus} GPU(s) by NVML" if self.gpus else "no GPU seen by NVML: CPU, memory, disk, network")
        return True

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """Stop sampling and send what was sampled; at most `timeout_s` waiting for the sampler's thread."""
        monitor, self.monitor = self.monitor, None
        if monitor is None:
            return
        monitor._shutdown_event.set()
        thread = monitor._process
        if isinstance(thread, threading.Thread):
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("the system-metrics sampler of run %s did not stop within %.0f s (the tracking server "
                            "does not answer); left behind", self.run_id, timeout_s)
                return
        try:
            # what was sampled since the last interval (MLflow's loop drops it when stopped): a run shorter than one
            # interval still gets its point
            leftover = monitor.aggregate_metrics()
            if leftover:
                monitor.publish_metrics(leftover)
            monitor.mlflow_logger.flush()
        except Exception as exc:
            log.warning("last system metrics of run %s not sent (%s: %s)", self.run_id, type(exc).__name__, exc)
