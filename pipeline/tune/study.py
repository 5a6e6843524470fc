"""The Optuna study of a sweep: its RDB storage, sampler and pruner, creating it or resuming it (a trial left RUNNING
by a dead sweep is marked FAIL), and how many trials are still missing."""
from __future__ import annotations

import time
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
INTERRUPTED = "the sweep stopped while this trial ran (killed or interrupted); marked failed on resume"


def storage_url(cfg: Config) -> str:
    """`tune.storage`, or SQLite `optuna.db` beside the MLflow SQLite store (else under work/); paths made absolute."""
    from pipeline.tracking.runs import resolve_tracking_uri

    if cfg.tune.storage:
        return resolve_tracking_uri(cfg.tune.storage)
    uri = resolve_tracking_uri(cfg.mlflow.tracking_uri)
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith(":memory:"):
        return prefix + str(Path(uri[len(prefix):]).parent / "optuna.db")
    return resolve_tracking_uri(prefix + "work/optuna.db")


def make_storage(url: str):
    import optuna

    kwargs: Dict[str, Any] = {}
    if url.startswith("sqlite"):
        # the driver's pruning thread and main thread share the file; wait for a lock instead of failing
        kwargs = {"connect_args": {"timeout": 60}}
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
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


def fail_interrupted(study, storage) -> List[Any]:
    """Mark every trial still RUNNING as FAIL (one sweep drives a study at a time: on resume, a RUNNING trial is
    one whose sweep died); returns those trials as they were."""
    from optuna.trial import TrialState

    stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    study_id = storage.get_study_id_from_name(study.study_name)
    for t in stale:
        storage.set_trial_user_attr(storage.get_trial_id_from_study_id_trial_number(study_id, t.number), ATTR_ERROR,
                                    INTERRUPTED)
        study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        log.warning("trial %d was running when the sweep stopped; marked failed", t.number)
    return stale


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
