"""Image transforms shared by conversion, the reader workers and the served model: bytes -> pixels -> tensors."""
from __future__ import annotations

import io
import re
from typing import Tuple

import numpy as np

# Images are normalised to roughly zero mean, unit variance with fixed constants so that the
# served model and the training loader agree without carrying statistics around.
PIXEL_MEAN = 0.5
PIXEL_STD = 0.5


class ImageDecodeError(ValueError):
    """The bytes are not an image PIL can decode."""


def _reason(exc: Exception) -> str:
    text = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", str(exc))
    return f"not a decodable image ({type(exc).__name__}: {text})"


def inspect_image(content: bytes) -> Tuple[int, int, str]:
    """Return (width, height, mode) of an encoded image, decoding it fully to prove it is readable."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(content)) as img:
            img.load()
            return int(img.width), int(img.height), str(img.mode)
    except Exception as exc:  # PIL raises many types for bad data
        raise ImageDecodeError(_reason(exc)) from None


def decode_image(content: bytes, size: int, channels: int) -> np.ndarray:
    """Decode encoded image bytes to a uint8 array of shape (channels, size, size)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(content)) as img:
            img = img.convert("L" if channels == 1 else "RGB")
            if img.size != (size, size):
                img = img.resize((size, size), Image.BILINEAR)
            arr = np.asarray(img, dtype=np.uint8)
    except Exception as exc:
        raise ImageDecodeError(_reason(exc)) from None
    if channels == 1:
        arr = arr[None, :, :]
    else:
        arr = arr.transpose(2, 0, 1)
    return np.ascontiguousarray(arr)


def pixels_to_float(pixels: np.ndarray) -> np.ndarray:
    """uint8 (..., C, H, W) -> normalised float32 of the same shape."""
    return (pixels.astype(np.float32) * (1.0 / 255.0) - PIXEL_MEAN) / PIXEL_STD


def decode_batch(contents, size: int, channels: int) -> np.ndarray:
    """Decode a sequence of encoded images into one normalised float32 array (N, C, size, size)."""
    out = np.empty((len(contents), channels, size, size), dtype=np.uint8)
    for i, content in enumerate(contents):
        out[i] = decode_image(content, size, channels)
    return pixels_to_float(out)
