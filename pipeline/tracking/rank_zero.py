"""What training rank 0 writes into the driver's MLflow run (per-epoch metrics, plots, the model), or into a local
folder when the server never comes back."""
from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from pipeline.log import get_logger, is_rank_zero
from pipeline.redact import URL_MASK, redact_url
from pipeline.tracking.offline import OfflineRun, offline_folder, server_back
from pipeline.tracking.telemetry import SystemTelemetry

log = get_logger(__name__)

MAX_PENDING_EPOCHS = 10_000  # epochs of metrics held while the server is unreachable; older ones go to a file
SLOW_ANSWER_S = 5.0  # a batch in flight longer than this at an epoch end is warned about


class RankZeroTracker:
    """Logs into an existing run by id; a no-op on any rank but 0 (the one rule: rank 0 alone writes).

    The training thread never waits on the network: epoch metrics and the precision tag go through MLflow's own
    asynchronous logging (`synchronous=False`), and at most one batch of metrics is in flight at a time, so a server
    that accepts connections and never answers holds one of MLflow's worker threads, not the ranks (the other ranks
    would otherwise meet `train.stall_timeout_s` in the next collective). Epochs not yet taken wait in `pending` and
    go with the next batch; at the end `close` waits for them at most one MLflow call's bound
    (pipeline.tracking.sending.http_call_bound_s: `mlflow.retries` and MLFLOW_HTTP_REQUEST_TIMEOUT), and `finish`
    leaves what was never taken in the job's offline folder (`lakehouse sync-run` uploads it).

    A relaunch (a failed rank, an OOM back-off) is a new tracker whose run already has an earlier attempt's epochs:
    those rank 0 held in memory when it died are gone, and the relaunch restores every epoch up to its checkpoint into
    the history it hands `finish`, which sends the restored values of this run's own epochs (not those of a run it
    was resumed from with train.ckpt_restore) that the server does not have.
    """

    def __init__(self, tracking_uri: Optional[str], run_id: str, local_dir: Optional[str] = None) -> None:
        from mlflow.tracking import MlflowClient

        # MLflow, with pipeline.tracking.runs, loads only in rank 0: every rank unpickles this class with its job
        from pipeline.tracking.runs import use_tracking_uri  # local: mlflow, in rank 0 alone

        if tracking_uri:
            use_tracking_uri(tracking_uri)
        self.run_id = run_id
        self.client = MlflowClient(tracking_uri) if tracking_uri else MlflowClient()
        self.pending: List = []  # (step, metrics) not yet accepted by the server, oldest first
        self.local_dir = local_dir
        self.epochs: List = []  # every epoch (step, metrics, timestamp ms): what a run left offline keeps
        self.sent: set = set()  # the steps the server took
        self.offline = None  # an OfflineRun once the server is given up on
        self.tags: Dict[str, str] = {}  # set by rank 0 (kept for a run left offline)
        self.unsent_tags: Dict[str, str] = {}
        self.telemetry: Optional[SystemTelemetry] = None  # rank 0's machine sampled in the background
        self._stamps: Dict[int, int] = {}  # step -> its epoch's timestamp (ms): a value sent twice stays one value
        self._inflight: Optional[Tuple[List, Any]] = None  # (the pending items sent, runs.Sending)
        self._tag_sends: List[Tuple[str, str, Any]] = []  # (key, value, runs.Sending)
        # values of epochs restored from the checkpoint that an earlier attempt got to the server, (step, {key: value},
        # the server's timestamp): a run left offline keeps them as taken
        self._taken_before: List[Tuple[int, Dict[str, float], int]] = []

    def record_precision(self, precision: str) -> None:
        """The precision the ranks resolved (`train.precision=auto` is decided in each rank): the run's tag."""
        self.record_tag("precision", precision)

    def record_tag(self, key: str, value: str) -> None:
        """A fact the ranks resolved (the precision; `data.decode=auto`'s choice as tag `decode`): the run's tag, sent
        in the background (checked in `finish`, sent again there if it did not arrive)."""
        if not is_rank_zero():
            return
        from pipeline.tracking.sending import Sending  # local: mlflow, in rank 0 alone

        self.tags[key] = value
        try:
            sending = Sending(self.client.set_tag(self.run_id, key, value, synchronous=False))
        except Exception as exc:  # kept, and sent with the model (or left offline with it)
            log.warning("MLflow did not take the %s tag (%s: %s)", key, type(exc).__name__, redact_url(str(exc)))
            self.unsent_tags[key] = value
            return
        self._tag_sends.append((key, value, sending))

    def log_epoch(self, metrics: Dict[str, float], step: int) -> None:
        """Queue an epoch's metrics and return at once (the training thread never waits on MLflow). While the
        server is unreachable or slow they wait (oldest first, at most MAX_PENDING_EPOCHS) and go with the next
        batch: one batch in flight at a time."""
        if not is_rank_zero():
            return
        now = int(time.time() * 1000)
        self.pending.append((int(step), dict(metrics)))
        self.epochs.append((int(step), dict(metrics), now))
        self._stamps[int(step)] = now
        if len(self.pending) > MAX_PENDING_EPOCHS:
            dropped = self.pending.pop(0)
            self._keep_locally([dropped])
        self._collect()
        if self._inflight is None:
            self._send()
            self._collect()  # a client that answered at once (a local store, a failure before queueing)
        else:  # no answer yet: a slow store is not worth a warning, a silent server is
            batch, sending = self._inflight
            waited = time.monotonic() - sending.started
            log.log(logging.WARNING if waited >= SLOW_ANSWER_S else logging.DEBUG,
                    "MLflow has not answered for %.0f s (epoch(s) %s in flight); %d epoch(s) buffered, training goes "
                    "on", waited, _steps(batch), len(self.pending))

    def _send(self) -> None:
        """Hand every pending epoch to MLflow's asynchronous logging, as one batch in flight."""
        from pipeline.tracking.sending import Sending, epoch_metrics, send_metrics  # local: mlflow, in rank 0 alone

        if not self.pending:
            return
        batch = list(self.pending)
        try:
            items = [m for step, metrics in batch for m in epoch_metrics(metrics, step, self._stamps.get(step))]
        except ValueError as exc:  # a metric that is not a number: named, and never taken
            self._inflight = (batch, Sending(error=exc))
            return
        self._inflight = (batch, send_metrics(self.client, self.run_id, items))

    def _collect(self) -> Optional[bool]:
        """The answer to the batch in flight, without waiting: True taken (its epochs leave `pending`), False
        refused or failed (they stay, with a warning), None nothing in flight or no answer yet."""
        if self._inflight is None or not self._inflight[1].done():
            return None
        batch, sending = self._inflight
        self._inflight = None
        error = sending.error()
        if error is None:
            self.pending = [p for p in self.pending if not any(p is b for b in batch)]
            self.sent.update(step for step, _ in batch)
            return True
        log.warning("MLflow did not take epoch(s) %s's metrics (%s: %s); %d epoch(s) buffered, sent when it answers "
                    "again", _steps(batch), type(error).__name__, redact_url(str(error)), len(self.pending))
        return False

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Send what waits and wait for the answer, at most `timeout_s` seconds (default: one MLflow call's bound,
        pipeline.tracking.sending.http_call_bound_s); True when the server took everything. False, with a warning naming
        how many metric values it did not take, when it refused them or did not answer in time (they stay pending)."""
        from pipeline.tracking.sending import http_call_bound_s  # local: mlflow, in rank 0 alone

        bound = http_call_bound_s() if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + bound
        tried = False  # a batch sent by this flush failed: the server is away now, no second try
        while True:
            answer = self._collect()
            if answer is False and tried:
                return False
            if not self.pending and self._inflight is None:
                return True
            if self._inflight is None:
                self._send()
                tried = True
                continue
            if not self._inflight[1].wait(deadline - time.monotonic()):
                values = sum(len(metrics) for _, metrics in self.pending)
                log.warning("MLflow did not answer within %.0f s (one call's bound: MLFLOW_HTTP_REQUEST_TIMEOUT=%s s, "
                            "MLFLOW_HTTP_REQUEST_MAX_RETRIES=%s, from 'mlflow.retries'): %d metric value(s) of %d "
                            "epoch(s) of run %s not sent", bound, os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", "120"),
                            os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7"), values, len(self.pending),
                            self.run_id)
                return False

    def _keep_locally(self, items) -> None:
        """Metrics that could not be sent at all go to a local JSON-lines file (named in a warning)."""
        import json

        if not items or not self.local_dir:
            return
        os.makedirs(self.local_dir, exist_ok=True)
        path = os.path.join(self.local_dir, f"unsent_metrics_{self.run_id}.jsonl")
        with open(path, "a") as fh:
            for step, metrics in items:
                fh.write(json.dumps({"run_id": self.run_id, "step": step, "metrics": metrics}) + "\n")
        log.warning("%d epoch(s) of metrics of run %s could not reach MLflow; kept in %s", len(items), self.run_id,
                    path)

    def start_telemetry(self, interval_s: float, resume: bool = False) -> None:
        """Sample this machine (CPU, memory, disk, network, its GPUs) into the run every `interval_s` seconds, on a
        background thread (0: off); `resume`: a relaunch of the same run continues its series' steps."""
        if not is_rank_zero() or interval_s <= 0:
            return
        self.telemetry = SystemTelemetry(self.client.tracking_uri, self.run_id, interval_s, resume=resume)
        self.telemetry.start()

    def stop_telemetry(self) -> None:
        """Stop sampling (bounded: a server that does not answer is not waited for)."""
        telemetry, self.telemetry = self.telemetry, None
        if telemetry is not None:
            telemetry.stop()

    def close(self) -> None:
        """At the end of training: a last try, then whatever is left goes to the local file (and stays pending for
        `finish`, which waits for the server before leaving the run offline)."""
        if self.pending and not self.flush():
            self._keep_locally(self.pending)

    def finish(self, model, job, history: List[Dict[str, float]], result,
               own: Optional[Set[int]] = None) -> Optional[str]:
        """Plots, the per-rank host/pid, the confusion matrix and the servable model; returns the model URI.

        The server unreachable: it is waited for, at most `mlflow.reconnect_wait_s`; if it does not come back, the
        metrics, plots and model go to the job's offline folder (`lakehouse sync-run` uploads it) and None is returned.

        `history` is the run's every epoch (EpochAccounting's, restored from the checkpoint on a relaunch); `own` the
        epochs of it this run trained (EpochAccounting.own_epochs; the rest are the run's it was resumed from, or of
        a checkpoint that does not say). Those this attempt did not report are an earlier attempt's, and their values
        the server does not have (held by a rank 0 that died while the server was away) are sent now, each once
        (`_report_restored`).
        """
        if not is_rank_zero():
            return None
        wait_s, retry_s = job.cfg.mlflow.reconnect_wait_s, job.cfg.mlflow.retry_wait_s
        back = None  # whether the server answered (None: not asked yet)
        restored = [(step, metrics) for step, metrics in self._restored(history) if step in (own or ())]
        if restored:
            back = self._report_restored(restored, wait_s, retry_s)
        if self.pending and (server_back(self.client, self.run_id, wait_s, retry_s) if back is None else back) \
                and self.flush():
            self._drop_local_file()
        if not self.pending:
            for key, value, sending in self._tag_sends:  # a tag that did not arrive (or has no answer yet) again
                if not sending.done() or sending.error() is not None:
                    self.unsent_tags[key] = value
            try:
                for key, value in self.unsent_tags.items():
                    self.client.set_tag(self.run_id, key, value)
                return self._finish_online(model, job, history, result)
            except Exception as exc:
                if server_back(self.client, self.run_id, wait_s, retry_s):
                    raise
                log.warning("MLflow went away while rank 0 logged the model (%s: %s)", type(exc).__name__,
                            redact_url(str(exc)))
        self._go_offline(job)
        return self._finish_offline(model, job, history, result)

    def _restored(self, history: Optional[List[Dict[str, Any]]]) -> List[Tuple[int, Dict[str, Any]]]:
        """The epochs of `history` this attempt did not report through `log_epoch` (an earlier attempt's, restored
        from the checkpoint), as (step, metrics), oldest first."""
        restored: Dict[int, Dict[str, Any]] = {}
        for record in history or []:
            if "epoch" in record and int(record["epoch"]) not in self._stamps:
                restored[int(record["epoch"])] = {k: v for k, v in record.items() if k != "epoch"}
        return sorted(restored.items())

    def _report_restored(self, restored: List[Tuple[int, Dict[str, Any]]], wait_s: float, retry_s: float) -> bool:
        """Queue the values of the `restored` epochs the server does not have; whether it answered.

        The server is asked, by metric and step: it alone knows what an earlier attempt got there (a batch it took
        just before rank 0 died included, and a part of one), and a value logged again (the earlier attempt's
        timestamp is not known) would be a second point of its metric history. A record of the steps taken in the job
        folder would not do: the folder is emptied before every launch (JobFolder.reset), and it cannot know of a batch
        in flight. A server that does not answer within `mlflow.reconnect_wait_s`: none is sent, as which it took is
        not known (the offline folder keeps this attempt's epochs; sync-run would send an earlier attempt's twice).
        """
        steps = _steps([(step, None) for step, _ in restored])
        on_server: Optional[Dict[Tuple[str, int], int]] = None
        if server_back(self.client, self.run_id, wait_s, retry_s):
            try:
                on_server = self._on_server(restored)
            except Exception as exc:
                if server_back(self.client, self.run_id, wait_s, retry_s):
                    raise  # the server answers: a real failure, not its absence
                log.warning("MLflow went away while rank 0 asked which epoch(s) %s restored from the checkpoint run %s "
                            "holds (%s: %s)", steps, self.run_id, type(exc).__name__, redact_url(str(exc)))
        if on_server is None:  # not known which epochs are this run's, nor which the server took: left as they are
            log.warning("MLflow could not be asked which of the %d epoch(s) restored from the checkpoint (%s) run %s "
                        "holds: those an earlier attempt's rank 0 held when it stopped are not sent again",
                        len(restored), steps, self.run_id)
            return False
        now = int(time.time() * 1000)
        queued: List[Tuple[int, Dict[str, Any]]] = []
        held = on_server
        for step, metrics in restored:
            self._stamps[step] = now  # one timestamp for the values of its epoch: a value sent twice stays one value
            missing = {k: v for k, v in metrics.items() if (k, step) not in held}
            self._taken_before += [(step, {k: v}, held[(k, step)]) for k, v in metrics.items() if (k, step) in held]
            if missing:
                queued.append((step, missing))
            else:
                self.sent.add(step)
        self.pending = queued + self.pending  # the oldest first
        self.epochs = [(step, metrics, now) for step, metrics in queued] + self.epochs
        values = sum(len(metrics) for _, metrics in queued)
        if values:
            log.info("of the epoch(s) restored from the checkpoint (%s), run %s lacked %d value(s) of %d epoch(s) (an "
                     "earlier attempt's rank 0 held them when it stopped): sent now", steps, self.run_id, values,
                     len(queued))
        return True

    def _on_server(self, restored: List[Tuple[int, Dict[str, Any]]]) -> Dict[Tuple[str, int], int]:
        """(metric key, step) -> its timestamp, of the `restored` epochs' values the run holds on the server."""
        steps = {step for step, _ in restored}
        found: Dict[Tuple[str, int], int] = {}
        for key in sorted({key for _, metrics in restored for key in metrics}):
            for metric in self.client.get_metric_history(self.run_id, key):
                if int(metric.step) in steps:
                    found.setdefault((key, int(metric.step)), int(metric.timestamp))
        return found

    def _drop_local_file(self) -> None:
        path = os.path.join(self.local_dir or "", f"unsent_metrics_{self.run_id}.jsonl")
        if self.local_dir and os.path.exists(path):
            os.remove(path)
            log.info("the buffered metrics reached MLflow after all; %s removed", path)

    def _go_offline(self, job) -> None:
        self.offline = OfflineRun(offline_folder(job.job_dir))
        epochs = [(step, metrics, ts, step in self.sent) for step, metrics, ts in self.epochs]
        epochs += [(step, metrics, ts, True) for step, metrics, ts in self._taken_before]
        self.offline.write_metrics(sorted(epochs, key=lambda epoch: epoch[0]))
        unsent = sum(len(metrics) for _, metrics in self.pending)
        self.offline.update(tags={**self.tags, "lakehouse.metrics_left_offline": str(unsent)})
        # the ranks' job holds no URI with credentials (workflow.for_the_ranks): its config's redacted one then
        uri = job.tracking_uri or job.cfg.mlflow.tracking_uri or ""
        redacted = redact_url(uri) != uri or URL_MASK in uri  # the folder keeps it so: sync-run needs it given
        log.warning("MLflow at %s did not come back within %.0f s (config key 'mlflow.reconnect_wait_s'): run %s's "
                    "metrics (%d value(s) the server never took), plots and model are kept in %s; upload them with "
                    "`lakehouse sync-run %s%s`%s", redact_url(uri), job.cfg.mlflow.reconnect_wait_s,
                    self.run_id, unsent, self.offline.folder, self.offline.folder,
                    " mlflow.tracking_uri=<the URI with its credentials>" if redacted else "",
                    " (the folder keeps the URI with its credentials redacted)" if redacted else "")

    def _plots(self, job, history, result, target) -> None:
        """The learning curves, and the confusion matrix of the epoch whose weights are logged (`result.confusion`,
        kept with that epoch's record: not the model's last validation's, which is another epoch's when the best
        one is registered); none where that epoch's matrix is not known (a checkpoint that did not record it)."""
        import numpy as np

        from pipeline.tracking.plots import confusion_matrix_png, learning_curves_png  # local: numpy, rank 0 alone

        with tempfile.TemporaryDirectory() as tmp:
            if history:
                learning_curves_png(history, os.path.join(tmp, "learning_curves.png"))
                target.log_artifact(self.run_id, os.path.join(tmp, "learning_curves.png"), "plots")
            cm = getattr(result, "confusion", None)
            if cm is not None:
                confusion_matrix_png(np.asarray(cm), job.data.class_names, os.path.join(tmp, "confusion_matrix.png"))
                target.log_artifact(self.run_id, os.path.join(tmp, "confusion_matrix.png"), "plots")
            else:
                log.info("no confusion matrix logged: the registered epoch's is not recorded")

    def _finish_offline(self, model, job, history, result) -> Optional[str]:
        self._plots(job, history, result, self.offline)
        meta = _network_meta(job)
        model.eval()
        self.offline.save_model(model.network.cpu(), meta, result.epochs)
        log.info("kept the model of run %s in %s", self.run_id, self.offline.folder)
        return None

    def _finish_online(self, model, job, history: List[Dict[str, float]], result) -> Optional[str]:
        from pipeline.tracking.pyfunc import log_model  # local: mlflow, in rank 0 alone

        self._plots(job, history, result, self.client)
        meta = _network_meta(job)
        model.eval()
        uri = log_model(model.network.cpu(), meta, "model", run_id=self.run_id, step=result.epochs)
        log.info("logged the model to run %s as %s", self.run_id, uri)
        return uri


def _network_meta(job) -> Dict[str, Any]:
    """What rebuilds the job's network for serving (pipeline.model.module.network_meta), online or offline."""
    from pipeline.model.module import network_meta  # local: torch and Lightning, kept out of the driver's import

    return network_meta(job.cfg.model, job.data.channels, job.data.image_size, job.data.class_names,
                        center_crop=job.cfg.data.decode != "convert")


def _steps(batch: List) -> str:
    steps = [step for step, _ in batch]
    return ", ".join(map(str, steps)) if len(steps) <= 5 else f"{steps[0]}..{steps[-1]}"


def log_rank_hosts(client, run_id: str, results: List[Any]) -> None:
    """Record where every rank ran (host, process id), its learning rate and final-weights digest."""
    import json

    tags = {f"rank_{r.rank}_host": r.host for r in results}
    tags.update({f"rank_{r.rank}_pid": str(r.pid) for r in results})
    for k, v in tags.items():
        client.set_tag(run_id, k, v)
    client.log_dict(run_id, [{"rank": r.rank, "host": r.host, "pid": r.pid, "lr": r.lr,
                              "weights_digest": r.final_weights_digest} for r in results], "ranks.json")
