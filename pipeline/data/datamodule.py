"""The LightningDataModule: per-rank readers (shard = rank, Petastorm or Arrow) that yield exactly the planned steps."""
from __future__ import annotations

import itertools
from typing import Iterator, List, Optional, Tuple

import numpy as np
import pytorch_lightning as pl
import torch

from pipeline.config import DataConfig
from pipeline.data.readers import ArrowShardReader, load_reader, open_petastorm, pass_order, require_reader
from pipeline.data.shards import ConvertedData, ConvertedSplit
from pipeline.data.transforms import PIXEL_MEAN, PIXEL_STD
from pipeline.lakehouse.partition import SplitPlan
from pipeline.log import get_logger, quiet_third_party_warnings

quiet_third_party_warnings()
log = get_logger(__name__)


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


    def as_uint8(self, rows: np.ndarray, pin: bool) -> torch.Tensor:
        """uint8 rows (N, C*H*W) -> a new uint8 (N, C, H, W) tensor, in pinned memory when `pin`: the model
        normalises it on its device (a quarter of the bytes of float32 cross to the GPU, and the copy can overlap)."""
        out = torch.from_numpy(np.ascontiguousarray(rows)).view(len(rows), *self.shape)
        return out.pin_memory() if pin else out.clone()


def int_values(column, name: str) -> np.ndarray:
    """An Arrow integer column (or a sequence) as a numpy view of its buffer. pyarrow 14's own `to_numpy` imports
    pandas, which a rank must not need."""
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if not isinstance(column, pa.Array):
        return np.asarray(column, dtype=np.int64)
    if not pa.types.is_integer(column.type):
        raise ValueError(f"column {name} has Arrow type {column.type}, expected an integer; convert again")
    if column.null_count:
        raise ValueError(f"column {name} holds {column.null_count} null(s); convert again")
    if len(column) == 0:
        return np.empty(0, np.int64)
    signed = pa.types.is_signed_integer(column.type)
    dtype = np.dtype(f"{'int' if signed else 'uint'}{column.type.bit_width}")
    return np.frombuffer(column.buffers()[1], dtype=dtype)[column.offset:column.offset + len(column)]


class BatchAssembler:
    """Turns row groups (Arrow columns `pixels`, `label_index`, optionally `row_id`) into batches of `batch_size`.

    Row groups stay uint8 views of the Arrow buffers until they are gathered, in a shuffle buffer of about
    `shuffle_buffer` rows, with one permutation (a quarter of the bytes of float32), into memory that is reused
    from one buffer to the next: a fresh multi-MB array page-faults on every write (measured 4-10x slower).
    Batches are normalised one at a time into new tensors (or handed over as uint8 with `uint8_out`). The last batch
    of a finite source may be short. With `with_ids` it yields (features, labels, row ids).
    """

    def __init__(self, row_groups, batch_size: int, transform: PixelsToTensor, shuffle_buffer: int, seed: int,
                 with_ids: bool = False, uint8_out: bool = False, pin: bool = False) -> None:
        self.row_groups = row_groups
        self.batch_size = batch_size
        self.transform = transform
        self.shuffle_buffer = shuffle_buffer
        self.generator = torch.Generator().manual_seed(seed)
        self.with_ids = with_ids
        self.uint8_out = uint8_out
        self.pin = pin
        self.skip = 0  # batches to drop without making tensors (a resumed stream fast-forwards through these)
        self._scratch = [np.empty((0, transform.row_bytes), np.uint8), np.empty((0, transform.row_bytes), np.uint8)]

    def _buffer(self, k: int, n: int) -> np.ndarray:
        if len(self._scratch[k]) < n:
            self._scratch[k] = np.empty((n, self.transform.row_bytes), np.uint8)
        return self._scratch[k][:n]

    def _features(self, rows: np.ndarray) -> torch.Tensor:
        return self.transform.as_uint8(rows, self.pin) if self.uint8_out else self.transform.normalize(rows)

    def _emit(self, xs, ms, final: bool):
        n = sum(len(m) for m in ms)
        x = np.concatenate(xs, out=self._buffer(0, n))
        meta = np.concatenate(ms)  # (n, 2) int64: label, row id
        if self.shuffle_buffer > 0:
            perm = torch.randperm(n, generator=self.generator).numpy()
            x = np.take(x, perm, axis=0, out=self._buffer(1, n), mode="clip")  # clip: no temporary for `out`
            meta = meta[perm]
        full = n if final else (n // self.batch_size) * self.batch_size
        bs = self.batch_size
        batches = []
        for i in range(0, full, bs):
            if self.skip:
                self.skip -= 1
                continue
            y = torch.from_numpy(np.ascontiguousarray(meta[i:i + bs, 0]))
            if self.pin:
                y = y.pin_memory()
            item = (self._features(x[i:i + bs]), y)
            batches.append(item + (meta[i:i + bs, 1].copy(),) if self.with_ids else item)
        return batches, [x[full:].copy()], [meta[full:]]  # the rest leaves the scratch memory before it is reused

    def __iter__(self):
        xs, ms, n = [], [], 0
        threshold = max(self.batch_size, self.shuffle_buffer)
        for chunk in self.row_groups:
            xs.append(self.transform.rows(chunk.pixels))
            labels = int_values(chunk.label_index, "label_index")
            meta = np.empty((len(labels), 2), np.int64)
            meta[:, 0] = labels
            ids = getattr(chunk, "row_id", None)
            meta[:, 1] = int_values(ids, "row_id") if ids is not None else -1
            ms.append(meta)
            n += len(labels)
            if n >= threshold:
                batches, xs, ms = self._emit(xs, ms, final=False)
                n = len(ms[0])
                yield from batches
        if n:
            batches, _, _ = self._emit(xs, ms, final=True)
            yield from batches


class ShardLoader:
    """Iterable of (features, labels) batches for one rank.

    Train: one endless stream of the shard's row groups; each pass yields exactly `steps` full batches, the same
    on every rank. Val: every validation row of the shard once per pass, in `plan.eval_steps` batches on every
    rank (the last ones empty on a rank with fewer rows). `reader` picks how the converted Parquet is read:
    `petastorm` (Petastorm's reader) or `arrow` (pyarrow directly, row groups in a (seed, pass)-seeded order).
    A shard of at most `memory_cache_mb` is read once and then served from memory (see `_row_groups`). The rows read
    in the last pass are kept in `rows_read` (and their row ids in `ids_read` with `track_ids`).

    With the `arrow` reader the train stream is a pure function of the seed, so its position (batches taken) is
    its state: `state_dict()` / `load_state_dict()` let a run resumed from a mid-epoch checkpoint continue exactly
    where it stopped (Lightning saves and restores them with the checkpoint).
    """

    def __init__(self, split: ConvertedSplit, plan: SplitPlan, rank: int, world_size: int, channels: int,
                 image_size: int, endless: bool, workers: int, shuffle_buffer: int, seed: int,
                 memory_cache_mb: int = 0, reader: str = "petastorm", track_ids: bool = False,
                 normalize_on_device: bool = False) -> None:
        require_reader(reader)
        self.split = split
        self.plan = plan
        self.rank = rank
        self.world_size = world_size
        self.endless = endless
        self.reader = reader
        self.transform = PixelsToTensor(channels, image_size)
        self.workers = workers
        self.shuffle_buffer = shuffle_buffer if endless else 0
        self.seed = seed
        self.keeps_in_memory = self.shard_mb() <= memory_cache_mb
        self.track_ids = track_ids
        self.normalize_on_device = normalize_on_device
        self.rows_read = 0
        self.ids_read: List[int] = []
        self.wait_s = 0.0  # time spent waiting for batches in the last pass
        self.batches_taken = 0  # train: batches taken from the endless stream since it started
        self._resume_at = 0
        self._epoch_steps = plan.steps_per_epoch
        self._kept: Optional[List] = None  # the shard's row groups, once one whole pass has been read
        self._source: Optional[Iterator] = None
        self._it: Optional[Iterator] = None

    def shard_mb(self) -> float:
        """Memory this rank's shard takes held as Arrow columns (pixels, labels, row ids)."""
        return self.plan.rows_per_rank[self.rank] * (self.transform.row_bytes + 12) / 2 ** 20

    def _petastorm(self, passes: Optional[int]):
        return open_petastorm(self.split, self.rank, self.world_size, self.plan.batch_size, passes, self.workers,
                              self.seed, self.endless, self.transform.row_bytes)

    def _row_groups(self, passes: Optional[int]) -> Iterator:
        """The shard's row groups for `passes` passes over it (None: endless).

        A shard that fits data.memory_cache_mb is read once, kept (the Arrow columns as read) and served from memory
        after that whole first pass; a larger one is read from Parquet every pass. A pass cut short (Lightning's
        sanity check) keeps nothing. With the arrow reader pass p takes the row groups in `pass_order(p)` whether
        they come from memory or from the files, so the stream does not depend on what is cached.
        """
        if self.reader == "arrow":
            yield from self._arrow_row_groups(passes)
            return
        if not self.keeps_in_memory:
            with self._petastorm(passes) as reader:
                yield from reader
            return
        for p in (itertools.count() if passes is None else range(passes)):
            if self._kept is not None:
                yield from (self._kept[i] for i in pass_order(len(self._kept), self.seed, p, self.endless))
                continue
            kept, rows, planned = [], 0, self.plan.rows_per_rank[self.rank]
            with self._petastorm(1) as reader:
                for group in reader:
                    kept.append(group)
                    rows += len(group.label_index)
                    if rows == planned:  # whole before its last batch is taken: Lightning may stop right there
                        self._keep(kept, rows)
                    yield group
            self._check_pass(rows, planned)

    def _arrow_row_groups(self, passes: Optional[int]) -> Iterator:
        reader = ArrowShardReader(self.split, self.rank, self.world_size, self.workers)
        planned = self.plan.rows_per_rank[self.rank]
        if not self.keeps_in_memory:  # every pass from the files, through one read-ahead that spans the passes
            tagged = ((p, i) for p in (itertools.count() if passes is None else range(passes))
                      for i in pass_order(len(reader), self.seed, p, self.endless))
            current, rows = 0, 0
            for p, _, group in reader.iter_tagged(tagged):
                if p != current:
                    self._check_pass(rows, planned)
                    current, rows = p, 0
                rows += len(group.label_index)
                yield group
            self._check_pass(rows, planned)
            return
        for p in (itertools.count() if passes is None else range(passes)):
            order = pass_order(len(reader), self.seed, p, self.endless)
            if self._kept is not None:
                yield from (self._kept[i] for i in order)
                continue
            kept: List = [None] * len(reader) if self.keeps_in_memory else []
            rows = 0
            for i, group in reader.iter_groups(order):
                rows += len(group.label_index)
                if self.keeps_in_memory:
                    kept[i] = group
                    if rows == planned:
                        self._keep(kept, rows)
                yield group
            self._check_pass(rows, planned)

    def _check_pass(self, rows: int, planned: int) -> None:
        if rows != planned:
            raise ShardCountError(f"rank {self.rank} read {rows} {self.plan.name} rows in a pass over its shard, "
                                  f"the plan says {planned}; the converted files changed, convert again")

    def _keep(self, row_groups: List, rows: int) -> None:
        self._kept = row_groups
        log.info("rank %d: %s shard (%d rows, %.1f MB) kept in memory after its first pass (data.memory_cache_mb)",
                 self.rank, self.plan.name, rows, self.shard_mb())

    def _assembler(self, source, shuffle_buffer: int) -> BatchAssembler:
        return BatchAssembler(source, self.plan.batch_size, self.transform, shuffle_buffer, self.seed,
                              with_ids=True, uint8_out=self.normalize_on_device,
                              pin=self.normalize_on_device and torch.cuda.is_available())

    def __len__(self) -> int:
        if self.endless:
            return self.plan.steps_per_epoch
        return self.plan.eval_steps

    def _take(self, it) -> Tuple[torch.Tensor, torch.Tensor]:
        import time

        t0 = time.perf_counter()
        x, y, ids = next(it)
        self.wait_s += time.perf_counter() - t0
        self.rows_read += len(y)
        if self.track_ids:
            self.ids_read.extend(ids.tolist())
        return x, y

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        self.rows_read = 0
        self.ids_read = []
        self.wait_s = 0.0
        if self.endless:
            if self._it is None:
                self._source = self._row_groups(None)
                assembler = self._assembler(self._source, self.shuffle_buffer)
                assembler.skip = self.batches_taken = self._resume_at
                self._resume_at = 0
                self._it = iter(assembler)
            # a resumed epoch has only the steps the interrupted one had not taken
            self._epoch_steps = self.plan.steps_per_epoch - self.batches_taken % self.plan.steps_per_epoch
            for _ in range(self._epoch_steps):
                batch = self._take(self._it)
                self.batches_taken += 1
                yield batch
            return
        source = self._row_groups(1)
        it = iter(self._assembler(source, 0))
        steps, batch = 0, None
        try:
            while True:
                try:
                    batch = self._take(it)
                except StopIteration:
                    break
                steps += 1
                yield batch
        finally:
            source.close()  # stops a reader left mid-pass
        if batch is not None:  # the same number of batches as the rank with the most rows (plan.eval_steps)
            x, y = batch
            for _ in range(self.plan.eval_steps - steps):
                yield x[:0], y[:0]

    def resume_at(self, batches: int) -> None:
        """Continue the train stream after `batches` batches were trained (a checkpoint's global step): with the
        arrow reader the stream is a pure function of the seed, so the resumed run reads exactly the rows the
        interrupted one had not read yet, in the same order. The petastorm reader's order is its own: it starts over.
        """
        if not self.endless or batches <= 0:
            return
        if self.reader != "arrow":
            log.warning("rank %d: data.reader=petastorm cannot replay its row order; the epoch resumed at step %d "
                        "reads a new shuffle of the shard (data.reader=arrow resumes exactly)", self.rank, batches)
        self.close()
        self._resume_at = self.batches_taken = int(batches)

    def state_dict(self) -> dict:
        """What the train stream depends on (saved by Lightning with each checkpoint, checked when restored)."""
        return {"reader": self.reader, "seed": self.seed, "world_size": self.world_size,
                "steps_per_epoch": self.plan.steps_per_epoch}

    def load_state_dict(self, state: dict) -> None:
        if state and self.endless and any(state.get(k) != v for k, v in self.state_dict().items()):
            log.warning("rank %d: the checkpoint's data stream (%s) differs from this job's (%s); the resumed run "
                        "reads other rows than the interrupted one would have", self.rank, state, self.state_dict())

    def expected_rows(self) -> int:
        if self.endless:  # an epoch resumed mid-way reads only the steps it had left
            return self._epoch_steps * self.plan.batch_size
        return self.plan.rows_per_rank[self.rank]

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
                 data_cfg: Optional[DataConfig] = None, normalize_on_device: bool = False,
                 track_ids: bool = False) -> None:
        super().__init__()
        if data.plan.train.world_size != world_size:
            raise ValueError(f"the shard plan was made for {data.plan.train.world_size} rank(s), "
                             f"this job has {world_size}")
        c = data_cfg or DataConfig()
        load_reader(c.reader)
        self.data = data
        self.rank = rank
        self.world_size = world_size
        kw = dict(rank=rank, world_size=world_size, channels=data.channels, image_size=data.image_size,
                  workers=c.reader_workers, seed=c.seed + rank, reader=c.reader, track_ids=track_ids,
                  normalize_on_device=normalize_on_device)
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


def make_datamodule(data: ConvertedData, rank: int, world_size: int, data_cfg: Optional[DataConfig] = None,
                    normalize_on_device: bool = False, track_ids: bool = False) -> LakehouseDataModule:
    """The data module of rank `rank`; loader settings from `data_cfg` (the data.* config keys).

    `normalize_on_device`: batches are uint8 (pinned where CUDA is present) and the model normalises them on its
    device. `track_ids`: the loaders record the row ids they hand out (tests, accounting).
    """
    return LakehouseDataModule(data, rank, world_size, data_cfg, normalize_on_device, track_ids)
