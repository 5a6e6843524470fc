"""The GPU decode path's batched resize (pipeline.data.gpu_decode.resized_crops): each row's crop, scale and flip as two
matrix products must give what resizing that crop alone gives (torch's antialiased bilinear, Pillow's filter); a
batch is resized in chunks whose padding stays within a budget (resize_plan), with the same pixels in the same order
as one padded product over the whole batch gave. The GpuDecoder test runs where torchvision imports (.venv-vision)."""
import io

import pytest
import torch
import torch.nn.functional as F

from pipeline.data.gpu_decode import resample_weights, resized_crops


def _one(img, box, size):
    left, top, w, h, flip = box
    crop = img[None, :, top:top + h, left:left + w].to(torch.float32)
    res = F.interpolate(crop, size=(size, size), mode="bilinear", align_corners=False, antialias=True)[0]
    return (res.flip(-1) if flip else res).round().clamp(0, 255).to(torch.uint8)


def test_a_batch_resized_at_once_equals_each_crop_resized_alone():
    g = torch.Generator().manual_seed(3)
    images = [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8)
              for h, w in ((350, 400), (120, 90), (500, 333), (64, 64))]
    # shrinking (2x and more), growing (a small crop), a flipped box, the whole image, a box at the far corner
    boxes = [(10, 20, 300, 280, False), (5, 7, 40, 30, True), (0, 0, 333, 500, True), (32, 40, 32, 24, False)]
    out = resized_crops(images, boxes, 56)
    assert out.shape == (4, 3, 56, 56) and out.dtype == torch.uint8
    for k, (img, box) in enumerate(zip(images, boxes)):
        diff = (out[k].int() - _one(img, box, 56).int()).abs()
        assert int(diff.max()) <= 1, (k, int(diff.max()))


def test_each_output_reads_only_its_own_crop_and_its_weights_sum_to_one():
    w = resample_weights(torch.tensor([10.0, 0.0]), torch.tensor([30.0, 7.0]), 8, 50)
    assert torch.allclose(w.sum(-1), torch.ones(2, 8))
    assert float(w[0, :, :10].abs().sum()) == 0 and float(w[0, :, 40:].abs().sum()) == 0
    assert float(w[1, :, 7:].abs().sum()) == 0


def test_the_cpu_paths_resize_matches_the_gpu_paths_batched_one():
    """crops.resize_box (each CPU decode worker's resize) and resized_crops (the GPU path's) resize the same crop the
    same way: within a level, so decode=cpu and decode=gpu differ only by their JPEG decoders."""
    import numpy as np

    from pipeline.data.crops import resize_box

    g = torch.Generator().manual_seed(5)
    images = [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8) for h, w in ((350, 400), (90, 120))]
    boxes = [(10, 20, 300, 280, True), (5, 7, 40, 30, False)]
    gpu = resized_crops(images, boxes, 56)
    for k, (img, box) in enumerate(zip(images, boxes)):
        cpu = resize_box(np.ascontiguousarray(img.permute(1, 2, 0).numpy()), box, 56)
        diff = (torch.from_numpy(cpu).permute(2, 0, 1).int() - gpu[k].int()).abs()
        assert cpu.shape == (56, 56, 3) and int(diff.max()) <= 1, (k, int(diff.max()))


# the reviewer's batch: one tall and one wide strip among small squares (one padded product: a 1000x blow-up)
STRIPS = [(3000, 40), (40, 3000)] + [(40, 40)] * 30


def _whole_batch_at_once(images, boxes, size):
    """The resize before chunking: every image padded to the batch's tallest and widest, one pair of products."""
    channels = images[0].shape[0]
    height, width = max(int(i.shape[1]) for i in images), max(int(i.shape[2]) for i in images)
    padded = torch.zeros((len(images), channels, height, width), dtype=torch.uint8)
    for k, img in enumerate(images):
        padded[k, :, :img.shape[1], :img.shape[2]] = img
    box = torch.tensor([b[:4] for b in boxes], dtype=torch.float32)
    rows = resample_weights(box[:, 1], box[:, 3], size, height)
    cols = resample_weights(box[:, 0], box[:, 2], size, width)
    flip = torch.tensor([bool(b[4]) for b in boxes])
    cols = torch.where(flip[:, None, None], cols.flip(1), cols)
    out = rows[:, None] @ padded.to(torch.float32) @ cols[:, None].transpose(-1, -2)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def _mixed_batch(shapes, seed=1):
    g = torch.Generator().manual_seed(seed)
    images, boxes = [], []
    for h, w in shapes:
        images.append(torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8))
        bw, bh = int(torch.randint(1, w + 1, (1,), generator=g)), int(torch.randint(1, h + 1, (1,), generator=g))
        left = int(torch.randint(0, w - bw + 1, (1,), generator=g))
        top = int(torch.randint(0, h - bh + 1, (1,), generator=g))
        boxes.append((left, top, bw, bh, bool(torch.randint(0, 2, (1,), generator=g))))
    return images, boxes


def _padded_sizes(monkeypatch):
    """The element counts of the padded batches the resize allocates from here on (it pads with torch.zeros)."""
    sizes, zeros = [], torch.zeros

    def spy(*args, **kwargs):
        t = zeros(*args, **kwargs)
        sizes.append(t.numel())
        return t

    monkeypatch.setattr(torch, "zeros", spy)
    return sizes


def test_a_mixed_batch_resized_in_chunks_gives_what_one_padded_product_gave_in_the_batchs_order(monkeypatch):
    import pipeline.data.gpu_decode as gpu_decode
    from pipeline.data.gpu_decode import resize_plan

    shapes = [(350, 400), (120, 90), (500, 333), (64, 64), (40, 600), (600, 40), (333, 500), (90, 120)] * 3
    images, boxes = _mixed_batch(shapes)
    monkeypatch.setattr(gpu_decode, "RESIZE_PIXELS", 200_000)
    for size in (16, 56):
        chunks = resize_plan(shapes, size)
        assert len(chunks) > 3 and sorted(sum(chunks, [])) == list(range(len(shapes)))
        assert any(c != list(range(c[0], c[-1] + 1)) for c in chunks)  # the rows go back to their places
        assert torch.equal(resized_crops(images, boxes, size), _whole_batch_at_once(images, boxes, size)), size


def test_the_padded_batch_stays_within_the_budget_for_strips_among_small_squares(monkeypatch):
    """The reviewer's mixed batch at 1/10 of its sides: the padded batches, counted where they are allocated, stay
    within the budget (one padded product over the whole batch took 32 x 300 x 300 pixels), the pixels unchanged."""
    import pipeline.data.gpu_decode as gpu_decode

    shapes = [(h // 10 if h > 40 else 8, w // 10 if w > 40 else 8) for h, w in STRIPS]
    images, boxes = _mixed_batch(shapes, seed=2)
    expected = _whole_batch_at_once(images, boxes, 16)
    budget = 20_000
    monkeypatch.setattr(gpu_decode, "RESIZE_PIXELS", budget, raising=False)
    sizes = _padded_sizes(monkeypatch)
    out = resized_crops(images, boxes, 16)
    assert sizes and max(sizes) <= 3 * budget, (max(sizes), 3 * budget)
    assert torch.equal(out, expected)


def test_the_resize_plan_bounds_every_chunks_padding_and_puts_an_oversized_image_alone():
    from pipeline.data.gpu_decode import RESIZE_CHUNK, RESIZE_PIXELS, resize_plan

    def padded(chunk, shapes, size):
        return len(chunk) * (max(shapes[i][0] for i in chunk) + size) * max(shapes[i][1] for i in chunk)

    phones = [(4032, 3024) if k % 3 else (3024, 4032) for k in range(64)]  # portrait and landscape phone photos
    imagenet = [(375, 500), (500, 375), (333, 500), (500, 500)] * 64
    for shapes in (STRIPS, phones, imagenet):
        chunks = resize_plan(shapes, 224)
        assert sorted(sum(chunks, [])) == list(range(len(shapes)))
        assert all(c == sorted(c) and len(c) <= RESIZE_CHUNK for c in chunks)
        assert all(padded(c, shapes, 224) <= RESIZE_PIXELS or len(c) == 1 for c in chunks)
    assert [len(c) for c in resize_plan(phones, 224)] == [1] * 64  # each is 13 M positions: alone
    assert len(resize_plan([(500, 500)] * 256, 224)) == 4  # 64 ImageNet-sized photos a chunk, as before
    assert resize_plan([(40, 40)] * 5, 224) == [[0, 1, 2, 3, 4]]  # one chunk, in order
    assert resize_plan([(10, 10), (9000, 9000), (10, 10)], 16, budget=50_000) == [[0, 2], [1]]
    assert resize_plan([], 16) == []


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
def test_the_gpu_decoder_resizes_mixed_photos_in_chunks_within_the_budget(monkeypatch):
    """GpuDecoder on torchvision's CPU decoder: a batch of tall, wide and small JPEGs resized in bounded chunks gives
    the same tensor as with a budget that holds the whole batch in one chunk."""
    from PIL import Image

    import pipeline.data.gpu_decode as gpu_decode
    from pipeline.data.decode import EncodedBatch

    try:
        gpu_decode.import_decode_jpeg()
    except ImportError as exc:
        pytest.skip(f"the GPU path's code needs torchvision (run in .venv-vision): {exc}")
    import numpy as np

    contents = []
    for k, (w, h) in enumerate([(300, 16), (16, 300)] + [(24, 24)] * 10):
        buf = io.BytesIO()
        Image.new("RGB", (w, h), (20 * k % 256, 90, 200 - 15 * k)).save(buf, format="JPEG", quality=90)
        contents.append(buf.getvalue())
    rows = np.empty((len(contents), 2), dtype=object)
    rows[:, 0] = contents
    rows[:, 1] = [f"/p/{i}.jpg" for i in range(len(contents))]
    monkeypatch.setattr(gpu_decode, "RESIZE_PIXELS", 10 ** 9, raising=False)
    whole = gpu_decode.GpuDecoder(16, 3, train=True, seed=3, device="cpu").decode(EncodedBatch(rows, 2))
    budget = 10_000
    monkeypatch.setattr(gpu_decode, "RESIZE_PIXELS", budget)
    sizes = _padded_sizes(monkeypatch)
    chunked = gpu_decode.GpuDecoder(16, 3, train=True, seed=3, device="cpu").decode(EncodedBatch(rows, 2))
    assert sizes and max(sizes) <= 3 * budget, (max(sizes), 3 * budget)
    assert torch.equal(chunked, whole)
