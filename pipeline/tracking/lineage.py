"""What a run was trained from: the config as params and artifact (secrets redacted), the Delta table and version as
the run's input, and the code's git commit. The table is recorded by its location (table_location: a local path
absolute and real), never as typed, so the record names the same table from any working directory."""
from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path
from typing import Any, Dict, Optional

import mlflow
from mlflow import MlflowClient
from mlflow.data.delta_dataset_source import DeltaDatasetSource
from mlflow.entities import DatasetInput, InputTag, Param
from mlflow.exceptions import MlflowException

from pipeline.config import Config
from pipeline.lakehouse.delta_common import table_location
from pipeline.log import get_logger
from pipeline.redact import redact_url, redacted

# MLflow servers before 1.x/2.x accepted 500 characters per param value; newer ones more. The whole
# config is also logged as config.yaml, so truncating long values loses nothing.
PARAM_VALUE_LIMIT = 500
BATCH_LIMIT = 100
# Two runs of one experiment that log the same table version at once both find no dataset row and both insert one; the
# SQL store's unique key refuses the second (an IntegrityError, sent back as a server error). The dataset then exists,
# and MLflow's log_inputs reuses an existing dataset and input edge, so asking again is safe.
DATASET_RACE = re.compile(r"IntegrityError|UNIQUE constraint failed|Duplicate entry|duplicate key value", re.I)
DATASET_ATTEMPTS = 3

log = get_logger(__name__)


def _param_value(value: Any) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= PARAM_VALUE_LIMIT else text[:PARAM_VALUE_LIMIT - 3] + "..."


def config_yaml(cfg: Config) -> str:
    """The config as YAML with its secrets redacted (pipeline.redact) and `delta.table` as its location: what
    `config.yaml` artifacts and the offline folder keep. `lakehouse sync-run` reloads it (from any working directory);
    only the redacted values (never the secrets) are then missing."""
    import yaml

    data = redacted(cfg.to_dict())
    data["delta"]["table"] = table_location(data["delta"]["table"])
    return yaml.safe_dump(data, sort_keys=False)


def config_params(cfg: Config) -> Dict[str, Any]:
    """The flattened config (`train.np`, `spark.conf`, ...) as logged in params, secrets redacted (pipeline.redact),
    `delta.table` as its location."""
    params = redacted(cfg.flat())
    params["delta.table"] = table_location(params["delta.table"])
    return params


def log_config(client: MlflowClient, run_id: str, cfg: Config) -> None:
    """Log the resolved config as artifact `config.yaml` and as flattened params (`train.np`, ...), secrets redacted
    in both (`spark.conf` secret values, passwords in URLs such as `tune.storage`; pipeline.redact)."""
    client.log_text(run_id, config_yaml(cfg), "config.yaml")
    params = [Param(str(k), _param_value(v)) for k, v in sorted(config_params(cfg).items())]
    for start in range(0, len(params), BATCH_LIMIT):
        client.log_batch(run_id, params=params[start:start + BATCH_LIMIT], synchronous=True)


def git_commit(cwd: Optional[str] = None) -> Optional[str]:
    """The commit checked out where the package lives (or `cwd`), or None outside a git checkout."""
    where = cwd or str(Path(__file__).resolve().parents[2])
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


class PinnedDeltaSource(DeltaDatasetSource):
    """A Delta table version as an MLflow dataset source; MLflow's own leaves out version 0 (a falsy check)."""

    def to_dict(self) -> Dict[str, Any]:
        return {**super().to_dict(), "delta_table_version": self._delta_table_version}


def delta_dataset(table: str, version: int, name: Optional[str] = None) -> "mlflow.data.meta_dataset.MetaDataset":
    """The Delta table at `version` as an MLflow dataset (no Spark needed), by its location, any credentials in its
    URL redacted (pipeline.redact: the source, name and digest never hold them)."""
    from mlflow.data.meta_dataset import MetaDataset

    table = redact_url(table_location(str(table)))
    digest = hashlib.sha256(f"{table}@{version}".encode()).hexdigest()[:16]
    ds_name = name or f"{Path(str(table).rstrip('/')).name or table}@v{version}"
    return MetaDataset(source=PinnedDeltaSource(path=str(table), delta_table_version=int(version)),
                       name=ds_name, digest=digest)


def log_lineage(client: MlflowClient, run_id: str, table: str, version: int, rows: Dict[str, int],
                extra_tags: Optional[Dict[str, Any]] = None) -> None:
    """Tag the run with the Delta table (its location), version and row counts, and log the table as the run's input;
    any credentials in the table's URL (or a tag's) are redacted (pipeline.redact), as in the params.

    `rows` maps split name to row count ({'train': 800, 'val': 200} -> tags rows_train, rows_val).
    `extra_tags` (world_size, backend, ...) are added; `git_commit` too when the code is a git checkout.
    """
    if version is None or int(version) < 0:
        raise ValueError(f"log_lineage: delta version must be a pinned version >= 0, got {version!r}")
    tags: Dict[str, str] = {"delta_table": redact_url(table_location(str(table))), "delta_version": str(int(version))}
    for split, count in rows.items():
        tags[f"rows_{split}"] = str(int(count))
    tags.update({str(k): redact_url(str(v)) for k, v in (extra_tags or {}).items()})
    commit = git_commit()
    if commit and "git_commit" not in tags:
        tags["git_commit"] = commit
        tags.setdefault("mlflow.source.git.commit", commit)
    from mlflow.entities import RunTag

    items = [RunTag(k, v[:5000]) for k, v in tags.items()]
    for start in range(0, len(items), BATCH_LIMIT):
        client.log_batch(run_id, tags=items[start:start + BATCH_LIMIT], synchronous=True)
    dataset = delta_dataset(table, int(version))
    # Dataset._to_mlflow_entity is what mlflow.log_input uses; the client call needs no active run.
    inputs = [DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", "training")])]
    for attempt in range(1, DATASET_ATTEMPTS + 1):
        try:
            client.log_inputs(run_id, datasets=inputs)
            return
        except MlflowException as exc:
            if attempt == DATASET_ATTEMPTS or not DATASET_RACE.search(str(exc)):
                raise
            log.info("input dataset %s: another run inserted it at the same moment (attempt %d of %d); logging it "
                     "again", dataset.name, attempt, DATASET_ATTEMPTS)
