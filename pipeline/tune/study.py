"""The Optuna study of a sweep: its RDB storage, sampler and pruner, creating it or resuming it, the heartbeat of a
running trial (a trial whose sweep is gone is failed, a live one never), and how many trials are still missing.

Several sweeps may drive one study (a `--resume` beside a running sweep, two resumes at once). Which trial is
abandoned is decided by Optuna's own heartbeat (`RDBStorage(heartbeat_interval=tune.heartbeat_s, grace_period=3 x
that)`): the sweep running a trial records its heartbeat every `tune.heartbeat_s` seconds, and before each new trial
(and when it resumes) a sweep calls `optuna.storages.fail_stale_trials`, which fails only the RUNNING trials whose
heartbeat stopped for the grace period: their process is gone. Optuna's rule skips a trial that never beat (its
sweep killed right after `study.ask()`), so `fail_stale` also fails a RUNNING trial with no heartbeat that started
more than the grace period ago. A trial failed either way cannot get user attributes any more (the storage refuses
to update a finished trial), so its reason is implied: a FAIL trial without an `error` attribute is one whose sweep
stopped (`failure_reason`); its MLflow child run is ended FAILED with that reason by the sweep that failed it. Each
sweep tells only the trials it asked. Like Optuna's own distributed `optimize`, two sweeps counting toward one
`n_trials` at once may start one trial more than asked.
"""
from __future__ import annotations

import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Optional

from pipeline.config import Config, ConfigError
from pipeline.log import get_logger
from pipeline.redact import redact_url, redacted

log = get_logger(__name__)

# Trial user attributes the sweep writes (also read on resume and by the report).
ATTR_RUN_ID = "mlflow_run_id"
ATTR_ERROR = "error"
ATTR_MODEL_URI = "model_uri"
ATTR_METRICS = "metrics"
# Study user attributes.
ATTR_PARENT_RUN = "mlflow_parent_run_id"
ATTR_N_TRIALS = "n_trials"
ATTR_SPACE = "space_yaml"
ATTR_CONFIG = "config"
ATTR_DELTA_VERSION = "delta_version"
ATTR_REGISTERED = "registered"
INTERRUPTED = ("the sweep stopped while this trial ran (killed or lost: its heartbeat stopped); failed by a later "
               "sweep on the study")
ATTR_BEATING = "lakehouse_heartbeat"  # a trial's system attribute, set once its first heartbeat is recorded
HEARTBEAT_GRACE = 3  # a running trial is stale once its heartbeat is older than this many heartbeat intervals


def storage_url(cfg: Config) -> str:
    """`tune.storage`, or SQLite `optuna.db` beside the MLflow SQLite store (else under work/); paths made absolute."""
    from pipeline.tracking.runs import resolve_tracking_uri  # local: mlflow, preloaded on a thread

    if cfg.tune.storage:
        return resolve_tracking_uri(cfg.tune.storage)
    uri = resolve_tracking_uri(cfg.mlflow.tracking_uri)
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith(":memory:"):
        return prefix + str(Path(uri[len(prefix):]).parent / "optuna.db")
    return resolve_tracking_uri(prefix + "work/optuna.db")


class StaleTrials:
    """The heartbeat settings of a sweep (`tune.heartbeat_s`) and Optuna's heartbeat-stale callback: it collects the
    trials `fail_stale_trials` just failed in this process (each stale trial is failed, and so reported, by exactly
    one sweep: the storage refuses a second update)."""

    def __init__(self, heartbeat_s: int) -> None:
        self.heartbeat_s = int(heartbeat_s)
        self.grace_s = HEARTBEAT_GRACE * self.heartbeat_s
        self._found: List[Any] = []

    def __call__(self, study, trial) -> None:
        self._found.append(trial)

    def take(self) -> List[Any]:
        found, self._found = self._found, []
        return found


def make_storage(url: str, stale: Optional[StaleTrials] = None):
    """The study's RDB storage; with `stale`, Optuna's heartbeat on: a trial silent for `stale.grace_s` is stale."""
    import optuna

    kwargs: Dict[str, Any] = {}
    if url.startswith("sqlite"):
        # the driver's pruning thread, heartbeat thread and main thread share the file (and other sweeps may): wait
        # for a lock instead of failing
        kwargs = {"connect_args": {"timeout": 60}}
    beat: Dict[str, Any] = {}
    if stale is not None:
        beat = {"heartbeat_interval": stale.heartbeat_s, "grace_period": stale.grace_s,
                "heartbeat_stale_trial_callback": stale}
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, **beat)
    except Exception as exc:
        raise ConfigError(f"config key 'tune.storage': cannot open Optuna storage {redact_url(url)!r}: "
                          f"{type(exc).__name__}: {redact_url(str(exc))}") from exc


def make_sampler(cfg: Config, offset: int = 0):
    """`tune.sampler` with `tune.seed` (+ `offset`: a resumed sweep must not replay the first sweep's draws)."""
    import optuna

    seed = None if cfg.tune.seed is None else int(cfg.tune.seed) + offset
    if cfg.tune.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(1, cfg.tune.startup_trials))


def make_pruner(cfg: Config):
    """`tune.pruner`: the median rule on the per-epoch metric, or none."""
    import optuna

    if cfg.tune.pruner == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=cfg.tune.startup_trials,
                                       n_warmup_steps=cfg.tune.warmup_epochs)


def describe_pruner(cfg: Config) -> str:
    if cfg.tune.pruner == "none":
        return "none"
    return f"median (startup trials {cfg.tune.startup_trials}, warmup epochs {cfg.tune.warmup_epochs})"


def default_name(space_source: str) -> str:
    return f"{Path(space_source).stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


def quiet_optuna() -> None:
    """The sweep logs its own progress line per trial; Optuna's own INFO lines and experimental warnings go."""
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # the sweep asks its trials itself (one per turn, trained by ranks) and keeps their heartbeat (Heartbeat below)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")


def check_metric(cfg: Config) -> None:
    """The trial's value and the model registered from it must come from the same epoch: the model is the epoch
    checkpointed as best by `train.early_stopping.monitor` (in `train.early_stopping.mode`), so `tune.metric` and
    `tune.direction` must be that metric and that direction.

    Raises:
        ConfigError: naming both keys of the pair that differs.
    """
    es = cfg.train.early_stopping
    if cfg.tune.metric != es.monitor:
        raise ConfigError(f"config keys 'tune.metric' ({cfg.tune.metric!r}) and 'train.early_stopping.monitor' "
                          f"({es.monitor!r}) differ: a trial's model is its best epoch by the monitor, so its value "
                          f"would come from another epoch; set both to the same metric")
    expected = "min" if cfg.tune.direction == "minimize" else "max"
    if es.mode != expected:
        raise ConfigError(f"config keys 'tune.direction' ({cfg.tune.direction!r}) and 'train.early_stopping.mode' "
                          f"({es.mode!r}) disagree: a trial's model is its best epoch by the monitor, so both must "
                          f"agree (minimize and min, or maximize and max)")


def create_study(cfg: Config, name: str, storage, url: str, n_trials: int, space_text: str,
                 enqueue: List[Dict[str, Any]]):
    """A new study (an existing name is an error naming `--resume`), with the trials to enqueue."""
    import optuna

    try:
        study = optuna.create_study(storage=storage, study_name=name, direction=cfg.tune.direction,
                                    sampler=make_sampler(cfg), pruner=make_pruner(cfg), load_if_exists=False)
    except optuna.exceptions.DuplicatedStudyError:
        raise ConfigError(f"config key 'tune.study': study {name!r} already exists in {redact_url(url)}; continue it "
                          f"with `lakehouse tune --resume {name}` or choose another name") from None
    study.set_user_attr(ATTR_N_TRIALS, int(n_trials))
    study.set_user_attr(ATTR_SPACE, space_text)
    study.set_user_attr(ATTR_CONFIG, comparable_config(cfg))
    for params in enqueue:
        study.enqueue_trial(params, skip_if_exists=True)
    log.info("created Optuna study %r in %s (%s sampler, %s pruner, %s %s)", name, redact_url(url), cfg.tune.sampler,
             describe_pruner(cfg), cfg.tune.direction, cfg.tune.metric)
    return study


def comparable_config(cfg: Config) -> Dict[str, str]:
    """The flat config a resumed sweep must match (tune.* may differ: trials, timeout, ...), as stored in the study:
    secrets redacted (pipeline.redact), so a changed password or key is not a different sweep."""
    return {k: repr(v) for k, v in sorted(redacted(cfg.flat()).items()) if not k.startswith("tune.")}


def load_study(cfg: Config, name: str, storage, url: str):
    """An existing study for `--resume`, with the sampler reseeded past its trials.

    Raises:
        ConfigError: no such study (the message lists the storage's studies), or the config differs from the one
            the study was started with (the keys named).
    """
    import optuna

    names = [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)]
    if name not in names:
        raise ConfigError(f"--resume {name}: no such study in {redact_url(url)} (config key 'tune.storage'); studies "
                          f"there: {', '.join(names) or 'none'}")
    probe = optuna.load_study(study_name=name, storage=storage)
    stored = probe.user_attrs.get(ATTR_CONFIG) or {}
    given = comparable_config(cfg)
    differs = sorted(k for k in set(stored) | set(given) if stored.get(k) != given.get(k))
    if stored and differs:
        shown = ", ".join(f"{k} (study {stored.get(k)}, now {given.get(k)})" for k in differs[:8])
        raise ConfigError(f"--resume {name}: the config differs from the one the study started with: {shown}; "
                          f"resume with the same --conf and overrides (tune.* may differ)")
    return optuna.load_study(study_name=name, storage=storage, sampler=make_sampler(cfg, len(probe.trials)),
                             pruner=make_pruner(cfg))


def fail_stale(study, stale: StaleTrials) -> List[Any]:
    """Fail the RUNNING trials whose heartbeat stopped (Optuna's `fail_stale_trials`: their sweep is gone); returns
    the ones this process failed. A trial of a live sweep is left RUNNING."""
    import optuna

    optuna.storages.fail_stale_trials(study)
    failed = stale.take()
    for t in failed:
        log.warning("trial %d of study %r was running in a sweep that stopped (no heartbeat for %d s); marked failed",
                    t.number, study.study_name, stale.grace_s)
    return failed + _fail_never_beaten(study, stale.grace_s)


def _fail_never_beaten(study, grace_s: float) -> List[Any]:
    """Fail the RUNNING trials that never recorded a heartbeat and started more than `grace_s` ago: their sweep was
    killed between `study.ask()` and the first beat (or could never beat). Optuna's stale rule skips a trial without
    a heartbeat, so such a trial would stay RUNNING for good. Each is failed by one sweep: the storage refuses the
    update of a trial that is finished already."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    storage = study._storage  # as optuna.storages.fail_stale_trials reads it
    now, failed = datetime.now(), []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.system_attrs.get(ATTR_BEATING) or t.datetime_start is None:
            continue
        if (now - t.datetime_start).total_seconds() <= grace_s:
            continue  # its sweep may be about to record the first beat
        try:
            if not storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                continue
        except UpdateFinishedTrialError:
            continue
        log.warning("trial %d of study %r started %.0f s ago and never recorded a heartbeat (its sweep stopped "
                    "before the first); marked failed", t.number, study.study_name,
                    (now - t.datetime_start).total_seconds())
        failed.append(t)
    return failed


def running(study) -> List[Any]:
    """The trials RUNNING now (after `fail_stale`: each in a live sweep)."""
    from optuna.trial import TrialState

    return study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))


def failure_reason(trial) -> Optional[str]:
    """Why a FAIL trial failed: its `error` attribute, or (none: it was failed by `fail_stale`) INTERRUPTED."""
    return trial.user_attrs.get(ATTR_ERROR) or INTERRUPTED


class Heartbeat:
    """A running trial's heartbeat, recorded in the study's storage every `interval_s` by a daemon thread while the
    sweep trains it. Entered right after `study.ask()`: the first beat is the first write before `__enter__` returns,
    with no lookup before it (the trial's own id, as Optuna's `optimize` takes it), so the trial has a heartbeat from
    the moment it exists but for that one write. A failed beat (the database briefly locked or away) is logged and
    retried at the next one: only a process that is gone stops beating."""

    def __init__(self, storage, trial, interval_s: int) -> None:
        self.storage = storage
        self.trial_id = trial._trial_id
        self.number = trial.number
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._failing = False
        self._marked = False

    def beat(self) -> None:
        try:
            self.storage.record_heartbeat(self.trial_id)
            if not self._marked:  # from now on Optuna's heartbeat rule watches this trial (`_fail_never_beaten`)
                self.storage.set_trial_system_attr(self.trial_id, ATTR_BEATING, True)
                self._marked = True
            if self._failing:
                log.info("trial %d: heartbeat recorded again", self.number)
            self._failing = False
        except Exception as exc:
            if not self._failing:
                log.warning("trial %d: could not record its heartbeat (%s: %s); retrying every %d s", self.number,
                            type(exc).__name__, exc, self.interval_s)
            self._failing = True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def __enter__(self) -> "Heartbeat":
        self.beat()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-trial-{self.number}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 60)


def counted(study) -> int:
    """Trials that took a slot of `n_trials`: every trial that started (waiting, enqueued ones do not)."""
    from optuna.trial import TrialState

    return len([t for t in study.get_trials(deepcopy=False) if t.state != TrialState.WAITING])


def best_trial(study) -> Optional[Any]:
    """The best COMPLETE trial, or None when none completed."""
    try:
        return study.best_trial
    except ValueError:
        return None
