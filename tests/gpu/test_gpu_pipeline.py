"""The train loop on GPUs from converted Parquet (the converter's layout, a shard plan) through `data.reader=arrow` and
Horovod ranks to a model registered in an MLflow SQLite store, without Spark (no Java on GPU images) or Petastorm."""
from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(900)]
IMAGE, CLASSES = 32, 10


def _arrow_api():
    """The Arrow reader's API (issue 13, done): imported plainly, so a break in it fails this test, not skips it."""
    from pipeline.data.convert import plan_data, split_from_manifest
    from pipeline.data.shards import COLUMNS, LABEL, PIXELS, ROW_ID

    return plan_data, split_from_manifest, (PIXELS, LABEL, ROW_ID), COLUMNS


def _write_split(folder: Path, rows: int, seed: int, files: int, group_rows: int, columns):
    """Parquet files as the converter writes them: pixels decoded by the project's decode_image from real PNG bytes,
    label_index int32, row_id int64, in row groups of `group_rows`. Returns the manifest entries."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from pipeline.images import decode_image

    pixels_col, label_col, id_col = columns
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, rows)
    pixels = []
    for label in labels:
        img = rng.integers(0, 96, (IMAGE, IMAGE), dtype=np.uint8)
        img[3 * label + 1, :] = 255
        buf = io.BytesIO()
        Image.fromarray(img, mode="L").save(buf, format="PNG")
        pixels.append(decode_image(buf.getvalue(), IMAGE, 1).tobytes())
    schema = pa.schema([(pixels_col, pa.binary()), (label_col, pa.int32()), (id_col, pa.int64())])
    folder.mkdir(parents=True)
    manifest, per_file = [], rows // files
    for f in range(files):
        lo, hi = f * per_file, rows if f == files - 1 else (f + 1) * per_file
        table = pa.table({pixels_col: pa.array(pixels[lo:hi], pa.binary()),
                          label_col: pa.array(labels[lo:hi], pa.int32()),
                          id_col: pa.array(np.arange(lo, hi) + seed * 1_000_000, pa.int64())}, schema=schema)
        name = f"part-{f:05d}.parquet"
        pq.write_table(table, folder / name, row_group_size=group_rows, compression="none")
        meta = pq.ParquetFile(folder / name).metadata
        manifest.append({"name": name, "bytes": (folder / name).stat().st_size,
                         "row_groups": [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]})
    return manifest


def test_converted_parquet_to_registered_model_with_the_arrow_reader(gpu_ranks, tmp_path):
    plan_data, split_from_manifest, columns, _ = _arrow_api()
    from mlflow.tracking import MlflowClient

    from pipeline.config import load_config
    from pipeline.data.shards import ConvertedData
    from pipeline.lakehouse.delta import PinnedTable
    from pipeline.tracking.runs import configure, tracked_run
    from pipeline.workflow import register_and_promote, train_in_run

    batch = 32
    cfg = load_config(str(ROOT / "conf/local.yaml"), [
        f"delta.table={tmp_path}/delta/images", f"data.cache_dir={tmp_path}/cache", "data.reader=arrow",
        f"data.batch_size={batch}", "train.backend=horovod", f"train.np=-{gpu_ranks}", "train.max_epochs=3",
        "train.precision=auto", "train.warmup_epochs=0", "model.lr=0.05",
        f"train.checkpoint_dir={tmp_path}/checkpoints", f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        f"mlflow.artifact_location={tmp_path}/mlartifacts", f"mlflow.unended_runs={tmp_path}/unended.jsonl",
        # the gate scores on held-out rows of the pinned Delta version (delta-rs, a 52 MB wheel the device tool
        # cannot carry beside the bundle); it is tested in the CPU tiers. Here: train, log, register.
        "mlflow.promote=false", "mlflow.system_metrics_interval_s=1"])
    splits = {}
    for name, rows, seed in (("train", 256 * gpu_ranks, 1), ("val", 64 * gpu_ranks, 2)):
        folder = tmp_path / "cache" / "entry" / name
        files = _write_split(folder, rows, seed, files=2, group_rows=32, columns=columns)
        splits[name] = split_from_manifest(name, folder.as_uri(), files)
    plan = plan_data(splits["train"], splits["val"], gpu_ranks, batch)
    data = ConvertedData(train=splits["train"], val=splits["val"], plan=plan,
                         class_names=[str(i) for i in range(CLASSES)], image_size=IMAGE, channels=1)
    pinned = PinnedTable(table=str(tmp_path / "delta" / "images"), version=0, num_files=2,
                         num_rows=sum(data.rows))

    configure(cfg.mlflow)
    tags = {"world_size": gpu_ranks, "backend": "horovod", "np": cfg.train.np}
    with tracked_run(cfg, run_name="gpu-tier", tags=tags) as run:
        r0 = train_in_run(run, cfg, data, pinned, tags)
        assert r0.model_uri, "rank 0 returned no model"
        version, _ = register_and_promote(run.client, cfg, r0.model_uri, run.run_id, pinned, r0.metrics)
        run_id = run.run_id

    client = MlflowClient(cfg.mlflow.tracking_uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    mv = client.get_model_version(cfg.mlflow.registered_model, str(version))
    assert mv.run_id == run_id and mv.tags["delta_version"] == "0" and mv.tags["world_size"] == str(gpu_ranks)
    assert r0.world_size == gpu_ranks and r0.epochs == 3
    assert r0.metrics["val_acc"] > 0.2, r0.metrics  # learned the drawn row (chance is 0.1)
    params = client.get_run(run_id).data.params
    assert params["data.reader"] == "arrow"
    # GPU telemetry: each rank's peak and reserved GPU memory per epoch, reported through rank 0, and NVML's series of
    # every GPU of rank 0's machine sampled in the background (utilisation, memory)
    for rank in range(gpu_ranks):
        for field in ("gpu_peak_memory_mb", "gpu_reserved_memory_mb", "peak_rss_mb", "host_cpu_percent"):
            history = client.get_metric_history(run_id, f"{field}_rank_{rank}")
            assert len(history) == 3, (field, rank)
        assert client.get_metric_history(run_id, f"gpu_peak_memory_mb_rank_{rank}")[-1].value > 0
    for device in range(gpu_ranks):
        for key in (f"system/gpu_{device}_utilization_percentage", f"system/gpu_{device}_memory_usage_megabytes"):
            assert client.get_metric_history(run_id, key), key
    assert params.get("train.precision", "auto") == "auto"
