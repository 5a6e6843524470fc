"""Read-only views for notebooks and reports: table history, class balance, image grids, registry review."""
from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy as np
import pandas as pd

from pipeline.config import Config, load_config
from pipeline.images import decode_image
from pipeline.lakehouse.delta import get_engine
from pipeline.lakehouse.spark import session_of
from pipeline.log import get_logger, setup_logging

log = get_logger(__name__)

DEFAULT_PROFILE = "conf/local.yaml"
HISTORY_COLUMNS = ["version", "timestamp", "operation", "rows"]
BALANCE_COLUMNS = ["label", "label_index", "rows", "fraction"]
REGISTRY_COLUMNS = ["version", "aliases", "status", "run_id", "delta_table", "delta_version", "created",
                    "gate_decision"]
# a run's metric series that are not per epoch, left out of `run_history`: MLflow's system metrics (stepped by sample),
# the job's events (restarts and OOM back-offs stepped by their count, an elastic relaunch's world_size) and tune's
# one-off values (a trial's tune_<metric>, a study's best_<metric>)
NOT_PER_EPOCH = ("restarts", "oom_backoffs", "world_size")
NOT_PER_EPOCH_PREFIXES = ("system/", "tune_", "best_")


# ---------------------------------------------------------------- notebook set-up

def project_root(start: Optional[str] = None) -> Path:
    """The nearest folder at or above `start` (default: the working directory) that holds conf/base.yaml."""
    here = Path(start or os.getcwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "conf" / "base.yaml").is_file():
            return folder
    return here


def notebook_config(conf: Optional[str] = None, overrides: Optional[Iterable[str]] = None,
                    chdir: bool = True) -> Config:
    """Load a profile for a notebook the way `lakehouse --conf` does from the project root.

    A notebook's kernel starts in notebooks/; with `chdir` the working directory becomes the project
    root, so relative paths in the profiles (work/delta/..., work/mlflow.db) mean what they mean on
    the command line. A relative `conf` is taken relative to the project root.
    """
    setup_logging()
    root = project_root()
    path = Path(conf or DEFAULT_PROFILE)
    if not path.is_absolute():
        path = root / path
    if chdir:
        os.chdir(root)
    cfg = load_config(str(path), [o for o in (overrides or []) if o])
    log.info("profile %s, Delta table %s, MLflow %s", path, cfg.delta.table, cfg.mlflow.tracking_uri)
    return cfg


# ---------------------------------------------------------------- the Delta table

def _timestamp(value: Any) -> Optional[pd.Timestamp]:
    """A Delta history timestamp (epoch milliseconds from delta-rs, datetime from delta-spark) as a pandas Timestamp."""
    if value is None:
        return None
    if isinstance(value, (int, float, np.integer)):
        return pd.Timestamp(int(value), unit="ms")
    if isinstance(value, datetime):
        return pd.Timestamp(value)
    return pd.Timestamp(str(value))


def history_frame(entries: Sequence[Dict[str, Any]], rows: Optional[Dict[int, Optional[int]]] = None) -> pd.DataFrame:
    """Delta history entries (either engine's) as a frame ordered by version: version, timestamp, operation, rows."""
    rows = rows or {}
    records = []
    for entry in entries:
        version = entry.get("version")
        if version is None:
            continue
        version = int(version)
        records.append({"version": version, "timestamp": _timestamp(entry.get("timestamp")),
                        "operation": entry.get("operation"), "rows": rows.get(version)})
    frame = pd.DataFrame(records, columns=HISTORY_COLUMNS)
    frame["rows"] = frame["rows"].astype("Int64")
    return frame.sort_values("version").reset_index(drop=True)


def _rows_at(spark, cfg: Config, version: int) -> Optional[int]:
    """Rows of the table at `version`: from the Delta log's statistics when present, else a Spark count."""
    try:
        df, pinned = get_engine(cfg.delta.engine).read(spark, cfg.delta.table, version)
    except Exception as exc:  # a version whose files or log entries were cleaned up
        log.warning("Delta table %s version %d cannot be read: %s", cfg.delta.table, version, exc)
        return None
    return pinned.num_rows if pinned.num_rows is not None else df.count()


def table_history(spark, cfg: Config) -> pd.DataFrame:
    """Every version of `delta.table`: version, timestamp, operation and the rows it holds. `spark` here and below: a
    session, or a `SparkOnDemand` (pipeline.lakehouse.spark), started when first needed."""
    spark = session_of(spark)
    entries = get_engine(cfg.delta.engine).history(spark, cfg.delta.table)
    versions = sorted({int(e["version"]) for e in entries if e.get("version") is not None})
    return history_frame(entries, {v: _rows_at(spark, cfg, v) for v in versions})


def balance_frame(counts: Sequence[Dict[str, Any]]) -> pd.DataFrame:
    """{label, label_index, rows} records -> the class balance ordered by label_index, with each class's fraction."""
    frame = pd.DataFrame(list(counts), columns=["label", "label_index", "rows"])
    total = frame["rows"].sum()
    frame["fraction"] = frame["rows"] / total if total else 0.0
    return frame.sort_values(["label_index", "label"]).reset_index(drop=True)[BALANCE_COLUMNS]


def _pinned_frame(spark, cfg: Config, version: Optional[int]):
    pinned_version = cfg.delta.version if version is None else version
    return get_engine(cfg.delta.engine).read(session_of(spark), cfg.delta.table, pinned_version)


def class_balance(spark, cfg: Config, version: Optional[int] = None) -> pd.DataFrame:
    """Rows per class at `version` (default `delta.version`, else the latest), counted by Spark."""
    df, pinned = _pinned_frame(spark, cfg, version)
    counts = [r.asDict() for r in df.groupBy("label", "label_index").count().withColumnRenamed("count", "rows")
              .collect()]
    log.info("class balance of %s version %d: %d class(es)", pinned.table, pinned.version, len(counts))
    return balance_frame(counts)


def sample_rows(spark, cfg: Config, n: int = 16, version: Optional[int] = None,
                columns: Sequence[str] = ("path", "label", "label_index", "content")) -> pd.DataFrame:
    """The first `n` rows of the table (limited in Spark before anything reaches the driver)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    df, _ = _pinned_frame(spark, cfg, version)
    rows = [r.asDict() for r in df.select(*columns).limit(n).collect()]
    frame = pd.DataFrame(rows, columns=list(columns))
    if "content" in frame.columns:
        frame["content"] = [bytes(c) if c is not None else None for c in frame["content"]]
    return frame


def grid_figure(images: Sequence[np.ndarray], titles: Sequence[str], cols: int = 8):
    """A matplotlib Figure with one image per cell; `images` are (C, H, W) or (H, W) uint8 arrays."""
    import matplotlib.pyplot as plt  # in Jupyter this registers the inline display of figures

    if len(images) != len(titles):
        raise ValueError(f"{len(images)} image(s) but {len(titles)} title(s)")
    n = max(1, len(images))
    cols = max(1, min(cols, n))
    rows = (n + cols - 1) // cols
    fig = plt.figure(figsize=(1.4 * cols, 1.6 * rows))
    plt.close(fig)  # not left open in pyplot's state: shown once, as the returned value
    for i in range(rows * cols):
        ax = fig.add_subplot(rows, cols, i + 1)
        ax.axis("off")
        if i >= len(images):
            continue
        img = np.asarray(images[i])
        if img.ndim == 3 and img.shape[0] in (1, 3):
            img = img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0)
        ax.imshow(img, cmap="gray" if img.ndim == 2 else None, vmin=0, vmax=255)
        ax.set_title(str(titles[i]), fontsize=8)
    fig.tight_layout()
    return fig


def image_grid(spark, cfg: Config, n: int = 16, version: Optional[int] = None, cols: int = 8):
    """A grid of `n` images from the table with their labels, decoded as training decodes them."""
    rows = sample_rows(spark, cfg, n, version, columns=("label", "content"))
    images = [decode_image(c, cfg.data.image_size, cfg.data.channels) for c in rows["content"]]
    return grid_figure(images, list(rows["label"]), cols)


# ---------------------------------------------------------------- MLflow runs and the registry

def _client(cfg: Config):
    from pipeline.tracking.runs import configure  # local: mlflow, out of the notebook's table views

    return configure(cfg.mlflow)


def is_epoch_metric(key: str) -> bool:
    """Whether the run's metric `key` is logged once per epoch at the epoch's step (not a system metric, a job event
    or a one-off value: NOT_PER_EPOCH)."""
    return key not in NOT_PER_EPOCH and not key.startswith(NOT_PER_EPOCH_PREFIXES)


def run_history(cfg: Config, run_id: str) -> pd.DataFrame:
    """A run's per-epoch metrics: one row per step (epoch), one column per metric logged each epoch; the run's other
    series (system/*, restarts, oom_backoffs, ...: NOT_PER_EPOCH) are not epochs and are left out."""
    client = _client(cfg)
    run = client.get_run(run_id)
    series: Dict[str, Dict[int, float]] = {}
    for key in sorted(k for k in run.data.metrics if is_epoch_metric(k)):
        for m in client.get_metric_history(run_id, key):
            series.setdefault(key, {})[int(m.step)] = float(m.value)
    frame = pd.DataFrame(series)
    frame.index.name = "epoch"
    return frame.sort_index()


def versions_frame(versions: Sequence[Any], aliases: Dict[str, List[str]], metric: str) -> pd.DataFrame:
    """MLflow ModelVersion objects -> one row each (newest first) with its aliases, lineage tags and `metric`."""
    records = []
    for mv in versions:
        tags = dict(mv.tags or {})
        raw = tags.get(metric)
        try:
            value = float(raw) if raw is not None else None
        except ValueError:
            value = None
        created = getattr(mv, "creation_timestamp", None)
        records.append({
            "version": int(mv.version),
            "aliases": ",".join(sorted(aliases.get(str(mv.version), []))),
            "status": str(mv.status),
            "run_id": mv.run_id,
            "delta_table": tags.get("delta_table"),
            "delta_version": int(tags["delta_version"]) if str(tags.get("delta_version", "")).isdigit() else None,
            metric: value,
            "created": pd.Timestamp(int(created), unit="ms") if created else None,
            "gate_decision": tags.get("gate_decision"),
        })
    columns = REGISTRY_COLUMNS[:6] + [metric] + REGISTRY_COLUMNS[6:]
    frame = pd.DataFrame(records, columns=columns)
    frame["delta_version"] = frame["delta_version"].astype("Int64")
    return frame.sort_values("version", ascending=False).reset_index(drop=True)


def _aliases(client, name: str) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    model = client.get_registered_model(name)
    for alias, version in (getattr(model, "aliases", None) or {}).items():
        out.setdefault(str(version), []).append(alias)
    return out


def registry_versions(cfg: Config) -> pd.DataFrame:
    """Every version of `mlflow.registered_model`, newest first.

    Columns: aliases, status, run id, the Delta table and version it was trained on, the gate metric
    (`mlflow.gate_metric`, from the version's tag), when it was created and what the gate decided.
    """
    client = _client(cfg)
    name = cfg.mlflow.registered_model
    from pipeline.tracking.registry import model_versions  # local: mlflow, out of the notebook's table views

    versions = model_versions(client, name)
    aliases = _aliases(client, name) if versions else {}
    return versions_frame(versions, aliases, cfg.mlflow.gate_metric)


def champion(cfg: Config, alias: str = "champion") -> Optional[Dict[str, Any]]:
    """The version holding `alias` (its registry_versions row), or None when no version holds it."""
    frame = registry_versions(cfg)
    held = frame[frame["aliases"].str.split(",").apply(lambda names: alias in names)]
    if held.empty:
        log.info("model %r has no %r alias yet", cfg.mlflow.registered_model, alias)
        return None
    return held.iloc[0].to_dict()


def predictions_frame(rows: pd.DataFrame, predicted: pd.DataFrame) -> pd.DataFrame:
    """True label beside the model's prediction, per row."""
    out = pd.DataFrame({
        "path": rows["path"].values if "path" in rows else None,
        "label": rows["label"].values,
        "predicted": predicted["label"].values,
        "probability": predicted["probability"].values,
    })
    out["correct"] = out["label"].astype(str) == out["predicted"].astype(str)
    return out


def predict_rows(spark, cfg: Config, n: int = 8, alias: str = "champion",
                 version: Optional[int] = None) -> pd.DataFrame:
    """Load `models:/<registered_model>@<alias>` with mlflow.pyfunc and predict on `n` rows of the table."""
    from pipeline.tracking.pyfunc import load_pyfunc  # local: mlflow and torch, out of the table views

    _client(cfg)  # also points this process's MLflow (and registry) at `mlflow.tracking_uri`
    uri = f"models:/{cfg.mlflow.registered_model}@{alias}"
    model = load_pyfunc(uri)
    rows = sample_rows(spark, cfg, n, version, columns=("path", "label", "content"))
    predicted = model.predict(rows[["content"]])
    log.info("predicted %d row(s) with %s", len(rows), uri)
    return predictions_frame(rows, predicted)
