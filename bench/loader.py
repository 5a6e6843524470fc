"""Loader efficiency: rows/s of the train ShardLoader with a given reader against a hand-written pyarrow loop."""
from __future__ import annotations

import dataclasses
import time
from typing import List, Optional

from bench.core import Result, Sizes, interleaved, median, torch_threads
from bench.reference import parquet_paths, pyarrow_pass
from pipeline.config import Config

def configured_reader(cfg: Config) -> str:
    return cfg.data.reader


def reader_problem(name: str) -> Optional[str]:
    """Why reader `name` cannot run in this install (the message of pipeline.data.readers.require_reader, which names
    `data.reader`), or None when it can."""
    from pipeline.data.readers import require_reader
    from pipeline.data.shards import ConversionError

    try:
        require_reader(name)
    except ConversionError as e:
        return str(e)
    return None


def available_readers(cfg: Config) -> List[str]:
    """The readers this install can run (petastorm is absent from the `modern` profile), the configured one first."""
    from pipeline.data.shards import READERS

    found = [reader for reader in READERS if reader_problem(reader) is None]
    return sorted(found, key=lambda r: r != configured_reader(cfg))


def with_reader(cfg: Config, reader: str, **data_changes) -> Config:
    """`cfg` whose data config reads with `reader` (and the other data.* changes)."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, reader=reader, **data_changes))


def train_datamodule(cfg: Config, data, rank: int = 0, world: int = 1):
    from pipeline.data.datamodule import make_datamodule

    return make_datamodule(data, rank, world, cfg.data)


def measure_loader(cfg: Config, prep, sizes: Sizes, reader: str, uncached: bool = False) -> Result:
    """Rows/s of the train ShardLoader reading with `reader` vs the hand-written pyarrow loop, each over a
    contiguous stretch.

    A repeat is one stretch of each (order flipped every repeat). The loader is opened afresh for its stretch,
    runs one untimed epoch, then `blocks` timed epochs, and is closed before the reference runs, so its reader
    threads neither prefetch for free nor take CPU from the reference. `uncached`: with data.memory_cache_mb=0.
    The figure's key carries the reader unless it is the configured one.
    """
    from pipeline.data.batches import PixelsToTensor

    mine = configured_reader(cfg)
    cfg = with_reader(cfg, reader, **({"memory_cache_mb": 0} if uncached else {}))
    data = prep.data1
    paths = parquet_paths(data.train)
    transform = PixelsToTensor(data.channels, data.image_size)
    bs = data.plan.train.batch_size
    epoch_rows = data.plan.train.rows_per_epoch_per_rank
    blocks = max(2, -(-sizes.loader_min_rows // max(1, epoch_rows)))

    kept = train_datamodule(cfg, data).train_loader.keeps_in_memory  # decided from the plan; nothing opened yet

    def run_loader() -> float:
        dm = train_datamodule(cfg, data)
        loader = dm.train_loader
        try:
            for _ in loader:  # untimed: opens the endless reader
                pass
            rows = 0
            t0 = time.perf_counter()
            for _ in range(blocks):
                for _x, y in loader:
                    rows += len(y)
            return rows / (time.perf_counter() - t0)
        finally:
            dm.teardown("fit")

    def run_reference() -> float:
        t0 = time.perf_counter()
        rows = sum(pyarrow_pass(paths, transform, bs) for _ in range(blocks))
        return rows / (time.perf_counter() - t0)

    with torch_threads(cfg.train.threads_per_rank):
        pyarrow_pass(paths, transform, bs)  # warm-up: page cache, imports
        ours, ref = interleaved(run_loader, run_reference, sizes.repeats)
        ratios = [o / r for o, r in zip(ours, ref)]
    groups = data.plan.train.row_group_rows
    if kept:
        note = (f"the shard ({data.plan.train.total_rows} rows) fits data.memory_cache_mb={cfg.data.memory_cache_mb}: "
                f"read through the {reader} reader in the untimed epoch and the start of the timed ones, then from "
                f"memory")
    elif reader == "petastorm":
        note = (f"{len(groups)} row groups of ~{sum(groups) // max(1, len(groups))} rows; Petastorm's reader threads "
                f"spend ~0.9 ms per row group whatever its size (two file opens and a legacy ParquetDataset read, "
                f"partly holding the GIL the consuming thread needs), so small row groups cost more per row")
    else:
        note = f"{len(groups)} row groups of ~{sum(groups) // max(1, len(groups))} rows, read by the {reader} reader"
    return Result("loader_efficiency_uncached" if uncached else "loader_efficiency", prep.name, median(ratios),
                  {"loader_rows_per_s": median(ours), "pyarrow_rows_per_s": median(ref), "reader": reader,
                   "rows_per_repeat": {"loader": blocks * epoch_rows, "pyarrow": blocks * data.plan.train.total_rows},
                   "kept_in_memory": kept, "reader_workers": cfg.data.reader_workers,
                   "shuffle_buffer": cfg.data.shuffle_buffer, "torch_threads": cfg.train.threads_per_rank or "default"},
                  len(ratios), ratios, note=note, variant="" if reader == mine else reader)
