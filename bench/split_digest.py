"""The content split's plan with and without the digests ingest stores: `split_index` of a table whose rows carry
their SHA-256 (the `sha256` column) against the same rows without it (every image read and hashed)."""
from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import Any, Dict, List

import numpy as np

from bench.core import Result, interleaved, median, ratio
from bench.photo_decode import imagenet_photos
from pipeline.log import get_logger

log = get_logger(__name__)

DATASET = "imagenet_shaped_photos_delta"
FILES = 4  # appends, one data file each: the plan reads files on several threads


def _write_tables(root: str, photos: List[bytes]) -> Dict[str, str]:
    """Two Delta tables of the same rows (delta-rs, FILES appends): `hashed` without the digest column (written
    before ingest stored one), `stored` with it."""
    import pyarrow as pa
    from deltalake import write_deltalake

    base = [("path", pa.string()), ("label", pa.string()), ("label_index", pa.int32()), ("content", pa.binary())]
    tables = {}
    for name, fields in (("hashed", base), ("stored", base + [("sha256", pa.string())])):
        schema = pa.schema(fields)
        path = os.path.join(root, name)
        for f, lo in enumerate(range(0, len(photos), -(-len(photos) // FILES))):
            chunk = photos[lo:lo + -(-len(photos) // FILES)]
            rows = {"path": [f"/photos/{lo + i}.jpg" for i in range(len(chunk))],
                    "label": [f"c{(lo + i) % 10}" for i in range(len(chunk))],
                    "label_index": [(lo + i) % 10 for i in range(len(chunk))], "content": chunk}
            if name == "stored":
                rows["sha256"] = [hashlib.sha256(c).hexdigest() for c in chunk]
            write_deltalake(path, pa.table(rows, schema=schema), mode="overwrite" if f == 0 else "append")
        tables[name] = path
    return tables


def _paths(pinned, rows_of_files) -> set:
    """The paths of the rows `rows_of_files` (per data file of `pinned`, in its order) name."""
    import pyarrow.parquet as pq

    out = set()
    for f, rows in zip(pinned.files, rows_of_files):
        paths = pq.read_table(f.uri.replace("file://", ""), columns=["path"]).column(0).to_pylist()
        out.update(paths[r] for r in rows)
    return out


def measure_split_digest(sizes, quick: bool = False) -> List[Result]:
    """`split_plan_digest_speedup`: seconds of `split_index(content)` over the table without digests / over the same
    rows with them, taking turns (sizes.repeats rounds after a warm-up of each, so both read from the page cache:
    on object storage the table without digests also downloads every image). The two plans are checked equal."""
    from pipeline.data.direct import split_index
    from pipeline.lakehouse.delta_files import pin_files

    photos = imagenet_photos(400 if quick else 4000)
    with tempfile.TemporaryDirectory(prefix="bench-split-digest-") as root:
        tables = _write_tables(root, photos)
        pinned = {name: pin_files(path) for name, path in tables.items()}
        plans = {name: split_index(p, 0.2, "content") for name, p in pinned.items()}  # the warm-up
        for split in ("train", "val"):
            got = [_paths(pinned[n], getattr(plans[n], split)) for n in ("hashed", "stored")]
            if got[0] != got[1]:
                raise AssertionError(f"split_digest: the {split} rows differ with and without the digests")

        def timed(name: str):
            def run() -> float:
                t0 = time.perf_counter()
                split_index(pinned[name], 0.2, "content")
                return time.perf_counter() - t0
            return run

        hashed, stored = interleaved(timed("hashed"), timed("stored"), sizes.repeats)
    per = [ratio(h, s) for h, s in zip(hashed, stored)]
    parts: Dict[str, Any] = {"rows": len(photos), "files": FILES, "hashed_s": median(hashed),
                             "stored_s": median(stored),
                             "mean_jpeg_kb": float(np.mean([len(p) for p in photos])) / 1e3,
                             "val_rows": int(sum(len(v) for v in plans["stored"].val))}
    log.info("split_digest: the content split of %d photos planned in %.3f s hashing them, %.3f s from the stored "
             "digests (%.1fx)", len(photos), parts["hashed_s"], parts["stored_s"], median(per))
    return [Result("split_plan_digest_speedup", DATASET, median(per), parts, len(per), per)]
