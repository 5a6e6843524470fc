"""Model registry: register a logged model as a version (tagged, described, READY); the promotion gate that moves the
champion alias is pipeline.tracking.gate, the rows it scores on pipeline.tracking.heldout (both import this one)."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

from mlflow import MlflowClient
from mlflow.entities import LoggedModelStatus
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from pipeline.config import ConfigError
from pipeline.log import get_logger
from pipeline.redact import redact_url

log = get_logger(__name__)


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


def logged_model_ready(model: Any) -> bool:
    """Whether MLflow logged model `model` is READY. MLflow links a logged model to its run before it uploads the
    artifacts: one whose upload failed (FAILED) or never ended (PENDING: the process died) has none, cannot be loaded,
    and is never registered or resumed from (pipeline.tracking.offline takes this check too)."""
    return str(model.status) == str(LoggedModelStatus.READY)


def _ready_logged_model(client: MlflowClient, model_id: str, model_uri: str, name: str, run_id: str) -> None:
    """Refuse (RegistryError) to register logged model `model_id` unless it is READY (`logged_model_ready`)."""
    model = client.get_logged_model(model_id)
    if not logged_model_ready(model):
        raise RegistryError(f"{model_uri}: logged model {model_id} of run {model.source_run_id or run_id} is "
                            f"{model.status}, not READY (the artifact upload failed or never ended): not registered "
                            f"as a version of {name!r}; log the model again")


def _logged_model_for_runs_uri(client: MlflowClient, model_uri: str) -> Optional[str]:
    """`runs:/<run_id>/<name>` -> the id of the READY logged model named `name` that the run output (the highest
    step; of those, the last output), or None when the run output no model of that name.

    Raises:
        RegistryError: the run output models named `name`, none READY: MLflow links a model to its run before it
            uploads the artifacts, so a FAILED or PENDING one has none and its version could not be loaded.
    """
    rest = model_uri[len("runs:/"):].strip("/")
    run_id, _, name = rest.partition("/")
    run = client.get_run(run_id)
    outputs = run.outputs.model_outputs if run.outputs else []
    best: Optional[Tuple[int, str]] = None
    not_ready = []
    for out in outputs:
        model = client.get_logged_model(out.model_id)
        if model.name != name:
            continue
        if not logged_model_ready(model):
            not_ready.append(f"{out.model_id} ({model.status})")
        elif best is None or out.step >= best[0]:
            best = (out.step, out.model_id)
    if best is None and not_ready:
        raise RegistryError(f"{model_uri}: run {run_id}'s logged model(s) named {name!r} are not READY: "
                            f"{', '.join(not_ready)} (the artifact upload failed or never ended); log the model again")
    return best[1] if best else None


def register_model(client: MlflowClient, model_uri: str, name: str, run_id: str, tags: Dict[str, str],
                   wait_s: float = 120.0, metrics: Optional[Dict[str, float]] = None) -> str:
    """Create a version of registered model `name` from `model_uri`, tagged; wait until it is READY.

    Tags should carry run_id, delta_table, delta_version and the validation metric (e.g. val_acc),
    which the promotion gate reads. `metrics`: those of the epoch whose weights `model_uri` holds, which the
    version's description lists (None: the run's latest values). Returns the version (a string, e.g. "3").

    Raises:
        RegistryError: `model_uri` names a logged model (`models:/m-<id>`, or those through `runs:/<run_id>/<name>`)
            not READY (FAILED or PENDING: its artifacts were never all uploaded; the message names it, its state and
            its run): nothing is registered. Or registered model `name` cannot be created.
    """
    model_id = _model_id_of(model_uri)
    source = model_uri
    if model_id is not None:
        _ready_logged_model(client, model_id, model_uri, name, run_id)
    elif model_uri.startswith("runs:/"):
        model_id = _logged_model_for_runs_uri(client, model_uri)
        if model_id is not None:
            source = f"models:/{model_id}"
    try:
        client.create_registered_model(name)
        log.info("created registered model %r", name)
    except MlflowException as exc:
        if "ALREADY_EXISTS" not in _error_code(exc):
            raise RegistryError(f"cannot create registered model {name!r}: {exc.message}") from exc
    # a table or URL with its credentials (s3a://KEY:SECRET@bucket/...) is recorded with them redacted (pipeline.redact)
    all_tags = {"run_id": run_id, **{str(k): redact_url(str(v)) for k, v in (tags or {}).items()}}
    mv = client.create_model_version(name=name, source=source, run_id=run_id, tags=all_tags,
                                     await_creation_for=0, model_id=model_id)
    mv = _wait_ready(client, name, mv, wait_s)
    _describe(client, name, str(mv.version), all_tags, source, metrics)
    log.info("registered %s as model %r version %s", model_uri, name, mv.version)
    return str(mv.version)


# Metrics a version's description lists (those of its weights' epoch; else its run's latest values), when logged.
DESCRIBED_METRICS = ("val_acc", "val_loss", "train_acc", "train_loss")


def version_description(name: str, version: str, tags: Dict[str, str], metrics: Dict[str, float],
                        model_meta: Optional[Dict[str, Any]] = None) -> str:
    """The registered version's description (Markdown): the data it was trained on, its metrics, how to call it."""
    uri = f"models:/{name}/{version}"
    meta = model_meta or {}
    lines = [f"Image classifier `{uri}`."]
    if tags.get("delta_table"):
        lines += ["", f"**Data**: Delta table `{redact_url(tags['delta_table'])}` pinned at version "
                      f"{tags.get('delta_version', '?')} (validation rows: the run's data.val_fraction and "
                      f"data.split_key, pipeline.lakehouse.split)."]
    shown = {k: metrics[k] for k in DESCRIBED_METRICS if k in metrics}
    if shown:
        lines += ["", "**Metrics** (its training run): " + ", ".join(f"{k}={v:.4g}" for k, v in shown.items())
                  + ". The promotion gate's same-rows scores are the version's `gate_*` tags."]
    if meta:
        classes = meta.get("class_names") or []
        lines += ["", f"**Input**: a `content` column of encoded images (PNG/JPEG bytes; in JSON, base64 strings), "
                      f"decoded to {meta.get('channels', '?')} channel(s) at {meta.get('image_size', '?')} px. "
                      f"**Output**: label, label_index, probability, probabilities over {len(classes)} classes "
                      f"({', '.join(map(str, classes[:20]))}{', ...' if len(classes) > 20 else ''})."]
    lines += [
        "", "**Use it**:", "",
        "```",
        "# batch: a Delta table (path, content) -> a Delta table of predictions, one commit",
        f"lakehouse predict --model {uri} --table <delta path> --out <delta path>",
        "# HTTP",
        f"mlflow models serve -m {uri} --env-manager local -h 127.0.0.1 -p 5000",
        "curl -s http://127.0.0.1:5000/invocations -H 'Content-Type: application/json' \\",
        "  -d '{\"dataframe_split\": {\"columns\": [\"content\"], \"data\": [[\"'$(base64 -w0 digit.png)'\"]]}}'",
        "# Python",
        f"mlflow.pyfunc.load_model('{uri}').predict(pandas.DataFrame({{'content': [open('digit.png', 'rb').read()]}}))",
        "# ONNX / TorchScript with the preprocessing contract",
        f"lakehouse export --model {uri} --format onnx",
        "```",
    ]
    return "\n".join(lines)


def _describe(client: MlflowClient, name: str, version: str, tags: Dict[str, str], source: str,
              metrics: Optional[Dict[str, float]] = None) -> None:
    """Write the version's description; a failure is logged, never fatal (the version is registered).

    `metrics` given (even empty) are the registered epoch's and the only ones listed: the run's latest values may be
    another epoch's (early stopping), so they are read only where no epoch is known (None: a model logged outside a
    training run)."""
    given = metrics
    metrics = dict(given or {})
    meta: Dict[str, Any] = {}
    try:
        if given is None and tags.get("run_id"):
            metrics = dict(client.get_run(tags["run_id"]).data.metrics)
    except MlflowException as exc:
        log.warning("model %r version %s: run %s metrics not read for the description: %s", name, version,
                    tags.get("run_id"), exc)
    try:
        import mlflow.models

        meta = dict(mlflow.models.get_model_info(source).metadata or {})
    except Exception as exc:  # not a model logged by pipeline.tracking.pyfunc: no input section
        log.debug("model %r version %s: no model metadata for the description (%s)", name, version, exc)
    try:
        client.update_model_version(name, version, description=version_description(name, version, tags, metrics,
                                                                                    meta))
    except MlflowException as exc:
        log.warning("could not write the description of model %r version %s: %s", name, version, exc)


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


def name_filter(name: str) -> Optional[str]:
    """MLflow's search filter `name = <name>` for registered model `name`, whatever quote it holds: MLflow's filter
    syntax has no escape inside a quoted value (`name='bob\\'s'` and `name='bob''s'` match nothing, `name='bob's'` is
    refused), so a name with a single quote is quoted with double quotes, any other with single quotes. None for a
    name with both quote characters: no filter string can name it (`model_versions` then filters by other means)."""
    if "'" not in name:
        return f"name='{name}'"
    if '"' not in name:
        return f'name="{name}"'
    return None


def model_versions(client: MlflowClient, name: str, run_id: Optional[str] = None) -> List[ModelVersion]:
    """The versions of registered model `name` (those registered from run `run_id` when given), whatever characters
    its name holds (`name_filter`). A name with both quote characters, which no filter can name: the run's versions
    (with `run_id`), else every version in the registry page by page, kept where the name is equal."""
    by_name = name_filter(name)
    by_run = f"run_id='{run_id}'" if run_id is not None else None
    if by_name is not None:
        return list(client.search_model_versions(by_name if by_run is None else f"{by_name} and {by_run}"))
    if by_run is not None:
        return [mv for mv in client.search_model_versions(by_run) if mv.name == name]
    found: List[ModelVersion] = []
    token = None
    while True:
        page = client.search_model_versions(page_token=token)
        found.extend(mv for mv in page if mv.name == name)
        token = getattr(page, "token", None)
        if not token:
            return found


def latest_version(client: MlflowClient, name: str) -> str:
    """The highest version number of registered model `name`; a ConfigError names the key when it has none (or a
    name no search can name, see `model_versions`)."""
    versions = model_versions(client, name)
    if not versions:
        raise ConfigError(f"config key 'mlflow.registered_model': no versions of model {name!r}")
    return str(max(int(v.version) for v in versions))
