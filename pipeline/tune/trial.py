"""One trial: the trial's config, the shared converted data (re-planned for its batch size), a real pipeline training
in an MLflow child run, and the driver side of pruning (the per-epoch metric reported to Optuna, the verdict
handed back to rank 0).

A trial's value and its model come from the same epoch: the model logged (and registered, if the trial is the best)
is the epoch checkpointed as best by `train.early_stopping.monitor`, and the trial's value is `tune.metric` read at
that epoch (`trial_value`). The sweep refuses a `tune.metric` other than the monitor, or a `tune.direction` other
than its mode (`study.check_metric`), so that epoch is also the best epoch of `tune.metric`: the value Optuna
optimizes is the value of the model it picks. A pruned trial's value is its metric at the epoch it was pruned.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Optional, Tuple

from pipeline.config import Config, apply_overrides
from pipeline.data.plan import derive_plan
from pipeline.distributed.backends import name_of
from pipeline.log import get_logger
from pipeline.redact import redact_url
from pipeline.tune.space import conversion_settings
from pipeline.tune.study import ATTR_ERROR, ATTR_METRICS, ATTR_MODEL_URI, ATTR_RUN_ID

log = get_logger(__name__)


class TrialFailed(RuntimeError):
    """A trial ended without a value (its reason is in the message and in the child run's `error` tag)."""


class SharedData:
    """The sweep's converted data: converted once per distinct conversion setting (once, unless the space searches
    image size, channels, val fraction or partitions), every trial on the same pinned Delta version, re-planned
    per batch size.

    `prepare(cfg, version)` converts the table at Delta `version` (None: `delta.version`); the version the sweep
    pinned is this object's, never written into a trial's config."""

    def __init__(self, prepare: Callable[[Config, Optional[int]], Tuple[Any, Any]],
                 delta_version: Optional[int] = None) -> None:
        self._prepare = prepare
        self._converted: Dict[tuple, Tuple[Any, Any]] = {}
        self.delta_version = delta_version
        self.conversions = 0

    def for_config(self, cfg: Config):
        """(data, pinned) for a trial's config: the shared conversion, its plan for `data.batch_size`."""
        key = conversion_settings(cfg)
        if key not in self._converted:
            data, pinned = self._prepare(cfg, self.delta_version)
            self.conversions += 1
            self.delta_version = pinned.version
            self._converted[key] = (data, pinned)
            log.info("converted data for the sweep (conversion %d): %s version %d", self.conversions, pinned.table,
                     pinned.version)
        data, pinned = self._converted[key]
        # the trial's plan over the same converted row groups (the files stay valid), derived as a job's is: its
        # starting batch (data.batch_size, or auto's start), lowered on a small table
        planned = derive_plan(cfg, data.plan, data.plan.train.world_size).shards
        if planned.train.batch_size != data.plan.train.batch_size:
            data = replace(data, plan=planned)
        return data, pinned


class PruningGate:
    """The driver side of `callbacks.DriverVerdict`: while the ranks run, each epoch's metrics that rank 0 writes to
    `folder` are reported to the Optuna trial, and the pruner's verdict is written back (`stop: ...` or
    `continue`). Optuna stays in the driver; the ranks only read a file.
    """

    def __init__(self, trial, folder: str, metric: str, pruner_name: str, poll_s: float = 0.02) -> None:
        self.trial = trial
        self.folder = folder
        self.metric = metric
        self.pruner_name = pruner_name
        self.poll_s = poll_s
        self.pruned_epoch: Optional[int] = None
        self.reason: Optional[str] = None
        self.reported: Dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "PruningGate":
        shutil.rmtree(self.folder, ignore_errors=True)
        os.makedirs(self.folder, exist_ok=True)
        self._thread = threading.Thread(target=self._watch, name=f"pruning-gate-{self.trial.number}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._drain()

    def _watch(self) -> None:
        while not self._stop.is_set():
            if not self._drain():
                self._stop.wait(self.poll_s)

    def _drain(self) -> bool:
        """Answer every epoch file not answered yet; True if one was."""
        answered = False
        while True:
            epoch = len(self.reported) if self.pruned_epoch is None else None
            if epoch is None:
                return answered
            path = os.path.join(self.folder, f"epoch-{epoch}.json")
            if not os.path.exists(path):
                return answered
            self._answer(epoch, path)
            answered = True

    def _answer(self, epoch: int, path: str) -> None:
        verdict = "continue"
        value = float("nan")
        try:
            with open(path) as fh:
                metrics = json.load(fh).get("metrics", {})
            value = float(metrics.get(self.metric, float("nan")))
            if math.isfinite(value):
                self.trial.report(value, epoch)
                if self.trial.should_prune():
                    self.pruned_epoch = epoch
                    self.reason = (f"pruned by the {self.pruner_name} pruner after epoch {epoch} "
                                   f"({self.metric} {value:.4g})")
                    verdict = f"stop: {self.reason}"
        except Exception as exc:  # a verdict must always be written: rank 0 is waiting for it
            log.warning("trial %d epoch %d: could not report to Optuna (%s: %s); the trial goes on",
                        self.trial.number, epoch, type(exc).__name__, exc)
        finally:
            self.reported[epoch] = value
            tmp = os.path.join(self.folder, f".verdict-{epoch}.tmp")
            with open(tmp, "w") as fh:
                fh.write(verdict)
            os.replace(tmp, os.path.join(self.folder, f"verdict-{epoch}"))


# how rank 0's stop reason starts when it stopped on the driver's verdict (callbacks.DriverVerdict.reason); the
# callbacks module loads Lightning, which the driver does not import for this
DRIVER_STOP = "stopped by the driver after epoch "


def pruned_epoch(gate: Optional[PruningGate], stop_reason: Optional[str]) -> Optional[int]:
    """The epoch a trial was pruned at, or None: it counts as pruned only when rank 0 stopped on the driver's verdict
    (its `stop_reason` says so). A verdict to prune that came after rank 0 stopped waiting (`tune.verdict_timeout_s`)
    stopped nothing: the ranks trained to the end, and the trial is COMPLETE with its final value."""
    if gate is None or gate.pruned_epoch is None:
        return None
    if stop_reason and stop_reason.startswith(DRIVER_STOP):
        return gate.pruned_epoch
    log.warning("trial %d: the driver's verdict to prune after epoch %d came after rank 0 stopped waiting for it "
                "(tune.verdict_timeout_s); the trial trained to the end (%s) and counts as complete",
                gate.trial.number, gate.pruned_epoch, stop_reason or "no stop")
    return None


@dataclass(frozen=True)
class TrialJob:
    """A trial's runtime facts, kept beside its config (the user's config with the trial's sampled values, never
    rewritten): its number, and its folders under `<train.checkpoint_dir>/tune/<study>`."""

    number: int
    study: str
    folder: str  # trial-N: the parent of its run's checkpoint and job folders
    epochs_folder: str  # epochs/trial-N: where rank 0 hands each epoch's metrics to the PruningGate

    @classmethod
    def of(cls, cfg: Config, study: str, number: int) -> "TrialJob":
        base = os.path.join(os.path.abspath(cfg.train.checkpoint_dir), "tune", study)
        return cls(number, study, os.path.join(base, f"trial-{number}"),
                   os.path.join(base, "epochs", f"trial-{number}"))


@dataclass
class TrialOutcome:
    number: int
    state: str  # COMPLETE | PRUNED | FAIL
    value: Optional[float]
    run_id: Optional[str]
    reason: Optional[str] = None
    epochs: int = 0
    elapsed_s: float = 0.0


def trial_value(metrics: Dict[str, float], metric: str) -> Optional[float]:
    """The trial's value: `metric` at the epoch the model was taken from (rank 0's `metrics`, the best epoch by
    `train.early_stopping.monitor`); None when that epoch has no finite value of it."""
    value = metrics.get(metric)
    if value is None or not math.isfinite(float(value)):
        return None
    return float(value)


def run_trial(trial, cfg: Config, overrides: Dict[str, Any], shared: SharedData, parent_run_id: str,
              study_name: str) -> TrialOutcome:
    """Train once with the trial's overrides, in a child run of `parent_run_id`; the trial is not told here.

    Returns the outcome: COMPLETE with its value, or PRUNED (the child run FINISHED with tag pruned=true) when rank 0
    stopped on the driver's verdict (`pruned_epoch`).

    Raises:
        TrialFailed / any exception: it failed (child run FAILED with tag `error`).
        KeyboardInterrupt, Terminated: the sweep is being stopped (child run KILLED).
    """
    from mlflow.entities import Metric, RunTag

    from pipeline.config import world_size_of
    from pipeline.tracking.runs import tracked_run
    from pipeline.workflow import train_in_run

    job = TrialJob.of(cfg, study_name, trial.number)
    tags = {"world_size": world_size_of(cfg), "backend": name_of(cfg), "np": cfg.train.np,
            "mlflow.parentRunId": parent_run_id, "optuna.study": study_name, "optuna.trial": trial.number,
            "optuna.params": json.dumps(overrides, sort_keys=True, default=str)}
    metric = cfg.tune.metric
    # the child run opens first, so a combination the config or the shard plan refuses is a FAILED run too
    with tracked_run(cfg, run_name=f"{study_name}-trial-{trial.number}", tags=tags) as run:
        trial.set_user_attr(ATTR_RUN_ID, run.run_id)
        tcfg = apply_overrides(cfg, overrides)
        data, pinned = shared.for_config(tcfg)
        gate = None
        if cfg.tune.pruner != "none":
            gate = PruningGate(trial, job.epochs_folder, metric, cfg.tune.pruner)
        r0 = train_in_run(run, tcfg, data, pinned, tags, epoch_gate=gate, checkpoint_root=job.folder)
        trial.set_user_attr(ATTR_METRICS, {k: v for k, v in r0.metrics.items() if math.isfinite(v)})
        pruned = pruned_epoch(gate, r0.stop_reason)
        if gate is not None and pruned is not None:
            run.client.log_batch(run.run_id, tags=[RunTag("pruned", "true"), RunTag("pruned_at_epoch", str(pruned))],
                                 synchronous=True)
            return TrialOutcome(trial.number, "PRUNED", gate.reported.get(pruned), run.run_id, reason=gate.reason,
                                epochs=r0.epochs)
        value = trial_value(r0.metrics or {}, metric)
        if value is None:
            seen = sorted({k for h in r0.history for k in h})
            raise TrialFailed(f"config key 'tune.metric': {metric!r} has no finite value at the model's epoch, the "
                              f"best by train.early_stopping.monitor (metrics: {', '.join(seen) or 'none'})")
        if not r0.model_uri:
            raise TrialFailed("rank 0 returned no model")
        trial.set_user_attr(ATTR_MODEL_URI, r0.model_uri)
        run.client.log_batch(run.run_id, metrics=[Metric(f"tune_{metric}", value, int(time.time() * 1000), 0)],
                             tags=[RunTag("pruned", "false")], synchronous=True)  # one round trip per trial
        return TrialOutcome(trial.number, "COMPLETE", value, run.run_id, epochs=r0.epochs)


def record_error(trial, exc: BaseException) -> str:
    """The failure reason, kept on the Optuna trial (the child run has it as tag `error`)."""
    reason = redact_url(f"{type(exc).__name__}: {exc}")  # kept in the study and as the child run's tag
    try:
        trial.set_user_attr(ATTR_ERROR, reason[:2000])
    except Exception as attr_exc:
        log.warning("could not record the error of trial %d: %s", trial.number, attr_exc)
    return reason
