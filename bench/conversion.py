"""Conversion: the first conversion of a pinned table against a plain Parquet write, and a second one (cache hit)."""
from __future__ import annotations

import dataclasses
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple
from urllib.parse import urlparse

from bench.core import Result, Sizes, median
from pipeline.config import Config
from pipeline.data.cache import remove_entry, root_url
from pipeline.log import get_logger

log = get_logger(__name__)


def _remove(url_or_path: str) -> None:
    from pipeline.lakehouse.delta import local_path

    path = local_path(url_or_path)
    if path:
        shutil.rmtree(path, ignore_errors=True)


def bench_cache_dir(cfg: Config, work_dir: str) -> str:
    """The bench's own converted-data cache: `<work_dir>/cache` for a local `data.cache_dir`, else
    `<data.cache_dir>-bench` on the same shared storage (the executors must see it). The bench deletes and rewrites
    its entries on every repeat, so it never touches the user's cache: an entry there of the same table stays."""
    import os

    if urlparse(cfg.data.cache_dir).scheme in ("", "file"):
        return os.path.join(os.path.abspath(work_dir), "cache")
    return cfg.data.cache_dir.rstrip("/") + "-bench"


def with_bench_cache(cfg: Config, work_dir: str) -> Config:
    """`cfg` converting into the bench's own cache (`bench_cache_dir`)."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache_dir=bench_cache_dir(cfg, work_dir)))


def remove_bench_cache(cfg: Config, work_dir: str) -> None:
    """Delete the bench's own cache folder (what is left of it once the measurements have deleted their entries)."""
    remove_entry(bench_cache_dir(cfg, work_dir))  # a whole folder, as for one entry


@dataclass
class Prepared:
    """One data set, pinned and converted for 2 ranks, with what the measurements need."""

    name: str
    table: str
    version: int
    rows: int
    class_names: List[str]
    data: Any  # ConvertedData (2-rank plan)
    data1: Any  # the same converters with a 1-rank plan

    def info(self) -> Dict[str, Any]:
        t = self.data.plan.train
        return {"table": self.table, "version": self.version, "rows": self.rows, "train_rows": t.total_rows,
                "val_rows": self.data.plan.val.total_rows, "train_row_groups": len(t.row_group_rows),
                "classes": len(self.class_names)}


def replan(cfg: Config, data, world: int, batch_size: int = 0):
    """The same converted data with the shard plan `derive_plan` makes for `world` ranks at `batch_size` per rank
    exactly (0: the plan's own; never lowered for data.min_steps_per_epoch: the bench measures the batch it asks)."""
    from pipeline.data.plan import derive_plan

    batch = batch_size or data.plan.train.batch_size
    return dataclasses.replace(data, plan=derive_plan(cfg, data, world, batch, min_steps=0).shards)


def measure_conversion(spark, cfg: Config, name: str, table: str, sizes: Sizes,
                       work_dir: str) -> Tuple[Prepared, List[Result]]:
    """Plain Parquet write vs the first conversion vs a second conversion of the same pinned table (a cache hit).

    A conversion is convert_for_training (both splits into one content-keyed cache entry); the plain write writes the
    same prepared train and val DataFrames with df.write.parquet. Every repeat rebuilds the DataFrames from the pinned
    table (as a second `train` would), the plain write goes to a scratch folder that is removed, and the cache entry
    is deleted before each first conversion so that it is a miss (an entry left by an earlier bench included). All of
    it happens in the bench's own cache (`bench_cache_dir`): the user's cache, and its entry of the same table, are
    not touched. The returned data lives there too (run_bench deletes it).
    """
    cfg = with_bench_cache(cfg, work_dir)
    from pipeline.data.convert import class_names_of, convert_for_training, decoded_frame
    from pipeline.lakehouse.delta import get_engine
    from pipeline.lakehouse.split import split_frame

    engine = get_engine(cfg.delta.engine)
    world = 2
    df, pinned = engine.read(spark, table)
    version = pinned.version
    class_names = class_names_of(df)

    def conversion():
        d, p = engine.read(spark, table, version)
        t0 = time.perf_counter()
        data = convert_for_training(spark, d, cfg, world, class_names, p)
        return time.perf_counter() - t0, data

    scratch = root_url(cfg.data.cache_dir).rstrip("/") + "/bench-plain-" + uuid.uuid4().hex[:8]

    def plain() -> float:
        d, _ = engine.read(spark, table, version)
        frames = [decoded_frame(f, cfg, world) for f in split_frame(d, cfg.data.val_fraction, cfg.data.split_key)]
        t0 = time.perf_counter()
        for split, frame in zip(("train", "val"), frames):
            frame.write.mode("overwrite").parquet(f"{scratch}/{split}")
        elapsed = time.perf_counter() - t0
        _remove(scratch)
        return elapsed

    plain()  # warm-up: Python workers, JIT, page cache of the table's files
    # warm-up too; and an entry left by an earlier job would make the first a hit
    remove_entry(conversion()[1].entry_url)
    plains, firsts, hits = [], [], []
    for r in range(sizes.repeats):
        plains.append(plain())
        first_s, first = conversion()
        firsts.append(first_s)
        hit_s, again = conversion()
        hits.append(hit_s)
        if again.entry_url != first.entry_url:
            log.warning("%s: the second conversion was not a cache hit (%s vs %s)", name, again.entry_url,
                        first.entry_url)
            remove_entry(again.entry_url)
        if r < sizes.repeats - 1:
            remove_entry(first.entry_url)
        log.info("%s conversion repeat %d: plain write %.2f s, first conversion %.2f s, second %.3f s", name, r + 1,
                 plains[-1], firsts[-1], hits[-1])
    data = convert_for_training(spark, df, cfg, world, class_names, pinned)  # a hit on the last repeat's entry
    rows = pinned.num_rows if pinned.num_rows is not None else df.count()
    prepared = Prepared(name=name, table=table, version=version, rows=rows, class_names=class_names, data=data,
                        data1=replan(cfg, data, 1))
    results = [
        Result("conversion_vs_plain_write", name, median([f / p for f, p in zip(firsts, plains)]),
               {"first_conversion_s": median(firsts), "plain_write_s": median(plains),
                "rows": data.plan.train.total_rows + data.plan.val.total_rows}, len(firsts),
               [f / p for f, p in zip(firsts, plains)]),
        Result("conversion_cache_hit", name, median([h / f for h, f in zip(hits, firsts)]),
               {"second_conversion_s": median(hits), "first_conversion_s": median(firsts)}, len(hits),
               [h / f for h, f in zip(hits, firsts)]),
    ]
    return prepared, results
