"""`lakehouse bench`: the pipeline's performance as ratios of two quantities measured in the same run, with targets."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import platform
import shutil
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pandas as pd

from pipeline.config import Config
from pipeline.log import get_logger, quiet_third_party_warnings
from pipeline.tracking.runs import temporary_env

quiet_third_party_warnings()
log = get_logger(__name__)

# name -> (comparison, target, what the ratio is)
TARGETS: Dict[str, Tuple[str, float, str]] = {
    "loader_efficiency": (">=", 0.9, "rows/s of the train ShardLoader as configured (a shard that fits "
                                     "data.memory_cache_mb is served from memory after its first pass) / rows/s of a "
                                     "hand-written pyarrow loop over the same Parquet files with the same PixelsToTensor"),
    "loader_efficiency_uncached": (">=", 0.9, "the same with data.memory_cache_mb=0: the ShardLoader reads every "
                                              "epoch through Petastorm / the same pyarrow loop"),
    "input_bound_fraction": ("<=", 0.10, "1 - step time on in-memory batches / step time with the real loader "
                                         "(same ImageClassifier, batch size, forward+backward+optimizer step)"),
    "conversion_vs_plain_write": ("<=", 1.2, "first make_converter / plain df.write.parquet of the same DataFrame"),
    "conversion_cache_hit": ("<=", 0.05, "second make_converter of the same pinned table (cache hit) / the first"),
    "horovod_cpu_scaling": (">=", 1.8, "samples/s with 2 ranks x 1 thread / samples/s with 1 rank x 1 thread "
                                       "(steady state, real loader, Horovod gloo)"),
    "shard_balance": ("<=", 1.05, "most / fewest rows read per rank in one epoch of a 2-shard plan"),
    "checkpoint_overhead": ("<=", 0.05, "time saving checkpoints / epoch time (the project's train loop)"),
    "tracking_overhead": ("<=", 1.03, "epoch (step) time with RankZeroTracker.log_epoch into a SQLite-store run / "
                                      "the same without the time spent in it"),
}


@dataclass(frozen=True)
class Sizes:
    """How much work each measurement does; --quick only proves the bench runs."""

    synthetic_rows: int
    repeats: int
    loader_min_rows: int  # rows read per loader repeat (whole epochs)
    train_steps: int  # steps per input-bound repeat
    warmup_steps: int  # untimed training steps before the first timed one (a process reaches steady speed after ~200)
    hvd_steps: int  # steps per Horovod window (one window = one repeat)


FULL = Sizes(synthetic_rows=50_000, repeats=5, loader_min_rows=200_000, train_steps=100, warmup_steps=250,
             hvd_steps=60)
QUICK = Sizes(synthetic_rows=2_000, repeats=2, loader_min_rows=10_000, train_steps=40, warmup_steps=8,
              hvd_steps=16)


@dataclass
class Result:
    """One ratio on one data set: the two measured parts, every repeat, the spread and the verdict."""

    name: str
    dataset: str
    ratio: float
    parts: Dict[str, Any]
    repeats: int
    per_repeat: List[float]
    method: str = ""
    target: float = 0.0
    op: str = ""
    passed: bool = False
    spread: Dict[str, float] = field(default_factory=dict)
    note: str = ""

    def __post_init__(self) -> None:
        self.op, self.target, desc = TARGETS[self.name]
        self.method = self.method or desc
        self.passed = bool(self.ratio >= self.target if self.op == ">=" else self.ratio <= self.target)
        vals = [v for v in self.per_repeat if v == v]
        if vals:
            mid = statistics.median(vals)
            self.spread = {"min": min(vals), "max": max(vals),
                           "rel": (max(vals) - min(vals)) / abs(mid) if mid else 0.0}

    @property
    def key(self) -> str:
        return f"{self.name}/{self.dataset}"


# --------------------------------------------------------------------------- helpers


def _median(values: List[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


@contextlib.contextmanager
def _patched(owner: Any, attr: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """Replace `owner.attr` by `make(original)` for the block (timing wrappers; the bench's only intrusion)."""
    original = owner.__dict__[attr]
    setattr(owner, attr, make(original))
    try:
        yield
    finally:
        setattr(owner, attr, original)


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _device():
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def _machine() -> Dict[str, Any]:
    import torch

    info: Dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                            "torch": torch.__version__, "device": "cpu", "gpus": 0}
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2 ** 30, 1)
    except Exception:
        pass
    if torch.cuda.is_available():
        info.update(device="cuda", gpus=torch.cuda.device_count(), gpu=torch.cuda.get_device_name(0))
    return info


def _load() -> List[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


def _sibling_table(table: str, name: str) -> str:
    return f"{table.rstrip('/').rsplit('/', 1)[0]}/{name}" if "/" in table.rstrip("/") else name


def _remove(url_or_path: str) -> None:
    from pipeline.lakehouse.delta import local_path

    path = local_path(url_or_path)
    if path:
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- the data sets


def ensure_sample(spark, cfg: Config, work_dir: str) -> None:
    """The ingested digits sample at `delta.table`; rendered and ingested first when the table is missing."""
    from pipeline.lakehouse.delta import get_engine

    if get_engine(cfg.delta.engine).exists(spark, cfg.delta.table):
        return
    from pipeline.lakehouse.ingest import ingest_folder
    from pipeline.lakehouse.sample_data import render_digits

    src = os.path.join(work_dir, "sample_digits")
    log.info("Delta table %s does not exist: rendering the digits sample to %s and ingesting it", cfg.delta.table, src)
    shutil.rmtree(src, ignore_errors=True)
    render_digits(src, size=cfg.data.image_size)
    ingest_folder(spark, cfg, src, mode="overwrite")


def _synthetic_udf(size: int, channels: int, classes: int):
    from pyspark.sql.functions import pandas_udf

    @pandas_udf("path string, label string, label_index int, width int, height int, mode string, content binary")
    def render(ids: pd.Series) -> pd.DataFrame:
        import io

        import numpy as np
        from PIL import Image, ImageDraw

        mode = "L" if channels == 1 else "RGB"
        rows = []
        for i in ids:
            i = int(i)
            k = i % classes
            rng = np.random.default_rng(i)
            noise = rng.integers(0, 64, size=(size, size) if channels == 1 else (size, size, 3), dtype=np.uint8)
            img = Image.fromarray(noise, mode=mode)
            draw = ImageDraw.Draw(img)
            # A class-dependent shape at a random place: learnable, and every image different.
            r = size // 4 + k % 3
            cx, cy = (int(v) for v in rng.integers(r, size - r, size=2))
            box = (cx - r, cy - r, cx + r, cy + r)
            fill = 255 if channels == 1 else (255, 40 * k % 256, 255 - 25 * k)
            if k % 4 == 0:
                draw.ellipse(box, fill=fill)
            elif k % 4 == 1:
                draw.rectangle(box, fill=fill)
            elif k % 4 == 2:
                draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
            else:
                draw.line([(cx - r, cy - r), (cx + r, cy + r)], fill=fill, width=1 + k // 4)
            buf = io.BytesIO()
            img.save(buf, format="PNG", optimize=False)
            rows.append((f"synthetic/shape_{k}/{i:07d}.png", f"shape_{k}", k, size, size, mode, buf.getvalue()))
        return pd.DataFrame(rows, columns=["path", "label", "label_index", "width", "height", "mode", "content"])

    return render


def ensure_synthetic(spark, cfg: Config, rows: int, classes: int = 10) -> Dict[str, Any]:
    """A Delta table of `rows` random-noise + shape PNGs beside `delta.table`, rendered on the executors.

    Kept between runs: generation is skipped when the table exists with `rows` rows.
    """
    from pyspark.sql import functions as F

    from pipeline.lakehouse.delta import get_engine

    engine = get_engine(cfg.delta.engine)
    table = _sibling_table(cfg.delta.table, f"bench_synthetic_{rows}_{cfg.data.image_size}px_{cfg.data.channels}ch")
    if engine.exists(spark, table):
        df, pinned = engine.read(spark, table)
        have = pinned.num_rows if pinned.num_rows is not None else df.count()
        if have == rows:
            log.info("synthetic table %s exists with %d rows (version %d): not generated again", table, rows,
                     pinned.version)
            return {"table": table, "generated": False, "generate_s": 0.0}
        log.info("synthetic table %s has %d rows, %d wanted: generating it again", table, have, rows)
    t0 = time.perf_counter()
    parts = max(2, min(64, rows // 2000))
    render = _synthetic_udf(cfg.data.image_size, cfg.data.channels, classes)
    df = (spark.range(0, rows, numPartitions=parts).select(render(F.col("id")).alias("r")).select("r.*"))
    version = engine.write(df, table, "overwrite")
    elapsed = time.perf_counter() - t0
    log.info("generated synthetic table %s: %d images in %.1f s (version %d)", table, rows, elapsed, version)
    return {"table": table, "generated": True, "generate_s": elapsed}


# --------------------------------------------------------------------------- conversion


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


def _one_rank(data):
    from pipeline.lakehouse.partition import ShardPlan, plan_split

    plan = data.plan
    return dataclasses.replace(data, plan=ShardPlan(
        train=plan_split("train", plan.train.row_group_rows, 1, plan.train.batch_size),
        val=plan_split("val", plan.val.row_group_rows, 1, plan.val.batch_size)))


def measure_conversion(spark, cfg: Config, name: str, table: str, sizes: Sizes) -> Tuple[Prepared, List[Result]]:
    """Plain Parquet write vs first make_converter vs a second make_converter of the same pinned table.

    Every repeat rebuilds the DataFrame from the pinned table (as a second `train` in the same session would),
    the plain write goes to a scratch folder that is removed, and the first conversion's cache is deleted
    before the next repeat so that it is a miss again.
    """
    from pipeline.data.convert import (cache_dir_url, class_names_of, convert_for_training, make_converter,
                                       prepare_split, split_frame)
    from pipeline.lakehouse.delta import get_engine

    engine = get_engine(cfg.delta.engine)
    world = 2
    df, pinned = engine.read(spark, table)
    version = pinned.version

    def build():
        d, _ = engine.read(spark, table, version)
        train_df, _ = split_frame(d, cfg.data.val_fraction)
        return prepare_split(train_df, cfg, world)

    scratch = cache_dir_url(cfg.data.cache_dir).rstrip("/") + "/bench-plain-" + uuid.uuid4().hex[:8]

    def plain(frame) -> float:
        t0 = time.perf_counter()
        frame.write.mode("overwrite").parquet(scratch)
        elapsed = time.perf_counter() - t0
        _remove(scratch)
        return elapsed

    plain(build())  # warm-up: Python workers, JIT, page cache of the table's files
    plains, firsts, hits = [], [], []
    conv = None
    for r in range(sizes.repeats):
        frame = build()
        plains.append(plain(frame))
        frame = build()
        t0 = time.perf_counter()
        conv = make_converter(spark, frame, cfg.data.cache_dir)
        firsts.append(time.perf_counter() - t0)
        frame = build()
        t0 = time.perf_counter()
        again = make_converter(spark, frame, cfg.data.cache_dir)
        hits.append(time.perf_counter() - t0)
        if again.cache_dir_url != conv.cache_dir_url:
            log.warning("%s: the second conversion was not a cache hit (%s vs %s)", name, again.cache_dir_url,
                        conv.cache_dir_url)
            again.delete()
        if r < sizes.repeats - 1:
            conv.delete()
        log.info("%s conversion repeat %d: plain write %.2f s, first conversion %.2f s, second %.3f s", name, r + 1,
                 plains[-1], firsts[-1], hits[-1])
    class_names = class_names_of(df)
    data = convert_for_training(spark, df, cfg, world, class_names)  # train: a cache hit on `conv`
    rows = pinned.num_rows if pinned.num_rows is not None else df.count()
    prepared = Prepared(name=name, table=table, version=version, rows=rows, class_names=class_names, data=data,
                        data1=_one_rank(data))
    results = [
        Result("conversion_vs_plain_write", name, _median([f / p for f, p in zip(firsts, plains)]),
               {"first_conversion_s": _median(firsts), "plain_write_s": _median(plains),
                "rows": data.plan.train.total_rows}, len(firsts), [f / p for f, p in zip(firsts, plains)]),
        Result("conversion_cache_hit", name, _median([h / f for h, f in zip(hits, firsts)]),
               {"second_conversion_s": _median(hits), "first_conversion_s": _median(firsts)}, len(hits),
               [h / f for h, f in zip(hits, firsts)]),
    ]
    return prepared, results


# --------------------------------------------------------------------------- loader


def _pyarrow_batches(paths: List[str], transform, batch_size: int) -> Iterator[Tuple[Any, Any]]:
    """The hand-written reference: every row group of every file, then the same transform (the pixel rows of the
    row group, normalised per batch of rows) without shuffling; the last batch of a row group may be short.

    (Normalised per batch, not per row group: a float32 tensor for a whole row group is a fresh multi-MB allocation
    whose speed swings 4-10x with the allocator's state, which made the reference, not the loader, the noise.)
    """
    import pyarrow.parquet as pq
    import torch

    for path in paths:
        pf = pq.ParquetFile(path)
        for g in range(pf.num_row_groups):
            table = pf.read_row_group(g, columns=["pixels", "label_index"])
            pixels = transform.rows(table.column("pixels"))
            labels = torch.from_numpy(table.column("label_index").to_numpy().astype("int64"))
            for i in range(0, len(labels), batch_size):
                yield transform.normalize(pixels[i:i + batch_size]), labels[i:i + batch_size]


def _pyarrow_pass(paths: List[str], transform, batch_size: int) -> int:
    """One timed pass of the reference; returns the rows read."""
    return sum(len(y) for _x, y in _pyarrow_batches(paths, transform, batch_size))


def _interleaved(first: Callable[[], float], second: Callable[[], float],
                 repeats: int) -> Tuple[List[float], List[float]]:
    """Run each of two measurements once per repeat, `first` first on even repeats and `second` first on odd ones."""
    a, b = [], []
    for r in range(repeats):
        if r % 2:
            b.append(second())
            a.append(first())
        else:
            a.append(first())
            b.append(second())
    return a, b


def measure_loader(cfg: Config, prep: Prepared, sizes: Sizes, uncached: bool = False) -> Result:
    """Rows/s of the train ShardLoader vs the hand-written pyarrow loop, each over a contiguous stretch.

    A repeat is one stretch of each (order flipped every repeat). The loader is opened afresh for its stretch,
    runs one untimed epoch, then `blocks` timed epochs, and is closed before the reference runs, so its reader
    threads neither prefetch for free nor take CPU from the reference. `uncached`: with data.memory_cache_mb=0.
    """
    from petastorm.fs_utils import get_filesystem_and_path_or_paths

    from pipeline.data.datamodule import PixelsToTensor

    if uncached:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, memory_cache_mb=0))
    data = prep.data1
    _, paths = get_filesystem_and_path_or_paths(list(data.train.file_urls))
    transform = PixelsToTensor(data.channels, data.image_size)
    bs = data.plan.train.batch_size
    epoch_rows = data.plan.train.rows_per_epoch_per_rank
    blocks = max(2, -(-sizes.loader_min_rows // max(1, epoch_rows)))

    kept = _train_loader(cfg, data).train_loader.keeps_in_memory  # decided from the plan; nothing opened yet

    def run_loader() -> float:
        dm = _train_loader(cfg, data)
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
        rows = sum(_pyarrow_pass(paths, transform, bs) for _ in range(blocks))
        return rows / (time.perf_counter() - t0)

    with _torch_threads(cfg.train.threads_per_rank):
        _pyarrow_pass(paths, transform, bs)  # warm-up: page cache, imports
        ours, ref = _interleaved(run_loader, run_reference, sizes.repeats)
        ratios = [o / r for o, r in zip(ours, ref)]
    groups = data.plan.train.row_group_rows
    if kept:
        note = (f"the shard ({data.plan.train.total_rows} rows) fits data.memory_cache_mb={cfg.data.memory_cache_mb}: "
                f"read through Petastorm in the untimed epoch and the start of the timed ones, then from memory")
    else:
        note = (f"{len(groups)} row groups of ~{sum(groups) // max(1, len(groups))} rows; Petastorm's reader threads "
                f"spend ~0.9 ms per row group whatever its size (two file opens and a legacy ParquetDataset read, "
                f"partly holding the GIL the consuming thread needs), so small row groups cost more per row")
    return Result("loader_efficiency_uncached" if uncached else "loader_efficiency", prep.name, _median(ratios),
                  {"loader_rows_per_s": _median(ours), "pyarrow_rows_per_s": _median(ref),
                   "rows_per_repeat": {"loader": blocks * epoch_rows, "pyarrow": blocks * data.plan.train.total_rows},
                   "kept_in_memory": kept, "reader_workers": cfg.data.reader_workers,
                   "shuffle_buffer": cfg.data.shuffle_buffer, "torch_threads": max(1, cfg.train.threads_per_rank)},
                  len(ratios), ratios, note=note)


# --------------------------------------------------------------------------- input-bound


def _train_loader(cfg: Config, data, rank: int = 0, world: int = 1):
    from pipeline.data.datamodule import make_datamodule

    return make_datamodule(data, rank, world, cfg.data)


def _endless(loader) -> Iterator[Tuple[Any, Any]]:
    """The train ShardLoader's batches across epochs (each pass is one epoch; the next continues the same reader)."""
    while True:
        yield from loader


def _model_and_optimizer(cfg: Config, channels: int, classes: int, device):
    from pipeline.model.module import ImageClassifier

    model = ImageClassifier.from_config(cfg.model, channels, classes, cfg.model.lr)
    model.to(device).train()
    opt = model.configure_optimizers()["optimizer"]
    return model, opt


def _step(model, opt, x, y) -> None:
    opt.zero_grad()
    loss = model.loss_fn(model(x), y)
    loss.backward()
    opt.step()


def measure_input_bound(cfg: Config, prep: Prepared, sizes: Sizes) -> Tuple[Result, Dict[str, float]]:
    """Step time on in-memory batches vs with the real loader, same model, batch size and optimizer.

    A repeat is one contiguous stretch of `train_steps` steps of each kind (order flipped every repeat); the
    loader is opened afresh for its stretch and warmed up untimed, and closed before the in-memory stretch.
    """
    import torch

    data = prep.data1
    device = _device()
    bs = data.plan.train.batch_size
    classes = max(2, len(prep.class_names))
    gen = torch.Generator().manual_seed(0)
    fake = [(torch.randn(bs, data.channels, data.image_size, data.image_size, generator=gen).to(device),
             torch.randint(0, classes, (bs,), generator=gen).to(device)) for _ in range(8)]
    steps = sizes.train_steps
    warm = max(5, steps // 5)

    def run_real() -> float:
        dm = _train_loader(cfg, data)
        try:
            it = _endless(dm.train_loader)
            for _ in range(warm):
                x, y = next(it)
                _step(model, opt, x.to(device), y.to(device))
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                x, y = next(it)
                _step(model, opt, x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            _sync(device)
            return (time.perf_counter() - t0) / steps
        finally:
            dm.teardown("fit")

    def run_fake() -> float:
        _sync(device)
        t0 = time.perf_counter()
        for i in range(steps):
            _step(model, opt, *fake[i % len(fake)])
        _sync(device)
        return (time.perf_counter() - t0) / steps

    with _torch_threads(cfg.train.threads_per_rank):
        model, opt = _model_and_optimizer(cfg, data.channels, classes, device)
        for i in range(max(warm, sizes.warmup_steps)):
            _step(model, opt, *fake[i % len(fake)])
        synth, real = _interleaved(run_fake, run_real, sizes.repeats)
        ratios = [1.0 - f / r for f, r in zip(synth, real)]
    per_dev = {"device": device.type, "images_per_s_real_loader": bs / _median(real),
               "images_per_s_in_memory": bs / _median(synth)}
    if device.type == "cuda":  # one process drives one GPU here
        per_dev["images_per_s_per_gpu"] = per_dev["images_per_s_real_loader"]
        per_dev["gpu"] = torch.cuda.get_device_name(device)
    result = Result("input_bound_fraction", prep.name, _median(ratios),
                    {"step_s_in_memory": _median(synth), "step_s_real_loader": _median(real), "batch_size": bs,
                     "steps_per_repeat": steps, "device": device.type,
                     "torch_threads": max(1, cfg.train.threads_per_rank)},
                    len(ratios), ratios)
    return result, per_dev


# --------------------------------------------------------------------------- shard balance


def measure_shard_balance(cfg: Config, prep: Prepared) -> Result:
    """One full pass (num_epochs=1) of each rank's shard of the 2-rank train plan; counts are exact, no timing."""
    from pipeline.data.datamodule import ShardLoader

    data = prep.data
    plan = data.plan.train
    rows = []
    for rank in range(plan.world_size):
        loader = ShardLoader(data.train, plan, rank=rank, world_size=plan.world_size, channels=data.channels,
                             image_size=data.image_size, endless=False, workers=cfg.data.reader_workers,
                             shuffle_buffer=0, seed=cfg.data.seed)
        for _ in loader:
            pass
        rows.append(loader.rows_read)
        loader.close()
    ratio = max(rows) / max(1, min(rows))
    used = plan.rows_per_epoch_per_rank * plan.world_size
    return Result("shard_balance", prep.name, ratio,
                  {"rows_read_per_rank": rows, "planned_rows_per_rank": list(plan.rows_per_rank),
                   "row_groups_per_rank": list(plan.row_groups_per_rank),
                   "train_rows_per_epoch_per_rank": plan.rows_per_epoch_per_rank,
                   "rows_used_per_epoch_fraction": used / max(1, plan.total_rows)},
                  1, [ratio], method=TARGETS["shard_balance"][2] + " (row counts: exact, one pass is enough)")


# --------------------------------------------------------------------------- Horovod scaling


def _timed_windows(step, batch, warmup: int, steps: int, windows: int, sync: Callable[[], None]) -> Dict[str, Any]:
    """`warmup` untimed steps, `sync()`, then `windows` timed stretches of `steps` steps: wall, wait and CPU time."""
    times, waits, cpu_main, cpu_all = [], [], [], []
    for _ in range(warmup):
        step(*batch())
    sync()
    for _ in range(windows):
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        wait = 0.0
        for _ in range(steps):
            tw = time.perf_counter()
            x, y = batch()
            wait += time.perf_counter() - tw
            step(x, y)
        times.append(time.perf_counter() - t0)
        cpu_all.append(time.process_time() - c0)
        cpu_main.append(time.thread_time() - m0)
        waits.append(wait)
    return {"steps": steps, "window_s": times, "wait_s": waits, "cpu_s": cpu_all, "main_thread_cpu_s": cpu_main}


def _memory_batches(data, count: int = 32):
    """Up to `count` full batches of real training rows (the reference's), kept in memory and served in turn.

    The controls train on the same images as the pipeline, so that only the loader and Horovod differ.
    """
    from petastorm.fs_utils import get_filesystem_and_path_or_paths

    from pipeline.data.datamodule import PixelsToTensor

    bs = data.plan.train.batch_size
    _, paths = get_filesystem_and_path_or_paths(list(data.train.file_urls))
    full = (b for b in _pyarrow_batches(paths, PixelsToTensor(data.channels, data.image_size), bs) if len(b[1]) == bs)
    cycle = itertools.cycle(list(itertools.islice(full, count)))
    return lambda: next(cycle)


def _solo_worker(cfg: Config, data, warmup: int, steps: int, windows: int, barrier, results) -> None:
    """Control: a plain process (no Horovod) training the same model on in-memory real batches, 1 thread."""
    import torch

    torch.set_num_threads(max(1, cfg.train.threads_per_rank))
    torch.manual_seed(cfg.train.seed)
    model, opt = _model_and_optimizer(cfg, data.channels, max(2, len(data.class_names)), torch.device("cpu"))
    out = _timed_windows(lambda x, y: _step(model, opt, x, y), _memory_batches(data), warmup, steps, windows,
                         lambda: barrier.wait(timeout=600))
    out["batch_size"] = data.plan.train.batch_size
    results.put(out)


def _solo_run(cfg: Config, data, procs: int, sizes: Sizes) -> Dict[str, Any]:
    """`procs` independent control processes at once (their timed windows start together)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_solo_worker, args=(cfg, data, sizes.warmup_steps, sizes.hvd_steps,
                                                      sizes.repeats, barrier, results)) for _ in range(procs)]
    for w in workers:
        w.start()
    try:
        outs = [results.get(timeout=cfg.train.start_timeout_s + 600) for _ in workers]
    finally:
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
    return {"samples_per_s": [sum(o["batch_size"] * o["steps"] / o["window_s"][i] for o in outs)
                              for i in range(sizes.repeats)]}


def _hvd_worker(cfg: Config, data, warmup: int, steps: int, windows: int, in_memory: bool = False) -> Dict[str, Any]:
    """One rank: the real ShardLoader (shard = rank), ImageClassifier, hvd.DistributedOptimizer, fixed steps.

    `in_memory`: real batches held in memory instead of the loader (Horovod's own cost, without the pipeline's).
    """
    from pipeline.log import setup_logging

    setup_logging()
    import horovod.torch as hvd
    import torch

    from pipeline.distributed.loop import repair_horovod_env

    if os.environ.get("LAKEHOUSE_BENCH_RAW_HOROVOD_ENV") != "1":  # =1: what training got before the repair
        repair_horovod_env()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(max(1, cfg.train.threads_per_rank))
    torch.manual_seed(cfg.train.seed)
    device = torch.device("cpu")
    model, opt = _model_and_optimizer(cfg, data.channels, max(2, len(data.class_names)), device)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    dm = None if in_memory else _train_loader(cfg, data, rank, size)
    if in_memory:
        batch = _memory_batches(data)
    else:
        it = _endless(dm.train_loader)

        def batch():
            return next(it)

    try:
        out = _timed_windows(lambda x, y: _step(model, opt, x, y), batch, warmup, steps, windows,
                             lambda: hvd.allreduce(torch.zeros(1), name="bench.sync"))
    finally:
        if dm is not None:
            dm.teardown("fit")
    out.update({"rank": rank, "size": size, "batch_size": data.plan.train.batch_size,
                "horovod_env": {k: os.environ.get(k) for k in ("HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY")}})
    return out


def _hvd_run(cfg: Config, data, np_: int, sizes: Sizes, in_memory: bool = False) -> Dict[str, Any]:
    import horovod

    from pipeline.distributed.launcher import _rank_env
    from pipeline.distributed.loop import TrainJob

    job = TrainJob(cfg=cfg, data=data, delta_table="", delta_version=0)
    t0 = time.perf_counter()
    with temporary_env(_rank_env(job)):
        results = horovod.run(_hvd_worker, args=(cfg, data, sizes.warmup_steps, sizes.hvd_steps, sizes.repeats,
                                                 in_memory),
                              num_proc=np_, use_gloo=True, hosts=f"localhost:{np_}",
                              start_timeout=cfg.train.start_timeout_s, verbose=0)
    wall = time.perf_counter() - t0
    results = sorted(results, key=lambda r: r["rank"])
    rates = []
    for w in range(sizes.repeats):
        slowest = max(r["window_s"][w] for r in results)
        rates.append(sum(r["batch_size"] * r["steps"] for r in results) / slowest)
    wait_frac = max(_median([ws / t for ws, t in zip(r["wait_s"], r["window_s"])]) for r in results)
    # CPU cores each rank used in its windows: all its threads, and the training (main) thread alone
    cores = [sum(r["cpu_s"]) / sum(r["window_s"]) for r in results]
    main = [sum(r["main_thread_cpu_s"]) / sum(r["window_s"]) for r in results]
    return {"samples_per_s": rates, "wall_s": wall, "loader_wait_fraction": wait_frac,
            "cores_per_rank": cores, "main_thread_cores_per_rank": main,
            "horovod_env": results[0]["horovod_env"]}


def measure_horovod_scaling(cfg: Config, prep: Prepared, sizes: Sizes) -> Result:
    """The pipeline's 2-rank / 1-rank scaling, beside two controls measured in the same run.

    machine: two independent plain processes at once / one (same model, in-memory batches, no Horovod): what this
    machine gives a second process. horovod_alone: Horovod with 2 ranks on in-memory batches / one plain process:
    Horovod's own cost (a size-1 Horovod optimizer does no allreduce, so the plain process is its 1-rank run).
    The pipeline's figure can only approach horovod_alone, which can only approach machine.
    """
    one = _hvd_run(cfg, prep.data1, 1, sizes)
    log.info("Horovod 1 rank: %.0f samples/s (median of %d windows)", _median(one["samples_per_s"]), sizes.repeats)
    two = _hvd_run(cfg, prep.data, 2, sizes)
    log.info("Horovod 2 ranks: %.0f samples/s (median of %d windows)", _median(two["samples_per_s"]), sizes.repeats)
    # The single process is measured before and after the others, so that drifting load on a shared machine
    # does not sit only in the denominator.
    solo1_windows = _solo_run(cfg, prep.data1, 1, sizes)["samples_per_s"]
    solo2 = _median(_solo_run(cfg, prep.data1, 2, sizes)["samples_per_s"])
    mem2 = _median(_hvd_run(cfg, prep.data, 2, sizes, in_memory=True)["samples_per_s"])
    solo1 = _median(solo1_windows + _solo_run(cfg, prep.data1, 1, sizes)["samples_per_s"])
    log.info("controls, in-memory batches: 1 plain process %.0f, 2 plain processes %.0f, Horovod 2 ranks %.0f "
             "samples/s", solo1, solo2, mem2)
    ratios = [b / a for a, b in zip(one["samples_per_s"], two["samples_per_s"])]
    ratio = _median(two["samples_per_s"]) / _median(one["samples_per_s"])
    machine, alone = solo2 / solo1, mem2 / solo1
    note = (f"controls in the same run: two independent processes scale {machine:.2f}x on this machine, Horovod "
            f"alone (2 ranks, in-memory batches, no loader) {alone:.2f}x, the pipeline {ratio:.2f}x. 1 rank used "
            f"{sum(one['cores_per_rank']):.2f} cores (training thread {sum(one['main_thread_cores_per_rank']):.2f}); "
            f"2 ranks {sum(two['cores_per_rank']):.2f} of {os.cpu_count()} (training threads "
            f"{sum(two['main_thread_cores_per_rank']):.2f}): each rank's Horovod background and Gloo threads and "
            f"its spin-wait for the allreduce take CPU from the other rank's training thread when ranks have no "
            f"spare core")
    return Result("horovod_cpu_scaling", prep.name, ratio,
                  {"samples_per_s_2_ranks": _median(two["samples_per_s"]),
                   "samples_per_s_1_rank": _median(one["samples_per_s"]),
                   "control_machine_2_procs_over_1": machine, "control_horovod_alone_2_ranks_over_1": alone,
                   "control_samples_per_s": {"plain_1_proc": solo1, "plain_2_procs": solo2,
                                             "horovod_2_ranks_in_memory": mem2},
                   "pipeline_over_horovod_alone": ratio / alone if alone else float("nan"),
                   "loader_wait_fraction_2_ranks": two["loader_wait_fraction"],
                   "loader_wait_fraction_1_rank": one["loader_wait_fraction"],
                   "cpu_cores_used_1_rank": sum(one["cores_per_rank"]),
                   "cpu_cores_used_2_ranks": sum(two["cores_per_rank"]),
                   "main_thread_cores_1_rank": sum(one["main_thread_cores_per_rank"]),
                   "main_thread_cores_2_ranks": sum(two["main_thread_cores_per_rank"]),
                   "cpus": os.cpu_count(), "horovod_env": two["horovod_env"],
                   "threads_per_rank": max(1, cfg.train.threads_per_rank), "warmup_steps": sizes.warmup_steps,
                   "steps_per_window": sizes.hvd_steps, "launch_wall_s": {"1": one["wall_s"], "2": two["wall_s"]}},
                  sizes.repeats, ratios, note=note)


# --------------------------------------------------------------------------- checkpoint and tracking


def measure_train_overheads(cfg: Config, prep: Prepared, sizes: Sizes, run) -> List[Result]:
    """The project's train loop (one process) for warm-up + `repeats` + 1 epochs, logging into `run`.

    Checkpoint writes (AtomicCheckpointIO.save_checkpoint) and RankZeroTracker.log_epoch are timed by wrappers;
    an epoch is the time between two epoch starts (steps, validation, checkpoints, logging). Epoch 0 is the
    warm-up and the last epoch (no next start) is not used.
    """
    from pipeline.distributed import callbacks as cb
    from pipeline.distributed.loop import TrainJob, train
    from pipeline.tracking.rank_zero import RankZeroTracker

    epochs = sizes.repeats + 2
    ckpt_dir = os.path.join(cfg.train.checkpoint_dir, "bench", prep.name)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    bcfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, max_epochs=epochs, checkpoint_dir=ckpt_dir, ckpt_restore=None,
                                  backend="single", np=1, warmup_epochs=0,
                                  early_stopping=dataclasses.replace(cfg.train.early_stopping, enabled=False)))
    starts: List[float] = []
    saves: List[Tuple[float, float]] = []
    logs: List[Tuple[float, float]] = []

    def timed(into):
        def make(original):
            def wrapper(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return original(*a, **kw)
                finally:
                    into.append((t0, time.perf_counter() - t0))
            return wrapper
        return make

    def epoch_start(original):
        def wrapper(self, trainer, pl_module):
            starts.append(time.perf_counter())
            return original(self, trainer, pl_module)
        return wrapper

    job = TrainJob(cfg=bcfg, data=prep.data1, delta_table=prep.table, delta_version=prep.version,
                   run_id=run.run_id, tracking_uri=run.tracking_uri,
                   job_dir=os.path.join(ckpt_dir, ".job"))
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(cb.AtomicCheckpointIO, "save_checkpoint", timed(saves)))
        stack.enter_context(_patched(RankZeroTracker, "log_epoch", timed(logs)))
        stack.enter_context(_patched(RankZeroTracker, "finish", lambda original: lambda *a, **kw: None))
        stack.enter_context(_patched(cb.EpochAccounting, "on_train_epoch_start", epoch_start))
        stack.enter_context(temporary_env({"LAKEHOUSE_PROGRESS": "0"}))
        train(job)
    ckpt_ratios, track_ratios, epoch_s, save_s, log_s = [], [], [], [], []
    for i in range(1, len(starts) - 1):
        a, b = starts[i], starts[i + 1]
        e = b - a
        s = sum(d for t, d in saves if a <= t < b)
        lg = sum(d for t, d in logs if a <= t < b)
        epoch_s.append(e)
        save_s.append(s)
        log_s.append(lg)
        ckpt_ratios.append(s / e)
        track_ratios.append(e / (e - lg))
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    steps = prep.data1.plan.train.steps_per_epoch
    return [
        Result("checkpoint_overhead", prep.name, _median(ckpt_ratios),
               {"checkpoint_s_per_epoch": _median(save_s), "epoch_s": _median(epoch_s),
                "checkpoints_per_epoch": len(saves) / max(1, len(starts)), "steps_per_epoch": steps},
               len(ckpt_ratios), ckpt_ratios),
        Result("tracking_overhead", prep.name, _median(track_ratios),
               {"step_s_with_logging": _median(epoch_s) / steps,
                "step_s_without_logging": (_median(epoch_s) - _median(log_s)) / steps,
                "log_epoch_s": _median(log_s), "tracking_uri": run.tracking_uri},
               len(track_ratios), track_ratios),
    ]


# --------------------------------------------------------------------------- report


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def log_table(report: Dict[str, Any]) -> None:
    head = f"{'ratio':<28} {'data set':<10} {'measured':>9} {'target':>8} {'result':>6} {'repeats':>7} {'spread':>17}"
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        spread = f"{r['spread'].get('min', float('nan')):.3g}..{r['spread'].get('max', float('nan')):.3g}"
        lines.append(f"{r['name']:<28} {r['dataset']:<10} {r['ratio']:>9.3f} {r['op'] + format(r['target'], 'g'):>8} "
                     f"{'pass' if r['passed'] else 'FAIL':>6} {r['repeats']:>7} {spread:>17}")
        lines.append("    " + ", ".join(f"{k}={_fmt(v)}" for k, v in r["parts"].items() if k != "tracking_uri"))
        if r.get("note") and not r["passed"]:
            lines.append("    note: " + r["note"])
    m = report["machine"]
    lines.append(f"machine: {m['cpus']} CPU(s), device {m['device']}; load before {report['load']['before']}, "
                 f"after {report['load']['after']}; {report['repeats']} repeat(s){' (--quick)' if report['quick'] else ''}")
    for line in lines:
        log.info("%s", line)


def _log_to_mlflow(run, report: Dict[str, Any]) -> None:
    from mlflow.entities import Metric, Param

    ts = int(time.time() * 1000)
    metrics = [Metric(k.replace("/", "."), float(v), ts, 0) for k, v in report["ratios"].items()]
    params = [Param("quick", str(report["quick"])), Param("repeats", str(report["repeats"])),
              Param("load_before", str(report["load"]["before"])), Param("device", report["machine"]["device"])]
    run.client.log_batch(run.run_id, metrics=metrics, params=params, synchronous=True)
    run.client.log_dict(run.run_id, report, "bench.json")
    for k, ok in report["passed"].items():
        run.client.set_tag(run.run_id, f"pass.{k.replace('/', '.')}", str(ok))


def run_bench(cfg: Config, quick: bool = False, out: str = "work/bench/bench.json") -> Dict[str, Any]:
    """Run every measurement on the ingested sample and a synthetic table; write `out` (JSON) and return it.

    The MLflow run (experiment `<mlflow.experiment>-bench`) receives the per-epoch metrics of the tracking
    measurement and, unless `quick`, the report as `bench.json` and the ratios as metrics.
    """
    from pipeline.lakehouse.spark import spark_session
    from pipeline.tracking.runs import tracked_run

    sizes = QUICK if quick else FULL
    t_start = time.perf_counter()
    out = os.path.abspath(out)
    work_dir = os.path.dirname(out)
    os.makedirs(work_dir, exist_ok=True)
    report: Dict[str, Any] = {
        "bench": "lakehouse", "quick": quick, "repeats": sizes.repeats,
        "repeats_note": ("--quick: 2 repeats after a warm-up; it proves the bench runs, the figures are indicative"
                         if quick else f"median of {sizes.repeats} repeats after a warm-up"),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": _machine(), "load": {"before": _load()},
        "sizes": dataclasses.asdict(sizes), "config": {k: v for k, v in cfg.flat().items() if k.startswith("data.")},
    }
    results: List[Result] = []
    datasets: Dict[str, Any] = {}
    per_device: Dict[str, Any] = {}
    bench_cfg = dataclasses.replace(cfg, mlflow=dataclasses.replace(cfg.mlflow, experiment=f"{cfg.mlflow.experiment}-bench"))
    log.info("bench%s: %d repeat(s), synthetic table of %d images", " --quick" if quick else "", sizes.repeats,
             sizes.synthetic_rows)
    with spark_session(cfg) as spark:
        ensure_sample(spark, cfg, work_dir)
        synth = ensure_synthetic(spark, cfg, sizes.synthetic_rows)
        preps: List[Prepared] = []
        try:
            for name, table in (("sample", cfg.delta.table), ("synthetic", synth["table"])):
                prep, conv_results = measure_conversion(spark, cfg, name, table, sizes)
                preps.append(prep)
                results.extend(conv_results)
                datasets[name] = prep.info()
            datasets["synthetic"].update(synth)
            with tracked_run(bench_cfg, run_name="bench-quick" if quick else "bench",
                             tags={"bench": "true", "quick": quick}) as run:
                for prep in preps:
                    log.info("measuring on %s (%d rows)", prep.name, prep.rows)
                    results.append(measure_loader(cfg, prep, sizes))
                    if results[-1].parts["kept_in_memory"]:
                        results.append(measure_loader(cfg, prep, sizes, uncached=True))
                    res, dev = measure_input_bound(cfg, prep, sizes)
                    results.append(res)
                    per_device[prep.name] = dev
                    results.append(measure_shard_balance(cfg, prep))
                # Checkpoint and tracking cost a fixed time per epoch, so the sample's short epochs are the worst
                # case; the synthetic table's epochs are ~30x longer.
                results.extend(measure_train_overheads(cfg, preps[0], sizes, run))
                results.append(measure_horovod_scaling(cfg, preps[-1], sizes))
                report["load"]["after"] = _load()
                report["datasets"] = datasets
                report["throughput"] = per_device
                report["results"] = [dataclasses.asdict(r) for r in results]
                report["ratios"] = {r.key: r.ratio for r in results}
                report["passed"] = {r.key: r.passed for r in results}
                report["all_passed"] = all(r.passed for r in results)
                report["duration_s"] = time.perf_counter() - t_start
                report["mlflow_run_id"] = run.run_id
                if not quick:
                    _log_to_mlflow(run, report)
        finally:
            for prep in preps:
                prep.data.delete()
    report["out"] = out
    with open(out, "w") as fh:
        json.dump(report, fh, indent=2, default=str)
    log_table(report)
    log.info("bench report written to %s (%.0f s)", out, report["duration_s"])
    return report
