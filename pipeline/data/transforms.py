"""Decoded pixels -> the normalised float tensors the model sees, shared by the reader workers and the served model."""
from __future__ import annotations

import numpy as np

from pipeline.data.crops import center_crop_decode
from pipeline.images import decode_image

# Images are normalised to roughly zero mean, unit variance with fixed constants so that the
# served model and the training loader agree without carrying statistics around.
PIXEL_MEAN = 0.5
PIXEL_STD = 0.5


def pixels_to_float(pixels: np.ndarray) -> np.ndarray:
    """uint8 (..., C, H, W) -> normalised float32 of the same shape."""
    return (pixels.astype(np.float32) * (1.0 / 255.0) - PIXEL_MEAN) / PIXEL_STD


def decode_batch(contents, size: int, channels: int, center_crop: bool = False) -> np.ndarray:
    """Decode a sequence of encoded images (pipeline.images, with its pixel bound) into one normalised float32 array
    (N, C, size, size). `center_crop`: the validation transform of a model whose ranks decoded its rows
    (pipeline.data.crops.center_crop_decode: the central VAL_CROP, resized), not the whole image resized."""
    out = np.empty((len(contents), channels, size, size), dtype=np.uint8)
    for i, content in enumerate(contents):
        out[i] = center_crop_decode(content, size, channels) if center_crop else decode_image(content, size, channels)
    return pixels_to_float(out)
