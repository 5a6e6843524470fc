"""The Optuna study of a sweep: its RDB storage, sampler and pruner, creating it or resuming it, the heartbeat of a
running trial (a trial whose sweep is gone is failed, a live one never), and how many trials are still missing.

Several sweeps may drive one study (a `--resume` beside a running sweep, two resumes at once), each with its own
`tune.heartbeat_s`. Which trial is abandoned is decided by Optuna's heartbeat, per trial: the sweep running a trial
records its heartbeat every `tune.heartbeat_s` seconds and, with its first beat, that interval on the trial (system
attribute `lakehouse_heartbeat_s`); before each new trial (and when it resumes) a sweep's `fail_stale` fails the
RUNNING trials whose heartbeat stopped for 3 x the interval their own sweep beats at (Optuna's stale rule, as
`optuna.storages.fail_stale_trials` applies it, for that trial's grace period): their process is gone. A trial with
no recorded interval (it never beat: its sweep was killed right after `study.ask()`, which Optuna's rule does not
see) is judged by the largest interval the study knows (the one it was created with, study attribute
`heartbeat_s`, and every interval its trials recorded) and fails once it started more than 3 x that ago. A trial
failed either way cannot get user attributes any more (the storage refuses to update a finished trial), so its
reason is implied: a FAIL trial without an `error` attribute is one whose sweep stopped (`failure_reason`); its
MLflow child run is ended FAILED with that reason by the sweep that failed it. Each sweep tells only the trials it
asked. Like Optuna's own distributed `optimize`, two sweeps counting toward one `n_trials` at once may start one
trial more than asked.

The sampler draws each trial's values from a seed of its own, derived from `tune.seed` and the trial's number
(`TrialSeeded`): a fresh sweep with a fixed seed draws again what it drew, and two sweeps on one study (never the
same trial number) never draw alike.
"""
from __future__ import annotations

import functools
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

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
ATTR_HEARTBEAT = "heartbeat_s"  # the tune.heartbeat_s the study was created with
INTERRUPTED = ("the sweep stopped while this trial ran (killed or lost: its heartbeat stopped); failed by a later "
               "sweep on the study")
ATTR_BEATING = "lakehouse_heartbeat"  # a trial's system attribute, set once its first heartbeat is recorded
ATTR_BEAT_S = "lakehouse_heartbeat_s"  # a trial's system attribute: the interval its sweep beats at (first beat)
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
    """The heartbeat settings of a sweep (`tune.heartbeat_s`): the interval this sweep beats at and its grace period
    (a trial of this sweep is stale once silent that long). Another sweep's trial is judged by its own interval
    (`fail_stale`)."""

    def __init__(self, heartbeat_s: int) -> None:
        self.heartbeat_s = int(heartbeat_s)
        self.grace_s = HEARTBEAT_GRACE * self.heartbeat_s


def make_storage(url: str, stale: Optional[StaleTrials] = None):
    """The study's RDB storage; with `stale`, Optuna's heartbeat on (the grace period is set per trial by
    `fail_stale`)."""
    import optuna

    kwargs: Dict[str, Any] = {}
    if url.startswith("sqlite"):
        # the driver's pruning thread, heartbeat thread and main thread share the file (and other sweeps may): wait
        # for a lock instead of failing
        kwargs = {"connect_args": {"timeout": 60}}
    beat: Dict[str, Any] = {}
    if stale is not None:
        beat = {"heartbeat_interval": stale.heartbeat_s, "grace_period": stale.grace_s}
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, **beat)
    except Exception as exc:
        raise ConfigError(f"config key 'tune.storage': cannot open Optuna storage {redact_url(url)!r}: "
                          f"{type(exc).__name__}: {redact_url(str(exc))}") from exc


def trial_seed(seed: int, number: int) -> int:
    """The seed of trial `number`'s draws: one per (tune.seed, trial number), well apart for nearby numbers."""
    import numpy as np

    return int(np.random.SeedSequence([int(seed), int(number)]).generate_state(1)[0])


def _base_sampler(cfg: Config, seed: Optional[int]):
    import optuna

    if cfg.tune.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(1, cfg.tune.startup_trials))


@functools.lru_cache(maxsize=None)
def _trial_seeded():
    """The class `TrialSeeded`, defined on first use: Optuna is imported by the driver only, when a sweep starts."""
    import optuna

    class TrialSeeded(optuna.samplers.BaseSampler):
        """`tune.sampler`, made again for every trial with the seed `trial_seed(tune.seed, trial number)`: each trial's
        random draws are its own, so two sweeps on one study (a resume beside a sweep, two resumes at once: never the
        same trial number) never draw the same values, and a fresh sweep with the same seed draws what it drew (TPE
        past its startup trials: given the same earlier results). Without a seed the draws are the OS's random."""

        def __init__(self, make: Callable[[Optional[int]], Any], seed: Optional[int]) -> None:
            self._make = make
            self._seed = seed
            self._sampler = make(seed)

        def before_trial(self, study, trial) -> None:
            if self._seed is not None:
                self._sampler = self._make(trial_seed(self._seed, trial.number))
            self._sampler.before_trial(study, trial)

        def infer_relative_search_space(self, study, trial):
            return self._sampler.infer_relative_search_space(study, trial)

        def sample_relative(self, study, trial, search_space):
            return self._sampler.sample_relative(study, trial, search_space)

        def sample_independent(self, study, trial, param_name, param_distribution):
            return self._sampler.sample_independent(study, trial, param_name, param_distribution)

        def after_trial(self, study, trial, state, values) -> None:
            self._sampler.after_trial(study, trial, state, values)

        def reseed_rng(self) -> None:
            self._sampler.reseed_rng()

    return TrialSeeded


def make_sampler(cfg: Config):
    """`tune.sampler`, each trial's draws seeded by `tune.seed` and the trial's number (`TrialSeeded`)."""
    seed = None if cfg.tune.seed is None else int(cfg.tune.seed)
    return _trial_seeded()(lambda s: _base_sampler(cfg, s), seed)


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
    study.set_user_attr(ATTR_HEARTBEAT, int(cfg.tune.heartbeat_s))
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
    """An existing study for `--resume`, with the sweep's sampler (each trial seeded by its own number).

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
    return optuna.load_study(study_name=name, storage=storage, sampler=make_sampler(cfg), pruner=make_pruner(cfg))


def largest_interval(study, trials: List[Any], own_s: int) -> int:
    """The largest heartbeat interval a sweep of the study is known to use: the one the study was created with, this
    sweep's own, and every interval its trials recorded."""
    known = [int(own_s), int(study.user_attrs.get(ATTR_HEARTBEAT) or 0)]
    known += [int(t.system_attrs.get(ATTR_BEAT_S) or 0) for t in trials]
    return max(known)


def _silent_for(storage, study_id: int, grace_s: int) -> set:
    """The ids of the study's RUNNING trials whose last heartbeat, by the database's clock, is older than `grace_s`:
    Optuna's stale rule (`RDBStorage._get_stale_trial_ids`, as `fail_stale_trials` calls it) for that grace period.
    Only the sweep's main thread reads the storage's grace period."""
    backend = getattr(storage, "_backend", storage)  # the RDBStorage under Optuna's cache
    kept = backend.grace_period
    backend.grace_period = int(grace_s)
    try:
        return set(backend._get_stale_trial_ids(study_id))
    finally:
        backend.grace_period = kept


def fail_stale(study, stale: StaleTrials) -> List[Any]:
    """Fail the RUNNING trials whose sweep is gone; returns the ones this process failed. A trial whose heartbeat
    stopped for 3 x the interval its own sweep recorded on it is failed; a trial with no recorded interval is judged
    by the largest interval the study knows (`largest_interval`), as is a trial that never beat (by its age). A
    trial of a live sweep is left RUNNING, whatever the intervals of the sweeps."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    live = [t for t in trials if t.state == TrialState.RUNNING]
    if not live:
        return []
    largest = largest_interval(study, trials, stale.heartbeat_s)
    by_grace: Dict[int, List[Any]] = {}
    for t in live:
        interval = int(t.system_attrs.get(ATTR_BEAT_S) or largest)
        by_grace.setdefault(HEARTBEAT_GRACE * interval, []).append(t)
    failed = []
    for grace_s, group in sorted(by_grace.items()):
        silent = _silent_for(study._storage, study._study_id, grace_s)
        for t in group:
            if t._trial_id in silent and _fail(study, t):
                log.warning("trial %d of study %r was running in a sweep that stopped (no heartbeat for %d s: 3 x "
                            "the %d s its sweep beats at); marked failed", t.number, study.study_name, grace_s,
                            grace_s // HEARTBEAT_GRACE)
                failed.append(t)
    done = {t.number for t in failed}
    return failed + _fail_never_beaten(study, [t for t in live if t.number not in done], HEARTBEAT_GRACE * largest)


def _fail(study, trial) -> bool:
    """Mark `trial` FAIL; False when another sweep finished it first (the storage refuses a second update)."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    try:
        return bool(study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL))
    except UpdateFinishedTrialError:
        return False


def _fail_never_beaten(study, live: List[Any], grace_s: float) -> List[Any]:
    """Fail the RUNNING trials (of `live`) that never recorded a heartbeat and started more than `grace_s` ago: their
    sweep was killed between `study.ask()` and the first beat (or could never beat). Optuna's stale rule skips a
    trial without a heartbeat, so such a trial would stay RUNNING for good. Each is failed by one sweep: the storage
    refuses the update of a trial that is finished already."""
    now, failed = datetime.now(), []
    for t in live:
        if t.system_attrs.get(ATTR_BEATING) or t.datetime_start is None:
            continue
        if (now - t.datetime_start).total_seconds() <= grace_s:
            continue  # its sweep may be about to record the first beat
        if not _fail(study, t):
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
                # the interval first: a trial marked beating is judged by its own sweep's interval (`fail_stale`)
                self.storage.set_trial_system_attr(self.trial_id, ATTR_BEAT_S, int(self.interval_s))
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
