"""From a pinned Delta DataFrame to converted Parquet for the ranks: split, decode once, repartition, size row groups, cache, plan.

The converter is Spark: executors decode each image once and write the split's Parquet files with pyarrow, in row
groups sized by the plan (so whole row groups spread evenly over the ranks), into the content-keyed cache of
`pipeline.data.cache`. Both readers (Petastorm's and the Arrow reader) read these files; nothing here needs Petastorm.
With data.decode=cpu|gpu|auto nothing is decoded here: the files keep each row's encoded bytes and path (the
"encoded" layout, shards.LAYOUTS), and the ranks decode every epoch (pipeline.data.decode).
"""
from __future__ import annotations

import functools
import math
import re
import time
import uuid
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from pipeline.config import Config
from pipeline.data import cache
from pipeline.data.plan import derive_plan, partitions_for
from pipeline.data.shards import (CONTENT, FORMAT_VERSION, LABEL, LAYOUTS, PATH, PIXELS, ROW_ID, ConversionError,
                                  ConvertedData, ConvertedSplit)
from pipeline.lakehouse.delta_common import files_digest
from pipeline.lakehouse.partition import PlanError, ShardPlan, plan_shards
from pipeline.lakehouse.split import split_frame, split_rule
from pipeline.log import get_logger

log = get_logger(__name__)

# split_frame: the split rule's Spark form (pipeline.lakehouse.split), which _convert applies
__all__ = ["ConversionError", "ConvertedData", "ConvertedSplit", "convert_for_training", "split_frame",
           "prepare_split", "write_split", "plan_data", "class_names_of"]


ENCODED_ROW_BYTES = 110_000  # an encoded row's size for sizing row groups before any is written: an ImageNet JPEG's


def layout_of(cfg: Config) -> str:
    """The converted files' layout: decoded pixels (data.decode=convert) or the encoded rows the ranks decode."""
    return "pixels" if cfg.data.decode == "convert" else "encoded"


def prepare_split(df, cfg: Config, world_size: int):
    """The columns to convert (encoded image, label, a stable row id from the path, the path itself), repartitioned
    for the ranks. The encoded layout writes the path; the pixels layout only names a row it cannot decode by it."""
    from pyspark.sql import functions as F

    parts = partitions_for(cfg.data.partitions_per_worker, world_size)
    columns = [F.col("content"), F.col("label_index").cast("int").alias(LABEL), F.xxhash64(F.col("path")).alias(ROW_ID),
               F.col("path").cast("string").alias(PATH)]
    return df.select(*columns).repartition(parts)


def group_rows_for(rows: int, world_size: int, row_bytes: int, groups_per_rank: int, max_group_mb: float,
                   partitions: int = 1, min_group_mb: float = 0.0) -> int:
    """Rows per row group: enough groups that every rank gets about `groups_per_rank` of them (whole groups then
    spread evenly, whatever the partitions' sizes), none below `min_group_mb` unless a whole partition is smaller
    (a reader pays a fixed cost per row group: Petastorm's ~0.9 ms made 22-row groups 4x slower per row than
    700-row ones), none above `max_group_mb`, and a partition of the expected size (`rows / partitions`, Spark's
    round-robin repartition) split into groups of equal size; the writer sizes each file's last groups evenly
    (`groups_to_write`), so no rank collects short ones."""
    target = math.ceil(max(1, rows) / max(1, world_size * groups_per_rank))
    target = max(target, int(min_group_mb * 2 ** 20 // max(1, row_bytes)))
    target = max(1, min(target, int(max_group_mb * 2 ** 20 // max(1, row_bytes))))
    per_partition = math.ceil(max(1, rows) / max(1, partitions))
    groups = math.ceil(per_partition / target)
    return max(1, math.ceil(per_partition / groups))


LAST_GROUP_SLACK = 0.25  # a file's last row groups may have this much more than `group_rows`
TAIL_BUFFER_MB = 256  # at most this much of a partition is held back to size its last row groups evenly


def tail_groups_for(world_size: int, group_rows: int, row_bytes: int) -> int:
    """How many row groups end each file evenly sized: one per rank (so every rank gets one of them whatever the file
    holds), at least two, and no more than `TAIL_BUFFER_MB` of rows held back by a writer."""
    fits = int(TAIL_BUFFER_MB * 2 ** 20 // max(1, group_rows * row_bytes * (1 + LAST_GROUP_SLACK)))
    return max(2, min(world_size, fits))


def groups_to_write(pending: int, group_rows: int, final: bool, tail_groups: int = 2) -> List[int]:
    """Sizes of the row groups a partition's writer writes now from `pending` buffered rows.

    Groups of `group_rows` while more than `tail_groups` groups' rows (and the slack) wait. At the end the rest is cut
    into the number of groups nearest its size, all equal, none more than a quarter above `group_rows`. So no file
    ends on a short group, and a partition a little larger or smaller than the converter's estimate (the split by
    path hash and the repartition are not exact) keeps the number of groups it was sized for. Before, the last rows
    were cut in two halves when they exceeded one group: on a small table sized for one group per partition some files
    got one group and others two halves, and an odd count of groups gave one rank a whole group more (shard balance
    1.65 in a CI run); and with as many groups per file as ranks, the short last groups all landed on the same rank.
    """
    sizes, rest = [], pending
    while rest > tail_groups * group_rows * (1 + LAST_GROUP_SLACK):
        sizes.append(group_rows)
        rest -= group_rows
    if final and rest:
        m = max(1, round(rest / group_rows))
        while rest > m * group_rows * (1 + LAST_GROUP_SLACK):
            m += 1
        sizes += [rest // m + (1 if i < rest % m else 0) for i in range(m)]
    return sizes


def decoded_rows(batch, image_size: int, channels: int) -> List[bytes]:
    """Each row's decoded pixels from an Arrow batch of content, label, row id and (when the batch has it) path.

    Raises:
        RowDecodeError: a row's image cannot be decoded, naming its path (its row id without one) and why, as the
            ranks' decode does (`pipeline.data.crops.decode_crop`); `write_split` lifts it out of Spark's error.
    """
    from pipeline.images import ImageDecodeError, RowDecodeError, decode_image

    contents = batch.column(0).to_pylist()
    out = []
    for i, content in enumerate(contents):
        try:
            out.append(decode_image(content, image_size, channels).tobytes())
        except ImageDecodeError as exc:
            names = batch.schema.names
            row = (batch.column(names.index(PATH))[i].as_py() if PATH in names
                   else f"with {ROW_ID} {batch.column(2)[i].as_py()}")
            raise RowDecodeError(f"row {row}: {exc}") from None
    return out


# The last line of a Python worker's traceback in the error Spark raises on the driver for a failed task
_ROW_ERROR = re.compile(r"RowDecodeError: (row [^\n]*)")


def _row_error(exc: BaseException) -> Optional[str]:
    """The message of the RowDecodeError a Python worker raised, from the error Spark wraps it in on the driver
    (PythonException, Py4JJavaError: the worker's traceback is inside their text), or None."""
    found = _ROW_ERROR.findall(str(exc))
    return found[-1].strip() if found else None


def _writer(split_url: str, image_size: int, channels: int, group_rows: int, tail_groups: int, encoded: bool = False):
    """The executor side of `write_split`: decode (or, `encoded`, keep the bytes and the path), then write this
    partition's file in row groups of `group_rows` (its last `tail_groups` evenly sized, see `groups_to_write`)."""

    def write(batches):
        import pyarrow as pa
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        from pipeline.data.cache import filesystem

        ctx = TaskContext.get()
        fs, folder = filesystem(split_url)
        name = f"part-{ctx.partitionId():05d}.parquet"
        tmp = f"{folder}/.{name}.{ctx.attemptNumber()}-{uuid.uuid4().hex[:6]}.tmp"
        types = {PIXELS: pa.binary(), CONTENT: pa.binary(), LABEL: pa.int32(), ROW_ID: pa.int64(), PATH: pa.string()}
        schema = pa.schema([(c, types[c]) for c in LAYOUTS["encoded" if encoded else "pixels"]])
        writer, pending, groups = None, [], []

        def write(part):
            nonlocal writer
            if writer is None:
                writer = pq.ParquetWriter(fs.open_output_stream(tmp), schema, compression="none")
            writer.write_table(part, row_group_size=len(part))
            groups.append(len(part))

        def flush(tables, final):
            """Write the groups `groups_to_write` asks for; keep the rest for the next batch."""
            table = pa.concat_tables(tables) if tables else schema.empty_table()
            start = 0
            for size in groups_to_write(len(table), group_rows, final, tail_groups):
                write(table.slice(start, size))
                start += size
            return [table.slice(start)] if start < len(table) else []

        try:
            for batch in batches:
                if encoded:  # the bytes as the table holds them, and the path: the ranks decode
                    pending.append(pa.Table.from_batches([batch]).rename_columns(schema.names).cast(schema))
                else:
                    pixels = decoded_rows(batch, image_size, channels)
                    pending.append(pa.table({PIXELS: pa.array(pixels, pa.binary()),
                                             LABEL: batch.column(1).cast(pa.int32()),
                                             ROW_ID: batch.column(2).cast(pa.int64())}, schema=schema))
                if sum(len(t) for t in pending) >= 2 * group_rows:
                    pending = flush(pending, final=False)
            flush(pending, final=True)
            if writer is None:
                return  # an empty partition writes no file
            writer.close()
            fs.move(tmp, f"{folder}/{name}")
        except BaseException:
            try:
                fs.delete_file(tmp)
            except Exception:
                pass
            raise
        size = fs.get_file_info(f"{folder}/{name}").size
        yield pa.RecordBatch.from_pydict({"file": [name], "bytes": [size], "groups": [groups]},
                                         schema=pa.schema([("file", pa.string()), ("bytes", pa.int64()),
                                                           ("groups", pa.list_(pa.int64()))]))

    return write


def decoded_frame(df, cfg: Config, world_size: int):
    """The plain-Spark equivalent of what the converter writes (decoded pixels, label, row id; repartitioned), for a
    reference `df.write.parquet` to compare the converter with (`lakehouse bench`)."""
    from pyspark.sql import functions as F
    from pyspark.sql.functions import pandas_udf

    from pipeline.images import ImageDecodeError, RowDecodeError, decode_image

    size, channels = cfg.data.image_size, cfg.data.channels

    @pandas_udf("binary")
    def decode(content, path):  # an undecodable row is named as the converter names it (decoded_rows)
        import pandas as pd

        out = []
        for b, p in zip(content, path):
            try:
                out.append(decode_image(bytes(b), size, channels).tobytes())
            except ImageDecodeError as exc:
                raise RowDecodeError(f"row {p}: {exc}") from None
        return pd.Series(out)

    prepared = prepare_split(df, cfg, world_size)
    return prepared.select(decode(F.col("content"), F.col(PATH)).alias(PIXELS), F.col(LABEL), F.col(ROW_ID))


def write_split(df, split_url: str, image_size: int, channels: int, group_rows: int, tail_groups: int = 2,
                encoded: bool = False) -> List[Dict[str, Any]]:
    """Convert `df` (columns content, label_index, row_id, path: `prepare_split`'s; path written only when `encoded`)
    into Parquet files under `split_url`, one per non-empty partition; returns each file's name, size and row groups,
    sorted by name (the readers' order).

    Raises:
        ConversionError: a row's image cannot be decoded (data.decode=convert), naming its path and why.
    """
    fs, folder = cache.filesystem(split_url)
    fs.create_dir(folder, recursive=True)
    try:
        out = df.mapInArrow(_writer(split_url, image_size, channels, group_rows, tail_groups, encoded),
                            "file string, bytes long, groups array<long>").collect()
    except Exception as exc:
        row = _row_error(exc)
        if row is None:
            raise
        raise ConversionError(f"converting into {split_url} (data.decode=convert): {row}; repair or remove that row "
                              f"of the table") from None
    return sorted(({"name": r["file"], "bytes": int(r["bytes"]), "row_groups": [int(g) for g in r["groups"]]}
                   for r in out), key=lambda f: f["name"])


def split_from_manifest(name: str, split_url: str, files: List[Dict[str, Any]]) -> ConvertedSplit:
    row_groups = [(i, j, rows) for i, f in enumerate(files) for j, rows in enumerate(f["row_groups"])]
    return ConvertedSplit(name=name, cache_dir_url=split_url, file_urls=[f"{split_url}/{f['name']}" for f in files],
                          row_groups=row_groups)


def verify_split(split: ConvertedSplit, files: List[Dict[str, Any]]) -> None:
    """Every file of a cache hit is there, of the size written, with the row groups written.

    Raises:
        ConversionError: naming the first file that is missing, truncated or unreadable.
    """
    import pyarrow.parquet as pq

    for url, expected in zip(split.file_urls, files):
        fs, path = cache.filesystem(url)
        try:
            size = fs.get_file_info(path).size
            if size is None:
                raise FileNotFoundError("missing")
            if size != expected["bytes"]:
                raise OSError(f"{size} bytes, {expected['bytes']} were written")
            with fs.open_input_file(path) as fh:
                meta = pq.read_metadata(fh)
            rows = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            if rows != expected["row_groups"]:
                raise OSError(f"row groups {rows}, {expected['row_groups']} were written")
        except Exception as exc:
            raise ConversionError(f"converted Parquet file {url} is unreadable ({type(exc).__name__}: {exc}); run "
                                  f"`lakehouse cache clear` (or delete {split.cache_dir_url.rsplit('/', 1)[0]}) to "
                                  f"convert again") from None


def _key_inputs(frame: Callable[[], Any], cfg: Config, world_size: int, pinned) -> Dict[str, Any]:
    """What the entry's content key hashes. The table's data files: the pinned table's `files_digest` when its engine
    read them from the log (no Spark work), else the DataFrame's `inputFiles()`."""
    digest = getattr(pinned, "files_digest", None)
    if digest is not None:
        count = pinned.num_files
    else:
        files = frame().inputFiles()
        digest, count = files_digest(files), len(files)
    return {
        "table": getattr(pinned, "table", None), "version": getattr(pinned, "version", None),
        "input_files": digest, "input_file_count": count,
        "val_fraction": cfg.data.val_fraction, "split_rule": split_rule(cfg.data.split_key),
        "image_size": cfg.data.image_size, "channels": cfg.data.channels, "world_size": world_size,
        "partitions_per_worker": cfg.data.partitions_per_worker, "row_groups_per_rank": cfg.data.row_groups_per_rank,
        "max_row_group_mb": cfg.data.max_row_group_mb, "min_row_group_mb": cfg.data.min_row_group_mb,
    } | ({"layout": "encoded", "image_size": None, "channels": None} if layout_of(cfg) == "encoded" else {})


def _convert(df, cfg: Config, world_size: int, url: str, inputs: Dict[str, Any],
             total_rows: Optional[int] = None) -> Dict[str, Any]:
    """Write both splits into a new folder of entry `url` and return its manifest (written last).

    Row groups are sized from the table's row count (`total_rows`, from the Delta log; counted when unknown) split by
    `data.val_fraction`: an estimate is all the sizing needs, and it costs no Spark job.
    """
    import pyarrow as pa

    train_df, val_df = split_frame(df, cfg.data.val_fraction, cfg.data.split_key)
    encoded = layout_of(cfg) == "encoded"
    row_bytes = ENCODED_ROW_BYTES if encoded else cfg.data.channels * cfg.data.image_size ** 2
    run = f"run-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"  # concurrent writers never mix files
    total = total_rows if total_rows is not None else df.count()
    share = {"train": 1.0 - cfg.data.val_fraction, "val": cfg.data.val_fraction}
    splits = {}
    for name, frame in (("train", train_df), ("val", val_df)):
        rows = max(1, round(total * share[name]))
        group_rows = group_rows_for(rows, world_size, row_bytes, cfg.data.row_groups_per_rank,
                                    cfg.data.max_row_group_mb, partitions_for(cfg.data.partitions_per_worker,
                                                                              world_size),
                                    cfg.data.min_row_group_mb)
        files = write_split(prepare_split(frame, cfg, world_size), f"{url}/{run}/{name}", cfg.data.image_size,
                            cfg.data.channels, group_rows, tail_groups_for(world_size, group_rows, row_bytes),
                            encoded)
        splits[name] = {"folder": f"{run}/{name}", "rows": sum(sum(f["row_groups"]) for f in files),
                        "group_rows": group_rows, "files": files}
    now = time.time()
    return {"format": FORMAT_VERSION, "columns": list(LAYOUTS[layout_of(cfg)]), "inputs": inputs, "created": now,
            "last_used": now, "writer": {"pyarrow": pa.__version__}, "splits": splits}


def _usable(manifest: Optional[Dict[str, Any]], url: str, columns=LAYOUTS["pixels"]) -> bool:
    if manifest is None:
        return False
    if manifest.get("format") != FORMAT_VERSION or manifest.get("columns") != list(columns):
        log.warning("cache entry %s was written in another format (format %s, columns %s); converting again",
                    url, manifest.get("format"), manifest.get("columns"))
        return False
    return True


def plan_data(train: ConvertedSplit, val: ConvertedSplit, world_size: int, batch_size: int,
              min_steps: int = 0) -> ShardPlan:
    """The shard plan alone over converted splits at `batch_size` per rank, lowered on a small table so an epoch has at
    least `min_steps` steps; fails when a rank would get no data. For data built without a config (tests, the bench's
    data sets); a job's plan, its rate included, is `pipeline.data.plan.derive_plan`'s."""
    return plan_shards(train.row_group_rows, val.row_group_rows, world_size, batch_size, min_steps)


def convert_for_training(spark, df, cfg: Config, world_size: int, class_names: Optional[List[str]] = None,
                         pinned: Any = None, leases: Optional[cache.JobLeases] = None,
                         batch_size: Optional[int] = None) -> ConvertedData:
    """Split, decode and convert the pinned DataFrame (or reuse the cache entry with the same content key), then plan
    the shards before any rank starts. `df`: the DataFrame, or a function that reads it, called only when it is needed:
    with a table pinned from its log (`pinned.files_digest`), a cache hit runs no Spark at all, so a job whose data is
    converted already starts no JVM for it. `batch_size`: the per-rank batch to plan for (the job's batch in use, which
    `data.batch_size: auto` leaves to the driver); default the job's starting batch (`plan.start_batch_size`). `class_names` None: the table's
    (`class_names_of`, a Spark job over the label columns), kept in the entry's manifest, so a cache hit reads them
    from there and runs no Spark job at all (1.7 s of a 2-rank job's start on the sample, measured).

    With `leases` (the job's, held until its training ends), the entry is leased before it is looked at, so neither
    another job's size bound nor `lakehouse cache clear` deletes it between here and the end of training.

    Raises:
        PlanError: a rank would get no data (with rows, row groups, ranks).
        ConversionError: a cached file is missing or unreadable, named.
    """
    frame = functools.cache(df if callable(df) else (lambda: df))  # read at most once
    inputs = _key_inputs(frame, cfg, world_size, pinned)
    key = cache.content_key(inputs)
    url = cache.entry_url(cfg.data.cache_dir, key)
    if leases is not None:  # first: a deleter under the cache's lock either sees it or has finished deleting
        cache.take_lease(leases, cfg.data.cache_dir, key)
    manifest = cache.read_manifest(url)
    if _usable(manifest, url, LAYOUTS[layout_of(cfg)]):
        log.info("converted data cache hit: %s", url)
        if class_names is None:  # the same table, version and files as when it was converted: the same classes
            class_names = manifest.get("class_names") or _class_names_to_train(frame(), pinned)
        manifest.setdefault("class_names", list(class_names))  # an entry from before they were kept: from now on
        cache.touch(url, manifest)
    else:
        if class_names is None:
            class_names = _class_names_to_train(frame(), pinned)  # before converting: an empty table fails here
        t0 = time.time()
        cache.mark_entry(url)  # before any byte of it: only a marked folder is ever evicted or cleared
        manifest = _convert(frame(), cfg, world_size, url, inputs, getattr(pinned, "num_rows", None))
        manifest["class_names"] = list(class_names)
        cache.write_manifest(url, manifest)
        log.info("converted %d train + %d val rows into %s in %.1f s", manifest["splits"]["train"]["rows"],
                 manifest["splits"]["val"]["rows"], url, time.time() - t0)
        cache.enforce_bound(cfg.data.cache_dir, cfg.data.cache_max_gb, keep=key)
    splits = {}
    for name in ("train", "val"):
        s = manifest["splits"][name]
        splits[name] = split_from_manifest(name, f"{url}/{s['folder']}", s["files"])
        verify_split(splits[name], s["files"])
    plan = derive_plan(cfg, (splits["train"].row_group_rows, splits["val"].row_group_rows), world_size,
                       batch_size).shards
    log.info("shard plan for %d rank(s): %s", world_size, plan.describe())
    return ConvertedData(train=splits["train"], val=splits["val"], plan=plan, class_names=class_names,
                         image_size=cfg.data.image_size, channels=cfg.data.channels, key=key, entry_url=url,
                         layout=layout_of(cfg))


def petastorm_row_group_rows(split: ConvertedSplit) -> List[int]:
    """Rows per row group in the order Petastorm's reader numbers them (to check it agrees with `split.row_groups`)."""
    import pyarrow.parquet as pq
    from petastorm.etl import dataset_metadata
    from petastorm.fs_utils import get_filesystem_and_path_or_paths
    from petastorm.reader import normalize_dataset_url_or_urls

    fs, paths = get_filesystem_and_path_or_paths(normalize_dataset_url_or_urls(split.file_urls))
    dataset = pq.ParquetDataset(paths, filesystem=fs, validate_schema=False, metadata_nthreads=10)
    pieces = dataset_metadata.load_row_groups(dataset)
    return [piece.get_metadata().row_group(piece.row_group).num_rows for piece in pieces]


# The most classes a table may name (label_index 0 .. MAX_CLASSES - 1). The largest label sets trained as one
# softmax head are ~10^4-10^5 classes (ImageNet-21k: 21,841); a head of 10^6 classes on a 512-wide feature is 5 * 10^8
# weights (2 GB in fp32), and the driver builds the list of names, one per index: an index above this is a corrupt or
# wrongly encoded label (label_index 3,000,000 made a 3,000,001-name list, +208 MB on the driver), not a class.
MAX_CLASSES = 1_000_000


def class_names_from(groups: Iterable[Tuple[Any, Any, Any]], where: Callable[[Any], str]) -> List[str]:
    """Class names ordered by label_index (a gap gets a placeholder name) from the table's distinct (label,
    label_index) pairs, each with a reference to a row that holds it: the one rule of both data paths.

    Args:
        groups: (label, label_index, row reference) for each distinct pair.
        where: names the row a reference points to (its file or table, and its path), for the error.

    Raises:
        ConversionError: an index that is null, not an integer, negative or >= MAX_CLASSES, or one index with two
            labels, naming the column, the value and a row that holds it.
    """
    pairs: Dict[int, Tuple[Any, Any]] = {}  # label_index -> (label, row reference)
    for name, index, ref in groups:
        if index is None:
            raise ConversionError(f"{where(ref)}: column {LABEL} is null; every row needs its class's index")
        try:
            i = int(index)
            if isinstance(index, float) and i != index:
                raise ValueError(index)
        except (TypeError, ValueError):
            raise ConversionError(f"{where(ref)}: column {LABEL} is {index!r}, not an integer") from None
        if not 0 <= i < MAX_CLASSES:
            raise ConversionError(f"{where(ref)}: column {LABEL} is {i}, outside 0..{MAX_CLASSES - 1} (a class's index "
                                  f"counts from 0, and a table names at most {MAX_CLASSES:,} classes)")
        if i in pairs and pairs[i][0] != name:
            raise ConversionError(f"{LABEL} {i} has two labels, {pairs[i][0]!r} ({where(pairs[i][1])}) and {name!r} "
                                  f"({where(ref)}); one index names one class: repair the table")
        pairs.setdefault(i, (name, ref))
    if not pairs:
        return []
    return [pairs[i][0] if i in pairs else f"class_{i}" for i in range(max(pairs) + 1)]


def _class_names_to_train(df, pinned) -> List[str]:
    """The table's class names (`class_names_of`); a table with no rows fails, naming it and its version."""
    table = f"Delta table {getattr(pinned, 'table', '?')} version {getattr(pinned, 'version', '?')}"
    names = class_names_of(df, table)
    if not names:
        raise PlanError(f"{table} has no rows to train on")
    return names


def class_names_of(df, table: str = "the Delta table") -> List[str]:
    """Class names ordered by label_index (a gap gets a placeholder name): `class_names_from` over the DataFrame's
    distinct (label, label_index) pairs, each with its least `path` to name a row (one Spark job).

    Raises:
        ConversionError: a null, negative, non-integer or too large index, or one index with two labels, naming
            `table` and a row's path.
    """
    if PATH in df.columns:
        rows = df.groupBy("label", LABEL).agg({PATH: "min"}).collect()
        groups = [(r[0], r[1], r[2]) for r in rows]
    else:
        groups = [(r[0], r[1], None) for r in df.select("label", LABEL).distinct().collect()]
    return class_names_from(groups, lambda path: f"{table}, the row with {PATH} {path!r}" if path is not None
                            else table)
