"""The data a job reads, by data.source: the direct path's data prepared on the driver (pinned files, split index,
plan; no Spark, no cache entry), and the data of a relaunch re-planned for its plan, whichever the source."""
from __future__ import annotations

import dataclasses
from typing import Any, List, Tuple

from pipeline.config import Config, world_size_of
from pipeline.data.convert import class_names_from
from pipeline.data.direct import DirectData, plan_direct, split_index
from pipeline.data.plan import RunPlan, plan_lr, start_batch_size
from pipeline.data.shards import LABEL, PATH, ConversionError
from pipeline.lakehouse.delta_common import PinnedTable
from pipeline.lakehouse.delta_files import DeltaFiles, arrow_filesystem, pin_files
from pipeline.lakehouse.partition import PlanError
from pipeline.log import get_logger

log = get_logger(__name__)

LABEL_NAME = "label"  # the class name column beside LABEL (label_index), as the converted path reads them


def class_names_direct(pinned: DeltaFiles) -> List[str]:
    """The table's class names ordered by label_index (a gap gets a placeholder name), read from its files' two
    label columns: `convert.class_names_from`, the converted path's rule, without Spark.

    Raises:
        PlanError: the table has no rows, naming it and its version.
        ConversionError: a file whose label columns cannot be read, or a label_index that is null, negative, too large
            or given two labels, naming the file and the row (its path).
    """
    import pyarrow.parquet as pq

    groups = {}  # (label, label_index) -> (file, row): its first row
    for f in pinned.files:
        try:
            fs, path = arrow_filesystem(f.uri, pinned.storage_options)
            with fs.open_input_file(path) as fh:
                table = pq.read_table(fh, columns=[LABEL_NAME, LABEL], use_threads=False)
        except Exception as exc:
            raise ConversionError(f"Delta table data file {f.uri}: its columns {LABEL_NAME}, {LABEL} cannot be read "
                                  f"({type(exc).__name__}: {exc})") from None
        for row, pair in enumerate(zip(table.column(LABEL_NAME).to_pylist(), table.column(LABEL).to_pylist())):
            groups.setdefault(pair, (f.uri, row))
    names = class_names_from(((name, index, ref) for (name, index), ref in groups.items()),
                             lambda ref: _row_named(pinned, *ref))
    if not names:
        raise PlanError(f"Delta table {pinned.table} version {pinned.version} has no rows to train on")
    return names


def _row_named(pinned: DeltaFiles, uri: str, row: int) -> str:
    """A row of a data file named for an error: the file, the row and its path value (read only for the error)."""
    import pyarrow.parquet as pq

    try:
        fs, path = arrow_filesystem(uri, pinned.storage_options)
        with fs.open_input_file(path) as fh:
            value = pq.read_table(fh, columns=[PATH], use_threads=False).column(0)[row].as_py()
        return f"Delta table data file {uri} row {row} ({PATH} {value!r})"
    except Exception:  # the file and row still say where
        return f"Delta table data file {uri} row {row}"


def prepare_direct(cfg: Config, version: Any = None) -> Tuple[DirectData, PinnedTable]:
    """data.source=direct on the driver, before any rank starts: the table pinned at `version` (None: delta.version)
    from its log, each file's rows split by the split rule, the rows planned over `abs(train.np)` ranks at the job's
    starting batch; no Spark session, nothing written to the cache. Returns the data and the pinned table as the
    run records it (its files digest included).

    Raises:
        ConfigError: the table cannot be read directly (a catalog name, a missing version, a feature, a file), named.
        ConversionError: a column the ranks read is not in the files, or a file is unreadable, named.
        PlanError: a rank would get no data.
    """
    pinned = pin_files(cfg.delta.table, cfg.delta.version if version is None else version)
    index = split_index(pinned, cfg.data.val_fraction, cfg.data.split_key)
    data = plan_direct(pinned, index, world_size_of(cfg), start_batch_size(cfg.data), cfg.data.min_steps_per_epoch)
    data = dataclasses.replace(data, pinned=pinned, index=index, class_names=class_names_direct(pinned),
                               image_size=cfg.data.image_size, channels=cfg.data.channels)
    log.info("data.source=direct: %s@%d read from its %d file(s) as they are: %s", pinned.table, pinned.version,
             len(pinned.files), data.lineage())
    table = PinnedTable(table=pinned.table, version=pinned.version, num_files=len(pinned.files),
                        num_rows=sum(f.rows for f in pinned.files), files_digest=pinned.digest)
    return data, table


def data_for_launch(data: Any, was: RunPlan, plan: RunPlan) -> Tuple[Any, RunPlan]:
    """The data a relaunch under `plan` reads (the last launch's was `was`), and its plan: converted data keeps its
    files and takes the plan's shards; direct data on another number of ranks is planned again over the same pinned
    files and split index (`plan_direct`: each rank's share is one run of rows, not the last launch's shares), and
    the plan takes its shards, steps and rate.

    Raises:
        PlanError: a rank would get no data on the new number of ranks.
    """
    if not isinstance(data, DirectData):
        return (data if plan.shards is was.shards else dataclasses.replace(data, plan=plan.shards)), plan
    if plan.world_size == data.train.world_size:
        return (data if plan.shards is data.plan else dataclasses.replace(data, plan=plan.shards)), plan
    again = plan_direct(data.pinned, data.index, plan.world_size, plan.batch_size, 0)
    again = dataclasses.replace(again, pinned=data.pinned, index=data.index, class_names=data.class_names,
                                image_size=data.image_size, channels=data.channels)
    shards = again.plan
    batch = shards.train.batch_size
    return again, dataclasses.replace(plan, shards=shards, batch_size=batch,
                                      steps_per_epoch=shards.train.steps_per_epoch,
                                      lr=plan_lr(plan.base_lr, plan.lr_scaling, plan.world_size, batch,
                                                 plan.start_batch))


def direct_readable(table: str, version: Any = None) -> Tuple[bool, str]:
    """Whether the direct path can read `table` at `version` (None: latest), and why not: pinned from its log with
    delta-rs (a catalog name, a missing table or version, a reader feature, a file the log lists but storage lacks are
    refused) and its files hold the columns the ranks read (`check_columns`). Reads the log and the footers only."""
    from pipeline.config import ConfigError
    from pipeline.data.direct import check_columns

    try:
        pinned = pin_files(table, version)
        check_columns(pinned)
    except (ConfigError, ConversionError, ImportError) as exc:
        return False, " ".join(str(exc).split())  # one line: delta-rs's messages span several
    return True, (f"{pinned.table}@{pinned.version}: {len(pinned.files)} file(s), {pinned.num_rows} row(s), "
                  f"reader protocol {pinned.min_reader_version}")
