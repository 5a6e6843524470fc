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

