"""A large JPEG's crop decoded at a reduced scale (libjpeg's DCT scaling through Pillow's `draft`,
pipeline.data.crops): which scale a crop takes, the pixels against a full-size decode of the same crop, ImageNet-shaped
photos left exactly as before, a phone's MPO JPEG, grayscale and a truncated photo handled as at full size."""
from __future__ import annotations

import io

import numpy as np
import pytest

from pipeline.data.crops import (DRAFT_GAP, RowDecodeError, crop_draws, crop_hwc, decode_crop, draft_scale, resize_box,
                                 train_box, val_box)
from pipeline.images import ImageDecodeError, opened
from pipeline.lakehouse.sample_data import PHOTO_CLASSES, render_photo

LARGE = (2400, 1800)


@pytest.fixture(scope="module")
def large():
    return [render_photo(PHOTO_CLASSES[i], 3, i, size=LARGE)[0] for i in range(2)]


def _full_size(content: bytes, box, size: int, mode: str = "RGB") -> np.ndarray:
    """The reference: Pillow's decode of the whole image, then the same box resized and flipped by `resize_box` (what
    crop_hwc does for every image that is not decoded at a reduced scale)."""
    from PIL import Image

    arr = np.array(Image.open(io.BytesIO(content)).convert(mode))
    return resize_box(arr[:, :, None] if arr.ndim == 2 else arr, box, size)


def test_draft_scale_keeps_the_crop_at_least_the_gap_times_the_output():
    assert DRAFT_GAP == 2
    assert draft_scale(400, 350, 300, 280, 224) == 1  # ImageNet-shaped: never
    assert draft_scale(2400, 1800, 895, 1500, 224) == 1  # just under 2 x 2 x 224 on its shorter side
    assert draft_scale(2400, 1800, 896, 1500, 224) == 2
    assert draft_scale(4032, 3024, 2646, 2646, 224) == 4  # a phone photo's center crop: 661 px at 1/4
    assert draft_scale(4032, 3024, 3583, 3000, 224) == 4 and draft_scale(8000, 6000, 5000, 5000, 224) == 8
    assert draft_scale(40000, 30000, 30000, 30000, 224) == 8  # libjpeg's smallest scale
    assert draft_scale(4032, 3024, 3024, 3024, 32) == 8


def test_an_imagenet_shaped_photo_is_decoded_exactly_as_at_full_size():
    photo = render_photo(PHOTO_CLASSES[0], 3, 0)[0]
    with opened(photo) as img:
        w, h = img.size
    for box in (train_box(w, h, crop_draws(1, 0, 1)[0]), val_box(w, h)):
        assert np.array_equal(crop_hwc(photo, box, 224, 3), _full_size(photo, box, 224))


def test_a_large_photo_decodes_at_a_reduced_scale_within_a_level_or_two_of_full_size(large):
    from PIL import Image

    w, h = LARGE
    boxes = [val_box(w, h)] + [train_box(w, h, u) for u in crop_draws(4, 0, 6)]
    scales = [draft_scale(w, h, b[2], b[3], 224) for b in boxes]
    assert scales[0] == 2 and scales[1:].count(2) >= 2 and 1 in scales[1:], scales  # draws 4: both kinds of crop
    diffs = []
    for content in large:
        for box, scale in zip(boxes, scales):
            got = crop_hwc(content, box, 224, 3)
            assert got.shape == (224, 224, 3) and got.dtype == np.uint8
            diffs.append(np.abs(got.astype(int) - _full_size(content, box, 224).astype(int)))
            # a crop too small for it: the full-size decode, exactly; a drafted one: other pixels (it was taken)
            assert bool(diffs[-1].any()) == (scale > 1), (box, scale)
    every = np.concatenate([d.ravel() for d in diffs])
    assert every.mean() < 1.5 and np.percentile(every, 99) <= 8, (every.mean(), np.percentile(every, 99))
    img = Image.open(io.BytesIO(large[0]))  # what the decoder holds: a quarter of the pixels at 1/2
    img.draft(img.mode, (w // 2, h // 2))
    img.load()
    assert img.size == (w // 2, h // 2)


def test_a_phone_cameras_mpo_jpeg_decodes_at_a_reduced_scale_too(large):
    """A JPEG with a second picture after the first (MPO: what phone cameras write) opens as its first picture."""
    from PIL import Image

    first = Image.open(io.BytesIO(large[0]))
    buf = io.BytesIO()
    first.save(buf, format="MPO", save_all=True, append_images=[first.resize((600, 450))], quality=90)
    mpo = buf.getvalue()
    with opened(mpo) as img:
        assert img.format == "MPO" and img.size == LARGE
    box = val_box(*LARGE)
    got = crop_hwc(mpo, box, 224, 3)
    diff = np.abs(got.astype(int) - _full_size(mpo, box, 224).astype(int))
    assert diff.any() and diff.mean() < 1.5  # drafted (other pixels than the full-size decode), within a level


def test_grayscale_output_of_a_large_rgb_photo(large):
    box = val_box(*LARGE)
    got = crop_hwc(large[1], box, 224, 1)
    assert got.shape == (224, 224, 1)
    diff = np.abs(got.astype(int) - _full_size(large[1], box, 224, mode="L").astype(int))
    assert diff.mean() < 1.5


def test_a_truncated_large_photo_is_named_as_at_full_size(large):
    cut = large[0][: len(large[0]) // 2]
    with pytest.raises(ImageDecodeError, match="not a decodable image"):
        crop_hwc(cut, val_box(*LARGE), 224, 3)
    with pytest.raises(RowDecodeError, match=r"row /photos/big/7\.jpg: not a decodable image"):
        decode_crop(cut, "/photos/big/7.jpg", val_box(*LARGE), 224, 3)


def test_the_libjpeg_turbo_path_gives_pillows_pixels_and_pillow_takes_what_it_does_not(monkeypatch):
    """A colour JPEG to RGB and a grayscale one to L decode through simplejpeg, to exactly the pixels Pillow's decode
    gives (the crops equal with it turned off); a colour JPEG to grayscale, a CMYK JPEG, a PNG, a JPEG whose scan data
    libjpeg warns about and a truncated JPEG go to Pillow, whose conversion, pixels and error they keep."""
    from PIL import Image

    from pipeline.data import crops

    if crops._simplejpeg is None:
        pytest.skip("simplejpeg is not installed here: every image decodes through Pillow")
    photo = render_photo(PHOTO_CLASSES[2], 5, 1)[0]
    img = Image.open(io.BytesIO(photo))
    w, h = img.size

    def encoded(mode: str, fmt: str = "JPEG") -> bytes:
        buf = io.BytesIO()
        img.convert(mode).save(buf, format=fmt)
        return buf.getvalue()

    gray, cmyk, png = encoded("L"), encoded("CMYK"), encoded("RGB", "PNG")
    mid = len(photo) // 2  # scan data zeroed, the end (EOI) kept: libjpeg warns, Pillow decides
    damaged = photo[:mid] + bytes(2048) + photo[mid + 2048:]
    box = train_box(w, h, crop_draws(7, 0, 1)[0])
    assert draft_scale(w, h, box[2], box[3], 224) == 1  # decoded whole: the path under test
    cases = [(photo, 3), (gray, 1), (gray, 3), (photo, 1), (cmyk, 3), (png, 3), (damaged, 3)]
    fast = [crop_hwc(c, box, 224, ch) for c, ch in cases]
    calls = []
    real = crops._simplejpeg.decode_jpeg
    monkeypatch.setattr(crops._simplejpeg, "decode_jpeg", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = [crop_hwc(c, box, 224, ch) for c, ch in cases]
    assert len(calls) == 3  # the colour JPEG to RGB, the grayscale one to L, the damaged one (refused); not the rest
    monkeypatch.setattr(crops, "_simplejpeg", None)
    for (content, ch), got, twice in zip(cases, fast, again):
        assert got.shape == (224, 224, ch) and np.array_equal(got, twice)
        assert np.array_equal(got, crop_hwc(content, box, 224, ch)), ch  # Pillow alone: the same pixels
    with pytest.raises(ImageDecodeError, match="not a decodable image"):
        crop_hwc(photo[: len(photo) // 2], box, 224, 3)
