"""The LightningDataModule: per-rank Petastorm readers (shard = rank) that yield exactly the planned steps."""
from __future__ import annotations

import itertools
from contextlib import ExitStack, contextmanager
from typing import Iterator, List, Optional, Tuple

import numpy as np
import pytorch_lightning as pl
import torch

from pipeline.config import DataConfig
from pipeline.data.convert import ConvertedData
from pipeline.data.transforms import PIXEL_MEAN, PIXEL_STD
from pipeline.lakehouse.partition import SplitPlan
from pipeline.log import get_logger, quiet_third_party_warnings

quiet_third_party_warnings()
log = get_logger(__name__)


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


class ShardCountError(RuntimeError):
    """A rank read a different number of rows than the plan said."""


class PixelsToTensor:
    """Raw uint8 pixel bytes of a row group (an Arrow binary column) -> normalised float32 (N, C, H, W).

    The Arrow column's value buffer is already the rows' pixels back to back: it is viewed and checked without a
    Python object per row (Petastorm's own conversion makes one `bytes` per row through pandas: 0.77 ms of the
    consuming thread for a 353-row group, timed around its `read_next`; see docs/PERFORMANCE.md).
    """

    def __init__(self, channels: int, size: int) -> None:
        self.shape = (channels, size, size)
        self.row_bytes = int(np.prod(self.shape))

    def __call__(self, column) -> torch.Tensor:
        return self.normalize(self.rows(column))

    def rows(self, column) -> np.ndarray:
        """Arrow binary column (or a sequence of bytes) -> read-only uint8 (N, C*H*W) view of its values."""
        import pyarrow as pa

        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        elif not isinstance(column, pa.Array):
            column = pa.array(list(column), type=pa.binary())
        if len(column) == 0:
            return np.empty((0, self.row_bytes), dtype=np.uint8)
        if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
            raise ValueError(f"pixel column has Arrow type {column.type}, expected binary; convert again")
        if column.null_count:
            raise ValueError(f"row {column.is_null().to_numpy(zero_copy_only=False).argmax()} of the pixel column "
                             f"is null; convert again")
        _, offsets_buf, data_buf = column.buffers()
        offset_type = np.int64 if pa.types.is_large_binary(column.type) else np.int32
        offsets = np.frombuffer(offsets_buf, dtype=offset_type)[column.offset:column.offset + len(column) + 1]
        lengths = np.diff(offsets)
        bad = np.flatnonzero(lengths != self.row_bytes)
        if bad.size:
            raise ValueError(f"row {bad[0]} of the pixel column holds {lengths[bad[0]]} bytes, expected "
                             f"{self.row_bytes} (rows of shape {self.shape}); convert again with this "
                             f"data.image_size and data.channels")
        view = np.frombuffer(data_buf, dtype=np.uint8)[offsets[0]:offsets[-1]].reshape(len(column), self.row_bytes)
        view.flags.writeable = False  # Arrow's memory: never written through this view
        return view

    def normalize(self, rows: np.ndarray) -> torch.Tensor:
        """uint8 rows (N, C*H*W) -> normalised float32 (N, C, H, W), a new tensor."""
        out = torch.from_numpy(rows.astype(np.float32))
        return out.mul_(1.0 / (255.0 * PIXEL_STD)).sub_(PIXEL_MEAN / PIXEL_STD).view(len(rows), *self.shape)


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
        return schema.make_namedtuple(**{name: table.column(name) for name in table.column_names})


def read_arrow_columns(reader) -> None:
    """Make a Petastorm batch reader yield Arrow columns (replaces its private results-queue reader)."""
    from petastorm.arrow_reader_worker import ArrowReaderWorkerResultsQueueReader

    current = getattr(reader, "_results_queue_reader", None)
    if not isinstance(current, ArrowReaderWorkerResultsQueueReader):
        import petastorm

        raise RuntimeError(f"petastorm {petastorm.__version__}: a batch reader without the results-queue reader of "
                           f"0.12.1 ({type(current).__name__}); pin petastorm==0.12.1 (see setup.py)")
    reader._results_queue_reader = ArrowColumns()


class BatchAssembler:
    """Turns row groups (Arrow columns `pixels`, `label_index`) into (features, labels) batches of `batch_size`.

    Row groups stay uint8 views of the Arrow buffers until they are gathered, in a shuffle buffer of about
    `shuffle_buffer` rows, with one permutation (a quarter of the bytes of float32), into memory that is reused
    from one buffer to the next: a fresh multi-MB array page-faults on every write (measured 4-10x slower).
    Batches are normalised one at a time into new tensors. The last batch of a finite source may be short.
    """

    def __init__(self, row_groups, batch_size: int, transform: PixelsToTensor, shuffle_buffer: int, seed: int) -> None:
        self.row_groups = row_groups
        self.batch_size = batch_size
        self.transform = transform
        self.shuffle_buffer = shuffle_buffer
        self.generator = torch.Generator().manual_seed(seed)
        self._scratch = [np.empty((0, transform.row_bytes), np.uint8), np.empty((0, transform.row_bytes), np.uint8)]

    def _buffer(self, k: int, n: int) -> np.ndarray:
        if len(self._scratch[k]) < n:
            self._scratch[k] = np.empty((n, self.transform.row_bytes), np.uint8)
        return self._scratch[k][:n]

    def _emit(self, xs, ys, final: bool):
        n = sum(len(y) for y in ys)
        x = np.concatenate(xs, out=self._buffer(0, n))
        y = np.concatenate(ys).astype(np.int64)
        if self.shuffle_buffer > 0:
            perm = torch.randperm(n, generator=self.generator).numpy()
            x = np.take(x, perm, axis=0, out=self._buffer(1, n), mode="clip")  # clip: no temporary for `out`
            y = y[perm]
        full = n if final else (n // self.batch_size) * self.batch_size
        bs = self.batch_size
        batches = [(self.transform.normalize(x[i:i + bs]), torch.from_numpy(y[i:i + bs])) for i in range(0, full, bs)]
        return batches, [x[full:].copy()], [y[full:]]  # the rest leaves the scratch memory before it is reused

    def __iter__(self):
        xs, ys, n = [], [], 0
        threshold = max(self.batch_size, self.shuffle_buffer)
        for chunk in self.row_groups:
            xs.append(self.transform.rows(chunk.pixels))
            ys.append(chunk.label_index.to_numpy())
            n += len(ys[-1])
            if n >= threshold:
                batches, xs, ys = self._emit(xs, ys, final=False)
                n = len(ys[0])
                yield from batches
        if n:
            batches, _, _ = self._emit(xs, ys, final=True)
            yield from batches


class ShardLoader:
    """Iterable of (features, labels) batches for one rank.

    Train: one endless stream of the shard's row groups; each pass yields exactly `steps` full batches, the same
    on every rank. Val: every validation row of the shard once per pass. A shard of at most `memory_cache_mb` is
    read through Petastorm once and then served from memory (see `_row_groups`); a larger one through a Petastorm
    reader every pass. The rows read in the last pass are kept in `rows_read`.
    """

    def __init__(self, converter, plan: SplitPlan, rank: int, world_size: int, channels: int, image_size: int,
                 endless: bool, workers: int, shuffle_buffer: int, seed: int, memory_cache_mb: int = 0) -> None:
        self.converter = converter
        self.plan = plan
        self.rank = rank
        self.world_size = world_size
        self.endless = endless
        self.transform = PixelsToTensor(channels, image_size)
        self.workers = workers
        self.shuffle_buffer = shuffle_buffer if endless else 0
        self.seed = seed
        self.keeps_in_memory = self.shard_mb() <= memory_cache_mb
        self.rows_read = 0
        self.wait_s = 0.0  # time spent waiting for batches in the last pass
        self._kept: Optional[List] = None  # the shard's row groups, once one whole pass has been read
        self._source: Optional[Iterator] = None
        self._it: Optional[Iterator] = None

    def shard_mb(self) -> float:
        """Memory this rank's shard takes held as Arrow columns (pixels and labels)."""
        return self.plan.rows_per_rank[self.rank] * (self.transform.row_bytes + 8) / 2 ** 20

    def _extra_row_groups(self) -> int:
        groups = self.plan.row_group_rows
        mean_rows = max(1.0, sum(groups) / max(1, len(groups)))
        row_bytes = int(np.prod(self.transform.shape))
        return min(MAX_EXTRA_ROW_GROUPS, int(PREFETCH_BYTES / row_bytes / mean_rows) - self.workers)

    @contextmanager
    def _open(self, num_epochs: Optional[int]) -> Iterator:
        """A Petastorm reader of this shard yielding each row group as Arrow columns; stopped on leaving."""
        def arrow_reader(reader, batch_size, shuffling_queue_capacity):
            read_arrow_columns(reader)
            return reader

        ctx = self.converter.make_torch_dataloader(
            batch_size=self.plan.batch_size, num_epochs=num_epochs, workers_count=self.workers,
            data_loader_fn=arrow_reader, cur_shard=self.rank, shard_count=self.world_size, seed=self.seed,
            shuffle_row_groups=self.endless, reader_pool_type="thread")
        with ExitStack() as stack:
            with _ventilation_depth(self._extra_row_groups()):  # the reader is created on entering
                reader = stack.enter_context(ctx)
            yield reader

    def _row_groups(self, passes: Optional[int]) -> Iterator:
        """The shard's row groups for `passes` passes over it (None: endless).

        A shard that fits data.memory_cache_mb is read through Petastorm once, kept (the Arrow columns as read) and
        served from memory after that whole first pass, in a new seeded order each train pass; a larger one is read
        through Petastorm every pass. A pass cut short (Lightning's sanity check) keeps nothing.
        """
        if not self.keeps_in_memory:
            with self._open(passes) as reader:
                yield from reader
            return
        order = np.random.default_rng(self.seed)
        for _ in (itertools.count() if passes is None else range(passes)):
            if self._kept is not None:
                for i in (order.permutation(len(self._kept)) if self.endless else range(len(self._kept))):
                    yield self._kept[i]
                continue
            kept, rows, planned = [], 0, self.plan.rows_per_rank[self.rank]
            with self._open(1) as reader:
                for group in reader:
                    kept.append(group)
                    rows += len(group.label_index)
                    if rows == planned:  # whole before its last batch is taken: Lightning may stop right there
                        self._keep(kept, rows)
                    yield group
            if rows != planned:
                raise ShardCountError(f"rank {self.rank} read {rows} {self.plan.name} rows in a pass over its shard, "
                                      f"the plan says {planned}; the converted files changed, convert again")

    def _keep(self, row_groups: List, rows: int) -> None:
        self._kept = row_groups
        log.info("rank %d: %s shard (%d rows, %.1f MB) kept in memory after its first pass (data.memory_cache_mb)",
                 self.rank, self.plan.name, rows, self.shard_mb())

    def __len__(self) -> int:
        if self.endless:
            return self.plan.steps_per_epoch
        return -(-self.plan.rows_per_rank[self.rank] // self.plan.batch_size)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        import time

        self.rows_read = 0
        self.wait_s = 0.0
        if self.endless:
            if self._it is None:
                self._source = self._row_groups(None)
                self._it = iter(BatchAssembler(self._source, self.plan.batch_size, self.transform,
                                               self.shuffle_buffer, self.seed))
            for _ in range(self.plan.steps_per_epoch):
                t0 = time.perf_counter()
                x, y = next(self._it)
                self.wait_s += time.perf_counter() - t0
                self.rows_read += len(y)
                yield x, y
            return
        source = self._row_groups(1)
        it = iter(BatchAssembler(source, self.plan.batch_size, self.transform, 0, self.seed))
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    x, y = next(it)
                except StopIteration:
                    break
                self.wait_s += time.perf_counter() - t0
                self.rows_read += len(y)
                yield x, y
        finally:
            source.close()  # stops a Petastorm reader left mid-pass

    def expected_rows(self) -> int:
        return self.plan.rows_per_epoch_per_rank if self.endless else self.plan.rows_per_rank[self.rank]

    def check_rows(self) -> None:
        """Raise when the rows read in the last full pass differ from the plan."""
        expected = self.expected_rows()
        if self.rows_read != expected:
            raise ShardCountError(f"rank {self.rank} read {self.rows_read} {self.plan.name} rows in an epoch, "
                                  f"the plan says {expected} ({self.plan.rows_per_rank} per rank)")

    def close(self) -> None:
        """Stop the endless train reader (the rows kept in memory stay for the next fit)."""
        if self._source is not None:
            self._source.close()
        self._source = self._it = None


class LakehouseDataModule(pl.LightningDataModule):
    """Loaders for shard `rank` of `world_size` over converted Delta data."""

    def __init__(self, data: ConvertedData, rank: int = 0, world_size: int = 1,
                 data_cfg: Optional[DataConfig] = None) -> None:
        super().__init__()
        if data.plan.train.world_size != world_size:
            raise ValueError(f"the shard plan was made for {data.plan.train.world_size} rank(s), "
                             f"this job has {world_size}")
        c = data_cfg or DataConfig()
        self.data = data
        self.rank = rank
        self.world_size = world_size
        kw = dict(rank=rank, world_size=world_size, channels=data.channels, image_size=data.image_size,
                  workers=c.reader_workers, seed=c.seed + rank)
        self.train_loader = ShardLoader(data.train, data.plan.train, endless=True, shuffle_buffer=c.shuffle_buffer,
                                        memory_cache_mb=c.memory_cache_mb, **kw)
        left_mb = c.memory_cache_mb - (self.train_loader.shard_mb() if self.train_loader.keeps_in_memory else 0)
        self.val_loader = ShardLoader(data.val, data.plan.val, endless=False, shuffle_buffer=0,
                                      memory_cache_mb=left_mb, **kw)  # one budget per rank: train first, then val

    @property
    def class_names(self) -> List[str]:
        return self.data.class_names

    def train_dataloader(self) -> ShardLoader:
        return self.train_loader

    def val_dataloader(self) -> ShardLoader:
        return self.val_loader

    def teardown(self, stage: str) -> None:
        self.train_loader.close()
        self.val_loader.close()


def make_datamodule(data: ConvertedData, rank: int, world_size: int,
                    data_cfg: Optional[DataConfig] = None) -> LakehouseDataModule:
    """The data module of rank `rank`; loader settings from `data_cfg` (the data.* config keys)."""
    return LakehouseDataModule(data, rank, world_size, data_cfg)
