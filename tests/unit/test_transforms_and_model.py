"""Transforms, LR scaling and the networks (pure logic, no Spark)."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.data.batches import PixelsToTensor
from pipeline.data.transforms import decode_batch
from pipeline.images import ImageDecodeError, decode_image, inspect_image
from pipeline.model.module import scaled_lr
from pipeline.model.nets import build_network


def _png(arr: np.ndarray, mode: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, mode=mode).save(buf, format="PNG")
    return buf.getvalue()


def test_decode_resizes_and_converts_channels():
    rgb = np.zeros((10, 20, 3), np.uint8)
    rgb[..., 0] = 255
    png = _png(rgb, "RGB")
    assert inspect_image(png) == (20, 10, "RGB")
    grey = decode_image(png, 16, 1)
    assert grey.shape == (1, 16, 16) and grey.dtype == np.uint8
    col = decode_image(png, 8, 3)
    assert col.shape == (3, 8, 8) and col[0].min() == 255 and col[1].max() == 0


def test_bad_bytes_raise_clear_error():
    with pytest.raises(ImageDecodeError, match="not a decodable image") as err:
        inspect_image(b"definitely not a png")
    assert "BytesIO object at" not in str(err.value)


def test_pixels_to_tensor_matches_reference_decode():
    imgs = [np.random.RandomState(i).randint(0, 256, (12, 12), dtype=np.uint8) for i in range(5)]
    pngs = [_png(a, "L") for a in imgs]
    raw = np.array([decode_image(p, 12, 1).tobytes() for p in pngs], dtype=object)
    out = PixelsToTensor(1, 12)(raw)
    ref = decode_batch(pngs, 12, 1)
    assert out.shape == (5, 1, 12, 12) and out.dtype == torch.float32
    assert np.allclose(out.numpy(), ref)
    assert out.min() >= -1.0 and out.max() <= 1.0


def test_pixels_to_tensor_rejects_wrong_size():
    raw = np.array([bytes(10)], dtype=object)
    with pytest.raises(ValueError, match="image_size"):
        PixelsToTensor(1, 12)(raw)


@pytest.mark.parametrize("rule,expected", [("linear", 0.4), ("sqrt", 0.2), ("none", 0.1)])
def test_lr_scaling(rule, expected):
    assert scaled_lr(0.1, 4, rule) == pytest.approx(expected)


def test_lr_scaling_rejects_unknown():
    with pytest.raises(ValueError, match="train.lr_scaling"):
        scaled_lr(0.1, 2, "cubic")


@pytest.mark.parametrize("arch", ["cnn", "resnet"])
@pytest.mark.parametrize("size,channels", [(32, 1), (64, 3)])
def test_networks_shape(arch, size, channels):
    net = build_network(arch, channels, 7, width=8)
    assert net(torch.zeros(2, channels, size, size)).shape == (2, 7)
