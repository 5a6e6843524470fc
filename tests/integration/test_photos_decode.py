"""ImageNet-shaped photos through the main job with the ranks decoding: `lakehouse sample-data --kind photos`,
`ingest`, then `lakehouse train data.decode=cpu` at 224 px on 2 Horovod ranks (random resized crops and flips decoded
in each rank every epoch, from the encoded bytes the conversion kept), through to a registered model version."""
import json
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import ROOT, available_readers, cli

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

PHOTOS = 80


def _run(tmp: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    out = subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout, cwd=tmp)
    (tmp / f"{args[0]}.log").write_text(out.stderr)
    assert out.returncode == 0, f"lakehouse {args[0]} exited {out.returncode}:\n{out.stderr[-4000:]}"
    return out


def test_photos_train_at_224_with_cpu_decode_on_two_horovod_ranks_and_register(tmp_path):
    from mlflow.tracking import MlflowClient

    images = tmp_path / "photos"
    paths = [f"delta.table={tmp_path}/delta/photos", f"data.cache_dir={tmp_path}/cache",
             f"train.checkpoint_dir={tmp_path}/ckpt", f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
             f"mlflow.artifact_location={tmp_path}/artifacts", "mlflow.experiment=photos",
             "mlflow.registered_model=photos", f"data.reader={available_readers()[0]}"]
    conf = ["--conf", str(ROOT / "conf/local.yaml")]
    out = _run(tmp_path, "sample-data", "--kind", "photos", "--count", str(PHOTOS), "--classes", "4",
               "--out", str(images))
    assert json.loads(out.stdout.strip().splitlines()[-1])["images"] == PHOTOS
    out = _run(tmp_path, "ingest", "--source", str(images), "--mode", "overwrite", *conf, *paths)
    ingested = json.loads(out.stdout.strip().splitlines()[-1])
    assert ingested["rows_written"] == PHOTOS and not ingested["skipped"]

    out = _run(tmp_path, "train", *conf, *paths, "data.decode=cpu", "data.image_size=224", "data.channels=3",
               "model.arch=resnet", "model.width=8", "train.np=-2", "train.max_epochs=1", "train.warmup_epochs=0",
               "data.batch_size=8", "data.min_steps_per_epoch=0", "data.decode_workers=1")
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["world_size"] == 2 and summary["backend"] == "horovod" and summary["epochs"] == 1
    assert summary["rows_train"] + summary["rows_val"] == PHOTOS
    assert summary["val_loss"] == summary["val_loss"]  # a number, not NaN
    log = (tmp_path / "train.log").read_text()
    assert ("data.decode=cpu: rank 0 decodes on the CPU (libjpeg-turbo, Pillow for other formats; "
            "data.decode_workers > 1: in worker processes), the ImageNet recipe at 224 px") in log

    # the conversion kept the encoded bytes and the paths (nothing decoded there), one cache entry
    entries = [p for p in (tmp_path / "cache").iterdir() if (p / "manifest.json").exists()]
    assert len(entries) == 1
    manifest = json.loads((entries[0] / "manifest.json").read_text())
    assert manifest["columns"] == ["content", "label_index", "row_id", "path"]
    sources = {str(p): p.read_bytes() for p in images.rglob("*.jpg")}
    files = sorted(entries[0].rglob("*.parquet"))
    table = pq.read_table(files[0])
    row = table.slice(0, 1).to_pylist()[0]
    assert row["path"].endswith(".jpg") and sources[row["path"].replace("file:", "")] == row["content"]

    client = MlflowClient(summary["tracking_uri"])
    run = client.get_run(summary["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["data.decode"] == "cpu" and run.data.params["data.image_size"] == "224"
    assert run.data.tags["decode"] == "cpu"  # where the ranks decoded (data.decode=auto is resolved there)
    versions = client.search_model_versions("name='photos'")
    assert len(versions) == 1 and str(versions[0].version) == str(summary["model_version"])
    assert versions[0].run_id == run.info.run_id
