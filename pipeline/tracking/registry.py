"""Model registry: register a logged model as a version, and the promotion gate that moves the champion alias.

Concurrent gates (two trains, or `lakehouse promote` / `sync-run` beside a train, finishing together) are correct
because the alias is moved with a compare-and-set that MLflow's registry does not offer, built here:
  1. outside any lock, the gate scores its challenger and the current alias holder on the same held-out rows
     (seconds to minutes);
  2. it takes the alias's lease (pipeline.tracking.lease: a registered-model tag `gate_lease.<alias>`, one holder
     at a time, bounded by a ttl) and re-reads the alias holder;
  3. if the holder is one it has scored, it decides and, still under the lease (checked just before), moves the
     alias; if the holder changed since it scored, it releases the lease, scores the new holder on the same rows,
     and goes back to 2 (at most MAX_GATE_ROUNDS times).
So every alias write is decided against the holder it replaces, on the same rows: the alias ends on the best of the
versions the gates compared, and a gate that loses (its champion moved to a better model) says so in its decision.
The assumption is the lease's: every gate uses the same lease times, a registry call completes within
`LeaseTimes.settle_s` (each gate refuses a lease whose write took longer), and hosts' clocks agree to within the
lease's margin. Something that moves the alias without this gate (by hand, another tool) is not excluded by it.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from pipeline.config import MlflowConfig
from pipeline.log import get_logger
from pipeline.tracking.lease import Lease, LeaseHeld, LeaseLost, LeaseTimes

log = get_logger(__name__)

GATE_MODES = ("max", "min")
# The tag on a model version that records what the gate decided about it.
GATE_TAG = "gate_decision"
# The registered-model tag holding the gate's lease on an alias (its key: LEASE_TAG + "." + alias).
LEASE_TAG = "gate_lease"
# How many times one gate re-scores a champion that moved while it scored before it gives up.
MAX_GATE_ROUNDS = 5


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
    _describe(client, name, str(mv.version), all_tags, source)
    log.info("registered %s as model %r version %s", model_uri, name, mv.version)
    return str(mv.version)


# Metrics a version's description lists (its run's latest values), when the run logged them.
DESCRIBED_METRICS = ("val_acc", "val_loss", "train_acc", "train_loss")


def version_description(name: str, version: str, tags: Dict[str, str], metrics: Dict[str, float],
                        model_meta: Optional[Dict[str, Any]] = None) -> str:
    """The registered version's description (Markdown): the data it was trained on, its metrics, how to call it."""
    uri = f"models:/{name}/{version}"
    meta = model_meta or {}
    lines = [f"Image classifier `{uri}`."]
    if tags.get("delta_table"):
        lines += ["", f"**Data**: Delta table `{tags['delta_table']}` pinned at version {tags.get('delta_version', '?')}"
                      f" (validation rows: the `path` CRC-32 split rule, pipeline.lakehouse.partition)."]
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


def _describe(client: MlflowClient, name: str, version: str, tags: Dict[str, str], source: str) -> None:
    """Write the version's description; a failure is logged, never fatal (the version is registered)."""
    metrics: Dict[str, float] = {}
    meta: Dict[str, Any] = {}
    try:
        if tags.get("run_id"):
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


@dataclass
class PromotionDecision:
    """What the gate decided about one model version, with the numbers it compared (same rows for both)."""

    promoted: bool
    version: str
    metric: str
    value: Optional[float]
    champion_version: Optional[str]
    champion_value: Optional[float]
    reason: str
    margin: float = 0.0
    rows: Optional[str] = None  # what both were scored on, e.g. "val split of work/delta/digits version 3 (361 rows)"
    error: Optional[str] = None  # why a model could not be scored (the decision is then "not promoted")
    # the alias holders that moved while this gate scored (another gate crowned them), oldest first
    moved_from: Optional[List[str]] = None
    chance: Optional[float] = None  # what a constant guess scores on the same rows (see `chance_level`); None: unknown
    min_lift: Optional[float] = None  # the margin over `chance` a version must beat; None: no chance floor


def chance_what(metric: str, mode: str) -> Optional[str]:
    """What a constant guess scores for `metric` in `mode`, in words, or None where the gate knows no such baseline:
    an accuracy (`*acc*`, max) -> the majority class's share; a loss (`*_loss`, min: cross-entropy) -> the entropy of
    the labels (the class-prior guess's cross-entropy)."""
    if mode == "max" and "acc" in metric:
        return "a constant guess of the majority class"
    if mode == "min" and metric.endswith("_loss"):
        return "the class-prior guess's cross-entropy, the entropy of the labels"
    return None


def chance_level(metric: str, mode: str, labels: Sequence[Optional[str]]) -> Optional[float]:
    """What the best constant guess scores on rows with these true `labels` (see `chance_what`); None when the metric
    has no known baseline or there are no labelled rows.

    Accuracy: the majority class's count over all rows (a row without a label is wrong for any guess, as the scorer
    counts it). Loss: the entropy (nats) of the labelled rows' class distribution.
    """
    kind = chance_what(metric, mode)
    counts = Counter(label for label in labels if label is not None)
    if kind is None or not counts:
        return None
    if mode == "max":
        return max(counts.values()) / len(labels)
    total = sum(counts.values())
    return float(-sum(n / total * math.log(n / total) for n in counts.values()))


def clears_chance(value: Optional[float], chance: Optional[float], min_lift: Optional[float], mode: str) -> bool:
    """`value` beats `chance` by more than `min_lift` (max: value > chance + lift; min: value < chance - lift); True
    when there is no floor (`chance` or `min_lift` None); False for a value that is not a number."""
    if value is None or math.isnan(value):
        return False
    if chance is None or min_lift is None:
        return True
    return value - chance > min_lift if mode == "max" else chance - value > min_lift


def decide(version: str, value: Optional[float], champion_version: Optional[str], champion_value: Optional[float],
           metric: str = "val_acc", mode: str = "max", margin: float = 0.0,
           champion_error: Optional[str] = None, chance: Optional[float] = None,
           min_lift: Optional[float] = None) -> PromotionDecision:
    """The gate's pure rule: promote when `value` beats the chance level by more than `min_lift` (the floor, see
    `chance_level`; none when `chance` or `min_lift` is None) and there is no champion, or it beats the champion's
    value (measured on the same rows) by more than `margin` (max: value > champion + margin; min: value < champion -
    margin).

    A tie never promotes; neither does a champion that could not be scored (`champion_error`) nor a value that
    is not a number. The floor holds for the first version too: a useless first model is not crowned.
    """
    if mode not in GATE_MODES:
        raise ValueError(f"config key 'mlflow.gate_mode': {mode!r} is not one of {', '.join(GATE_MODES)}")
    if margin is None or not margin >= 0:
        raise ValueError(f"config key 'mlflow.gate_margin': {margin!r} must be a number >= 0")
    if min_lift is not None and not min_lift >= 0:
        raise ValueError(f"config key 'mlflow.gate_min_lift': {min_lift!r} must be a number >= 0 or null")
    version = str(version)
    champ = None if champion_version is None else str(champion_version)
    better_word = "higher" if mode == "max" else "lower"

    def out(promoted: bool, reason: str) -> PromotionDecision:
        return PromotionDecision(promoted, version, metric, value, champ, champion_value, reason, margin,
                                 error=champion_error, chance=chance, min_lift=min_lift)

    if value is None or math.isnan(value):
        return out(False, f"version {version} has {metric}={value}, which cannot be compared; not promoted")
    if champ == version:
        return out(True, f"version {version} ({metric}={value:g}) is already the champion")
    what = chance_what(metric, mode)
    if min_lift is None:
        floor = "no chance floor (mlflow.gate_min_lift is null)"
    elif chance is None:
        floor = (f"no chance floor: no known chance level for {metric} in {mode} mode" if what is None else
                 f"no chance floor: no labelled rows to measure {what} on")
    elif not clears_chance(value, chance, min_lift, mode):
        kept = f"champion version {champ} kept" if champ is not None else "no champion yet, none crowned"
        return out(False, f"version {version} {metric}={value:g} does not beat chance {metric}={chance:g} ({what} "
                          f"on the same rows) by more than mlflow.gate_min_lift {min_lift:g} ({better_word} is "
                          f"better); registered, not promoted ({kept})")
    else:
        floor = f"beats chance {chance:g} ({what}) by {abs(value - chance):g} > min lift {min_lift:g}"
    if champ is None:
        return out(True, f"no champion yet; version {version} ({metric}={value:g}) becomes champion; {floor}")
    if champion_error is not None:
        return out(False, f"champion version {champ} could not be scored ({champion_error}); version {version} "
                          f"({metric}={value:g}) is not promoted: fix or move the alias by hand")
    if champion_value is None or math.isnan(champion_value):
        return out(False, f"champion version {champ} has {metric}={champion_value}, which cannot be compared; "
                          f"version {version} ({metric}={value:g}) is not promoted: move the alias by hand")
    gain = value - champion_value if mode == "max" else champion_value - value
    if gain > margin:
        return out(True, f"version {version} {metric}={value:g} beats champion version {champ} "
                         f"{metric}={champion_value:g} by {gain:g} > margin {margin:g} ({better_word} is better); "
                         f"promoted; {floor}")
    return out(False, f"version {version} {metric}={value:g} does not beat champion version {champ} "
                      f"{metric}={champion_value:g} by more than margin {margin:g} ({better_word} is better); "
                      f"champion kept")


# --- the rows both models are scored on --------------------------------------------------------------------------

@dataclass
class HeldOutRows:
    """The rows of one pinned Delta version that a split rule holds out: encoded images and their true labels."""

    table: str
    version: int
    split: str
    contents: List[bytes]
    labels: List[str]

    def describe(self) -> str:
        return f"{self.split} split of Delta table {self.table} version {self.version} ({len(self.labels)} rows)"


def split_of(metric: str) -> str:
    """The split a gate metric is measured on: `train_*` on the training rows, everything else on the val rows."""
    return "train" if metric.startswith("train_") else "val"


def _catalog_split_rows(table: str, version: int, val_fraction: float, split: str):
    """`split` of a catalog-named table (catalog.schema.table) at `version`, read through the active Spark session
    (the catalog's: delta-rs cannot resolve the name), as a pyarrow Table of the gate's columns.

    The split rule (pipeline.data.convert.split_frame, the one training uses) and the column selection run in Spark,
    so the driver collects only the held-out rows: a large catalog table is never collected whole.
    """
    import pyarrow as pa

    from pipeline.data.convert import split_frame
    from pipeline.lakehouse.delta import SparkDeltaEngine

    try:
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
    except ImportError:
        spark = None
    if spark is None:
        raise RegistryError(f"promotion gate: Delta table {table} is a catalog name; scoring its held-out rows needs "
                            f"the catalog's Spark session: run the gate where one is active (a Databricks job or "
                            f"notebook, `lakehouse train`)")
    try:
        df, _ = SparkDeltaEngine().read(spark, table, version)
    except Exception as exc:  # the catalog or delta-spark answers with its own exception types
        raise RegistryError(f"promotion gate: Delta table {table} version {version} cannot be read through the "
                            f"Spark session's catalog: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}") from exc
    missing = [c for c in ("path", "content", "label") if c not in df.columns]
    if missing:
        raise RegistryError(f"promotion gate: Delta table {table} version {version} has no column(s) "
                            f"{', '.join(missing)}; it has {df.columns}")
    train, val = split_frame(df.select("path", "content", "label").filter(df["path"].isNotNull()), val_fraction)
    pdf = (val if split == "val" else train).toPandas()
    return pa.Table.from_pandas(pdf, preserve_index=False)


def held_out_rows(table: str, version: int, val_fraction: float, split: str = "val") -> HeldOutRows:
    """Read `split` of Delta `table` at `version` with delta-rs (no Spark; a catalog name through the active Spark
    session, split there): the training split rule on `path`.

    Raises:
        RegistryError: the table, version or a needed column is missing, or the split has no rows.
    """
    import pyarrow.compute as pc

    from pipeline.lakehouse.delta import DeltaError, DeltaRsEngine, catalog_name
    from pipeline.lakehouse.partition import is_validation

    try:
        if catalog_name(table):
            rows = _catalog_split_rows(table, int(version), val_fraction, split)
        else:
            dataset = DeltaRsEngine()._open(table, int(version)).to_pyarrow_dataset()
            missing = [c for c in ("path", "content", "label") if c not in dataset.schema.names]
            if missing:
                raise RegistryError(f"promotion gate: Delta table {table} version {version} has no column(s) "
                                    f"{', '.join(missing)}; it has {dataset.schema.names}")
            paths = dataset.to_table(columns=["path"]).column("path").to_pylist()
            keep = [p for p in paths if p is not None and is_validation(p, val_fraction) == (split == "val")]
            rows = dataset.to_table(columns=["path", "content", "label"], filter=pc.field("path").isin(keep))
    except DeltaError as exc:
        raise RegistryError(f"promotion gate: {exc}") from None
    if rows.num_rows == 0:
        raise RegistryError(f"promotion gate: the {split} split of Delta table {table} version {version} "
                            f"(data.val_fraction={val_fraction}) has no rows to score")
    rows = rows.sort_by("path")
    return HeldOutRows(table, int(version), split, rows.column("content").to_pylist(),
                       [None if v is None else str(v) for v in rows.column("label").to_pylist()])


def score_on_rows(model_uri: str, rows: HeldOutRows, metric: str) -> float:
    """`metric` (`*_acc`: top-1 accuracy; `*_loss`: mean cross-entropy) of the pyfunc at `model_uri` on `rows`.

    The model is the one users serve: loaded with mlflow.pyfunc, called on the `content` column with
    on_error=null. An undecodable row counts as wrong and adds no loss.
    """
    import numpy as np
    import pandas as pd

    from pipeline.tracking.pyfunc import load_pyfunc

    model = load_pyfunc(model_uri)
    out = model.predict(pd.DataFrame({"content": rows.contents}), params={"on_error": "null"})
    if metric.endswith("_acc"):
        return float(np.mean([p is not None and p == t for p, t in zip(out["label"], rows.labels)]))
    if metric.endswith("_loss"):
        names = list((model.metadata.metadata or {}).get("class_names") or [])
        if not names:
            raise RegistryError(f"{model_uri} records no class_names in its MLflow model metadata; its loss on "
                                f"the held-out rows cannot be computed")
        where = {n: i for i, n in enumerate(names)}
        losses = [-math.log(max(float(p[where[t]]) if t in where else 0.0, 1e-12))
                  for p, t in zip(out["probabilities"], rows.labels) if p is not None]
        return float(np.mean(losses)) if losses else math.nan
    raise RegistryError(f"config key 'mlflow.gate_metric': {metric!r} is neither an accuracy (*_acc) nor a loss "
                        f"(*_loss); the gate cannot score it on held-out rows")


Scorer = Callable[[str, HeldOutRows, str], float]


def _champion(client: MlflowClient, name: str, alias: str) -> Optional[ModelVersion]:
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        # No alias: RESOURCE_DOES_NOT_EXIST, or (SQLite store, 3.x) INVALID_PARAMETER_VALUE "alias ... not found".
        code = _error_code(exc)
        if "RESOURCE_DOES_NOT_EXIST" in code or ("INVALID_PARAMETER_VALUE" in code and "not found" in str(exc)):
            return None
        raise


def _val_fraction(client: MlflowClient, mv: ModelVersion, fallback: float) -> float:
    """The val fraction the challenger was trained with (its run's `data.val_fraction` param), else `fallback`."""
    if mv.run_id:
        try:
            raw = client.get_run(mv.run_id).data.params.get("data.val_fraction")
        except MlflowException:
            raw = None
        if raw is not None:
            try:
                return float(raw)
            except ValueError:
                pass
    return float(fallback)


def _pinned_data(name: str, mv: ModelVersion) -> Tuple[str, int]:
    tags = mv.tags or {}
    missing = [t for t in ("delta_table", "delta_version") if not tags.get(t)]
    if missing:
        raise RegistryError(f"model {name!r} version {mv.version} has no tag(s) {', '.join(missing)}: the gate "
                            f"cannot tell which Delta version's held-out rows to score it on")
    try:
        return tags["delta_table"], int(tags["delta_version"])
    except ValueError:
        raise RegistryError(f"model {name!r} version {mv.version}: tag delta_version is "
                            f"{tags['delta_version']!r}, not a number") from None


class _ModelTags:
    """The registered model's tags as the lease's TagStore."""

    def __init__(self, client: MlflowClient, name: str):
        self.client, self.name = client, name

    def get(self, key: str) -> Optional[str]:
        return (self.client.get_registered_model(self.name).tags or {}).get(key)

    def set(self, key: str, value: str) -> None:
        self.client.set_registered_model_tag(self.name, key, value)

    def delete(self, key: str) -> None:
        self.client.delete_registered_model_tag(self.name, key)


def _chain(holders: List[Optional[str]]) -> str:
    """Alias holders in order, e.g. `version 4 -> version 6` (`no version` where the alias was unset)."""
    return " -> ".join(f"version {v}" if v is not None else "no version" for v in holders)


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:500] if str(exc) else ''}"


def _record(client: MlflowClient, name: str, version: str, tags: Dict[str, str]) -> None:
    for key, val in tags.items():
        try:
            client.set_model_version_tag(name, version, key, str(val)[:5000])
        except MlflowException as exc:  # the decision stands even if an audit tag cannot be written
            log.warning("could not tag model %r version %s with %s: %s", name, version, key, exc)


def promote(client: MlflowClient, name: str, version: str, metric: str = "val_acc", mode: str = "max",
            alias: str = "champion", margin: float = 0.0, val_fraction: float = 0.2,
            held_out: Optional[HeldOutRows] = None, scorer: Scorer = score_on_rows,
            lease: LeaseTimes = LeaseTimes(),
            min_lift: Optional[float] = MlflowConfig.gate_min_lift) -> PromotionDecision:
    """Score the challenger `version` and the `alias` holder on the same held-out rows; move `alias` only if the
    challenger beats the chance level of those rows by more than `min_lift` (`mlflow.gate_min_lift`; None: no such
    floor) and the holder by more than `margin` (see `decide`), with the compare-and-set of the module docstring:
    the holder is re-read under the alias's lease just before the move, and re-scored if it changed. A challenger
    under the floor stays registered, unpromoted; the holder is then not scored (nothing it scores could crown it).

    The rows: the `val` split (`train` for a `train_*` metric) of the Delta version the challenger was trained on
    (its tags delta_table, delta_version; the split rule with its run's data.val_fraction, else `val_fraction`),
    unless `held_out` is given. Both figures, the rows and the decision are recorded as tags of the challenger
    (gate_<metric>, gate_champion_<metric>, gate_champion_version, gate_rows, gate_margin, gate_chance_<metric> and
    gate_min_lift when the floor applies, gate_decision, and gate_champion_moved_from when the holder moved while it
    scored). A champion that cannot be loaded or scored leaves the alias where it is; the decision's `error` and
    reason name its version, and it is logged as an error.

    Raises:
        RegistryError: the challenger has no pinned data, or it cannot be loaded or scored; the alias's lease was
            held by another gate for longer than `lease.wait_s` (the message names it); the alias moved more than
            MAX_GATE_ROUNDS times while this gate scored.
        ValueError: `mode` is not max/min, `margin` < 0, or `min_lift` < 0.
    """
    if mode not in GATE_MODES:
        raise ValueError(f"config key 'mlflow.gate_mode': {mode!r} is not one of {', '.join(GATE_MODES)}")
    if margin is None or not margin >= 0:
        raise ValueError(f"config key 'mlflow.gate_margin': {margin!r} must be a number >= 0")
    if min_lift is not None and not min_lift >= 0:
        raise ValueError(f"config key 'mlflow.gate_min_lift': {min_lift!r} must be a number >= 0 or null")
    version = str(version)
    mv = client.get_model_version(name, version)
    if held_out is None:
        table, data_version = _pinned_data(name, mv)
        held_out = held_out_rows(table, data_version, _val_fraction(client, mv, val_fraction), split_of(metric))
    try:
        value = scorer(f"models:/{name}/{version}", held_out, metric)
    except Exception as exc:
        why = f"model {name!r} version {version} could not be scored on the {held_out.describe()}: {_one_line(exc)}"
        _record(client, name, version, {GATE_TAG: f"not promoted: {why}"})
        raise RegistryError(why) from exc
    chance = chance_level(metric, mode, held_out.labels)

    scores: Dict[str, float] = {}  # every alias holder this gate scored, on `held_out`
    errors: Dict[str, str] = {}  # ... or why it could not

    def score_holder(holder: str) -> None:
        try:
            scores[holder] = scorer(f"models:/{name}/{holder}", held_out, metric)
        except Exception as exc:
            errors[holder] = f"model {name!r} version {holder} ({alias}) cannot be loaded or scored: {_one_line(exc)}"

    def holder_now() -> Optional[str]:
        current = _champion(client, name, alias)
        return str(current.version) if current is not None else None

    seen = [holder_now()]  # the holders this gate scored against, in order
    decision: Optional[PromotionDecision] = None
    if not clears_chance(value, chance, min_lift, mode):  # nothing to move: no holder to score, no lease to take
        decision = decide(version, value, seen[-1], None, metric, mode, margin, None, chance, min_lift)
    for _ in range(MAX_GATE_ROUNDS if decision is None else 0):
        holder = seen[-1]
        if holder is not None and holder != version and holder not in scores and holder not in errors:
            score_holder(holder)  # outside the lease: scoring takes seconds to minutes
        gate_lease = Lease(_ModelTags(client, name), f"{LEASE_TAG}.{alias}",
                           what=f"promotion gate of model {name!r} version {version}", times=lease)
        try:
            gate_lease.acquire()
        except LeaseHeld as exc:
            why = f"promotion gate for model {name!r} version {version}: alias {alias!r} not moved: {exc}"
            _record(client, name, version, {f"gate_{metric}": f"{value:.6g}", GATE_TAG: f"not promoted: {why}"})
            raise RegistryError(why) from None
        try:
            now = holder_now()
            if now != holder:  # moved while this gate scored: score the new holder on the same rows, then again
                log.warning("promotion gate for model %r version %s: alias %r moved %s while this gate scored; "
                            "scoring the new holder on the same rows", name, version, alias, _chain([holder, now]))
                seen.append(now)
                continue
            decision = decide(version, value, holder, scores.get(holder), metric, mode, margin, errors.get(holder),
                              chance, min_lift)
            if decision.promoted and holder != version:
                gate_lease.check()
                client.set_registered_model_alias(name, alias, version)
            break
        except LeaseLost as exc:  # stalled past its margin, or taken: nothing written, judge again
            log.warning("promotion gate for model %r version %s: %s; trying again", name, version, exc)
            decision = None
        finally:
            gate_lease.release()
    if decision is None:
        why = (f"promotion gate for model {name!r} version {version}: no decision in {MAX_GATE_ROUNDS} rounds (alias "
               f"{alias!r} moved {_chain(seen)} while this gate scored; a lost lease is logged); alias not moved: "
               f"run the gate again (`lakehouse promote`)")
        _record(client, name, version, {f"gate_{metric}": f"{value:.6g}", GATE_TAG: f"not promoted: {why}"})
        raise RegistryError(why)

    champion_version, champion_error = decision.champion_version, decision.error
    decision.rows = held_out.describe()
    moved = [str(v or "none") for v in seen[:-1]] if len(seen) > 1 else None
    if moved:
        decision.moved_from = moved
        decision.reason += (f" (alias {alias!r} moved {_chain(seen)} while this gate scored; judged against the "
                            f"last holder on the same rows)")
    tags = {f"gate_{metric}": f"{value:.6g}", "gate_rows": decision.rows, "gate_margin": f"{margin:g}",
            GATE_TAG: decision.reason}
    if chance is not None and min_lift is not None:
        tags.update({f"gate_chance_{metric}": f"{chance:.6g}", "gate_min_lift": f"{min_lift:g}"})
    if champion_version is not None and champion_version != version:
        tags["gate_champion_version"] = champion_version
        if champion_error or decision.champion_value is not None:  # unscored when the challenger is under chance
            tags[f"gate_champion_{metric}"] = "error" if champion_error else f"{decision.champion_value:.6g}"
    if moved:
        tags["gate_champion_moved_from"] = ",".join(moved)
    elif "gate_champion_moved_from" in (mv.tags or {}):  # from an earlier gate of this version: not this decision's
        try:
            client.delete_model_version_tag(name, version, "gate_champion_moved_from")
        except MlflowException as exc:
            log.warning("could not remove the stale tag gate_champion_moved_from of model %r version %s: %s", name,
                        version, exc)
    _record(client, name, version, tags)
    if champion_error:
        log.error("promotion gate for model %r version %s: %s", name, version, decision.reason)
    elif (moved and not decision.promoted) or not clears_chance(value, chance, min_lift, mode):
        # lost to a champion crowned while it scored, or no better than a constant guess: say so loudly
        log.warning("promotion gate for model %r version %s on the %s: %s", name, version, decision.rows,
                    decision.reason)
    else:
        log.info("promotion gate for model %r version %s on the %s: %s", name, version, decision.rows,
                 decision.reason)
    return decision
