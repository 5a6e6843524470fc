"""Model registry: register a logged model as a version, and the promotion gate that moves the champion alias."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from pipeline.log import get_logger

log = get_logger(__name__)

GATE_MODES = ("max", "min")
# The tag on a model version that records what the gate decided about it.
GATE_TAG = "gate_decision"


class RegistryError(RuntimeError):
    """Registering or promoting a model version failed; the message names the model and version."""


def _error_code(exc: BaseException) -> str:
    return str(getattr(exc, "error_code", ""))


def _model_id_of(model_uri: str) -> Optional[str]:
    """`models:/m-<id>` -> `m-<id>` (an MLflow 3 logged model); registry URIs (`models:/name/1`) -> None."""
    if model_uri.startswith("models:/"):
        rest = model_uri[len("models:/"):].strip("/")
        if rest and "/" not in rest and "@" not in rest and rest.startswith("m-"):
            return rest
    return None


def _logged_model_for_runs_uri(client: MlflowClient, model_uri: str) -> Optional[str]:
    """`runs:/<run_id>/<name>` -> the id of the logged model named `name` that the run output, if any."""
    rest = model_uri[len("runs:/"):].strip("/")
    run_id, _, name = rest.partition("/")
    run = client.get_run(run_id)
    outputs = run.outputs.model_outputs if run.outputs else []
    best: Optional[Tuple[int, str]] = None
    for out in outputs:
        model = client.get_logged_model(out.model_id)
        if model.name == name and (best is None or out.step >= best[0]):
            best = (out.step, out.model_id)
    return best[1] if best else None


def register_model(client: MlflowClient, model_uri: str, name: str, run_id: str, tags: Dict[str, str],
                   wait_s: float = 120.0) -> str:
    """Create a version of registered model `name` from `model_uri`, tagged; wait until it is READY.

    Tags should carry run_id, delta_table, delta_version and the validation metric (e.g. val_acc),
    which the promotion gate reads. Returns the version (a string, e.g. "3").
    """
    try:
        client.create_registered_model(name)
        log.info("created registered model %r", name)
    except MlflowException as exc:
        if "ALREADY_EXISTS" not in _error_code(exc):
            raise RegistryError(f"cannot create registered model {name!r}: {exc.message}") from exc
    all_tags = {"run_id": run_id, **{str(k): str(v) for k, v in (tags or {}).items()}}
    model_id = _model_id_of(model_uri)
    source = model_uri
    if model_id is None and model_uri.startswith("runs:/"):
        model_id = _logged_model_for_runs_uri(client, model_uri)
        if model_id is not None:
            source = f"models:/{model_id}"
    mv = client.create_model_version(name=name, source=source, run_id=run_id, tags=all_tags,
                                     await_creation_for=0, model_id=model_id)
    mv = _wait_ready(client, name, mv, wait_s)
    log.info("registered %s as model %r version %s", model_uri, name, mv.version)
    return str(mv.version)


def _wait_ready(client: MlflowClient, name: str, mv: ModelVersion, wait_s: float) -> ModelVersion:
    deadline = time.monotonic() + wait_s
    delay = 0.2
    while True:
        status = str(mv.status)
        if status == "READY":
            return mv
        if status == "FAILED_REGISTRATION":
            raise RegistryError(f"model {name!r} version {mv.version} failed to register: "
                                f"{mv.status_message or 'no message'}")
        if time.monotonic() >= deadline:
            raise RegistryError(f"model {name!r} version {mv.version} is still {status} after {wait_s:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 5.0)
        mv = client.get_model_version(name, mv.version)


@dataclass
class PromotionDecision:
    """What the gate decided about one model version, with the numbers it compared."""

    promoted: bool
    version: str
    metric: str
    value: Optional[float]
    champion_version: Optional[str]
    champion_value: Optional[float]
    reason: str


def decide(version: str, value: float, champion_version: Optional[str], champion_value: Optional[float],
           metric: str = "val_acc", mode: str = "max") -> PromotionDecision:
    """The gate's pure rule: promote when there is no champion or `value` is at least as good as its value."""
    if mode not in GATE_MODES:
        raise ValueError(f"config key 'mlflow.gate_mode': {mode!r} is not one of {', '.join(GATE_MODES)}")
    version = str(version)
    champ = None if champion_version is None else str(champion_version)
    better_word = "higher" if mode == "max" else "lower"

    def out(promoted: bool, reason: str) -> PromotionDecision:
        return PromotionDecision(promoted, version, metric, value, champ, champion_value, reason)

    if value is None or math.isnan(value):
        return out(False, f"version {version} has {metric}={value}, which cannot be compared; not promoted")
    if champ is None:
        return out(True, f"no champion yet; version {version} ({metric}={value:g}) becomes champion")
    if champ == version:
        return out(True, f"version {version} ({metric}={value:g}) is already the champion")
    if champion_value is None or math.isnan(champion_value):
        return out(True, f"champion version {champ} has no comparable {metric} ({champion_value}); "
                         f"version {version} ({metric}={value:g}) replaces it")
    good = value >= champion_value if mode == "max" else value <= champion_value
    if good:
        return out(True, f"version {version} {metric}={value:g} is at least as good as champion version {champ} "
                         f"{metric}={champion_value:g} ({better_word} is better); promoted")
    return out(False, f"champion version {champ} {metric}={champion_value:g} is better than version {version} "
                      f"{metric}={value:g} ({better_word} is better); champion kept")


def version_metric(client: MlflowClient, name: str, version: str, metric: str) -> Optional[float]:
    """The version's `metric`: its model version tag named `metric`, else its run's metric; None if neither."""
    mv = client.get_model_version(name, str(version))
    raw = (mv.tags or {}).get(metric)
    if raw is not None:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"model {name!r} version {version}: tag {metric!r} is {raw!r}, not a number") from None
    if mv.run_id:
        try:
            metrics = client.get_run(mv.run_id).data.metrics
        except MlflowException as exc:
            if "RESOURCE_DOES_NOT_EXIST" in _error_code(exc):
                return None
            raise
        if metric in metrics:
            return float(metrics[metric])
    return None


def _champion(client: MlflowClient, name: str, alias: str) -> Optional[ModelVersion]:
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        # No alias: RESOURCE_DOES_NOT_EXIST, or (SQLite store, 3.x) INVALID_PARAMETER_VALUE "alias ... not found".
        code = _error_code(exc)
        if "RESOURCE_DOES_NOT_EXIST" in code or ("INVALID_PARAMETER_VALUE" in code and "not found" in str(exc)):
            return None
        raise


def promote(client: MlflowClient, name: str, version: str, metric: str = "val_acc", mode: str = "max",
            alias: str = "champion") -> PromotionDecision:
    """Move `alias` to `version` only if its `metric` is at least as good as the current holder's.

    Raises:
        ValueError: the version has no `metric` (neither tag nor run metric), or `mode` is not max/min.
    """
    if mode not in GATE_MODES:
        raise ValueError(f"config key 'mlflow.gate_mode': {mode!r} is not one of {', '.join(GATE_MODES)}")
    version = str(version)
    value = version_metric(client, name, version, metric)
    if value is None:
        raise ValueError(f"model {name!r} version {version} has no metric {metric!r} (neither a model version tag "
                         f"{metric!r} nor a metric of its run); the promotion gate cannot judge it")
    current = _champion(client, name, alias)
    champion_version = str(current.version) if current is not None else None
    champion_value = None
    if current is not None and champion_version != version:
        champion_value = version_metric(client, name, champion_version, metric)
    decision = decide(version, value, champion_version, champion_value, metric, mode)
    if decision.promoted and champion_version != version:
        client.set_registered_model_alias(name, alias, version)
    try:
        client.set_model_version_tag(name, version, GATE_TAG, decision.reason[:5000])
    except MlflowException as exc:  # the decision stands even if the audit tag cannot be written
        log.warning("could not tag model %r version %s with the gate decision: %s", name, version, exc)
    log.info("promotion gate for model %r version %s: %s", name, version, decision.reason)
    return decision
