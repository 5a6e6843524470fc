"""One row's CPU decode in the ImageNet recipe: the crop boxes (random resized crop and flip for training, the central
crop for validation) and the decode of a box to a uint8 square (simplejpeg or Pillow, then torch's resize);
`decode_chunk` is a decode worker process's whole task (pipeline.data.decode). No tensor crosses a process: the rows
go back as numpy."""
from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.images import (MAX_PIXELS, ImageDecodeError, RowDecodeError, is_jpeg, jpeg_frame, opened,  # noqa: F401
                             to_mode)

try:  # libjpeg-turbo straight into numpy (a dependency; without it Pillow decodes every image, to the same pixels)
    import simplejpeg as _simplejpeg
except ImportError:  # pragma: no cover - an install without it (an old GPU bundle)
    _simplejpeg = None

DECODE_MODES = ("convert", "cpu", "gpu", "auto")
CROP_SCALE = (0.08, 1.0)  # RandomResizedCrop's share of the image's area ...
CROP_RATIO = (3 / 4, 4 / 3)  # ... and its aspect ratio range (torchvision's defaults, the ImageNet recipe)
CROP_ATTEMPTS = 10  # boxes tried before the central fallback, as torchvision does
VAL_CROP = 0.875  # validation: the central 224/256 of the shorter side
DRAFT_GAP = 2  # a JPEG is decoded at 1/2, 1/4 or 1/8 scale (DCT scaling) only while its crop keeps at least this
#                many times the output size at that scale (Pillow's thumbnail keeps the same gap): the resize after it
#                still averages over 2+ pixels, so the pixels stay within a level or two of a full decode's
DRAWS = 2 * CROP_ATTEMPTS + 3  # uniform draws per row: (area, log aspect) per attempt, top, left, flip


# ----------------------------------------------------------------------------------------------------------- crops
def crop_draws(seed: int, batch_index: int, n: int) -> np.ndarray:
    """(n, DRAWS) uniform draws in [0, 1) for batch `batch_index` of the stream seeded `seed`."""
    return np.random.default_rng([int(seed), int(batch_index)]).random((n, DRAWS))


def train_box(width: int, height: int, u: Sequence[float]) -> Tuple[int, int, int, int, bool]:
    """(left, top, box width, box height, flip) of a random resized crop from one row's draws `u` (torchvision's
    RandomResizedCrop: up to CROP_ATTEMPTS boxes of a random area and aspect; else the whole image's central box of
    an aspect within CROP_RATIO)."""
    area = width * height
    log_lo, log_hi = math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1])
    for a in range(CROP_ATTEMPTS):
        target = area * (CROP_SCALE[0] + (CROP_SCALE[1] - CROP_SCALE[0]) * u[2 * a])
        aspect = math.exp(log_lo + (log_hi - log_lo) * u[2 * a + 1])
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = min(height - h, int(u[-3] * (height - h + 1)))
            left = min(width - w, int(u[-2] * (width - w + 1)))
            return left, top, w, h, bool(u[-1] < 0.5)
    ratio = width / height
    if ratio < CROP_RATIO[0]:
        w, h = width, int(round(width / CROP_RATIO[0]))
    elif ratio > CROP_RATIO[1]:
        h, w = height, int(round(height * CROP_RATIO[1]))
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h, bool(u[-1] < 0.5)


def val_box(width: int, height: int) -> Tuple[int, int, int, int, bool]:
    """(left, top, side, side, no flip): the central square of VAL_CROP of the shorter side, what "resize the shorter
    side to size / VAL_CROP, then center crop size" takes from the image."""
    side = max(1, int(round(min(width, height) * VAL_CROP)))
    return (width - side) // 2, (height - side) // 2, side, side, False


def _bytes_of_row(content: Any, path: Any) -> None:
    if not isinstance(content, (bytes, bytearray, memoryview)):
        raise RowDecodeError(f"row {path}: no image bytes ({type(content).__name__})")


def header(content: Any, path: Any, max_pixels: int) -> Tuple[int, int, str]:
    """(width, height, format) from the row's header alone, within the pixel bound; RowDecodeError names the row."""
    _bytes_of_row(content, path)
    try:
        with opened(bytes(content), max_pixels) as img:
            return int(img.width), int(img.height), str(img.format)
    except ImageDecodeError as exc:
        raise RowDecodeError(f"row {path}: {exc}") from None


def draft_scale(width: int, height: int, box_w: int, box_h: int, size: int) -> int:
    """The JPEG scale (1, 2, 4 or 8: decode at 1/scale) for a crop of `box_w` x `box_h` of a `width` x `height` image
    resized to `size`: the largest that keeps the crop at least DRAFT_GAP x `size` on its shorter side."""
    scale = 1
    while scale < 8 and min(box_w, box_h) >= 2 * scale * DRAFT_GAP * size:
        scale *= 2
    return scale if width // scale and height // scale else 1


def _drafted(img: Any, box: Tuple[int, int, int, int, bool], size: int) -> float:
    """A JPEG whose crop is large against `size` is set to decode at a reduced scale (libjpeg's DCT scaling, Pillow's
    `draft`): a 4032x3024 photo's crop to 224 px decodes at 1/4 in about 0.6 of the time, and a worker holds a
    sixteenth of its pixels. Returns the scale the decoder took (1: full size; any other format, or a crop too small
    for it)."""
    # MPO: a JPEG with more pictures after the first (phone cameras write them), which Pillow opens as its first
    wanted = draft_scale(img.width, img.height, box[2], box[3], size) if img.format in ("JPEG", "MPO") else 1
    if wanted == 1:
        return 1.0
    width = img.width
    got = img.draft(img.mode, (img.width // wanted, img.height // wanted))  # None: a JPEG it cannot scale
    return 1.0 if got is None else width / got[1][2]


def _jpeg_pixels(content: bytes, width: int, height: int, channels: int) -> Optional[np.ndarray]:
    """A whole JPEG of the channels' components (3: colour to RGB, 1: grayscale to L) decoded straight into an
    (h, w, channels) array by libjpeg-turbo through simplejpeg: the same pixels as Pillow's decode (the same library,
    accurate DCT, fancy upsampling), in ~0.75 of its time (no row-by-row unpacking into Pillow's 4-byte pixels, no
    copy out of it); called only where `_fast_jpeg` found simplejpeg and the frame. None where Pillow decodes it
    instead: bytes libjpeg warns about (`strict`: Pillow then decides, as it always did, whether the row decodes)."""
    try:
        out = _simplejpeg.decode_jpeg(content, colorspace="GRAY" if channels == 1 else "RGB", strict=True)
    except Exception:  # noqa: BLE001  # Pillow's decode names what is wrong, or decodes it
        return None
    return out if out.shape[:2] == (height, width) else None


def _fast_jpeg(content: Any, channels: int, max_pixels: int) -> Optional[Tuple[int, int]]:
    """(width, height) of a whole JPEG (`images.is_jpeg`) of the channels' components within the pixel bound, from its
    frame header alone (`images.jpeg_frame`, ~1 us where Pillow's open costs ~35); None: Pillow opens it (another
    format or mode, a CMYK JPEG, a header it cannot walk, or over the bound, which `opened` names)."""
    if _simplejpeg is None or not is_jpeg(content):
        return None
    frame = jpeg_frame(content)
    if frame is None or frame[2] != (1 if channels == 1 else 3) or frame[0] * frame[1] > max_pixels:
        return None
    return frame[0], frame[1]


def resize_box(pixels: np.ndarray, box: Tuple[int, int, int, int, bool], size: int) -> np.ndarray:
    """The crop `box` (left, top, width, height, flip) of an (h, w, channels) uint8 image resized to `size` square
    with torch's antialiased bilinear filter (its uint8 kernel, channels_last: ~150 us a photo on one core, where
    Pillow's `resize(box=)` took ~590 us) and flipped: uint8 (size, size, channels). The crop alone is resized, the
    filter's window cut at its edges, as the GPU path's batched resize does (gpu_decode.resample_weights)."""
    left, top, w, h, flip = box
    crop = torch.from_numpy(pixels[top:top + h, left:left + w]).permute(2, 0, 1).unsqueeze(0)
    out = F.interpolate(crop.contiguous(memory_format=torch.channels_last), size=(size, size), mode="bilinear",
                        antialias=True, align_corners=False)[0].permute(1, 2, 0)  # a view: (size, size, channels)
    return (out.flip(1) if flip else out).numpy()


def crop_hwc(content: bytes, box: Tuple[int, int, int, int, bool], size: int, channels: int,
             max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """One image: decode, resize `box` (left, top, width, height, flip) to `size` square (antialiased bilinear),
    flip; uint8 (size, size, channels). `crop_of` with a box known before the header is read."""
    return crop_of(content, lambda _w, _h: box, size, channels, max_pixels)


def crop_of(content: bytes, box_of: Callable[[int, int], Tuple[int, int, int, int, bool]], size: int,
            channels: int, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """One image, its header read once: the box `box_of(width, height)` (left, top, width, height, flip) resized to
    `size` square (antialiased bilinear) and flipped; uint8 (size, size, channels), NHWC rows for the decoders'
    batches (no per-image transpose). A whole JPEG of the channels' components has its size from its frame header
    and decodes through simplejpeg (`_fast_jpeg`, `_jpeg_pixels`); anything else opens through Pillow
    (`images.opened`: the format allow-list and the pixel bound) and decodes there, converted once to the channels'
    mode. The box is resized by `resize_box`. A JPEG whose box is at least 2 x DRAFT_GAP x `size` on its shorter side
    decodes at a reduced scale first (`_drafted`; ImageNet-shaped photos, ~400x350 to 224 px, never do); its box is
    then fractional at that scale, and Pillow's `resize(box=)` takes it as it is. Raises ImageDecodeError saying why
    (no row named)."""
    from PIL import Image

    fast = _fast_jpeg(content, channels, max_pixels)
    if fast is not None:
        box = box_of(*fast)
        if draft_scale(fast[0], fast[1], box[2], box[3], size) == 1:
            pixels = _jpeg_pixels(content, fast[0], fast[1], channels)
            if pixels is not None:
                return resize_box(pixels, box, size)
    mode = "L" if channels == 1 else "RGB"
    try:
        with opened(bytes(content), max_pixels) as img:
            box = box_of(int(img.width), int(img.height))
            left, top, w, h, flip = box
            s = _drafted(img, box, size)
            if s != 1.0:
                img = to_mode(img, mode)
                out = img.resize((size, size), Image.BILINEAR, box=(left / s, top / s, (left + w) / s, (top + h) / s))
                arr = np.asarray(out.transpose(Image.FLIP_LEFT_RIGHT) if flip else out, dtype=np.uint8)
                return arr[:, :, None] if channels == 1 else arr
            pixels = np.array(to_mode(img, mode), dtype=np.uint8)
    except ImageDecodeError:
        raise
    except Exception as exc:  # Pillow raises many types for bad data (OSError: truncated, SyntaxError, ...)
        raise ImageDecodeError(f"not a decodable image ({type(exc).__name__}: {exc})") from None
    return resize_box(pixels if pixels.ndim == 3 else pixels[:, :, None], box, size)


def crop_pixels(content: bytes, box: Tuple[int, int, int, int, bool], size: int, channels: int,
                max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """`crop_hwc` as uint8 (channels, size, size). Raises ImageDecodeError saying why (no row named)."""
    return crop_hwc(content, box, size, channels, max_pixels).transpose(2, 0, 1)


def decode_crop(content: bytes, path: Any, box: Tuple[int, int, int, int, bool], size: int, channels: int,
                max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """One row: `crop_hwc` (uint8 (size, size, channels)), a RowDecodeError naming `path` when it cannot."""
    try:
        return crop_hwc(content, box, size, channels, max_pixels)
    except ImageDecodeError as exc:
        raise RowDecodeError(f"row {path}: {exc}") from None


def center_crop_decode(content: bytes, size: int, channels: int, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """The validation transform of one image (the central VAL_CROP of the shorter side, resized to `size`): what a
    model trained with data.decode=cpu|gpu|auto sees of an image at evaluation, for the served model, the promotion
    gate and the preprocessing contract to do the same. Raises ImageDecodeError saying why."""
    try:
        with opened(bytes(content), max_pixels) as img:
            width, height = img.width, img.height
    except ImageDecodeError:
        raise
    except Exception as exc:
        raise ImageDecodeError(f"not a decodable image ({type(exc).__name__}: {exc})") from None
    return crop_pixels(content, val_box(width, height), size, channels, max_pixels)


def boxes_for(sizes: Sequence[Tuple[int, int]], train: bool, seed: int, batch_index: int,
              rows: Optional[int] = None) -> List[Tuple]:
    """The crop box of every row of a batch, from the rows' (width, height) and the batch's draws. `rows`: the
    batch's row count where `sizes` are its first rows only (default: all of them)."""
    if not train:
        return [val_box(w, h) for w, h in sizes]
    draws = crop_draws(seed, batch_index, len(sizes) if rows is None else rows)
    return [train_box(w, h, draws[i]) for i, (w, h) in enumerate(sizes)]


def decode_chunk(contents: Sequence[Any], paths: Sequence[Any], draws: Optional[np.ndarray], size: int, channels: int,
                 max_pixels: int = MAX_PIXELS, out: Optional[np.ndarray] = None,
                 on_row: Optional[Callable[[int], None]] = None) -> np.ndarray:
    """Rows of one batch -> uint8 (k, size, size, channels), each row's header read once for its box and its decode
    (a decode worker's whole task), into `out` when given. `draws`: those rows' crop_draws (training), None: the
    central crop. `on_row(i)`: called before row i is decoded (a worker notes where it is). Raises RowDecodeError
    naming a row."""
    if out is None:
        out = np.empty((len(contents), size, size, channels), dtype=np.uint8)
    for i, (content, path) in enumerate(zip(contents, paths)):
        if on_row is not None:
            on_row(i)
        _bytes_of_row(content, path)
        u = draws[i] if draws is not None else None
        try:
            out[i] = crop_of(content, val_box if u is None else (lambda w, h, u=u: train_box(w, h, u)), size,
                             channels, max_pixels)
        except ImageDecodeError as exc:
            raise RowDecodeError(f"row {path}: {exc}") from None
    return out
