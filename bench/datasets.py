"""The bench's two data sets: the ingested digits sample, and a synthetic table of shape PNGs rendered by Spark."""
from __future__ import annotations

import os
import shutil
import time
from typing import Any, Dict

import pandas as pd

from pipeline.config import Config
from pipeline.log import get_logger

log = get_logger(__name__)


def sibling_table(table: str, name: str) -> str:
    return f"{table.rstrip('/').rsplit('/', 1)[0]}/{name}" if "/" in table.rstrip("/") else name


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
    table = sibling_table(cfg.delta.table, f"bench_synthetic_{rows}_{cfg.data.image_size}px_{cfg.data.channels}ch")
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



def converted_without_spark(folder: str, rows: int, image_size: int, channels: int, classes: int = 10,
                            batch_size: int = 256, files: int = 4, group_rows: int = 1024, seed: int = 0):
    """A converted data set (ConvertedData, 1-rank plan) written with pyarrow alone, in the converter's layout: the
    decoded pixels as uint8 bytes, label_index int32, row_id int64. For a GPU machine without Java or Spark (the
    GPU figures of `lakehouse bench --gpu`); what the loader reads per row is what it reads from a real conversion.
    Each image is noise with a class-dependent bright row, so training learns something."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data.convert import plan_data, split_from_manifest
    from pipeline.data.shards import LABEL, PIXELS, ROW_ID, ConvertedData

    rng = np.random.default_rng(seed)
    shape = (image_size, image_size) if channels == 1 else (image_size, image_size, channels)
    schema = pa.schema([(PIXELS, pa.binary()), (LABEL, pa.int32()), (ROW_ID, pa.int64())])
    splits = {}
    for name, n in (("train", rows), ("val", max(batch_size * 2, rows // 8))):
        split_dir = os.path.join(folder, name)
        shutil.rmtree(split_dir, ignore_errors=True)
        os.makedirs(split_dir)
        manifest, per_file = [], -(-n // files)
        for f in range(files):
            lo, hi = f * per_file, min(n, (f + 1) * per_file)
            if lo >= hi:
                break
            labels = rng.integers(0, classes, hi - lo)
            images = rng.integers(0, 96, (hi - lo,) + shape, dtype=np.uint8)
            images[np.arange(hi - lo), (labels * image_size) // classes] = 255
            table = pa.table({PIXELS: pa.array([im.tobytes() for im in images], pa.binary()),
                              LABEL: pa.array(labels, pa.int32()),
                              ROW_ID: pa.array(np.arange(lo, hi), pa.int64())}, schema=schema)
            file_name = f"part-{f:05d}.parquet"
            pq.write_table(table, os.path.join(split_dir, file_name), row_group_size=group_rows, compression="none")
            meta = pq.ParquetFile(os.path.join(split_dir, file_name)).metadata
            manifest.append({"name": file_name, "bytes": os.path.getsize(os.path.join(split_dir, file_name)),
                             "row_groups": [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]})
        splits[name] = split_from_manifest(name, "file://" + os.path.abspath(split_dir), manifest)
    plan = plan_data(splits["train"], splits["val"], 1, batch_size)
    return ConvertedData(train=splits["train"], val=splits["val"], plan=plan,
                         class_names=[f"class_{k}" for k in range(classes)], image_size=image_size, channels=channels)
