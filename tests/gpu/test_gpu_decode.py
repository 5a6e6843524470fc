"""data.decode=gpu on a CUDA device: nvJPEG (torchvision.io.decode_jpeg on the rank's device) against the CPU path
on the same rows (same labels, same rows in the same order, pixels within a stated tolerance), a corrupt JPEG handled
the same way, and a few steps of ResNet-50 at 224 px in bf16-mixed, channels_last, fed by decode=gpu. The rows are
Parquet files in the converter's encoded layout written with pyarrow (no Spark or Java on GPU images)."""
from __future__ import annotations

import io
import time
from pathlib import Path

import pytest

from .gpu_env import cuda_state

pytestmark = [pytest.mark.timeout(900)]
SIZE = 224
# nvJPEG and libjpeg-turbo differ in their IDCT and chroma upsampling, and torch's antialiased bilinear differs from
# Pillow's by rounding: the same crop may differ by a few levels on average and more on sharp edges.
MEAN_TOLERANCE = 3.0  # mean |gpu - cpu| per pixel value, in levels of 255
P99_TOLERANCE = 32.0  # the 99th percentile of |gpu - cpu|


@pytest.fixture(scope="module")
def tv_io():
    ok, why = cuda_state()
    if not ok:
        pytest.skip(f"data.decode=gpu needs a CUDA device: {why}")
    from pipeline.data.gpu_decode import import_decode_jpeg

    try:
        return import_decode_jpeg()
    except ImportError as exc:
        pytest.skip(f"data.decode=gpu needs torchvision on this image: {exc}")


def _photos(n: int, seed: int = 3):
    from pipeline.lakehouse.sample_data import PHOTO_CLASSES, render_photo

    labels = [i % len(PHOTO_CLASSES) for i in range(n)]
    return [render_photo(PHOTO_CLASSES[k], seed, i)[0] for i, k in enumerate(labels)], labels


def _png(rgb=(20, 180, 90), size=(300, 240)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, rgb).save(buf, format="PNG")
    return buf.getvalue()


def _encoded_data(folder: Path, contents, labels, val_rows: int, batch_size: int):
    """ConvertedData in the encoded layout (content, label_index, row_id, path): the last `val_rows` are val."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data.convert import plan_data, split_from_manifest
    from pipeline.data.shards import ENCODED_COLUMNS, ConvertedData

    n = len(contents)
    splits = {}
    for name, lo, hi in (("train", 0, n - val_rows), ("val", n - val_rows, n)):
        (folder / name).mkdir(parents=True)
        table = pa.table([pa.array(contents[lo:hi], pa.binary()), pa.array(labels[lo:hi], pa.int32()),
                          pa.array(range(lo, hi), pa.int64()), pa.array([f"/photos/{i}.jpg" for i in range(lo, hi)])],
                         names=list(ENCODED_COLUMNS))
        path = folder / name / "part-00000.parquet"
        pq.write_table(table, path, row_group_size=16, compression="none")
        meta = pq.ParquetFile(path).metadata
        manifest = [{"name": path.name, "bytes": path.stat().st_size,
                     "row_groups": [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]}]
        splits[name] = split_from_manifest(name, f"file://{folder / name}", manifest)
    plan = plan_data(splits["train"], splits["val"], 1, batch_size)
    classes = max(labels) + 1
    return ConvertedData(train=splits["train"], val=splits["val"], plan=plan,
                         class_names=[f"c{k}" for k in range(classes)], image_size=SIZE, channels=3, layout="encoded")


def _datamodule(data, decode: str, **data_keys):
    from pipeline.config import DataConfig
    from pipeline.data.datamodule import make_datamodule

    cfg = DataConfig(reader="arrow", decode=decode, image_size=SIZE, channels=3, shuffle_buffer=64, batch_size=16,
                     channels_last=True, **data_keys)
    return make_datamodule(data, 0, 1, cfg, normalize_on_device=True, track_ids=True)


def _close(gpu, cpu, what: str) -> None:
    import torch

    diff = (gpu.float().cpu() - cpu.float()).abs().flatten()
    mean, p99 = float(diff.mean()), float(torch.quantile(diff[:1_000_000], 0.99))
    print(f"{what}: mean |gpu - cpu| {mean:.3f}, 99th percentile {p99:.1f}, max {float(diff.max()):.0f} levels")
    assert mean < MEAN_TOLERANCE and p99 < P99_TOLERANCE, (what, mean, p99)


def test_gpu_decode_gives_the_cpu_paths_rows_labels_and_pixels_within_tolerance(tv_io, tmp_path):
    import torch

    contents, labels = _photos(72)
    contents[5] = _png()  # a row that is not a JPEG: decoded on the CPU within the GPU batch
    data = _encoded_data(tmp_path, contents, labels, val_rows=24, batch_size=16)
    gpu_dm, cpu_dm = _datamodule(data, "gpu"), _datamodule(data, "cpu")
    assert gpu_dm.decode_used == "gpu" and cpu_dm.decode_used == "cpu"
    assert _datamodule(data, "auto").decode_used == "gpu"
    for loader in ("train_dataloader", "val_dataloader"):
        g_ld, c_ld = getattr(gpu_dm, loader)(), getattr(cpu_dm, loader)()
        g_batches, c_batches = list(g_ld), list(c_ld)
        assert g_ld.ids_read == c_ld.ids_read  # the same rows in the same order
        assert len(g_batches) == len(c_batches)
        for (gx, gy), (cx, cy) in zip(g_batches, c_batches):
            assert gx.is_cuda and gx.dtype == torch.uint8 and gx.is_contiguous(memory_format=torch.channels_last)
            assert torch.equal(gy.cpu(), cy)
            _close(gx, cx, loader)
    gpu_dm.teardown("fit")
    cpu_dm.teardown("fit")


def test_the_cpu_share_of_each_gpu_batch_is_the_cpu_paths_own_pixels_and_the_rest_within_tolerance(tv_io, tmp_path):
    """data.decode_cpu_share=0.25 with 4 decode workers: each batch's last quarter decoded by the CPU workers while
    nvJPEG decodes the rest on the device; the same rows, labels and order as decode=cpu."""
    import torch

    contents, labels = _photos(72)
    data = _encoded_data(tmp_path, contents, labels, val_rows=24, batch_size=16)
    gpu_dm = _datamodule(data, "gpu", decode_workers=4, decode_cpu_share=0.25)
    cpu_dm = _datamodule(data, "cpu", decode_workers=4)
    for loader in ("train_dataloader", "val_dataloader"):
        g_ld, c_ld = getattr(gpu_dm, loader)(), getattr(cpu_dm, loader)()
        g_batches, c_batches = list(g_ld), list(c_ld)
        assert g_ld.ids_read == c_ld.ids_read and len(g_batches) == len(c_batches)
        for (gx, gy), (cx, cy) in zip(g_batches, c_batches):
            start = len(gy) - round(0.25 * len(gy))
            assert gx.is_cuda and gx.is_contiguous(memory_format=torch.channels_last)
            assert torch.equal(gy.cpu(), cy)
            assert torch.equal(gx[start:].cpu(), cx[start:]), loader  # the CPU workers' rows, in their places
            if start:
                _close(gx[:start], cx[:start], f"{loader} (nvJPEG's share)")
    assert gpu_dm.train_loader.decoder.handovers["ring"] > 0
    gpu_dm.teardown("fit")
    cpu_dm.teardown("fit")


def test_a_corrupt_jpeg_is_handled_by_the_gpu_path_as_by_the_cpu_path(tv_io):
    import numpy as np

    from pipeline.data.decode import Decoder, EncodedBatch, RowDecodeError

    from pipeline.data.gpu_decode import GpuDecoder

    contents, _ = _photos(8)
    good = contents[0]
    for bad in (good[: len(good) // 3], good[:600] + bytes(len(good) - 600), b"\xff\xd8\xff" + bytes(100)):
        batch_rows = np.empty((8, 2), dtype=object)
        batch_rows[:, 0] = contents[:3] + [bad] + contents[4:]
        batch_rows[:, 1] = [f"/photos/dogs/{i}.jpg" for i in range(8)]
        batch = EncodedBatch(batch_rows, 0)
        errors = []
        for decoder in (Decoder(SIZE, 3, True, 0, workers=2), GpuDecoder(SIZE, 3, True, 0, device="cuda")):
            with pytest.raises(RowDecodeError, match=r"row /photos/dogs/3\.jpg") as err:
                decoder.decode(batch)
            errors.append(str(err.value))
        assert errors[0] == errors[1]


def test_gpu_decoder_throughput_is_reported(tv_io):
    """Not a target check (that is `lakehouse bench`): the figure, printed, for the record of the run."""
    import numpy as np
    import torch

    from pipeline.data.decode import EncodedBatch

    from pipeline.data.gpu_decode import GpuDecoder

    contents, _ = _photos(256)
    rows = np.empty((256, 2), dtype=object)
    rows[:, 0], rows[:, 1] = contents, [f"/p/{i}" for i in range(256)]
    decoder = GpuDecoder(SIZE, 3, True, 0, device="cuda")
    decoder.decode(EncodedBatch(rows, 0))  # warm-up: nvJPEG's handles and buffers
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k in range(1, 9):
        x = decoder.decode(EncodedBatch(rows, k))
    torch.cuda.synchronize()
    rate = 8 * 256 / (time.perf_counter() - t0)
    print(f"GpuDecoder: {rate:.0f} images/s (decode, random resized crop to {SIZE}, flip; one thread)")
    assert x.shape == (256, 3, SIZE, SIZE) and rate > 0


def test_resnet50_takes_a_few_bf16_steps_at_224_fed_by_gpu_decode(tv_io, tmp_path):
    import numpy as np
    import pytorch_lightning as pl
    import torch

    from pipeline.config import ModelConfig
    from pipeline.model.module import ImageClassifier

    contents, labels = _photos(96)
    data = _encoded_data(tmp_path, contents, labels, val_rows=32, batch_size=16)
    dm = _datamodule(data, "gpu")
    try:
        from pipeline.model.timm_backbone import build_timm_network

        net = build_timm_network("timm/resnet50", 3, len(data.class_names), data_size=SIZE)
    except ImportError:  # no timm on this image: torchvision's ResNet-50, randomly initialised, the same network
        import torchvision

        net = torchvision.models.resnet50(weights=None, num_classes=len(data.class_names))
    net = net.to(memory_format=torch.channels_last)
    model = ImageClassifier(net, len(data.class_names), ModelConfig(arch="timm/resnet50", lr=0.01), lr=0.01,
                            steps_per_epoch=data.plan.train.steps_per_epoch, max_epochs=1)
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0,
                         enable_model_summary=False)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == data.plan.train.steps_per_epoch >= 4
    assert np.isfinite(float(trainer.callback_metrics["train_loss"]))
    assert dm.decode_used == "gpu"
    dm.teardown("fit")
