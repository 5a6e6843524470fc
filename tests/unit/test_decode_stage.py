"""The rank's decode stage (pipeline.data.decode) on the CPU: the ImageNet recipe's crops from (seed, batch index),
the same batches whatever the worker count, labels kept with their images through the shuffle, a corrupt row named by
its path, the decode workers' ring of shared slots (batches cycling through it, batches too large for a slot, a worker
killed mid-batch), the loader over real Parquet files of encoded rows; and the GPU path's code run on torchvision's
CPU decoder where torchvision is importable (.venv-vision), skipped with the reason elsewhere."""
from __future__ import annotations

import io
import logging
import os
import time
from collections import namedtuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.data.batches import BatchAssembler
from pipeline.data.decode import (CROP_RATIO, DRAWS, Decoder, EncodedBatch, EncodedRows, RowDecodeError, boxes_for,
                                  crop_draws, decode_crop, default_workers, train_box, val_box)
from pipeline.data.gpu_decode import resolve_decode

SIZE = 32
Group = namedtuple("Group", ["pixels", "label_index", "row_id", "path"])


def _jpeg(rgb, size=(90, 70), quality=90) -> bytes:
    """A JPEG of one solid colour (its label can be read back from any crop)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, tuple(int(v) for v in rgb)).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _photo(i: int) -> bytes:
    from pipeline.lakehouse.sample_data import PHOTO_CLASSES, render_photo

    return render_photo(PHOTO_CLASSES[i % len(PHOTO_CLASSES)], 5, i)[0]


COLOURS = [(250, 10, 10), (10, 250, 10), (10, 10, 250), (240, 240, 20)]  # label k is colour k


def _colour_label(x: torch.Tensor) -> int:
    mean = x.float().mean(dim=(1, 2)).numpy()
    return int(np.argmin([np.abs(mean - np.array(c)).sum() for c in COLOURS]))


def _batch(contents, index=0, prefix="/t/img"):
    rows = np.empty((len(contents), 2), dtype=object)
    rows[:, 0] = contents
    rows[:, 1] = [f"{prefix}{i}.jpg" for i in range(len(contents))]
    return EncodedBatch(rows, index)


def test_crop_draws_depend_on_seed_and_batch_index_only():
    a, b = crop_draws(3, 7, 5), crop_draws(3, 7, 5)
    assert a.shape == (5, DRAWS) and np.array_equal(a, b)
    assert not np.array_equal(a, crop_draws(3, 8, 5)) and not np.array_equal(a, crop_draws(4, 7, 5))
    # the same draws whatever the images' sizes: a batch's crops never depend on which image is decoded first
    assert boxes_for([(400, 300)] * 5, True, 3, 7) == [train_box(400, 300, u) for u in a]
    # the first rows of a batch alone (the GPU's rows where the CPU decodes the rest): the boxes of their places
    sizes = [(400, 300), (300, 400), (640, 480), (100, 90), (500, 333)]
    assert boxes_for(sizes[:2], True, 3, 7, rows=5) == boxes_for(sizes, True, 3, 7)[:2]
    assert boxes_for(sizes[:2], False, 3, 7, rows=5) == boxes_for(sizes, False, 3, 7)[:2]


@pytest.mark.parametrize("size", [(400, 350), (160, 800), (800, 160), (37, 41)])
def test_random_resized_crop_boxes_stay_inside_the_image_within_the_recipe(size):
    w, h = size
    rng = np.random.default_rng(0)
    flips = []
    for _ in range(500):
        left, top, bw, bh, flip = train_box(w, h, rng.random(DRAWS))
        assert 0 <= left and 0 <= top and left + bw <= w and top + bh <= h and bw >= 1 and bh >= 1
        flips.append(flip)
    assert 0.35 < np.mean(flips) < 0.65
    left, top, bw, bh, _ = train_box(w, h, np.ones(DRAWS) * 0.999)  # every attempt too large: the central fallback
    assert CROP_RATIO[0] - 0.05 <= bw / bh <= CROP_RATIO[1] + 0.05 or (bw, bh) == (w, h)


def test_the_validation_box_is_the_central_seven_eighths_of_the_shorter_side():
    assert val_box(400, 300) == (69, 19, 262, 262, False)
    assert val_box(256, 256) == (16, 16, 224, 224, False)


def test_cpu_batches_are_the_same_whatever_the_worker_count_and_match_pillow_row_by_row():
    batch = _batch([_photo(i) for i in range(7)], index=4)
    one = Decoder(SIZE, 3, train=True, seed=11, workers=1).decode(batch)
    three = Decoder(SIZE, 3, train=True, seed=11, workers=3).decode(batch)
    assert one.shape == (7, 3, SIZE, SIZE) and one.dtype == torch.uint8
    assert torch.equal(one, three)
    boxes = Decoder(SIZE, 3, train=True, seed=11).boxes(batch)
    for i in range(7):
        ref = decode_crop(batch.rows[i, 0], batch.rows[i, 1], boxes[i], SIZE, 3).transpose(2, 0, 1)  # HWC
        assert np.array_equal(one[i].numpy(), ref)
    again = Decoder(SIZE, 3, train=True, seed=11, workers=2).decode(batch)
    other_epoch = Decoder(SIZE, 3, train=True, seed=11, workers=2).decode(batch._replace(index=5))
    assert torch.equal(one, again) and not torch.equal(one, other_epoch)  # crops change from batch to batch
    val = Decoder(SIZE, 3, train=False, seed=11).decode(batch)
    assert torch.equal(val, Decoder(SIZE, 3, train=False, seed=99).decode(batch))  # no randomness in validation


def test_a_flip_mirrors_the_crop():
    from PIL import Image

    buf = io.BytesIO()
    img = np.zeros((40, 60, 3), np.uint8)
    img[:, :30] = 255  # white left half
    Image.fromarray(img).save(buf, format="PNG")
    plain = decode_crop(buf.getvalue(), "p", (0, 0, 60, 40, False), 16, 3)
    flipped = decode_crop(buf.getvalue(), "p", (0, 0, 60, 40, True), 16, 3)
    assert plain.shape == (16, 16, 3)  # Pillow's HWC order: the decoders' batches are NHWC
    assert np.array_equal(plain[:, ::-1], flipped) and plain[8, 0, 0] == 255 and flipped[8, 0, 0] == 0


def test_labels_stay_with_their_images_through_the_shuffle_and_the_decode():
    groups = []
    for g in range(4):
        labels = [(g * 5 + i) % 4 for i in range(9)]
        groups.append(Group(pa.chunked_array([pa.array([_jpeg(COLOURS[k]) for k in labels], pa.binary())]),
                            pa.chunked_array([pa.array(labels, pa.int32())]),
                            pa.chunked_array([pa.array(range(g * 9, g * 9 + 9), pa.int64())]),
                            pa.chunked_array([pa.array([f"/t/{g}/{i}.jpg" for i in range(9)])])))
    assembler = BatchAssembler(iter(groups), 8, EncodedRows(), shuffle_buffer=20, seed=2, with_ids=True)
    decoder = Decoder(SIZE, 3, train=True, seed=2, workers=2)
    seen = []
    for x, y, ids in decoder.batches(iter(assembler)):
        assert x.dtype == torch.uint8 and len(x) == len(y) == len(ids)
        assert [_colour_label(img) for img in x] == y.tolist()
        seen.extend(ids.tolist())
    assert sorted(seen) == list(range(36))


def test_a_resumed_stream_skips_batches_but_keeps_their_crops_aligned():
    def stream(skip):
        groups = [Group(pa.array([_photo(i) for i in range(g * 6, g * 6 + 6)], pa.binary()),
                        pa.array([0] * 6, pa.int32()), pa.array(range(g * 6, g * 6 + 6), pa.int64()),
                        pa.array([f"/p/{i}" for i in range(g * 6, g * 6 + 6)])) for g in range(3)]
        a = BatchAssembler(iter(groups), 4, EncodedRows(), shuffle_buffer=0, seed=1, with_ids=True)
        a.skip = skip
        return list(Decoder(SIZE, 3, train=True, seed=1, workers=2).batches(iter(a)))

    full, resumed = stream(0), stream(2)
    assert len(resumed) == len(full) - 2
    for (x1, _, ids1), (x2, _, ids2) in zip(full[2:], resumed):
        assert np.array_equal(ids1, ids2) and torch.equal(x1, x2)


def test_a_corrupt_jpeg_is_named_by_its_path_and_stops_the_stream():
    good = _photo(1)
    broken = good[:600] + bytes(len(good) - 600)  # a valid header, then zeros where the scan was
    truncated = good[: len(good) // 3]
    for bad in (broken, truncated, b"not an image at all"):
        batch = _batch([good, bad, good], prefix="/data/cats/")
        with pytest.raises(RowDecodeError, match=r"row /data/cats/1\.jpg: "):
            Decoder(SIZE, 3, train=True, seed=0, workers=2).decode(batch)
    items = iter([(_batch([good, good]), torch.tensor([0, 0])), (_batch([good, truncated], 1, "/x/"),
                                                                  torch.tensor([0, 1]))])
    it = Decoder(SIZE, 3, train=False, seed=0).batches(items)
    assert len(next(it)[0]) == 2
    with pytest.raises(RowDecodeError, match=r"row /x/1\.jpg"):
        next(it)


def test_an_image_over_the_pixel_bound_is_refused_before_decoding():
    batch = _batch([_jpeg((1, 2, 3), size=(300, 300))])
    with pytest.raises(RowDecodeError, match=r"row /t/img0\.jpg: too many pixels"):
        Decoder(SIZE, 3, train=False, seed=0, max_pixels=10_000).decode(batch)


def test_png_and_grey_rows_decode_alongside_jpegs():
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (50, 40), 77).save(buf, format="PNG")
    x = Decoder(SIZE, 1, train=False, seed=0).decode(_batch([buf.getvalue(), _jpeg((77, 77, 77))]))
    assert x.shape == (2, 1, SIZE, SIZE) and abs(int(x[0].float().mean()) - 77) <= 1
    assert abs(int(x[1].float().mean()) - 77) <= 2


def test_decode_modes_resolve_by_what_the_rank_has(monkeypatch):
    assert resolve_decode("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_decode("auto") == "cpu"
    with pytest.raises(ValueError, match="config key 'data.decode' is gpu but no CUDA device"):
        resolve_decode("gpu")
    monkeypatch.setenv("HOROVOD_LOCAL_SIZE", "2")
    assert default_workers(8) == max(1, len(os.sched_getaffinity(0)) // 2)


# ------------------------------------------------------------------------------- the loader over real Parquet files
def write_encoded_data(folder, rows: int, val_rows: int, batch_size: int, group_rows: int = 8, corrupt_at=None):
    """ConvertedData of encoded rows written with pyarrow alone, in the converter's encoded layout (as on a GPU
    machine without Spark): solid-colour JPEGs whose colour is the label, two files per split."""
    from pipeline.data.convert import plan_data, split_from_manifest
    from pipeline.data.shards import ENCODED_COLUMNS, ConvertedData

    splits = {}
    for name, n in (("train", rows), ("val", val_rows)):
        os.makedirs(folder / name)
        manifest = []
        for f, (lo, hi) in enumerate(((0, n // 2), (n // 2, n))):
            labels = [(i * 7 + f) % len(COLOURS) for i in range(lo, hi)]
            contents = [_jpeg(COLOURS[k], size=(60 + i % 9, 50 + i % 5)) for i, k in zip(range(lo, hi), labels)]
            paths = [f"/photos/{name}/{i}.jpg" for i in range(lo, hi)]
            if corrupt_at is not None and name == "train" and lo <= corrupt_at < hi:
                contents[corrupt_at - lo] = contents[corrupt_at - lo][:200]
            table = pa.table([pa.array(contents, pa.binary()), pa.array(labels, pa.int32()),
                              pa.array(range(lo, hi), pa.int64()), pa.array(paths)], names=list(ENCODED_COLUMNS))
            path = folder / name / f"part-{f:05d}.parquet"
            pq.write_table(table, path, row_group_size=group_rows, compression="none")
            meta = pq.ParquetFile(path).metadata
            manifest.append({"name": path.name, "bytes": path.stat().st_size,
                             "row_groups": [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]})
        splits[name] = split_from_manifest(name, f"file://{folder / name}", manifest)
    plan = plan_data(splits["train"], splits["val"], 1, batch_size)
    return ConvertedData(train=splits["train"], val=splits["val"], plan=plan, class_names=["r", "g", "b", "y"],
                         image_size=SIZE, channels=3, layout="encoded")


@pytest.mark.parametrize("memory_cache_mb", [0, 64])
def test_the_datamodule_decodes_encoded_rows_with_labels_and_counts_as_planned(tmp_path, memory_cache_mb):
    from pipeline.config import DataConfig
    from pipeline.data.datamodule import make_datamodule

    data = write_encoded_data(tmp_path, rows=48, val_rows=20, batch_size=8)
    cfg = DataConfig(reader="arrow", decode="cpu", decode_workers=2, shuffle_buffer=16, memory_cache_mb=memory_cache_mb,
                     channels=3, image_size=SIZE)
    dm = make_datamodule(data, 0, 1, cfg, normalize_on_device=True, track_ids=True)
    assert dm.decode_used == "cpu"
    for epoch in range(2):
        n = 0
        for x, y in dm.train_dataloader():
            assert x.shape == (8, 3, SIZE, SIZE) and x.dtype == torch.uint8
            assert [_colour_label(img) for img in x] == y.tolist()
            n += len(y)
        dm.train_loader.check_rows()
        assert n == 48
    vals = list(dm.val_dataloader())
    assert sum(len(y) for _, y in vals) == 20
    assert all([_colour_label(img) for img in x] == y.tolist() for x, y in vals)
    dm.val_loader.check_rows()
    # a rank that does not normalise on its device gets the loader's float formula
    dm = make_datamodule(data, 0, 1, cfg, normalize_on_device=False)
    x, y = next(iter(dm.val_dataloader()))
    assert x.dtype == torch.float32 and -1.0 <= float(x.min()) and float(x.max()) <= 1.0
    dm.teardown("fit")


def test_the_datamodule_refuses_a_layout_of_the_other_decode_setting(tmp_path):
    from pipeline.config import DataConfig
    from pipeline.data.datamodule import make_datamodule

    data = write_encoded_data(tmp_path, rows=16, val_rows=8, batch_size=8)
    with pytest.raises(ValueError, match="data.decode' is 'convert' but the converted data holds encoded images"):
        make_datamodule(data, 0, 1, DataConfig(reader="arrow"))


def test_a_corrupt_row_in_the_table_stops_training_naming_its_path(tmp_path):
    from pipeline.config import DataConfig
    from pipeline.data.datamodule import make_datamodule

    data = write_encoded_data(tmp_path, rows=32, val_rows=8, batch_size=8, corrupt_at=13)
    dm = make_datamodule(data, 0, 1, DataConfig(reader="arrow", decode="cpu", channels=3, image_size=SIZE))
    with pytest.raises(RowDecodeError, match=r"row /photos/train/13\.jpg: not a decodable image"):
        list(dm.train_dataloader())
    dm.teardown("fit")


# ------------------------------------------------------------------------ the GPU path's code on torchvision's CPU
def _torchvision():
    from pipeline.data.gpu_decode import import_decode_jpeg

    try:
        return import_decode_jpeg()
    except ImportError as exc:
        pytest.skip(f"the GPU path's code needs torchvision (run in .venv-vision): {exc}")


def test_the_gpu_path_on_torchvision_cpu_decoder_matches_the_cpu_path_within_tolerance():
    _torchvision()
    from PIL import Image

    from pipeline.data.gpu_decode import GpuDecoder

    png = io.BytesIO()
    Image.new("RGB", (70, 50), (5, 200, 90)).save(png, format="PNG")
    contents = [_photo(i) for i in range(6)] + [png.getvalue()]  # a PNG row goes to the CPU within the batch
    for train in (True, False):
        batch = _batch(contents, index=3)
        cpu = Decoder(224, 3, train=train, seed=9, workers=2).decode(batch)
        gpu = GpuDecoder(224, 3, train=train, seed=9, device="cpu").decode(batch)
        assert gpu.shape == cpu.shape and gpu.dtype == torch.uint8
        diff = (gpu.float() - cpu.float()).abs()
        # libjpeg-turbo in both here; on a GPU nvJPEG's IDCT and upsampling differ by a few levels more
        assert float(diff.mean()) < 2.0 and float(diff.max()) <= 40, (train, float(diff.mean()), float(diff.max()))
        assert torch.equal(gpu[-1], cpu[-1])  # the PNG row: the CPU path's own pixels


def test_large_photos_cpu_path_at_a_reduced_jpeg_scale_stays_within_the_gpu_paths_tolerance():
    """The CPU path decodes a large photo's crop at 1/2 or 1/4 scale (pipeline.data.crops' draft); the GPU path
    decodes it whole (nvJPEG; here torchvision's CPU decoder): the same tolerance as for ImageNet-shaped photos."""
    _torchvision()
    from pipeline.data.crops import draft_scale
    from pipeline.data.gpu_decode import GpuDecoder
    from pipeline.lakehouse.sample_data import PHOTO_CLASSES, render_photo

    size = (2400, 1800)
    contents = [render_photo(PHOTO_CLASSES[i], 6, i, size=size)[0] for i in range(3)]
    assert draft_scale(*size, 1575, 1575, 224) == 2  # the validation crop takes it
    for train in (True, False):
        batch = _batch(contents, index=1)
        cpu = Decoder(224, 3, train=train, seed=4, workers=1).decode(batch)
        gpu = GpuDecoder(224, 3, train=train, seed=4, device="cpu").decode(batch)
        diff = (gpu.float() - cpu.float()).abs()
        assert float(diff.mean()) < 2.0 and float(diff.max()) <= 40, (train, float(diff.mean()), float(diff.max()))


def test_the_gpu_path_handles_a_corrupt_jpeg_as_the_cpu_path_does():
    _torchvision()
    from pipeline.data.gpu_decode import GpuDecoder

    good = _photo(2)
    for bad in (good[: len(good) // 3], good[:600] + bytes(len(good) - 600)):
        batch = _batch([good, bad], prefix="/data/dogs/")
        with pytest.raises(RowDecodeError, match=r"row /data/dogs/1\.jpg") as cpu_err:
            Decoder(SIZE, 3, train=True, seed=0).decode(batch)
        with pytest.raises(RowDecodeError, match=r"row /data/dogs/1\.jpg") as gpu_err:
            GpuDecoder(SIZE, 3, train=True, seed=0, device="cpu").decode(batch)
        assert str(cpu_err.value) == str(gpu_err.value)


def test_the_cpu_share_of_a_gpu_batch_is_decoded_by_the_workers_with_the_cpu_paths_pixels_in_its_places(caplog):
    """data.decode_cpu_share: the batch's last rows go to the CPU decode workers (through the ring), the others to the
    GPU path (torchvision's CPU decoder here), each row with the box of its place in the batch: the share's rows are
    the CPU path's own pixels, the others the GPU path's, whichever thread ends first."""
    _torchvision()
    from PIL import Image

    from pipeline.data.gpu_decode import GpuDecoder

    png = io.BytesIO()
    Image.new("RGB", (70, 50), (5, 200, 90)).save(png, format="PNG")
    contents = [_photo(i) for i in range(9)] + [png.getvalue()]
    shared = GpuDecoder(64, 3, train=True, seed=5, device="cpu", workers=2, cpu_share=0.3)
    alone = GpuDecoder(64, 3, train=True, seed=5, device="cpu")
    cpu = Decoder(64, 3, train=True, seed=5, workers=1)
    try:
        assert shared.share_start(10) == 7 and shared.share_start(3) == 2 and alone.share_start(10) == 10
        for index in range(7):  # more batches than the ring has slots: each slot is taken again
            batch = _batch(contents, index=index)
            got, gpu_only, cpu_only = shared.decode(batch), alone.decode(batch), cpu.decode(batch)
            assert torch.equal(got[:7], gpu_only[:7]), index
            assert torch.equal(got[7:], cpu_only[7:]), index  # the PNG row among them
            assert not torch.equal(got[7:9], gpu_only[7:9])  # the two decoders' own pixels: they do differ here
            assert shared.handovers["ring"] == index + 1  # through the ring every time: no slot was lost
        assert sorted(shared._ring._free) == list(range(shared._ring.slots))
        val = _batch(contents[:4], index=0)
        whole = GpuDecoder(64, 3, train=False, seed=5, device="cpu", workers=2, cpu_share=1.0)
        try:
            assert torch.equal(whole.decode(val), Decoder(64, 3, train=False, seed=5, workers=1).decode(val))
        finally:
            whole.close()
        with pytest.raises(ValueError, match=r"data\.decode_cpu_share.*between 0 and 1"):
            GpuDecoder(64, 3, train=True, seed=5, device="cpu", workers=2, cpu_share=1.5)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pipeline.data.gpu_decode"):
            one = GpuDecoder(64, 3, train=True, seed=5, device="cpu", workers=1, cpu_share=0.5)
        assert one.share_start(10) == 10  # one worker is a thread, no processes: the share is off, and said so
        assert "'data.decode_cpu_share' is 0.5 but this rank has 1 decode worker" in caplog.text
    finally:
        shared.close()


def test_a_corrupt_row_in_the_cpu_share_of_a_gpu_batch_is_named_and_the_decoder_goes_on():
    _torchvision()
    from pipeline.data.gpu_decode import GpuDecoder

    good = _photo(2)
    decoder = GpuDecoder(SIZE, 3, train=True, seed=0, device="cpu", workers=2, cpu_share=0.5)
    try:
        for bad_at in (0, 3):  # in the GPU path's rows, then in the CPU share's
            contents = [good] * 4
            contents[bad_at] = good[: len(good) // 3]
            with pytest.raises(RowDecodeError, match=rf"row /data/dogs/{bad_at}\.jpg"):
                decoder.decode(_batch(contents, prefix="/data/dogs/"))
        assert decoder.decode(_batch([good] * 4, index=5)).shape == (4, 3, SIZE, SIZE)
        assert decoder.handovers["ring"] == 3 and sorted(decoder._ring._free) == list(range(decoder._ring.slots))
    finally:
        decoder.close()


def test_only_a_jpeg_whole_to_its_end_marker_goes_to_the_gpu_decoder():
    """nvJPEG decodes a truncated or zero-padded JPEG without a word (seen on an H100), where Pillow refuses it: such
    rows, and a JPEG with bytes after its end marker, take the CPU path, which names them or decodes them."""
    from pipeline.data.gpu_decode import is_jpeg

    good = _photo(3)
    assert good.endswith(b"\xff\xd9") and is_jpeg(good) and is_jpeg(bytearray(good))
    for not_whole in (good[: len(good) // 3], good[:600] + bytes(len(good) - 600), b"\xff\xd8\xff" + bytes(100),
                      good + b"trailer", b"\x89PNG\r\n", b"", None):
        assert not is_jpeg(not_whole), not_whole[:8] if not_whole else not_whole


def test_a_jpeg_with_bytes_after_its_end_marker_decodes_on_the_cpu_path_within_a_gpu_batch():
    _torchvision()
    from pipeline.data.gpu_decode import GpuDecoder

    contents = [_photo(4), _photo(5) + b"\x00camera trailer"]
    batch = _batch(contents, index=1)
    cpu = Decoder(SIZE, 3, train=False, seed=0).decode(batch)
    gpu = GpuDecoder(SIZE, 3, train=False, seed=0, device="cpu").decode(batch)
    assert torch.equal(gpu[1], cpu[1])  # the CPU path's own pixels for the row nvJPEG is not given


def test_more_than_one_worker_decodes_in_worker_processes_and_their_errors_name_the_row():
    import os

    batch = _batch([_jpeg((1, 2, 3), size=(40, 40)), _jpeg((4, 5, 6), size=(300, 300))])
    decoder = Decoder(SIZE, 3, train=False, seed=0, workers=2, max_pixels=10_000)
    try:
        with pytest.raises(RowDecodeError, match=r"row /t/img1\.jpg: too many pixels"):
            decoder.decode(batch)
        procs = decoder.processes()
        assert procs is not None and os.getpid() not in {procs.submit(os.getpid).result() for _ in range(4)}
        assert Decoder(SIZE, 3, train=False, seed=0, workers=1).processes() is None  # one worker: a thread here
    finally:
        decoder.close()


def test_decode_workers_end_with_a_rank_that_ends_without_its_teardown(tmp_path):
    """A rank ends with os._exit once its result is delivered: its decode workers must end too, or they hold its
    stdout open and a launcher reading it to the end waits forever (seen: a pipe never closed)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import os, io, numpy as np
        from PIL import Image
        from pipeline.data.decode import Decoder, EncodedBatch
        buf = io.BytesIO(); Image.new("RGB", (40, 30), (9, 8, 7)).save(buf, format="JPEG")
        rows = np.empty((4, 2), dtype=object); rows[:, 0] = [buf.getvalue()] * 4; rows[:, 1] = ["/a.jpg"] * 4
        d = Decoder(16, 3, train=True, seed=0, workers=2)
        d.decode(EncodedBatch(rows, 0))
        print(" ".join(str(p) for p in d.processes()._processes), flush=True)
        os._exit(0)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)  # EOF on stdout
    assert done.returncode == 0, done.stderr[-2000:]
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2


def test_a_decode_workers_chunk_travels_as_offsets_into_a_shared_slot_not_as_pickled_bytes():
    from multiprocessing.reduction import ForkingPickler

    from pipeline.data.crops import decode_chunk
    from pipeline.data.decode_workers import _ring_chunk

    photos = [_photo(i) for i in range(8)]
    batch = _batch([photos[i % 8] for i in range(256)], index=3, prefix="/data/photos/train/n01440764/n01440764_1")
    for workers in (2, 16):  # 2: the largest chunk a 256-row batch has on a rank's processes
        decoder = Decoder(224, 3, train=True, seed=5, workers=workers)
        try:
            decoder.processes(batch)
            ring = decoder._ring
            tasks = decoder.ring_tasks(0, batch, ring.write_input(0, batch.rows), 256 // workers)
            assert len(tasks) == workers and sum(t.hi - t.lo for t in tasks) == 256
            # what the pool's call pipe carries per chunk: offsets and the draws' key, not ~75 KB of bytes a row
            sizes = [len(bytes(ForkingPickler.dumps((_ring_chunk, (t,))))) for t in tasks]
            assert max(sizes) < 10_000 < sum(len(c) for c in batch.rows[:, 0]) // workers, sizes
        finally:
            decoder.close()
    small = _batch(photos[:6], index=3, prefix="/photos/")
    decoder = Decoder(SIZE, 3, train=True, seed=5, workers=2)
    try:
        x = decoder.decode(small)
        assert decoder.handovers == {"ring": 1}
        ref = decode_chunk(photos[:6], list(small.rows[:, 1]), crop_draws(5, 3, 6), SIZE, 3)
        assert np.array_equal(x.permute(0, 2, 3, 1).numpy(), ref)
    finally:
        decoder.close()


def _one_worker(batches, **kw):
    return [Decoder(SIZE, 3, seed=7, workers=1, **kw).decode(b) for b in batches]


def test_batches_cycling_through_the_ring_keep_the_one_worker_pixels_and_a_kept_batch_never_changes():
    photos = [_photo(i) for i in range(12)]
    batches = [_batch([photos[(b * 5 + i) % 12] for i in range(5 if b < 9 else 3)], index=b) for b in range(10)]
    for train in (True, False):
        want = _one_worker(batches, train=train)
        decoder = Decoder(SIZE, 3, train=train, seed=7, workers=2)
        try:
            got, first = [], None
            for x, k in decoder.batches(((b, b.index) for b in batches), depth=2):
                got.append(x)
                if first is None:
                    first = x.clone()
            # 10 batches through 3 slots, the last one with fewer rows than a slot
            assert decoder.handovers == {"ring": 10} and decoder._ring.slots < len(batches)
            assert all(torch.equal(g, w) for g, w in zip(got, want)) and len(got) == 10
            assert torch.equal(got[0], first)  # the consumer's batch is its own, not a view of a slot decoded again
            again = [decoder.decode(b) for b in batches[:4]]  # and one at a time, after the stream
            assert all(torch.equal(g, w) for g, w in zip(again, want))
            assert sorted(decoder._ring._free) == [0, 1, 2]
        finally:
            decoder.close()


def test_a_batch_larger_than_a_slot_decodes_the_old_way_with_the_same_pixels():
    tiny = [_jpeg(COLOURS[i % 4], size=(40 + i, 30)) for i in range(20)]  # ~1 KB each: the input area's 1 MiB floor
    photos = [_photo(i) for i in range(20)]  # ~75 KB each: 1.5 MB, over the input area
    batches = [_batch(tiny, 0), _batch(photos, 1), _batch(tiny + tiny[:5], 2), _batch(photos[:10], 3)]
    assert sum(map(len, photos)) > 1 << 20 > sum(map(len, photos[:10]))
    want = _one_worker(batches, train=True)
    decoder = Decoder(SIZE, 3, train=True, seed=7, workers=2)
    try:
        got = [decoder.decode(b) for b in batches]
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert decoder.handovers == {"ring": 2, "pickled": 2}  # the photos' bytes, then more rows than a slot
        assert decoder._ring.rows == 20
    finally:
        decoder.close()


def test_a_corrupt_row_in_the_ring_is_named_and_the_decoder_goes_on_or_closes():
    good = [_photo(i) for i in range(6)]
    bad = good[2][: len(good[2]) // 3]
    decoder = Decoder(SIZE, 3, train=True, seed=7, workers=2)
    try:
        first = decoder.decode(_batch(good, 0))
        for b in range(4):  # more errors than slots: a failed batch gives its slot back
            with pytest.raises(RowDecodeError, match=r"row /bad/4\.jpg: not a decodable image"):
                decoder.decode(_batch(good[:4] + [bad] + good[5:], b + 1, prefix="/bad/"))
        with pytest.raises(RowDecodeError, match=r"row /none/1\.jpg: no image bytes"):  # no bytes: the old way
            decoder.decode(_batch([good[0], None, good[1]], 9, prefix="/none/"))
        assert torch.equal(decoder.decode(_batch(good, 0)), first)
        assert decoder.handovers == {"ring": 6, "pickled": 1}
    finally:
        decoder.close()
    # a stream that fails mid-way closes with batches still decoding in their slots, and the decoder decodes again
    items = [(_batch(good, b, prefix="/s/") if b != 2 else _batch([good[0], bad], b, prefix="/s/"), b)
             for b in range(6)]
    with pytest.raises(RowDecodeError, match=r"row /s/1\.jpg"):
        list(decoder.batches(iter(items), depth=2))
    decoder.close()
    assert torch.equal(decoder.decode(_batch(good, 0)), first)
    decoder.close()


def test_after_close_the_next_pass_decodes_in_worker_processes_again_forked_by_the_consumer():
    """close() ends a pass (the loader's close: a resumed stream's resume_at, a fit's teardown); the next pass must
    decode in worker processes again, not silently in the rank's threads. A decode thread that asks for them after
    close gets none (it decodes in its own thread), and the workers are forked by the consumer's call that starts
    them, not at a later submit from a decode thread."""
    good = [_photo(i) for i in range(6)]
    decoder = Decoder(SIZE, 3, train=True, seed=7, workers=2)
    try:
        first = decoder.decode(_batch(good, 0))
        decoder.close()
        assert decoder.submit_share(_batch(good, 1), 3) is None and decoder._procs is None  # a decode thread's ask
        assert torch.equal(decoder.decode(_batch(good, 0)), first)
        assert decoder.handovers == {"ring": 2}  # both passes through the worker processes' ring
    finally:
        decoder.close()
    fresh = Decoder(SIZE, 3, train=True, seed=7, workers=2)
    try:
        assert len(fresh.processes(_batch(good, 0))._processes) == 2  # forked in this call, in this thread
    finally:
        fresh.close()


def test_a_close_between_a_decode_threads_ask_and_its_submit_leaves_the_share_to_that_thread(monkeypatch):
    """close() can end the pass while a GPU decode thread is between `processes(start=False)` and its chunks' submit:
    the shut pool refuses them ("cannot schedule new futures after shutdown"). The share is then the thread's to
    decode (None), as for a thread that asks after close, not a RuntimeError in a closed pass."""
    good = [_photo(i) for i in range(6)]
    decoder = Decoder(SIZE, 3, train=True, seed=7, workers=2)
    try:
        decoder.decode(_batch(good, 0))  # the pass's processes and ring
        ring, tasks = decoder._ring, decoder.ring_tasks

        def close_then_tasks(*args, **kwargs):  # the consumer's close() lands after the slot is taken
            decoder.close()
            return tasks(*args, **kwargs)

        monkeypatch.setattr(decoder, "ring_tasks", close_then_tasks)
        assert decoder.submit_share(_batch(good, 1), 3) is None
        assert sorted(ring._free) == list(range(ring.slots))  # the slot it took is given back
        monkeypatch.undo()
        assert torch.equal(decoder.decode(_batch(good, 0)), Decoder(SIZE, 3, train=True, seed=7).decode(
            _batch(good, 0)))  # the next pass decodes in its processes again
        assert decoder.handovers == {"ring": 2}
    finally:
        decoder.close()


def test_a_close_under_a_consumers_pickled_shares_leaves_them_to_its_threads(monkeypatch):
    """close() from another thread can end the pass after `submit` got the processes and before its shares (a batch
    larger than the ring's slots goes pickled) reach them: each share is then decoded in the rank's thread, to the
    same pixels, not failed with "cannot schedule new futures after shutdown"."""
    good = [_photo(i) for i in range(6)]
    decoder = Decoder(SIZE, 3, train=True, seed=7, workers=2)
    try:
        decoder.decode(_batch(good[:3], 0))  # the pass's processes, and a ring of 3-row slots
        pool = decoder.pool

        def close_then_pool():  # the other thread's close() lands between the ask and the shares' submit
            decoder.close()
            return pool()

        monkeypatch.setattr(decoder, "pool", close_then_pool)
        got = decoder.decode(_batch(good, 1))  # 6 rows: more than a slot holds, so pickled
        monkeypatch.undo()
        assert torch.equal(got, Decoder(SIZE, 3, train=True, seed=7).decode(_batch(good, 1)))
        assert decoder.handovers == {"ring": 1, "pickled": 1}
    finally:
        decoder.close()


def test_a_decode_worker_killed_mid_batch_fails_the_batch_instead_of_hanging():
    import signal
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    batch = _batch([_photo(i) for i in range(48)])
    decoder = Decoder(224, 3, train=True, seed=0, workers=2)
    try:
        handle = decoder.submit(batch)
        pool = decoder.processes()
        pids = list(pool._processes)
        os.kill(pids[0], signal.SIGKILL)
        with ThreadPoolExecutor(1) as waiter:
            with pytest.raises(BrokenProcessPool):
                waiter.submit(decoder.result, handle).result(timeout=60)
        _gone_within(pids, 20)  # the pool ends the other workers too: nothing is left to hold the rank at its exit
        _pool_thread_ends_within(pool, 20)
    finally:
        decoder.close()


@pytest.mark.parametrize("fits_ring", [True, False])
def test_a_decode_worker_that_dies_on_a_row_is_named_with_the_row_and_its_signal(monkeypatch, fits_ring):
    """A worker killed while decoding a row (the host's out-of-memory killer, a crash inside libjpeg) stops the batch
    with an error that names that row's path and the signal, through the ring and the pickled way alike."""
    import signal
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    import pipeline.data.crops as crops
    from pipeline.data.decode_workers import DecodeWorkerDied

    real = crops._bytes_of_row

    def dying(content, path):  # in the forked worker: dies as a crash inside the decoder would, on that row
        if "evil" in str(path):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(content, path)

    monkeypatch.setattr(crops, "_bytes_of_row", dying)  # before the fork: the workers inherit it
    first = _batch([_jpeg((10 * i, 40, 90)) for i in range(8 if fits_ring else 2)], index=0)
    batch = _batch([_jpeg((10 * i, 40, 90)) for i in range(8)], index=3)
    batch.rows[6, 1] = "/t/evil.jpg"
    decoder = Decoder(SIZE, 3, train=True, seed=0, workers=2)
    try:
        decoder.decode(first)  # the ring is sized by the first batch: 2 rows leaves the 8-row batch to the pickled way
        handle = decoder.submit(batch)
        with ThreadPoolExecutor(1) as waiter:
            with pytest.raises(BrokenProcessPool) as err:
                waiter.submit(decoder.result, handle).result(timeout=60)
        assert decoder.handovers["ring" if fits_ring else "pickled"] >= 1
    finally:
        decoder.close()
    assert isinstance(err.value, DecodeWorkerDied)
    message = str(err.value)
    import re

    workers = re.findall(r"worker \d+ \(([^)]*)\) on row '([^']*)'", message)
    assert workers and workers[0] == ("killed by SIGKILL", "/t/evil.jpg"), message  # the one that died, first
    assert "'/t/evil.jpg' (batch 3, row 6)" in message
    assert all(how == "killed by SIGTERM" for how, _ in workers[1:]), message  # any other: the pool's own SIGTERM


def test_a_pool_broken_with_no_worker_dead_on_its_own_blames_no_row():
    """Where every worker found ended by the pool's own SIGTERM (the pool broke for another reason, chained as the
    cause), the error says no worker died on its own instead of naming their rows as the culprits; a worker that died
    on its own is named first, the SIGTERMs after it; one still running is left out."""
    from pipeline.data.decode_workers import Doing, died

    doing = Doing(3)
    doing.table[:] = [(101, 4, 7), (102, 4, 9), (103, -1, -1)]  # two on rows, one between tasks
    paths = {(4, 7): "/t/a.jpg", (4, 9): "/t/b.jpg"}
    sigterm = str(died(doing, lambda b, r: paths.get((b, r)), lambda pid: "killed by SIGTERM"))
    assert sigterm.startswith("the decode pool broke without a worker dying on its own"), sigterm
    assert "'/t/a.jpg'" in sigterm and "'/t/b.jpg'" in sigterm
    how = {101: "killed by SIGTERM", 102: "killed by SIGSEGV"}
    one = str(died(doing, lambda b, r: paths.get((b, r)), how.get))
    assert one.index("worker 102 (killed by SIGSEGV) on row '/t/b.jpg' (batch 4, row 9)") < one.index("worker 101"), one
    alive = str(died(doing, lambda b, r: paths.get((b, r)), {102: "exit code 1"}.get))
    assert "worker 102 (exit code 1)" in alive and "worker 101" not in alive, alive


def test_a_failed_batch_buffer_gives_its_ring_slot_back():
    """A batch's buffer that cannot be allocated (pinned memory refused, an interrupt) fails that batch and gives its
    slot back: the next batches still go through the ring, not the slower pickled way."""
    decoder = Decoder(SIZE, 3, train=False, seed=0, workers=2)
    real = decoder._empty
    failures = [3]

    def refused(n):
        if n and failures[0]:
            failures[0] -= 1
            raise RuntimeError("pinned memory refused")
        return real(n)

    decoder._empty = refused
    try:
        for i in range(3):
            handle = decoder.submit(_batch([_jpeg((30 * i, 40, 90)) for _ in range(6)], index=i))
            with pytest.raises(RuntimeError, match="pinned memory refused"):
                decoder.result(handle)
        ring = decoder._ring
        deadline = time.monotonic() + 20  # a slot frees once its chunks, still decoding, end
        while len(ring._free) < ring.slots and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(ring._free) == list(range(ring.slots))
        for i in range(3, 6):
            assert decoder.decode(_batch([_jpeg((30 * i, 40, 90)) for _ in range(6)], index=i)).shape[0] == 6
        assert decoder.handovers == {"ring": 6}
    finally:
        decoder.close()


@pytest.mark.parametrize("row_mb", [16, 64])
def test_a_first_batch_too_large_to_map_a_ring_for_decodes_without_it(caplog, row_mb):
    """A first batch whose ring the host cannot map (the kernel refuses one mapping larger than its memory and swap)
    is decoded all the same: a ring of its bytes once, or none (each batch's rows pickled to the workers), and the
    log says why, instead of a bare OSError from every submit. 256 rows refer to one object of `row_mb`: a batch of
    4 or 16 GB, whose ring asks 3 x 4 x that (on this 24 GB host: 16 maps a ring of its bytes once, 64 none)."""
    from pipeline.data.decode_workers import input_bytes

    huge = bytes(row_mb << 20)
    rows = np.empty((256, 2), dtype=object)
    rows[:, 0] = [huge] * 256
    rows[:, 1] = [f"/t/big{i}.jpg" for i in range(256)]
    decoder = Decoder(SIZE, 3, train=False, seed=0, workers=2)
    with caplog.at_level(logging.WARNING, logger="pipeline.data.decode"):
        ring = decoder._make_ring(EncodedBatch(rows, 0))
    used = input_bytes(rows)  # the bytes and the paths
    if ring is None:
        assert "decoding without the ring" in caplog.text
    elif ring.input_bytes < 4 * used:
        assert "could not be mapped" in caplog.text and ring.input_bytes == used
        assert ring.slots * ring.slot_bytes == 3 * (256 * SIZE * SIZE * 3 + used)
    else:
        assert ring.slots * ring.slot_bytes == 3 * (256 * SIZE * SIZE * 3 + 4 * used)  # overcommit allowed


def _gone_within(pids, seconds: float) -> None:
    """The processes `pids` ended (exited, reaped or not) within `seconds`. Never reaps them: they are the pool's
    children, and a pool whose child was reaped by someone else sees it alive forever (multiprocessing's poll takes
    ECHILD for "not started yet"), so its manager thread spins at full CPU and the interpreter's exit joins it for
    ever (psutil.wait_procs reaped them here, and a `make test` hung after its unit tests' summary)."""
    import psutil

    def running(pid: int) -> bool:
        proc = _process(pid)
        try:
            return proc is not None and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + seconds
    alive = [pid for pid in pids if running(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if running(pid)]
    assert not alive, f"decode workers still running after {seconds} s: {alive}"


def _pool_thread_ends_within(pool, seconds: float) -> None:
    """The broken pool's manager thread has ended: one left spinning keeps the interpreter from exiting."""
    thread = getattr(pool, "_executor_manager_thread", None)  # CPython's; None once it was joined
    if thread is not None:
        thread.join(timeout=seconds)
        assert not thread.is_alive(), f"the broken pool's manager thread still runs after {seconds} s"


def _process(pid: int):
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def test_a_decode_worker_ends_on_sigterm_though_the_rank_handles_sigterm():
    """A rank installs a Python SIGTERM handler (the graceful stop); its forked decode workers must not inherit it, or
    the SIGTERM with which a broken pool ends its workers leaves them running, and the rank waits for them at exit."""
    import signal

    seen = []
    old = signal.signal(signal.SIGTERM, lambda *_: seen.append(1))
    decoder = Decoder(64, 3, train=True, seed=0, workers=2)
    try:
        decoder.decode(_batch([_photo(i) for i in range(8)]))
        pool = decoder.processes()
        pids = list(pool._processes)
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        _gone_within(pids, 10)
        _pool_thread_ends_within(pool, 20)
    finally:
        signal.signal(signal.SIGTERM, old)
        decoder.close()
    assert not seen  # the signal went to the workers, not to this process


def test_the_converters_row_error_names_the_row_without_importing_torch_on_the_executor():
    """data.decode=convert decodes on Spark's Python workers: an undecodable row raises the RowDecodeError that names
    it (the driver lifts it out of Spark's error by its class name) from the ground layer, so a worker that meets one
    does not import torch to say so."""
    import subprocess
    import sys

    code = ("import sys, pyarrow as pa\n"
            "from pipeline.data.convert import decoded_rows\n"
            "b = pa.record_batch([pa.array([b'not an image']), pa.array([1]), pa.array([5]), pa.array(['/t/bad.jpg'])],"
            " names=['content', 'label_index', 'row_id', 'path'])\n"
            "try:\n    decoded_rows(b, 32, 1)\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc)\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.splitlines()[0].startswith("RowDecodeError row /t/bad.jpg: not a decodable image"), out
    assert out.splitlines()[-1] == "False", out
