"""What training rank 0 writes into the driver's MLflow run: per-epoch metrics, plots, the model."""
from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, List, Optional

from pipeline.log import get_logger, is_rank_zero

log = get_logger(__name__)

MAX_PENDING_EPOCHS = 10_000  # epochs of metrics held while the server is unreachable; older ones go to a file


class RankZeroTracker:
    """Logs into an existing run by id; a no-op on any rank but 0 (the one rule: rank 0 alone writes)."""

    def __init__(self, tracking_uri: Optional[str], run_id: str, local_dir: Optional[str] = None) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        if tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)
        self.run_id = run_id
        self.client = MlflowClient(tracking_uri) if tracking_uri else MlflowClient()
        self.pending: List = []  # (step, metrics) not yet accepted by the server, oldest first
        self.local_dir = local_dir

    def record_precision(self, precision: str) -> None:
        """The precision the ranks resolved (`train.precision=auto` is decided in each rank): the run's tag."""
        if not is_rank_zero():
            return
        self.client.set_tag(self.run_id, "precision", precision)

    def log_epoch(self, metrics: Dict[str, float], step: int) -> None:
        """Send an epoch's metrics; while the server is unreachable they wait (oldest first, at most
        MAX_PENDING_EPOCHS) and go with the next epoch that gets through, so training never waits on MLflow."""
        if not is_rank_zero():
            return
        self.pending.append((int(step), dict(metrics)))
        if len(self.pending) > MAX_PENDING_EPOCHS:
            dropped = self.pending.pop(0)
            self._keep_locally([dropped])
        self.flush()

    def flush(self) -> bool:
        """Send what waits, in order; False (with a warning) when the server is still unreachable."""
        from pipeline.tracking.runs import log_epoch_metrics

        while self.pending:
            step, metrics = self.pending[0]
            try:
                log_epoch_metrics(self.client, self.run_id, metrics, step)
            except Exception as exc:  # a metric late is not worth a training lost
                log.warning("MLflow did not take epoch %d's metrics (%s: %s); %d epoch(s) buffered, sent when it "
                            "answers again", step, type(exc).__name__, exc, len(self.pending))
                return False
            self.pending.pop(0)
        return True

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

    def close(self) -> None:
        """At the end of training: a last try, then whatever is left goes to the local file."""
        if self.pending and not self.flush():
            self._keep_locally(self.pending)
            self.pending = []

    def finish(self, model, job, history: List[Dict[str, float]], result) -> Optional[str]:
        """Plots, the per-rank host/pid, the confusion matrix and the servable model; returns the model URI."""
        if not is_rank_zero():
            return None
        from pipeline.model.module import network_meta
        from pipeline.tracking.plots import confusion_matrix_png, learning_curves_png
        from pipeline.tracking.pyfunc import log_model

        cfg = job.cfg
        with tempfile.TemporaryDirectory() as tmp:
            if history:
                learning_curves_png(history, os.path.join(tmp, "learning_curves.png"))
                self.client.log_artifact(self.run_id, os.path.join(tmp, "learning_curves.png"), "plots")
            cm = getattr(model, "last_confusion", None)
            if cm is not None:
                confusion_matrix_png(cm.cpu().numpy(), job.data.class_names, os.path.join(tmp, "confusion_matrix.png"))
                self.client.log_artifact(self.run_id, os.path.join(tmp, "confusion_matrix.png"), "plots")
        meta = network_meta(cfg.model, job.data.channels, job.data.image_size, job.data.class_names)
        model.eval()
        uri = log_model(model.network.cpu(), meta, "model", run_id=self.run_id, step=result.epochs)
        log.info("logged the model to run %s as %s", self.run_id, uri)
        return uri


def log_rank_hosts(client, run_id: str, results: List[Any]) -> None:
    """Record where every rank ran (host, process id), its learning rate and final-weights digest."""
    import json

    tags = {f"rank_{r.rank}_host": r.host for r in results}
    tags.update({f"rank_{r.rank}_pid": str(r.pid) for r in results})
    for k, v in tags.items():
        client.set_tag(run_id, k, v)
    client.log_dict(run_id, [{"rank": r.rank, "host": r.host, "pid": r.pid, "lr": r.lr,
                              "weights_digest": r.final_weights_digest} for r in results], "ranks.json")
