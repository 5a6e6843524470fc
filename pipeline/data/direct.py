"""The direct path (data.source=direct): a pinned Delta version's own Parquet files split by the split rule, spread over
the ranks at the row level, and read per rank with pyarrow into the arrow reader's row groups. No copy, no Spark.

Three steps, each a function:

- `split_index`: the rows of each file in each split, by the one split rule (`split.row_key` and
  `split.is_validation`, as the converted path's Spark filter): it reads the `data.split_key` column (`path`; for
  `content`, the digests ingest stores, or the bytes to hash where a row has none), nothing else.
- `plan_ranges` / `plan_direct`: metadata only. The split's rows, file after file, are cut into one contiguous run per
  rank: train into equal shares (the total a multiple of the world size; fewer than world-size rows left out, logged),
  validation into shares that differ by at most one row (every validation row read once; `SplitPlan.eval_steps` pads
  the ranks with fewer). Files of any sizes are balanced at the row level: a rank's share is (file, start, stop) runs.
- `DirectShardReader`: one rank's runs cut at the files' row-group boundaries into chunks, read with pyarrow (only
  the content, label and path columns) and handed over as `readers.RowGroup`s of the encoded layout, so the loader's
  batch assembly, decode (data.decode=cpu|gpu|auto), data.memory_cache_mb and mid-epoch resume work unchanged: pass
  p takes the chunks in `readers.pass_order(n, seed, p)`, a pure function of (seed, pass).

A row's id is (file index << 32) | its row in the file: unique within the pinned version.
"""
from __future__ import annotations

import bisect
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from pipeline.data.readers import ArrowShardReader, RowGroup, pass_order
from pipeline.data.shards import CONTENT, LABEL, PATH, ConversionError
from pipeline.lakehouse.delta_files import DeltaFiles, arrow_filesystem
from pipeline.lakehouse.partition import PlanError, ShardPlan, plan_shards
from pipeline.lakehouse.split import DIGEST, is_validation, row_key, split_rule, stored_digest
from pipeline.log import get_logger

log = get_logger(__name__)

READ_COLUMNS = (CONTENT, LABEL, PATH)  # what a rank reads of the table's files
INDEX_THREADS = 4  # files whose split key column is read at once
FILE_BITS = 32  # a row id is (file index << FILE_BITS) | row in the file

Run = Tuple[int, int, int]  # (file index, start, stop): rows [start, stop) of the split's rows of that file


@dataclass
class SplitIndex:
    """The rows of each split in each file of a pinned version: sorted row numbers within the file."""

    train: List[np.ndarray]
    val: List[np.ndarray]
    split_key: str
    val_fraction: float

    def counts(self, name: str) -> List[int]:
        return [len(p) for p in getattr(self, name)]


def _file_split(uri: str, storage_options: Mapping[str, str], split_key: str, val_fraction: float) \
        -> Tuple[np.ndarray, np.ndarray]:
    """(train rows, val rows) of one file by the split rule; a row without a key value is in neither."""
    import pyarrow.parquet as pq

    column = CONTENT if split_key == "content" else PATH
    fs, path = arrow_filesystem(uri, storage_options)
    train: List[int] = []
    val: List[int] = []
    row = 0
    try:
        with fs.open_input_file(path) as fh:
            pf = pq.ParquetFile(fh)
            check_types(pf.schema_arrow, f"Delta table data file {uri}")
            if column not in pf.schema_arrow.names:
                raise KeyError(f"no column {column!r} (data.split_key={split_key})")
            digests = split_key == "content" and DIGEST in pf.schema_arrow.names
            for g in range(pf.num_row_groups):
                for key in _group_keys(pf, g, split_key, column, digests):
                    if key is not None:
                        (val if is_validation(key, val_fraction) else train).append(row)
                    row += 1
    except ConversionError:
        raise
    except Exception as exc:
        raise ConversionError(f"Delta table data file {uri} row {row}: the split key cannot be read "
                              f"({type(exc).__name__}: {exc})") from None
    return np.asarray(train, np.int64), np.asarray(val, np.int64)


def _group_keys(pf, group: int, split_key: str, column: str, digests: bool) -> List[Optional[str]]:
    """Each row's split key in row group `group` of the Parquet file `pf`: with `digests` (the content key and a
    DIGEST column) the stored digests, the bytes read only in a group where some row has none (`split.row_key`)."""
    if digests:
        stored = pf.read_row_group(group, columns=[DIGEST], use_threads=False).column(0).to_pylist()
        if all(stored_digest(d) is not None for d in stored):
            return stored
        contents = pf.read_row_group(group, columns=[column], use_threads=False).column(0).to_pylist()
        return [row_key(split_key, None, c, d) for c, d in zip(contents, stored)]
    values = pf.read_row_group(group, columns=[column], use_threads=False).column(0).to_pylist()
    if split_key == "path":
        return [row_key(split_key, v, None) for v in values]
    return [row_key(split_key, None, v) for v in values]


# What the ranks' loader takes of each column it reads (batches.py): (the type said in words, pyarrow type predicates)
COLUMN_TYPES = {CONTENT: ("binary", ("is_binary", "is_large_binary")),
                LABEL: ("an integer", ("is_integer",)),
                PATH: ("a string", ("is_string", "is_large_string"))}


def check_types(schema, where: str) -> None:
    """Refuse a data file whose content, label_index or path column has a type the ranks cannot read (label_index as
    text, say), before any rank starts. `schema`: the file's Arrow schema; `where`: the file, named in the error.

    Raises:
        ConversionError: naming the file, the column, its type and the type the direct path reads.
    """
    import pyarrow as pa

    for name, (want, predicates) in COLUMN_TYPES.items():
        if name not in schema.names:
            continue  # check_columns names a missing column
        kind = schema.field(name).type
        if not any(getattr(pa.types, p)(kind) for p in predicates):
            fix = " or use data.source=converted, which casts it" if name == LABEL else ""
            raise ConversionError(f"{where}: column {name} has type {kind}; the direct path reads it as {want}: "
                                  f"rewrite the column as {want}{fix}")


def check_columns(pinned: DeltaFiles) -> None:
    """Refuse a table whose files lack a column the ranks read (a partition column is not in the files), or whose
    first file holds one of another type (`check_types`; `split_index` checks every file's as it reads it).

    Raises:
        ConversionError: naming the table, its version and the columns, or the file, column and type.
    """
    import pyarrow.parquet as pq

    lacking = [c for c in READ_COLUMNS if c not in pinned.columns or c in pinned.partition_columns]
    if lacking:
        raise ConversionError(f"Delta table {pinned.table} version {pinned.version}: the direct path reads columns "
                              f"{', '.join(READ_COLUMNS)} from its data files, and {', '.join(lacking)} "
                              f"{'is' if len(lacking) == 1 else 'are'} not in them (missing, or a partition column); "
                              f"use data.source=converted")
    if not pinned.files:
        return
    uri = pinned.files[0].uri
    try:
        fs, path = arrow_filesystem(uri, pinned.storage_options)
        with fs.open_input_file(path) as fh:
            schema = pq.read_schema(fh)
    except Exception as exc:
        raise ConversionError(f"Delta table data file {uri}: its Parquet footer cannot be read "
                              f"({type(exc).__name__}: {exc})") from None
    check_types(schema, f"Delta table {pinned.table} version {pinned.version} data file {uri}")


def split_index(pinned: DeltaFiles, val_fraction: float, split_key: str, threads: int = INDEX_THREADS) -> SplitIndex:
    """Each file's rows in train and val by the split rule of `data.split_key` (the converted path's rule, so the same
    validation rows): reads that one column of every file (`path`; for `content` the stored digests, or the bytes to
    hash), on `threads` threads."""
    split_rule(split_key)  # a key that is not one of partition.SPLIT_KEYS is refused, naming the config key
    check_columns(pinned)
    uris = [f.uri for f in pinned.files]
    with ThreadPoolExecutor(max(1, min(threads, len(uris) or 1))) as pool:
        parts = list(pool.map(lambda u: _file_split(u, pinned.storage_options, split_key, val_fraction), uris))
    for f, (t, v) in zip(pinned.files, parts):
        if len(t) + len(v) > f.rows:
            raise ConversionError(f"Delta table data file {f.uri} holds {len(t) + len(v)} rows, the log says {f.rows}")
    return SplitIndex(train=[t for t, _ in parts], val=[v for _, v in parts], split_key=split_key,
                      val_fraction=val_fraction)


def plan_ranges(counts: Sequence[int], world_size: int, drop_remainder: bool) -> List[List[Run]]:
    """The runs of each rank over files of `counts` rows, taken file after file: rank r gets rows [lo_r, hi_r) of the
    concatenation, cut at file boundaries. `drop_remainder`: every rank the same rows (the total a multiple of
    `world_size`, the last `total % world_size` rows in no share); else shares differing by at most one row, every
    row in one. Metadata only, O(files + ranks), deterministic."""
    if world_size < 1:
        raise PlanError(f"world size {world_size} must be >= 1")
    total = int(sum(counts))
    per, extra = divmod(total, world_size)
    if drop_remainder:
        extra = 0
    bounds = [0]
    for r in range(world_size):
        bounds.append(bounds[-1] + per + (1 if r < extra else 0))
    starts = np.concatenate([[0], np.cumsum(np.asarray(counts, np.int64))]).tolist()  # file f: [starts[f], starts[f+1])
    out: List[List[Run]] = []
    for r in range(world_size):
        lo, hi = bounds[r], bounds[r + 1]
        runs: List[Run] = []
        f = bisect.bisect_right(starts, lo) - 1
        while lo < hi:
            while starts[f + 1] <= lo:  # empty files
                f += 1
            stop = min(hi, starts[f + 1])
            runs.append((f, lo - starts[f], stop - starts[f]))
            lo = stop
        out.append(runs)
    return out


@dataclass
class DirectSplit:
    """One split of the direct path: the table's files, the split's rows of each (sorted row numbers), and the runs
    of each rank over them. Picklable; crosses into the ranks as a ConvertedSplit does."""

    name: str
    file_urls: List[str]
    file_sizes: List[int]
    positions: List[np.ndarray]
    runs: List[List[Run]]
    storage_options: Mapping[str, str] = field(default_factory=dict, repr=False)
    file_rows: List[int] = field(default_factory=list)  # each file's rows, both splits' (and rows without a key)

    @property
    def world_size(self) -> int:
        return len(self.runs)

    @property
    def rows_per_rank(self) -> List[int]:
        return [sum(stop - start for _, start, stop in runs) for runs in self.runs]

    @property
    def rows(self) -> int:
        return sum(self.rows_per_rank)

    @property
    def row_group_rows(self) -> List[int]:
        """Each rank's share as one group, in rank order: what `plan.derive_plan` and `partition.plan_shards` plan
        over (group i on rank i mod world size), so they give this split's rows per rank back."""
        return self.rows_per_rank

    def rank_rows(self, rank: int) -> List[Tuple[int, np.ndarray]]:
        """(file index, row numbers in the file) of each run of `rank`, in plan order."""
        return [(f, self.positions[f][start:stop]) for f, start, stop in self.runs[rank]]

    def encoded_row_bytes(self) -> int:
        """An encoded row's bytes on average (the files' sizes over their rows, both splits': the whole files), for
        data.memory_cache_mb: `loader.encoded_row_bytes`'s rule without listing the files. Without `file_rows` (a
        split made by hand), over this split's rows."""
        rows = sum(self.file_rows) if self.file_rows else sum(len(p) for p in self.positions)
        return max(1, sum(self.file_sizes) // max(1, rows))


@dataclass
class DirectData:
    """The direct path's train/val splits of a pinned version, the shard plan over the ranks, and the lineage."""

    train: DirectSplit
    val: DirectSplit
    plan: ShardPlan
    table: str
    version: int
    files_digest: str
    split_key: str
    val_fraction: float
    left_out: int = 0  # train rows in no share this plan (fewer than the world size)
    # what the model and the ranks' data module need, as on ConvertedData (the driver sets them from its config)
    class_names: List[str] = field(default_factory=list)
    image_size: int = 0
    channels: int = 0
    layout: str = "encoded"  # the files hold encoded images: the ranks always decode them (data.decode != convert)
    # the pinned files and their split index, kept so a relaunch on fewer ranks is planned again without reading
    pinned: Optional[DeltaFiles] = None
    index: Optional[SplitIndex] = None

    @property
    def rows(self) -> Tuple[int, int]:
        return self.plan.train.total_rows, self.plan.val.total_rows

    def lineage(self) -> Dict[str, object]:
        """What a run records of the data it trained on: table@version, the digest of the file list, the source."""
        return {"source": "direct", "table": self.table, "version": self.version, "files_digest": self.files_digest,
                "split_rule": split_rule(self.split_key), "val_fraction": self.val_fraction}


def plan_direct(pinned: DeltaFiles, index: SplitIndex, world_size: int, batch_size: int,
                min_steps: int = 0) -> DirectData:
    """The direct plan for `world_size` ranks: train in equal shares, val every row once (see `plan_ranges`), and the
    ShardPlan of `partition.plan_shards` over the shares (equal steps per rank, the batch lowered on a small table to
    give `min_steps` steps, an empty share refused). Metadata only.

    Raises:
        PlanError: a rank would get no rows, with the numbers.
    """
    uris, sizes = [f.uri for f in pinned.files], [f.size for f in pinned.files]
    file_rows = [f.rows for f in pinned.files]
    for name in ("train", "val"):
        rows = sum(index.counts(name))
        if 0 < rows < world_size:
            raise PlanError(f"{name} split of {pinned.table}@{pinned.version}: {rows} row(s) cannot feed {world_size} "
                            f"ranks; some rank would read no data. Use fewer ranks (train.np) or add data")
    splits = {}
    for name, drop in (("train", True), ("val", False)):
        runs = plan_ranges(index.counts(name), world_size, drop_remainder=drop)
        splits[name] = DirectSplit(name, uris, sizes, getattr(index, name), runs, pinned.storage_options, file_rows)
    left_out = sum(index.counts("train")) - splits["train"].rows
    if left_out:
        log.info("direct plan: %d train row(s) (fewer than the %d ranks) left out of this plan so every rank has "
                 "%d rows", left_out, world_size, splits["train"].rows_per_rank[0])
    plan = plan_shards(splits["train"].rows_per_rank, splits["val"].rows_per_rank, world_size, batch_size, min_steps)
    log.info("direct shard plan for %d rank(s) over %d file(s) of %s@%d: %s", world_size, len(uris), pinned.table,
             pinned.version, plan.describe())
    return DirectData(train=splits["train"], val=splits["val"], plan=plan, table=pinned.table, version=pinned.version,
                      files_digest=pinned.digest, split_key=index.split_key, val_fraction=index.val_fraction,
                      left_out=left_out, pinned=pinned, index=index)


class DirectShardReader(ArrowShardReader):
    """Reads one rank's share of a DirectSplit with pyarrow, `workers` chunks ahead of the consumer: the arrow reader's
    interface (`len`, `read`, `iter_groups`, `iter_tagged`), so the loader takes it in the arrow reader's place.

    A chunk is the rank's rows inside one row group of one file; `read` reads that row group's content, label and
    path columns and takes the rows (a zero-copy slice where they are consecutive). Footers are read once, when the
    reader is made (metadata only, each file closed again); a read-ahead thread keeps at most `open_files`
    files open (the arrow reader's `_file`), so a share of thousands of files stays within the open-file limit.
    """

    def __init__(self, split: DirectSplit, rank: int, world_size: int, workers: int = 2) -> None:
        if split.world_size != world_size:
            raise PlanError(f"{split.name} split was planned for {split.world_size} ranks, not {world_size}")
        self.split = split
        self.rank = rank
        self._files_state(workers)
        self.groups: List[Tuple[int, int, np.ndarray]] = []  # (file index, row group, row numbers in the file)
        self._first_row: List[int] = []  # of each chunk: its row group's first row in the file
        for f, rows in split.rank_rows(rank):
            bounds = self._group_bounds(f)
            cut = np.searchsorted(rows, bounds[1:-1], side="left")
            for g, part in enumerate(np.split(rows, cut)):
                if len(part):
                    self.groups.append((f, g, part))
                    self._first_row.append(int(bounds[g]))

    def _group_bounds(self, file_index: int) -> np.ndarray:
        meta = self._footer(file_index)[0]
        return np.concatenate([[0], np.cumsum([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])])

    def _filesystem(self, url: str) -> Tuple[object, str]:
        return arrow_filesystem(url, self.split.storage_options)

    def _footer(self, file_index: int) -> Tuple[object, int]:
        """(Parquet footer, file size) of a file, read once (the arrow reader's `_footer`) when the reader is made.

        Raises:
            ConversionError: naming the file when it cannot be opened or its footer read.
        """
        try:
            return super()._footer(file_index)
        except Exception as exc:
            raise ConversionError(f"Delta table data file {self.split.file_urls[file_index]} cannot be opened "
                                  f"({type(exc).__name__}: {exc})") from None

    def rows(self) -> int:
        return sum(len(rows) for _, _, rows in self.groups)

    def read(self, local_index: int) -> RowGroup:
        """Chunk `local_index` of this rank's share.

        Raises:
            ConversionError: naming the file and row group when it is missing, changed or unreadable.
        """
        import pyarrow as pa

        file_index, group, rows = self.groups[local_index]
        try:
            table = self._file(file_index).read_row_group(group, columns=list(READ_COLUMNS), use_threads=False)
            start = int(rows[0]) - self._first_row[local_index]
            if int(rows[-1]) - int(rows[0]) + 1 == len(rows):  # sorted and unique: a contiguous run, not copied
                table = table.slice(start, len(rows))
            else:
                table = table.take(pa.array(rows - self._first_row[local_index]))
        except Exception as exc:
            url = self.split.file_urls[file_index]
            raise ConversionError(f"Delta table data file {url} row group {group} ({self.split.name} split, direct "
                                  f"path) is unreadable ({type(exc).__name__}: {exc})") from None
        ids = pa.array((np.int64(file_index) << FILE_BITS) | rows.astype(np.int64))
        return RowGroup(table.column(CONTENT), table.column(LABEL), ids, table.column(PATH))

    def order(self, seed: int, pass_index: int, shuffle: bool) -> np.ndarray:
        """The chunks' order in pass `pass_index`: the arrow reader's rule (seed, pass) -> permutation."""
        return pass_order(len(self), seed, pass_index, shuffle)


def direct_row_ids(split: DirectSplit, rank: int, world_size: int) -> List[int]:
    """Every row id of `rank`'s share (for checks and tests; reads the share)."""
    reader = DirectShardReader(split, rank, world_size, workers=1)
    ids: List[int] = []
    for _, group in reader.iter_groups(range(len(reader))):
        ids.extend(group.row_id.to_pylist())
    return ids


def decode_row_id(row_id: int) -> Tuple[int, int]:
    """(file index, row in the file) of a direct row id."""
    return row_id >> FILE_BITS, row_id & ((1 << FILE_BITS) - 1)

