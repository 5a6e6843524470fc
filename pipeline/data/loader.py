"""The reader loop of one rank: exactly the planned steps per pass from its shard (Petastorm or Arrow), the rows read
counted against the plan, and the stream's position as state a mid-epoch checkpoint resumes from."""
from __future__ import annotations

import itertools
from typing import Iterator, List, Optional, Tuple

import torch

from pipeline.data.batches import BatchAssembler, PixelsToTensor, normalize_uint8
from pipeline.data.decode import Decoder, EncodedRows
from pipeline.data.direct import DirectShardReader, DirectSplit
from pipeline.data.readers import ArrowShardReader, open_petastorm, pass_order, require_reader
from pipeline.data.shards import ConvertedSplit
from pipeline.lakehouse.partition import SplitPlan
from pipeline.log import get_logger, quiet_third_party_warnings

quiet_third_party_warnings()
log = get_logger(__name__)


class ShardCountError(RuntimeError):
    """A rank read a different number of rows than the plan said."""


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

    With a `decoder` (pipeline.data.decode: data.decode=cpu|gpu|auto) the split holds encoded rows: they are shuffled
    and batched as pixel rows are, then decoded and cropped batch by batch, ahead of the step, by the decoder.

    A `DirectSplit` (data.source=direct: the table's own files, no conversion) is read by `direct.DirectShardReader`
    in the arrow reader's place: always the arrow reader's stream (exact resume), always encoded rows and a decoder.
    """

    def __init__(self, split: ConvertedSplit, plan: SplitPlan, rank: int, world_size: int, channels: int,
                 image_size: int, endless: bool, workers: int, shuffle_buffer: int, seed: int,
                 memory_cache_mb: int = 0, reader: str = "petastorm", track_ids: bool = False,
                 normalize_on_device: bool = False, decoder: Optional[Decoder] = None) -> None:
        require_reader(reader)
        self.direct = isinstance(split, DirectSplit)
        if self.direct:
            if decoder is None:
                raise ValueError(f"the {split.name} split of the direct path (data.source=direct) holds encoded "
                                 f"images: its loader needs a decoder (data.decode=cpu|gpu|auto)")
            reader = "arrow"  # the direct reader is an arrow reader: the stream is a pure function of the seed
        self.split = split
        self.plan = plan
        self.rank = rank
        self.world_size = world_size
        self.endless = endless
        self.reader = reader
        self.decoder = decoder
        self.transform = (EncodedRows(split.encoded_row_bytes() if self.direct else encoded_row_bytes(split))
                          if decoder is not None
                          else PixelsToTensor(channels, image_size))
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
        make = DirectShardReader if self.direct else ArrowShardReader
        reader = make(self.split, self.rank, self.world_size, self.workers)
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

    def _batches(self, assembler: BatchAssembler) -> Iterator:
        """The assembler's batches; encoded ones decoded by the decoder, a few batches ahead (and normalised here
        unless the model normalises on its device)."""
        if self.decoder is None:
            return iter(assembler)
        decoded = self.decoder.batches(iter(assembler), depth=2)
        if self.normalize_on_device:
            return decoded
        return ((normalize_uint8(x), *rest) for x, *rest in decoded)

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
                self._it = self._batches(assembler)
            # a resumed epoch has only the steps the interrupted one had not taken
            self._epoch_steps = self.plan.steps_per_epoch - self.batches_taken % self.plan.steps_per_epoch
            for _ in range(self._epoch_steps):
                batch = self._take(self._it)
                self.batches_taken += 1
                yield batch
            return
        source = self._row_groups(1)
        it = self._batches(self._assembler(source, 0))
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
        interrupted one had not read yet, in the same order. The petastorm reader's order is its own: it starts over,
        which is worth a warning only for a checkpoint taken mid-epoch. One taken at an epoch's end resumes at the
        next epoch's start: no epoch was part-read, so no row of it can be read twice or missed, and a petastorm
        epoch's order is its own in an uninterrupted run too.
        """
        if not self.endless or batches <= 0:
            return
        if self.reader != "arrow" and batches % self.plan.steps_per_epoch:
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
        if self.decoder is not None:
            self.decoder.close()  # its threads; made again by the next pass


def encoded_row_bytes(split: ConvertedSplit) -> int:
    """The bytes of an encoded row on average: the split's files' sizes over its rows (data.memory_cache_mb)."""
    from pipeline.data.cache import filesystem

    total = 0
    for url in split.file_urls:
        fs, path = filesystem(url)
        total += fs.get_file_info(path).size or 0
    return max(1, total // max(1, split.rows))
