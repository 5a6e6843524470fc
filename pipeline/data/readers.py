"""Per-rank row-group readers over converted Parquet: Petastorm's reader or pyarrow directly, with one shard rule.

Both hand over each row group as Arrow columns (`pixels`, `label_index`, `row_id`; or, in a split of encoded rows,
`content` in the pixels' place and `path`) and read the row groups of shard `rank` (global row group i goes to rank
``i % world_size``). Petastorm is imported only when its reader is used.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from pipeline.data.shards import (COLUMNS, CONTENT, ENCODED_COLUMNS, LABEL, PATH, PIXELS, ROW_ID, ConversionError,
                                  ConvertedSplit)
from pipeline.log import get_logger

log = get_logger(__name__)


class RowGroup(NamedTuple):
    """One row group's columns as Arrow arrays: `pixels` holds the decoded pixels, or the encoded bytes of a split
    of encoded rows (which also has each row's `path`)."""

    pixels: object
    label_index: object
    row_id: object
    path: object = None


def row_group_of(table) -> RowGroup:
    """The RowGroup of an Arrow table of either layout (shards.LAYOUTS)."""
    names = table.column_names
    image = PIXELS if PIXELS in names else CONTENT
    return RowGroup(*(table.column(name) if name in names else None for name in (image, LABEL, ROW_ID, PATH)))


def pass_order(n: int, seed: int, pass_index: int, shuffle: bool) -> np.ndarray:
    """The order of a rank's `n` row groups in pass `pass_index`: a permutation seeded by (seed, pass), or as stored."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, pass_index]).permutation(n)


def require_reader(name: str) -> None:
    """Fail with what to do when the reader `data.reader` names cannot run in this install."""
    if name == "petastorm":
        import importlib.util

        if importlib.util.find_spec("petastorm") is None:
            raise ConversionError("config key 'data.reader' is 'petastorm' but Petastorm is not installed (the "
                                  "modern profile has none): set data.reader=arrow, or install the classic profile "
                                  "(`make setup PROFILE=classic`)")
    elif name != "arrow":
        raise ConversionError(f"config key 'data.reader': {name!r} is not petastorm or arrow")


def load_reader(name: str) -> None:
    """Check that reader `name` can run (`require_reader`) and import its library now, when the rank sets up, not
    inside the first epoch's first pass: Petastorm's import (with pandas and setuptools) took ~0.5 s there, which
    made the first epoch of every launch, and of every relaunch after a failure, that much slower than the rest."""
    require_reader(name)
    if name == "petastorm":
        import petastorm.pytorch  # noqa: F401
        import petastorm.spark.spark_dataset_converter  # noqa: F401


OPEN_FILES_PER_THREAD = (4, 64)  # the fewest and most Parquet files a read-ahead thread keeps open between reads


def open_files_per_thread(threads: int) -> int:
    """How many files each of a reader's `threads` keeps open: an eighth of the process's soft open-file limit shared
    among them (the rest is the process's: sockets, the other split's reader, Spark's), within OPEN_FILES_PER_THREAD.
    Re-opening a file costs a request on an object store (chunks come in a shuffled order), and keeping every file
    open ran a share of more than ~1,000 files out of descriptors."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    soft = 1 << 16 if soft == resource.RLIM_INFINITY else soft
    fewest, most = OPEN_FILES_PER_THREAD
    return max(fewest, min(most, soft // 8 // max(1, threads)))


class ArrowShardReader:
    """Reads one rank's row groups of a converted split with pyarrow, `workers` row groups ahead of the consumer.

    pyarrow releases the GIL while it reads and decompresses, so the read-ahead overlaps the training step. Each
    file's footer is read once (`_footer`) and a read-ahead thread keeps at most `open_files` files open
    (`open_files_per_thread`, `_file`), so a shard of thousands of files stays within the process's open-file limit; the direct reader
    (`direct.DirectShardReader`) keeps its files the same way.
    """

    def __init__(self, split: ConvertedSplit, rank: int, world_size: int, workers: int = 2) -> None:
        self.split = split
        self.groups = split.shard(rank, world_size)
        self._files_state(workers)

    def _files_state(self, workers: int) -> None:
        """The read-ahead's threads and what they keep of the files: each file's footer, each thread's open files."""
        self.workers = max(1, workers)
        self._local = threading.local()
        self._footers: Dict[int, Tuple[Any, int]] = {}  # file index -> (Parquet footer, the file's size then)
        self.open_files = open_files_per_thread(self.workers + 1)  # the read-ahead threads and the consumer's

    def __len__(self) -> int:
        return len(self.groups)

    def _filesystem(self, url: str) -> Tuple[Any, str]:
        """(pyarrow filesystem, path inside it) of one of the split's files."""
        from pipeline.data.cache import filesystem

        return filesystem(url)

    def _footer(self, file_index: int) -> Tuple[Any, int]:
        """(Parquet footer, file size) of a file, read once (metadata only) and the file closed again."""
        import pyarrow.parquet as pq

        if file_index not in self._footers:
            fs, path = self._filesystem(self.split.file_urls[file_index])
            with fs.open_input_file(path) as fh:
                self._footers[file_index] = (pq.read_metadata(fh), fh.size())
        return self._footers[file_index]

    def _file(self, file_index: int):
        """The file as a ParquetFile on its footer read once (`_footer`), from this thread's open files (at most
        `open_files`: the least recently read one is closed to open another)."""
        import pyarrow.parquet as pq

        files = getattr(self._local, "files", None)
        if files is None:
            files = self._local.files = OrderedDict()
        if file_index in files:
            files.move_to_end(file_index)
            return files[file_index][1]
        while len(files) >= self.open_files:
            files.popitem(last=False)[1][0].close()
        meta, size = self._footer(file_index)
        fs, path = self._filesystem(self.split.file_urls[file_index])
        fh = fs.open_input_file(path)
        try:
            if fh.size() != size:
                raise OSError(f"{fh.size()} bytes, {size} when its footer was read: the file changed")
            pf = pq.ParquetFile(fh, metadata=meta)
        except BaseException:
            fh.close()
            raise
        files[file_index] = (fh, pf)
        return pf

    def read(self, local_index: int) -> RowGroup:
        """Row group `local_index` of this rank's shard.

        Raises:
            ConversionError: naming the file and row group when it is missing, truncated or unreadable.
        """
        file_index, group, rows = self.groups[local_index]
        try:
            pf = self._file(file_index)
            columns = ENCODED_COLUMNS if CONTENT in pf.schema_arrow.names else COLUMNS
            table = pf.read_row_group(group, columns=list(columns), use_threads=False)
            if table.num_rows != rows:
                raise OSError(f"{table.num_rows} rows, the converter wrote {rows}")
        except Exception as exc:
            url = self.split.file_urls[file_index]
            raise ConversionError(f"converted Parquet file {url} row group {group} ({self.split.name} split) is "
                                  f"unreadable ({type(exc).__name__}: {exc}); run `lakehouse cache clear` to "
                                  f"convert again") from None
        return row_group_of(table)

    def iter_groups(self, order: Sequence[int]) -> Iterator[Tuple[int, RowGroup]]:
        """(local index, row group) in `order`, read ahead on a small thread pool; stops cleanly when closed."""
        for _, i, group in self.iter_tagged((None, i) for i in order):
            yield i, group

    def iter_tagged(self, items: Iterable[Tuple[Any, int]]) -> Iterator[Tuple[Any, int, RowGroup]]:
        """(tag, local index, row group) for each (tag, local index) of `items`, which may be endless (the passes
        of a train stream, tagged with their pass): `workers` + 1 row groups are read ahead on one thread pool,
        across pass boundaries, so a pass never starts by waiting for its first read. Stops cleanly when closed."""
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix=f"arrow-{self.split.name}")
        pending: deque = deque()
        it = iter(items)
        try:
            for tag, i in it:
                pending.append((tag, int(i), pool.submit(self.read, int(i))))
                if len(pending) > self.workers:
                    break
            while pending:
                tag, i, future = pending.popleft()
                nxt = next(it, None)
                if nxt is not None:
                    pending.append((nxt[0], int(nxt[1]), pool.submit(self.read, int(nxt[1]))))
                yield tag, i, future.result()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)


# Petastorm keeps at most workers + petastorm.reader._VENTILATE_EXTRA_ROWGROUPS (2) row groups in flight and, when
# that many are, looks again only every 10 ms: with row groups of a few hundred rows a reader cannot pass ~4 row
# groups per 10 ms (`lakehouse bench`: 140k rows/s on the digits sample, 0.19 of a plain pyarrow loop). Small row
# groups get a deeper queue, up to about this many bytes of pixels; large ones keep Petastorm's default.
PREFETCH_BYTES = 32 * 2 ** 20
MAX_EXTRA_ROW_GROUPS = 64


@contextmanager
def _ventilation_depth(extra: int) -> Iterator[None]:
    """Let a Petastorm reader created in this block keep `extra` row groups in flight beyond its workers."""
    import petastorm.reader as petastorm_reader

    old = petastorm_reader._VENTILATE_EXTRA_ROWGROUPS
    petastorm_reader._VENTILATE_EXTRA_ROWGROUPS = max(old, extra)
    try:
        yield
    finally:
        petastorm_reader._VENTILATE_EXTRA_ROWGROUPS = old


class ArrowColumns:
    """Petastorm results-queue reader that hands over each row group's columns as Arrow arrays.

    Petastorm 0.12.1's batch reader turns every column into pandas first (a Python object per row for binary
    columns); the loader only needs the Arrow buffers. Installed on a reader with `read_arrow_columns`.
    """

    batched_output = True

    def read_next(self, workers_pool, schema, ngram):
        from petastorm.workers_pool import EmptyResultError

        try:
            table = workers_pool.get_results()
        except EmptyResultError:
            raise StopIteration
        return row_group_of(table)


def read_arrow_columns(reader) -> None:
    """Make a Petastorm batch reader yield Arrow columns (replaces its private results-queue reader)."""
    from petastorm.arrow_reader_worker import ArrowReaderWorkerResultsQueueReader

    current = getattr(reader, "_results_queue_reader", None)
    if not isinstance(current, ArrowReaderWorkerResultsQueueReader):
        import petastorm

        raise RuntimeError(f"petastorm {petastorm.__version__}: a batch reader without the results-queue reader of "
                           f"0.12.1 ({type(current).__name__}); pin petastorm==0.12.1 (see setup.py)")
    reader._results_queue_reader = ArrowColumns()


@contextmanager
def open_petastorm(split: ConvertedSplit, rank: int, world_size: int, batch_size: int, num_epochs: Optional[int],
                   workers: int, seed: int, shuffle: bool, row_bytes: int) -> Iterator:
    """A Petastorm reader of shard `rank` yielding each row group as Arrow columns; stopped on leaving."""
    require_reader("petastorm")
    from petastorm.spark.spark_dataset_converter import SparkDatasetConverter

    converter = SparkDatasetConverter(split.cache_dir_url, list(split.file_urls), split.rows)

    def arrow_reader(reader, batch_size, shuffling_queue_capacity):
        read_arrow_columns(reader)
        return reader

    groups = split.row_group_rows
    mean_rows = max(1.0, sum(groups) / max(1, len(groups)))
    extra = min(MAX_EXTRA_ROW_GROUPS, int(PREFETCH_BYTES / row_bytes / mean_rows) - workers)
    ctx = converter.make_torch_dataloader(
        batch_size=batch_size, num_epochs=num_epochs, workers_count=workers, data_loader_fn=arrow_reader,
        cur_shard=rank, shard_count=world_size, seed=seed, shuffle_row_groups=shuffle, reader_pool_type="thread")
    with ExitStack() as stack:
        with _ventilation_depth(extra):  # the reader is created on entering
            reader = stack.enter_context(ctx)
        yield reader


def shard_row_ids(split: ConvertedSplit, rank: int, world_size: int) -> List[int]:
    """Every row id of shard `rank` (for checks and tests; reads only the row_id column)."""
    reader = ArrowShardReader(split, rank, world_size, workers=1)
    ids: List[int] = []
    for _, group in reader.iter_groups(range(len(reader))):
        ids.extend(group.row_id.to_pylist())
    return ids
