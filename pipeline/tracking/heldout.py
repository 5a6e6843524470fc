"""The rows the promotion gate scores versions on: rows every compared version held out, read and scored in chunks.

Fair: a version trained with data.val_fraction 0.3 held out rows that one trained with 0.1 trained on, and the
other way round, so two versions are compared on the rows held out by BOTH (per split key the smaller fraction, under
different keys each key's rule: pipeline.lakehouse.split.held_out_by_all), of one table at one Delta version.
Each version's own rule is read from its run (params data.val_fraction, data.split_key, or the same-named version
tags); a run that records no data.split_key was split by path (split.LEGACY_SPLIT_KEY), one that records no
data.val_fraction is taken to have used the gate's configured one. Versions trained on different tables are not
compared (`comparable`). Bounded memory: the table is scanned in record batches (delta-rs) or streamed from Spark (a
catalog table, split in Spark), and `score_on_rows` scores GATE_CHUNK_ROWS rows at a time; only labels stay in memory.
"""
from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union
from urllib.parse import urlparse

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from pipeline.lakehouse.split import (DIGEST, LEGACY_SPLIT_KEY, SPLIT_KEYS, HoldOut, held_out_by_all,
                                      held_out_frame, in_split, stored_digest)
from pipeline.log import get_logger
from pipeline.tracking.registry import RegistryError

log = get_logger(__name__)

GATE_CHUNK_ROWS = 256  # rows decoded and scored at once (and the delta-rs scan's batch size)
GATE_COLUMNS = ("path", "content", "label")

Chunk = Tuple[List[Optional[bytes]], List[Optional[str]]]  # (encoded images, their true labels)


@dataclass
class HeldOutRows:
    """Rows of one pinned Delta version chosen by a split rule: their true labels (in memory) and a way to read the
    rows themselves in chunks. `contents` holds rows given in memory (a caller's own); else `source(size)` reads
    them."""

    table: str
    version: int
    split: str
    contents: Optional[List[bytes]] = None
    labels: List[Optional[str]] = field(default_factory=list)
    source: Optional[Callable[[int], Iterator[Chunk]]] = None
    rule: str = ""  # how the rows were chosen, e.g. "held out by val_fraction 0.1 by content"

    def chunks(self, size: int = GATE_CHUNK_ROWS) -> Iterator[Chunk]:
        """The rows, at most `size` at a time, with their labels."""
        if self.contents is not None:
            for i in range(0, len(self.contents), size):
                yield list(self.contents[i:i + size]), list(self.labels[i:i + size])
        elif self.source is not None:
            yield from self.source(size)

    def describe(self) -> str:
        rule = f"; {self.rule}" if self.rule else ""
        return f"{self.split} split of Delta table {self.table} version {self.version} ({len(self.labels)} rows{rule})"


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


def split_of(metric: str) -> str:
    """The split a gate metric is measured on: `train_*` on the training rows, everything else on the val rows."""
    return "train" if metric.startswith("train_") else "val"


def _conditions(holdout: Union[float, HoldOut, Sequence[HoldOut]], split: str = "val") -> Tuple[HoldOut, ...]:
    """A bare fraction is the path rule (what it meant before data.split_key); one or several HoldOuts are merged
    for `split` (`held_out_by_all`)."""
    if isinstance(holdout, (int, float)):
        return (HoldOut(float(holdout), LEGACY_SPLIT_KEY),)
    return held_out_by_all([holdout] if isinstance(holdout, HoldOut) else list(holdout), split)


def _rule_words(conditions: Tuple[HoldOut, ...], split: str) -> str:
    what = " and ".join(c.describe() for c in conditions)
    return f"held out by {what}" if split == "val" else f"trained on under {what}"


def _delta_rows(table: str, version: int, conditions: Tuple[HoldOut, ...], split: str) -> HeldOutRows:
    """The version's rows. An unpartitioned table through delta-rs's dataset (its own storage and credentials); a
    partitioned one from the data files its log lists, a partition column's value taken from the log: delta-rs's
    dataset cannot be opened on a partitioned table with the pyarrow of the classic profile (a TypeError in
    pyarrow.field)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.lakehouse.delta import DeltaRsEngine
    from pipeline.lakehouse.delta_files import arrow_filesystem

    dt, groups, _ = DeltaRsEngine()._snapshot(table, int(version))
    names = pa.schema(dt.schema().to_arrow()).names
    missing = [c for c in GATE_COLUMNS if c not in names]
    if missing:
        raise RegistryError(f"promotion gate: Delta table {table} version {version} has no column(s) "
                            f"{', '.join(missing)}; it has {names}")
    by_content = any(c.split_key == "content" for c in conditions)
    partitioned = bool(dt.metadata().partition_columns)
    dataset = None if partitioned else dt.to_pyarrow_dataset()

    def file_batches(uri: str, read: List[str], size: int) -> Iterator["pa.RecordBatch"]:
        fs, path = arrow_filesystem(uri)
        try:
            with fs.open_input_file(path) as fh:
                parquet = pq.ParquetFile(fh)
                lacking = [c for c in read if c not in parquet.schema_arrow.names]
                if lacking == [DIGEST]:  # a file written before the table had digests: its bytes are hashed
                    for batch in parquet.iter_batches(batch_size=size, columns=[c for c in read if c != DIGEST]):
                        yield batch.append_column(DIGEST, pa.nulls(batch.num_rows, pa.string()))
                    return
                if lacking:
                    raise RegistryError(f"promotion gate: data file {uri} of Delta table {table} version {version} "
                                        f"has no column(s) {', '.join(lacking)}")
                yield from parquet.iter_batches(batch_size=size, columns=read)
        except (OSError, pa.ArrowException) as exc:
            raise RegistryError(f"promotion gate: data file {uri} of Delta table {table} version {version} cannot "
                                f"be read: {type(exc).__name__}: {exc}") from None

    def batches(columns: List[str], size: int) -> Iterator[dict]:
        """Each record batch of the version as {column: values}."""
        if dataset is not None:
            for batch in dataset.to_batches(columns=columns, batch_size=size):
                yield {c: batch.column(c).to_pylist() for c in columns}
            return
        for key, files in groups.items():  # in the log's order of its files
            fixed = {c: v for c, v in key if c in columns}  # a partition column: one value for the whole group
            read = [c for c in columns if c not in fixed]
            for uri in files:
                for batch in file_batches(uri, read, size):
                    cols = {c: batch.column(c).to_pylist() for c in read}
                    yield {**cols, **{c: [v] * batch.num_rows for c, v in fixed.items()}}

    digests = by_content and DIGEST in names  # the content key read from the digests ingest stores

    def scan(size: int, with_content: bool, lacking: Optional[List[bool]] = None) -> Iterator[Chunk]:
        """The rows in the split, in chunks. `lacking`: stop at a row whose content key needs its bytes (no stored
        digest) when they are not read, and say so there."""
        columns = ["path", "label"] + (["content"] if with_content else []) + ([DIGEST] if digests else [])
        for batch in batches(columns, size):
            paths, labels = batch["path"], batch["label"]
            contents = batch["content"] if with_content else [None] * len(paths)
            stored = batch[DIGEST] if digests else [None] * len(paths)
            if lacking is not None and any(stored_digest(d) is None for d in stored):
                lacking.append(True)
                return
            keep = [i for i, p in enumerate(paths)
                    if p is not None and in_split(split, conditions, p, contents[i], stored[i])]
            if keep:
                yield ([contents[i] for i in keep], [None if labels[i] is None else str(labels[i]) for i in keep])

    # the labels first, from the stored digests where every row has one; else from the bytes
    lacking: List[bool] = []
    labels = [lab for _, chunk in scan(GATE_CHUNK_ROWS * 4, False, lacking) for lab in chunk] if digests else []
    if not digests or lacking:
        labels = [lab for _, chunk in scan(GATE_CHUNK_ROWS * 4, by_content) for lab in chunk]
    return HeldOutRows(table, int(version), split, None, labels, lambda size: scan(size, True),
                       _rule_words(conditions, split))


def _catalog_rows(table: str, version: int, conditions: Tuple[HoldOut, ...], split: str) -> HeldOutRows:
    """The rows of a catalog-named table (catalog.schema.table) through the active Spark session (delta-rs cannot
    resolve the name): the split rule (pipeline.lakehouse.split.held_out_frame, training's) and the column selection
    run in Spark; the driver collects the labels, and streams the rows partition by partition when scoring."""
    from pipeline.lakehouse.delta import SparkDeltaEngine

    from pipeline.lakehouse.spark import active_session

    try:
        spark = active_session()  # started on another thread too (pipeline.lakehouse.spark.SparkOnDemand)
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
    missing = [c for c in GATE_COLUMNS if c not in df.columns]
    if missing:
        raise RegistryError(f"promotion gate: Delta table {table} version {version} has no column(s) "
                            f"{', '.join(missing)}; it has {df.columns}")
    columns = list(GATE_COLUMNS) + ([DIGEST] if DIGEST in df.columns else [])
    rows = held_out_frame(df.select(*columns).filter(df["path"].isNotNull()), conditions, split)
    labels = [None if r[0] is None else str(r[0]) for r in rows.select("label").toLocalIterator()]

    def stream(size: int) -> Iterator[Chunk]:
        contents: List[Optional[bytes]] = []
        chunk_labels: List[Optional[str]] = []
        for r in rows.select("content", "label").toLocalIterator():
            contents.append(None if r[0] is None else bytes(r[0]))
            chunk_labels.append(None if r[1] is None else str(r[1]))
            if len(contents) >= size:
                yield contents, chunk_labels
                contents, chunk_labels = [], []
        if contents:
            yield contents, chunk_labels

    return HeldOutRows(table, int(version), split, None, labels, stream, _rule_words(conditions, split))


def held_out_rows(table: str, version: int, holdout: Union[float, HoldOut, Sequence[HoldOut]],
                  split: str = "val") -> HeldOutRows:
    """The rows of Delta `table` at `version` in `split` under `holdout`: one model's (a HoldOut), or the rows held
    out by all of several (`val`) / trained on by all (`train`); a bare fraction is the path rule. Read with
    delta-rs (no Spark), a catalog name through the active Spark session; nothing but labels is held in memory.

    Raises:
        RegistryError: the table, version or a needed column is missing, or the split has no rows.
    """
    from pipeline.lakehouse.delta import DeltaError, catalog_name

    conditions = _conditions(holdout, split)
    try:
        read = _catalog_rows if catalog_name(table) else _delta_rows
        rows = read(table, int(version), conditions, split)
    except DeltaError as exc:
        raise RegistryError(f"promotion gate: {exc}") from None
    if not rows.labels:
        raise RegistryError(f"promotion gate: the {split} split of Delta table {table} version {version} "
                            f"({rows.rule}) has no rows to score")
    return rows


def score_on_rows(model_uri: str, rows: HeldOutRows, metric: str) -> float:
    """`metric` (`*_acc`: top-1 accuracy; `*_loss`: mean cross-entropy) of the pyfunc at `model_uri` on `rows`,
    scored GATE_CHUNK_ROWS rows at a time.

    The model is the one users serve: loaded with mlflow.pyfunc, called on the `content` column with
    on_error=null. An undecodable row counts as wrong and adds no loss.
    """
    import pandas as pd

    from pipeline.tracking.pyfunc import load_pyfunc

    if not (metric.endswith("_acc") or metric.endswith("_loss")):
        raise RegistryError(f"config key 'mlflow.gate_metric': {metric!r} is neither an accuracy (*_acc) nor a loss "
                            f"(*_loss); the gate cannot score it on held-out rows")
    model = load_pyfunc(model_uri, check_requirements=False)  # scored where it was trained: no requirement warning
    where = None
    if metric.endswith("_loss"):
        names = list((model.metadata.metadata or {}).get("class_names") or [])
        if not names:
            raise RegistryError(f"{model_uri} records no class_names in its MLflow model metadata; its loss on "
                                f"the held-out rows cannot be computed")
        where = {n: i for i, n in enumerate(names)}
    rows_seen, right, loss_sum, loss_rows = 0, 0, 0.0, 0
    for contents, labels in rows.chunks(GATE_CHUNK_ROWS):
        out = model.predict(pd.DataFrame({"content": contents}), params={"on_error": "null"})
        rows_seen += len(labels)
        if where is None:
            right += sum(p is not None and p == t for p, t in zip(out["label"], labels))
        else:
            for p, t in zip(out["probabilities"], labels):
                if p is not None:
                    loss_sum += -math.log(max(float(p[where[t]]) if t in where else 0.0, 1e-12))
                    loss_rows += 1
    if where is None:
        return right / rows_seen if rows_seen else math.nan
    return loss_sum / loss_rows if loss_rows else math.nan


Scorer = Callable[[str, HeldOutRows, str], float]


# --- each version's own rule, and whether two versions can be compared -------------------------------------------

def _recorded(client: MlflowClient, mv: ModelVersion, key: str) -> Optional[str]:
    """A version's `key` from its tags, else its run's params (every config key is a run param), else None."""
    value = (mv.tags or {}).get(key)
    if value is None and mv.run_id:
        try:
            value = client.get_run(mv.run_id).data.params.get(key)
        except MlflowException as exc:
            log.warning("promotion gate: run %s of version %s not read for %s: %s", mv.run_id, mv.version, key, exc)
    return value


def holdout_of(client: MlflowClient, mv: ModelVersion, fallback_fraction: float) -> HoldOut:
    """The rows version `mv`'s training held out: its data.val_fraction (unrecorded or unreadable:
    `fallback_fraction`, the gate's configured one) and data.split_key (unrecorded: trained before the key existed,
    by path)."""
    raw = _recorded(client, mv, "data.val_fraction")
    try:
        fraction = float(raw) if raw is not None else float(fallback_fraction)
    except ValueError:
        log.warning("promotion gate: version %s records data.val_fraction=%r, not a number; using %g", mv.version,
                    raw, fallback_fraction)
        fraction = float(fallback_fraction)
    key = _recorded(client, mv, "data.split_key") or LEGACY_SPLIT_KEY
    if key not in SPLIT_KEYS:
        raise RegistryError(f"model version {mv.version} records data.split_key={key!r}, not one of "
                            f"{', '.join(SPLIT_KEYS)}: the gate cannot tell which rows it held out")
    return HoldOut(fraction, key)


def pinned_data(name: str, mv: ModelVersion) -> Tuple[str, int]:
    """(delta_table, delta_version) a version was trained on, from its tags."""
    tags = mv.tags or {}
    missing = [t for t in ("delta_table", "delta_version") if not tags.get(t)]
    if missing:
        raise RegistryError(f"model {name!r} version {mv.version} has no tag(s) {', '.join(missing)}: the gate "
                            f"cannot tell which Delta version's held-out rows to score it on")
    try:
        return _location(name, mv, tags["delta_table"]), int(tags["delta_version"])
    except ValueError:
        raise RegistryError(f"model {name!r} version {mv.version}: tag delta_version is "
                            f"{tags['delta_version']!r}, not a number") from None


def _location(name: str, mv: ModelVersion, recorded: str) -> str:
    """A version's recorded table as its location (pipeline.lakehouse.delta.table_location). A version registered
    before locations were recorded may hold a relative path: it is resolved against this working directory, as it
    always was, and said so."""
    from pipeline.lakehouse.delta import catalog_name, table_location

    location = table_location(recorded)
    if not catalog_name(recorded) and not urlparse(recorded).scheme and not os.path.isabs(recorded):
        log.warning("model %r version %s records delta_table=%r, a relative path: read as %s (relative to this "
                    "working directory)", name, mv.version, recorded, location)
    return location


def _same_table(a: str, b: str) -> bool:
    """One table under two spellings: their locations (pipeline.lakehouse.delta.table_location: a local path
    absolute and real, a `file:` URI as its path, a URI without trailing slashes) are equal, or a catalog name in any
    case or quoting (pipeline.lakehouse.delta.same_table). A relative path (recorded before locations were) is
    resolved against this working directory."""
    from pipeline.lakehouse.delta import same_table

    return same_table(a, b)


def comparable(name: str, challenger: ModelVersion, holder: ModelVersion) -> Optional[str]:
    """None when `holder` can be scored against `challenger` on rows both held out; else why not (trained on
    different tables: each one's held-out rows are of its own table, no row is held out by both)."""
    table, _ = pinned_data(name, challenger)
    holder_table = (holder.tags or {}).get("delta_table")
    if holder_table and not _same_table(table, holder_table):
        return (f"refused: champion version {holder.version} was trained on Delta table {holder_table} and version "
                f"{challenger.version} on {table}; their scores on different tables' rows are not comparable (no "
                f"row is held out by both)")
    return None
