"""What a sweep shows: the study's MLflow parent run (opened, reopened on resume, closed with its status), its
artifacts (space, trials, best, optimization history and parameter importance plots) and the per-trial progress line."""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from typing import Any, Dict, Iterator, List, Optional

from pipeline.config import Config
from pipeline.log import get_logger
from pipeline.tune.study import ATTR_PARENT_RUN, ATTR_RUN_ID, failure_reason

log = get_logger(__name__)


def _status_of(client, run_id: str) -> Optional[str]:
    try:
        return client.get_run(run_id).info.status
    except Exception:
        return None


@contextlib.contextmanager
def parent_run(cfg: Config, study, study_name: str, params: Dict[str, Any],
               in_use: Optional[Dict[str, str]] = None) -> Iterator[Any]:
    """The study's parent run (`tracked_run`): created with the study, reopened when the sweep resumes; ended
    FINISHED, KILLED (Ctrl-C, SIGTERM) or FAILED. SIGTERM raises `Terminated` in the main thread meanwhile.
    The config and `params` are logged once, with the run; `in_use` as tags by every sweep, new or resumed (a
    param's value cannot change: a resume with another trial count or timeout shows it there).
    """
    from mlflow.entities import Param, RunTag

    from pipeline.tracking.lineage import BATCH_LIMIT, log_config  # local: mlflow, preloaded on a thread
    from pipeline.tracking.runs import configure, tracked_run  # local: mlflow, preloaded on a thread

    run_id = study.user_attrs.get(ATTR_PARENT_RUN)
    if run_id and _status_of(configure(cfg.mlflow), run_id) is None:
        log.warning("the parent run %s of study %r is gone; a new one is started", run_id, study_name)
        run_id = None
    tags = {"optuna.study": study_name, "lakehouse.job": "tune"}
    with tracked_run(cfg, run_name=f"tune-{study_name}", tags=tags, reopen=run_id) as run:
        if not run_id:
            study.set_user_attr(ATTR_PARENT_RUN, run.run_id)
            log_config(run.client, run.run_id, cfg)
            items = [Param(k, str(v)[:500]) for k, v in params.items()]
            for start in range(0, len(items), BATCH_LIMIT):
                run.client.log_batch(run.run_id, params=items[start:start + BATCH_LIMIT], synchronous=True)
        if in_use:
            run.client.log_batch(run.run_id, tags=[RunTag(k, v) for k, v in in_use.items()], synchronous=True)
        yield run


def progress_line(number: int, done: int, total: int, outcome, best: Optional[Any], metric: str,
                  elapsed_s: float) -> str:
    """`trial 3/8 (#2) COMPLETE: val_loss 0.4123; best 0.3871 (#1); 41.2 s (sweep 2.1 min)`."""
    if outcome.state == "COMPLETE":
        what = f"{metric} {outcome.value:.4g}"
    elif outcome.state == "PRUNED":
        what = outcome.reason or "pruned"
    else:
        what = outcome.reason or "failed"
    best_txt = f"best {best.value:.4g} (#{best.number})" if best is not None else "no best yet"
    return (f"trial {done}/{total} (#{number}) {outcome.state}: {what}; {best_txt}; "
            f"{outcome.elapsed_s:.1f} s (sweep {elapsed_s / 60:.1f} min)")


def log_best(client, run_id: str, best, metric: str, step: int) -> None:
    """The best so far on the parent run: tags best_trial / best_value / best.<key>, metric best_<metric> by trial,
    in one request (it runs after every trial: one store round trip, not one per tag)."""
    import time

    from mlflow.entities import Metric, RunTag

    if best is None:
        return
    tags = {"best_trial": str(best.number), "best_value": repr(best.value)}
    tags.update({f"best.{k}": str(v) for k, v in best.params.items()})
    try:
        client.log_batch(run_id, metrics=[Metric(f"best_{metric}", float(best.value), int(time.time() * 1000), step)],
                         tags=[RunTag(k, v[:5000]) for k, v in tags.items()], synchronous=True)
    except Exception as exc:
        log.warning("could not log the best so far (best_%s, tags best.*) on run %s: %s", metric, run_id, exc)


def save_plots(study, folder: str) -> List[str]:
    """The optimization history and parameter importance as PNGs (Optuna's matplotlib plots); a plot Optuna cannot
    draw yet (importance needs two finished trials) is skipped with the reason in the log."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ovm

    out = []
    for name, draw in (("optimization_history", ovm.plot_optimization_history),
                       ("param_importances", ovm.plot_param_importances)):
        path = os.path.join(folder, f"{name}.png")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ax = draw(study)
            fig = (ax.flat[0] if hasattr(ax, "flat") else ax).figure
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            plt.close(fig)
            out.append(path)
        except Exception as exc:
            log.warning("no %s plot: %s: %s", name, type(exc).__name__, exc)
    return out


def trial_rows(study) -> List[Dict[str, Any]]:
    from optuna.trial import TrialState

    rows = []
    for t in study.get_trials(deepcopy=False):
        rows.append({"number": t.number, "state": t.state.name,
                     "value": t.value if t.value is not None and math.isfinite(t.value) else None,
                     "params": t.params, "mlflow_run_id": t.user_attrs.get(ATTR_RUN_ID),
                     "error": failure_reason(t) if t.state == TrialState.FAIL else None,
                     "last_epoch": max(t.intermediate_values) if t.intermediate_values else None,
                     "duration_s": t.duration.total_seconds() if t.duration else None})
    return rows


def log_study_artifacts(client, run_id: str, study, space_text: str, summary: Dict[str, Any]) -> None:
    """space.yaml, trials.json, best.json and the plots (plots/) on the parent run."""
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "space.yaml"), "w") as fh:
            fh.write(space_text)
        with open(os.path.join(tmp, "trials.json"), "w") as fh:
            json.dump(trial_rows(study), fh, indent=1, default=str)
        with open(os.path.join(tmp, "best.json"), "w") as fh:
            json.dump(summary, fh, indent=1, default=str)
        for name in ("space.yaml", "trials.json", "best.json"):
            client.log_artifact(run_id, os.path.join(tmp, name))
        plots = os.path.join(tmp, "plots")
        os.makedirs(plots)
        for path in save_plots(study, plots):
            client.log_artifact(run_id, path, "plots")
