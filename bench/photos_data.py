"""The photo figures' data, without Spark: ImageNet-shaped JPEGs (`lakehouse sample-data --kind photos`'s generator)
written with pyarrow as the encoded rows a conversion with data.decode=cpu|gpu|auto writes (content, label_index,
row_id, path), and the decode references on the same bytes: a plain Pillow loop and the CPU decoder on one thread."""
from __future__ import annotations

import os
import shutil
import time
from typing import Any, Dict, List, Tuple

from pipeline.log import get_logger

log = get_logger(__name__)

Row = Tuple[bytes, int, int, str]  # content, label_index, row_id, path


def render_rows(lo: int, hi: int, classes: int, seed: int) -> List[Row]:
    """Rows `lo`..`hi` - 1: photo i is of class i % `classes` (PHOTO_CLASSES in turn, as sample-data writes them)."""
    from pipeline.lakehouse.sample_data import PHOTO_CLASSES, render_photo

    names = PHOTO_CLASSES[:classes]
    rows = []
    for i in range(lo, hi):
        k = i % classes
        content, _ = render_photo(names[k], seed, i)
        rows.append((content, k, i, f"photos/{names[k]}/{i:05d}.jpg"))
    return rows


def _render_chunk(args: Tuple[int, int, int, int]) -> List[Row]:
    return render_rows(*args)


def rendered(count: int, classes: int, seed: int, procs: int = 0) -> List[Row]:
    """`count` rows, rendered in `procs` processes (0: the cores; a few hundred photos: in this one)."""
    procs = procs or (os.cpu_count() or 1)
    if procs <= 1 or count < 256:
        return render_rows(0, count, classes, seed)
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    chunk = max(16, -(-count // (procs * 4)))
    jobs = [(lo, min(count, lo + chunk), classes, seed) for lo in range(0, count, chunk)]
    with ProcessPoolExecutor(min(procs, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
        return [row for part in pool.map(_render_chunk, jobs) for row in part]


def write_split(split_dir: str, rows: List[Row], files: int, group_rows: int) -> List[Dict[str, Any]]:
    """`rows` into `files` Parquet files of the encoded layout (shards.ENCODED_COLUMNS) under `split_dir`, row groups
    of `group_rows`; returns the manifest (name, bytes, rows per row group) split_from_manifest takes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data.shards import CONTENT, LABEL, PATH, ROW_ID

    schema = pa.schema([(CONTENT, pa.binary()), (LABEL, pa.int32()), (ROW_ID, pa.int64()), (PATH, pa.string())])
    shutil.rmtree(split_dir, ignore_errors=True)
    os.makedirs(split_dir)
    manifest, per_file = [], -(-len(rows) // files)
    for f in range(files):
        part = rows[f * per_file:(f + 1) * per_file]
        if not part:
            break
        table = pa.table({CONTENT: pa.array([r[0] for r in part], pa.binary()),
                          LABEL: pa.array([r[1] for r in part], pa.int32()),
                          ROW_ID: pa.array([r[2] for r in part], pa.int64()),
                          PATH: pa.array([r[3] for r in part], pa.string())}, schema=schema)
        name = f"part-{f:05d}.parquet"
        path = os.path.join(split_dir, name)
        pq.write_table(table, path, row_group_size=group_rows, compression="none")  # JPEG bytes do not compress
        meta = pq.ParquetFile(path).metadata
        manifest.append({"name": name, "bytes": os.path.getsize(path),
                         "row_groups": [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]})
    return manifest


def photos_without_spark(folder: str, train_rows: int, val_rows: int, image_size: int, batch_size: int,
                         classes: int = 5, files: int = 4, seed: int = 0, procs: int = 0):
    """A converted data set of ImageNet-shaped JPEG rows (ConvertedData, encoded layout, 1-rank plan at `batch_size`)
    written with pyarrow alone, as a conversion with data.decode=cpu|gpu|auto lays them out: what the ranks read and
    decode per row is what they read from a real table's conversion. Row groups of `batch_size` rows (about 18 MB at
    256 photos of ~70 KB)."""
    from pipeline.data.convert import plan_data, split_from_manifest
    from pipeline.data.shards import ConvertedData
    from pipeline.lakehouse.sample_data import PHOTO_CLASSES

    t0 = time.perf_counter()
    rows = rendered(train_rows + val_rows, classes, seed, procs)
    rendered_s = time.perf_counter() - t0
    splits = {}
    for name, part in (("train", rows[:train_rows]), ("val", rows[train_rows:])):
        split_dir = os.path.join(folder, name)
        manifest = write_split(split_dir, part, files, max(1, batch_size))
        splits[name] = split_from_manifest(name, "file://" + os.path.abspath(split_dir), manifest)
    plan = plan_data(splits["train"], splits["val"], 1, batch_size)
    log.info("photos: %d + %d ImageNet-shaped JPEG rows (%.0f KB each on average) rendered in %.1f s and written to "
             "%s in %.1f s", train_rows, val_rows, sum(len(r[0]) for r in rows) / max(1, len(rows)) / 1024,
             rendered_s, folder, time.perf_counter() - t0 - rendered_s)
    return ConvertedData(train=splits["train"], val=splits["val"], plan=plan, class_names=PHOTO_CLASSES[:classes],
                         image_size=image_size, channels=3, layout="encoded")


def train_contents(data, count: int) -> List[Tuple[bytes, str, int]]:
    """The first `count` train rows' (content, path, label_index), in file and row group order."""
    import pyarrow.parquet as pq

    from bench.reference import parquet_paths
    from pipeline.data.shards import CONTENT, LABEL, PATH

    out: List[Tuple[bytes, str, int]] = []
    for path in parquet_paths(data.train):
        table = pq.read_table(path, columns=[CONTENT, PATH, LABEL])
        out += zip(table.column(CONTENT).to_pylist(), table.column(PATH).to_pylist(),
                   table.column(LABEL).to_pylist())
        if len(out) >= count:
            break
    return out[:count]


def _pillow_decode(contents: List[bytes], channels: int) -> None:
    """The plain Pillow loop: open, decode, convert to the channels' mode; no crop or resize."""
    import io

    from PIL import Image

    mode = "L" if channels == 1 else "RGB"
    for content in contents:
        with Image.open(io.BytesIO(content)) as img:
            img.convert(mode).load()


def pillow_images_per_s(contents: List[bytes], channels: int = 3) -> float:
    """The reference: a plain Pillow decode loop on one thread, images/s: what one core decodes when it does nothing
    else."""
    _pillow_decode(contents[:8], channels)  # Pillow's plugins loaded, as the decoder's warm-up does
    t0 = time.perf_counter()
    _pillow_decode(contents, channels)
    return len(contents) / (time.perf_counter() - t0)


def _pillow_timed(contents: List[bytes], channels: int, barrier, out) -> None:
    """In one of `pillow_every_core_images_per_s`' processes: warm up, wait for the others, time one loop."""
    _pillow_decode(contents[:8], channels)
    barrier.wait()
    t0 = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
    _pillow_decode(contents, channels)
    out.put((t0, time.monotonic()))


def pillow_every_core_images_per_s(contents: List[bytes], processes: int, channels: int = 3,
                                   timeout_s: float = 600.0) -> float:
    """The same plain Pillow loop in `processes` processes at once (one per core), all of `contents` each, started
    together: their images over the time from the first start to the last end. What the host's cores decode when all
    of them decode at once (shared caches, memory bandwidth, a VM's cores that are another's hyperthreads), the
    reference a decoder using every core can be held to."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_pillow_timed, args=(contents, channels, barrier, out), daemon=True)
             for _ in range(processes)]
    for p in procs:
        p.start()
    try:
        times = [out.get(timeout=timeout_s) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    wall = max(t1 for _, t1 in times) - min(t0 for t0, _ in times)
    return processes * len(contents) / wall


def decoder_images_per_s(rows: List[Tuple[bytes, str, int]], size: int, channels: int, seed: int = 0) -> float:
    """The product's CPU decoder (pipeline.data.decode.Decoder: header, random resized crop, flip) on one worker
    thread, on the same bytes, images/s."""
    import numpy as np

    from pipeline.data.decode import Decoder, EncodedBatch

    enc = np.empty((len(rows), 2), dtype=object)
    enc[:, 0] = [r[0] for r in rows]
    enc[:, 1] = [r[1] for r in rows]
    decoder = Decoder(size, channels, train=True, seed=seed, workers=1)
    try:
        decoder.decode(EncodedBatch(enc[:8], 0))  # the thread started, Pillow's plugins loaded
        t0 = time.perf_counter()
        decoder.decode(EncodedBatch(enc, 1))
        return len(rows) / (time.perf_counter() - t0)
    finally:
        decoder.close()
