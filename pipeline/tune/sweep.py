"""The `lakehouse tune` job: open or resume the study and its MLflow parent run, convert the data once, run the
missing trials one after the other (each with its heartbeat; a trial whose sweep is gone is failed first, a live
trial of another sweep on the study is left alone), then register only the best trial's model and let the promotion
gate decide."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

from pipeline.config import Config, ConfigError, apply_overrides
from pipeline.data.leases import JobLeases
from pipeline.errors import Terminated
from pipeline.log import get_logger
from pipeline.redact import redact_url
from pipeline.tune.report import log_best, log_study_artifacts, parent_run, progress_line
from pipeline.tune.space import load_space, space_from_text
from pipeline.tune.study import (ATTR_DELTA_VERSION, ATTR_METRICS, ATTR_MODEL_URI, ATTR_N_TRIALS, ATTR_REGISTERED,
                                 ATTR_RUN_ID, ATTR_SPACE, INTERRUPTED, Heartbeat, StaleTrials, best_trial,
                                 check_metric, counted, create_study, default_name, describe_pruner, fail_stale,
                                 failure_reason, load_study, make_storage, quiet_optuna, running, storage_url)
from pipeline.tune.trial import SharedData, TrialOutcome, record_error, run_trial
from pipeline.workflow import gate_version, prepare_data, register_version, require_model_arch

log = get_logger(__name__)


@dataclass
class Opened:
    """The sweep's study and what drives it: its storage (heartbeat on), its heartbeat settings, the space, the
    trials asked, and the trials this sweep failed on opening (their sweep had stopped)."""

    study: Any
    storage: Any
    stale: StaleTrials
    url: str
    space: Any
    total: int
    failed: List[Any] = field(default_factory=list)


def check_cli_values(n_trials: Any, timeout_s: Any) -> None:
    """`--trials` and `--timeout` (or `run_tune`'s `n_trials` and `timeout_s`) as the config checks `tune.n_trials` and
    `tune.timeout_s`: None (not given), or at least one trial and a finite timeout above 0 s.

    Raises:
        ConfigError: naming the option and its config key.
    """
    if n_trials is not None and (isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1):
        raise ConfigError(f"--trials (config key 'tune.n_trials') must be a whole number >= 1, got {n_trials!r}")
    if timeout_s is not None:
        ok = not isinstance(timeout_s, bool) and isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s)
        if not ok or timeout_s <= 0:
            raise ConfigError(f"--timeout (config key 'tune.timeout_s') must be a number of seconds > 0, "
                              f"got {timeout_s!r}")


def sweep_config(cfg: Config, n_trials: Optional[int], timeout_s: Optional[float]) -> Config:
    """`cfg` with `--trials` as `tune.n_trials` and `--timeout` as `tune.timeout_s` (those given), checked: the
    config the sweep runs, logs and shows is the one it uses."""
    check_cli_values(n_trials, timeout_s)
    if cfg.tune.pruner != "none" and cfg.tune.verdict_timeout_s >= cfg.train.stall_timeout_s:
        # the ranks wait for the verdict at an epoch end without a step: the driver's stall watchdog would end them
        raise ConfigError(f"config key 'tune.verdict_timeout_s' ({cfg.tune.verdict_timeout_s:g} s) must be below "
                          f"train.stall_timeout_s ({cfg.train.stall_timeout_s} s): the ranks wait for the pruning "
                          f"verdict without making progress, and a wait that long counts as a stall")
    values: Dict[str, Any] = {}
    if n_trials is not None:
        values["tune.n_trials"] = int(n_trials)
    if timeout_s is not None:
        values["tune.timeout_s"] = float(timeout_s)
    return apply_overrides(cfg, values) if values else cfg


def trials_asked(trials: Optional[int], overrides: Sequence[str], cfg: Config) -> Optional[int]:
    """The trial count a `lakehouse tune` command line asks for: `--trials`, else a `tune.n_trials=N` override among
    `overrides` (its value, as read into `cfg`), else None (a new study takes `tune.n_trials`, a resumed one keeps
    the count it has)."""
    if trials is not None:
        return trials
    if any(o.split("=", 1)[0].strip() == "tune.n_trials" for o in overrides):
        return cfg.tune.n_trials
    return None


def _require_archs(cfg: Config, space: Any) -> None:
    """Refuse (ConfigError naming model.arch) a network the config or the space (a category, a fixed value, an
    enqueued trial) may pick that this install cannot build: each trial failed in its ranks instead, after its data
    was prepared."""
    for arch in space.values_of("model.arch", cfg.model.arch):
        require_model_arch(apply_overrides(cfg, {"model.arch": arch}))


def _open(cfg: Config, space_path: Optional[str], asked: bool, resume: Optional[str]) -> Opened:
    """Create the study, or reopen `resume`. `asked`: `cfg.tune.n_trials` was given for this sweep (`--trials` or
    an explicit `tune.n_trials`): on resume it replaces the study's count; otherwise the study keeps its own."""
    check_metric(cfg)  # before any study is made or touched
    url = storage_url(cfg)
    stale = StaleTrials(cfg.tune.heartbeat_s)
    storage = make_storage(url, stale)
    if resume:
        study = load_study(cfg, resume, storage, url)
        stored = study.user_attrs.get(ATTR_SPACE) or ""
        if space_path and stored and Path(space_path).is_file() and Path(space_path).read_text() == stored:
            space = space_from_text(stored, cfg, str(space_path), stored=True)  # the study's own, as it began
        elif space_path:
            space = load_space(space_path, cfg)
            if stored and space.text != stored:
                raise ConfigError(f"--resume {resume}: search space {space_path} differs from the one the study "
                                  f"started with; resume without --space to use the study's own")
        elif stored:
            space = space_from_text(stored, cfg, f"(study {resume})", stored=True)
        else:
            raise ConfigError(f"--resume {resume}: the study has no stored search space; pass --space")
        _require_archs(cfg, space)  # before the study is changed (its count, its stale trials)
        kept = study.user_attrs.get(ATTR_N_TRIALS)
        total = int(cfg.tune.n_trials if asked or kept is None else kept)
        if total != kept:
            study.set_user_attr(ATTR_N_TRIALS, total)
            log.info("study %r: %d trial(s) asked now (it had %s)", resume, total, kept)
        failed = fail_stale(study, stale)
        live = running(study)
        for t in live:
            log.info("trial %d of study %r is running in another sweep (its heartbeat is live); left alone",
                     t.number, resume)
        log.info("resuming study %r: %d of %d trial(s) started, %d marked failed (their sweep had stopped), "
                 "%d running in another sweep", resume, counted(study), total, len(failed), len(live))
        return Opened(study, storage, stale, url, space, total, failed)
    if not space_path:
        raise ConfigError("lakehouse tune needs --space conf/search/<name>.yaml (or --resume STUDY)")
    space = load_space(space_path, cfg)
    _require_archs(cfg, space)  # before the study is made: a refused sweep leaves no study to --resume
    name = cfg.tune.study or default_name(space_path)
    total = int(cfg.tune.n_trials)  # checked >= 1 with the config (and --trials by check_cli_values)
    study = create_study(cfg, name, storage, url, total, space.text, space.enqueue)
    return Opened(study, storage, stale, url, space, total)


def _fail_runs(client, trials, reason: str = INTERRUPTED, only_running: bool = True) -> None:
    """End the MLflow child runs of failed trials FAILED with tag `error` = `reason` (a run already ended is left as
    it is, unless `only_running` is False)."""
    for t in trials:
        run_id = t.user_attrs.get(ATTR_RUN_ID)
        if not run_id:
            continue
        try:
            if not only_running or client.get_run(run_id).info.status == "RUNNING":
                client.set_tag(run_id, "error", reason[:5000])
                client.set_terminated(run_id, status="FAILED")
        except Exception as exc:
            log.warning("could not mark the run %s of failed trial %d failed: %s", run_id, t.number, exc)


def _tell(op: Opened, client, trial, outcome: TrialOutcome, **kwargs) -> TrialOutcome:
    """Tell the study how this sweep's own trial ended. If another sweep failed it meanwhile (its heartbeat was not
    seen for the grace period: this process stalled or lost the database), the trial is lost: the outcome becomes
    FAIL saying so, its child run FAILED, and the sweep goes on."""
    import optuna

    try:
        op.study.tell(trial, **kwargs)
        return outcome
    except (ValueError, optuna.exceptions.UpdateFinishedTrialError):
        now = next((t for t in op.study.get_trials(deepcopy=False) if t.number == trial.number), None)
        if now is None or not now.state.is_finished():
            raise
    reason = (f"trial {trial.number} was marked {now.state.name} by another sweep on study {op.study.study_name!r} "
              f"while it ran here (no heartbeat seen for {op.stale.grace_s} s); its result is lost")
    log.error("%s", reason)
    _fail_runs(client, [now], reason, only_running=False)
    return TrialOutcome(trial.number, "FAIL", None, outcome.run_id, reason=reason, epochs=outcome.epochs)


def _pin_version(study, shared: SharedData) -> None:
    """Record the Delta version the trials read, so a resumed sweep reads the same one."""
    if shared.delta_version is not None and study.user_attrs.get(ATTR_DELTA_VERSION) is None:
        study.set_user_attr(ATTR_DELTA_VERSION, shared.delta_version)


def _register_best(cfg: Config, client, study, best) -> Dict[str, Any]:
    """Register the best trial's model once, then the gate. Once per study: a resumed sweep, or a second sweep on the
    same study ending at the same time, finds the version already registered (`_one_version`) instead of adding
    another of the same weights."""
    done = study.user_attrs.get(ATTR_REGISTERED) or {}
    if done.get("trial") == best.number:
        log.info("trial %d's model is already registered as version %s", best.number, done.get("version"))
        return done
    run_id = best.user_attrs.get(ATTR_RUN_ID)
    model_uri = best.user_attrs.get(ATTR_MODEL_URI)
    if not run_id or not model_uri:
        raise RuntimeError(f"best trial {best.number} of study {study.study_name!r} has no logged model; "
                           f"nothing registered")
    tags = client.get_run(run_id).data.tags
    pinned = SimpleNamespace(table=tags.get("delta_table", cfg.delta.table),
                             version=int(tags.get("delta_version", -1)))
    mine = {"optuna.study": study.study_name, "optuna.trial": str(best.number)}
    version = _one_version(client, cfg.mlflow.registered_model, run_id, mine)
    if version is None:
        registered = register_version(client, cfg, model_uri, run_id, pinned, best.user_attrs.get(ATTR_METRICS) or {},
                                      extra_tags={**mine, f"tune_{cfg.tune.metric}": best.value})
        version = _one_version(client, cfg.mlflow.registered_model, run_id, mine, registered)
    decision = gate_version(client, cfg, version)
    done = {"trial": best.number, "version": str(version), "champion": bool(decision and decision.promoted),
            "gate": decision.reason if decision else "mlflow.promote is false"}
    study.set_user_attr(ATTR_REGISTERED, done)
    return done


def _one_version(client, name: str, run_id: str, mine: Dict[str, str], registered: Optional[str] = None):
    """The version of model `name` registered from `run_id` for this study's trial (`mine`: its tags), the lowest where
    two sweeps registered it at once: the other one (`registered`, this sweep's own) is deleted before any gate judged
    it, so both sweeps go on with the same version. None where there is none yet."""
    from pipeline.tracking.registry import model_versions  # local: mlflow, preloaded on a thread

    found = sorted((int(v.version) for v in model_versions(client, name, run_id)
                    if all(v.tags.get(k) == val for k, val in mine.items())))
    if registered is not None and int(registered) not in found:
        found = sorted([*found, int(registered)])  # not listed yet by a store that lags its writes
    if not found:
        return None
    if registered is not None and int(registered) != found[0]:
        log.warning("trial %s of study %r was registered by another sweep at the same time as version %d; this "
                    "sweep's version %s is deleted and version %d kept", mine["optuna.trial"], mine["optuna.study"],
                    found[0], registered, found[0])
        try:
            client.delete_model_version(name, str(registered))
        except Exception as exc:  # the registry's own exception types: the duplicate stays, named, never gated
            log.warning("could not delete version %s of model %r (%s); it duplicates version %d and is not promoted",
                        registered, name, redact_url(f"{type(exc).__name__}: {exc}"), found[0])
    return str(found[0])


def _next_trial(op: Opened, cfg: Config, shared: SharedData, parent, t0: float,
                timeout: Optional[float]) -> Optional[TrialOutcome]:
    """One turn of the sweep: None when no trial is left to start (all `total` counted, or the timeout passed);
    else fail the trials whose sweep is gone, ask the study for a trial, train it in its child run while its
    heartbeat is recorded, tell the study, log the progress line and the best so far. Returns the trial's outcome
    (a failure is an outcome; Ctrl-C and SIGTERM propagate)."""
    from optuna.trial import TrialState

    study, space, total = op.study, op.space, op.total
    name = study.study_name
    metric = cfg.tune.metric
    _fail_runs(parent.client, fail_stale(study, op.stale))  # as Optuna's optimize does before each trial
    done = counted(study)
    if done >= total:
        return None
    if timeout is not None and time.monotonic() - t0 >= timeout:
        log.warning("tune timeout of %.0f s reached after %d of %d trial(s); no new trial starts "
                    "(continue with --resume %s)", timeout, done, total, name)
        return None
    # the trial is RUNNING from the ask; its heartbeat is the next write, before any other work (a sweep killed in
    # between leaves a trial that never beat: fail_stale fails it by its age)
    trial = study.ask()
    with Heartbeat(op.storage, trial, op.stale.heartbeat_s):
        started = time.monotonic()
        try:
            overrides = space.suggest(trial)
            log.info("trial %d/%d (#%d) starts: %s", done + 1, total, trial.number,
                     ", ".join(f"{k}={v}" for k, v in overrides.items()))
            outcome = run_trial(trial, cfg, overrides, shared, parent.run_id, name)
        except (KeyboardInterrupt, Terminated) as exc:
            record_error(trial, exc)
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
            log.error("sweep stopped during trial %d (%s); continue it with `lakehouse tune --resume %s`",
                      trial.number, type(exc).__name__, name)
            raise
        except Exception as exc:
            reason = record_error(trial, exc)
            outcome = TrialOutcome(trial.number, "FAIL", None, trial.user_attrs.get(ATTR_RUN_ID), reason=reason)
            outcome = _tell(op, parent.client, trial, outcome, state=TrialState.FAIL)
        else:
            if outcome.state == "PRUNED":
                outcome = _tell(op, parent.client, trial, outcome, state=TrialState.PRUNED)
            else:
                outcome = _tell(op, parent.client, trial, outcome, values=outcome.value)
    _pin_version(study, shared)
    outcome.elapsed_s = time.monotonic() - started
    best = best_trial(study)
    log.info("%s", progress_line(trial.number, counted(study), total, outcome, best, metric,
                                 time.monotonic() - t0))
    log_best(parent.client, parent.run_id, best, metric, trial.number)
    return outcome


def run_tune(spark, cfg: Config, space_path: Optional[str] = None, n_trials: Optional[int] = None,
             timeout_s: Optional[float] = None, resume: Optional[str] = None) -> Dict[str, Any]:
    """Run (or resume) a sweep; returns the summary that `lakehouse tune` prints as its last line of JSON.

    `n_trials` (`--trials`) and `timeout_s` (`--timeout`), when given, set `tune.n_trials` and `tune.timeout_s`; on
    `resume`, `n_trials` replaces the study's count (without it the study keeps its own).

    Raises:
        ConfigError: a bad space, study, resume, trial count or timeout (named).
        KeyboardInterrupt, Terminated: the sweep was stopped; the running trial is marked failed, the study kept
            (continue with `--resume`).
    """
    from optuna.trial import TrialState

    from pipeline.tracking.runs import configure  # local: mlflow, preloaded on a thread

    cfg = sweep_config(cfg, n_trials, timeout_s)  # before anything logs or uses the config
    quiet_optuna()
    configure(cfg.mlflow)  # fail fast, before any Spark work, when MLflow is unreachable
    op = _open(cfg, space_path, n_trials is not None, resume)
    study, url, space, total = op.study, op.url, op.space, op.total
    if cfg.tune.n_trials != total:  # a resume that keeps the study's own count: the config shows the one in use
        cfg = apply_overrides(cfg, {"tune.n_trials": total})
    name = study.study_name
    timeout = cfg.tune.timeout_s
    metric = cfg.tune.metric
    # every cache entry the sweep converts or hits stays leased until the sweep ends: later trials reuse it
    leases = JobLeases(f"tune study {name}")
    shared = SharedData(lambda c, version: prepare_data(spark, c, leases, version=version),
                        study.user_attrs.get(ATTR_DELTA_VERSION))
    # beside the config's own params (tune.* as this sweep runs them): what this study resolved them to, and the space
    params = {"study.name": name, "study.storage": redact_url(url), "study.pruner": describe_pruner(cfg),
              "study.n_trials": total, **{f"space.{k}": v for k, v in space.describe().items()}}
    # params cannot change on a resumed parent run: these tags show what the latest sweep on the study runs with
    in_use = {"tune.n_trials": str(total), "tune.timeout_s": "null" if timeout is None else str(timeout)}
    t0 = time.monotonic()
    with leases, parent_run(cfg, study, name, params, in_use) as parent:
        _fail_runs(parent.client, op.failed)
        if not space.needs_conversion():
            shared.for_config(cfg)  # convert (or hit the cache) once, before the first trial
            _pin_version(study, shared)
        while _next_trial(op, cfg, shared, parent, t0, timeout) is not None:
            pass

        best = best_trial(study)
        registered: Dict[str, Any] = {}
        if best is not None:
            registered = _register_best(cfg, parent.client, study, best)
        else:
            log.warning("study %r has no completed trial; nothing registered", name)
        trials = study.get_trials(deepcopy=False)
        states = [t.state for t in trials]
        summary = {
            "study": name,
            "storage": redact_url(url),
            "trials": counted(study),
            "asked": total,
            "complete": states.count(TrialState.COMPLETE),
            "pruned": states.count(TrialState.PRUNED),
            "failed": states.count(TrialState.FAIL),
            "running": states.count(TrialState.RUNNING),  # trials of another sweep on the study, still training
            "best_trial": best.number if best is not None else None,
            "best_value": best.value if best is not None else None,
            "best_params": best.params if best is not None else None,
            "metric": metric,
            "direction": cfg.tune.direction,
            "parent_run_id": parent.run_id,
            "best_run_id": best.user_attrs.get(ATTR_RUN_ID) if best is not None else None,
            "model_name": cfg.mlflow.registered_model,
            "model_version": int(registered["version"]) if registered.get("version") else None,
            "champion": bool(registered.get("champion")),
            "conversions": shared.conversions,
            "failures": {str(t.number): failure_reason(t) for t in trials if t.state == TrialState.FAIL},
            "elapsed_s": round(time.monotonic() - t0, 1),
            "tracking_uri": redact_url(parent.tracking_uri),
        }
        log_study_artifacts(parent.client, parent.run_id, study, space.text, summary)
        if best is not None:
            parent.client.log_metric(parent.run_id, "best_value", float(best.value))
    return summary
