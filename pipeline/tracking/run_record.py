"""What the driver records in a training run's MLflow run: its start (config, lineage, shard plan, checkpoint folder,
restore point) and what changes while it trains (restarts, elastic relaunches, OOM back-offs), each change recorded
without ever failing the training."""
from __future__ import annotations

from typing import Any, Dict, Optional

from pipeline.log import get_logger
from pipeline.redact import redact_url

log = get_logger(__name__)

CAUSE_CHARS = 4000  # a tag value's room for a cause (MLflow allows 5,000)


def _plan_dict(plan) -> Dict[str, Any]:
    return {"train": plan.train.__dict__, "val": plan.val.__dict__}


class RunRecord:
    """The driver's records in run `run_id` through `client` (MlflowClient)."""

    def __init__(self, client, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def start(self, cfg, pinned, rows: Dict[str, int], tags: Dict[str, Any], plan, checkpoint_dir: str,
              restore_from: Optional[str]) -> None:
        """Before the ranks start: the config, the table's lineage (`tags` beside it), the shard plan and the batch it
        starts with, the run's checkpoint folder and, when resuming, the restore point."""
        from pipeline.tracking.lineage import log_config, log_lineage  # local: mlflow, out of `import workflow`

        log_config(self.client, self.run_id, cfg)
        log_lineage(self.client, self.run_id, pinned.table, pinned.version, rows, extra_tags=tags)
        self.client.log_dict(self.run_id, _plan_dict(plan), "shard_plan.json")
        self.client.set_tag(self.run_id, "batch_size_used", plan.train.batch_size)  # per rank; a back-off halves it
        self.client.set_tag(self.run_id, "checkpoint_dir", checkpoint_dir)
        if restore_from:
            self.client.set_tag(self.run_id, "resumed_from", restore_from)

    def restart(self, n: int, cause: str) -> None:
        """A restart (train.max_restarts): the `restarts` metric and a tag with its cause."""
        self._safely(f"restart {n}", lambda: (
            self.client.log_metric(self.run_id, "restarts", n, step=n),
            self.client.set_tag(self.run_id, f"restart_{n}_cause", redact_url(cause)[:CAUSE_CHARS])))

    def world(self, world: int, cause: str) -> None:
        """An elastic relaunch (train.min_np) on fewer ranks: the `world_size_used` tag, the `world_size` metric and a
        tag with its cause."""
        self._safely(f"the elastic change to {world} rank(s)", lambda: (
            self.client.set_tag(self.run_id, "world_size_used", world),
            self.client.log_metric(self.run_id, "world_size", world),
            self.client.set_tag(self.run_id, f"world_size_{world}_cause", redact_url(cause)[:CAUSE_CHARS])))

    def batch(self, n: int, plan, cause: str) -> None:
        """An OOM back-off (data.batch_size=auto, train.oom_backoff): the `batch_size_used` tag, the `oom_backoffs`
        metric, a tag with its cause and the new shard plan."""
        self._safely(f"OOM back-off {n}", lambda: (
            self.client.set_tag(self.run_id, "batch_size_used", plan.train.batch_size),
            self.client.log_metric(self.run_id, "oom_backoffs", n, step=n),
            self.client.set_tag(self.run_id, f"oom_backoff_{n}_cause", redact_url(cause)[:CAUSE_CHARS]),
            self.client.log_dict(self.run_id, _plan_dict(plan), "shard_plan.json")))

    def _safely(self, what: str, record) -> None:
        try:
            record()
        except Exception as exc:  # the training matters more than its record
            log.warning("could not record %s in MLflow: %s", what, exc)
