"""The image codec: encoded bytes -> header checked against a pixel bound -> uint8 pixels, for every decode path.

Ingest's validation, the training conversion, `predict`, the served model and the export's reference preprocessing
all open images here, so one bound protects them all from a decompression bomb: a small file that declares a huge
image (a 164 KB PNG of 13000x13000 pixels decodes to ~500 MB). PIL reads only the header when it opens a file; the
declared width x height is checked against the bound before any pixel is decoded. PIL's own guard only warns below
2 x its `Image.MAX_IMAGE_PIXELS` (~179 MP); nothing here relies on it.

Only the formats in ACCEPTED_FORMATS are ever opened: PIL is told to try those plugins and no other, so bytes of any
other format (EPS, whose plugin hands the sender's PostScript to Ghostscript; PSD, ICO, JPEG 2000, ...) are refused
as undecodable before any plugin but the accepted ones has read them.
"""
from __future__ import annotations

import contextlib
import io
import re
from typing import Any, Iterator, Tuple

import numpy as np

# The most pixels (width x height, as the header declares them) an image may have to be decoded: 64 MP is above
# every common camera (a 50 MP full-frame photo is 8192x6144) and bounds one decode to ~200 MB of RGB. An image over
# it is refused with TooManyPixelsError, never decoded. Callers may pass a different `max_pixels`.
MAX_PIXELS = 64_000_000

# The image formats PIL may open (passed to Image.open as `formats=`), those of ingest.extensions' default: JPEG and
# PNG (what cameras, scanners and datasets hold), GIF, BMP, TIFF (microscopes, scanners) and WebP. Plain raster
# codecs: no interpreter behind them (EPS/PS runs Ghostscript), none of PIL's rarely used, thinly tested parsers (PSD,
# ICO, JPEG 2000, DDS, TGA, PCX, ...). A camera's multi-picture JPEG (MPO) opens through the JPEG plugin: accepted.
# Anything else is an ImageDecodeError naming this list; the caller names the file or row.
ACCEPTED_FORMATS = ("JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP")


class ImageDecodeError(ValueError):
    """The bytes are not an image PIL can decode; the message says why (the caller adds the file or row)."""


class TooManyPixelsError(ImageDecodeError):
    """The image declares more pixels than the bound; it was not decoded. The message names its size."""


class RowDecodeError(ImageDecodeError):
    """A row's image cannot be decoded; the message names its path and why. The job stops: the table holds a row
    that ingest would not have written (another writer's, or bytes changed after ingest). Here, below the data layer,
    so that an executor converting rows raises it without importing torch."""


def _reason(exc: Exception) -> str:
    text = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", str(exc))
    if type(exc).__name__ == "UnidentifiedImageError":  # no accepted format's plugin took the bytes
        text = f"{text}; accepted formats: {', '.join(ACCEPTED_FORMATS)}"
    return f"not a decodable image ({type(exc).__name__}: {text})"


def check_pixels(width: int, height: int, max_pixels: int = MAX_PIXELS) -> None:
    """Raise TooManyPixelsError when `width` x `height` is over `max_pixels`."""
    pixels = int(width) * int(height)
    if pixels > max_pixels:
        bound = "pipeline.images.MAX_PIXELS" if max_pixels == MAX_PIXELS else "the caller's bound"
        raise TooManyPixelsError(
            f"too many pixels: the image declares {width}x{height} = {pixels:,} pixels ({pixels / 1e6:.1f} MP), over "
            f"the {max_pixels:,} ({bound}); not decoded (a decompression bomb, or a picture to downscale first)")


# JPEG frame header markers (SOF0-3, 5-7, 9-11, 13-15: baseline, extended, progressive, lossless, hierarchical,
# arithmetic): the segment that declares the frame's height, width and components
_SOF = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))
_STANDALONE = frozenset((0x01, *range(0xD0, 0xD8)))  # TEM, RST0-7: markers without a length


def is_jpeg(content: Any) -> bool:
    """A JPEG whole from its start (SOI) to its end (EOI), what the fast decoders are given (nvJPEG on the GPU,
    simplejpeg on the CPU). nvJPEG decodes a truncated or zero-padded stream without a word (seen on an H100: gray
    where the data stopped), where Pillow refuses it; so a row whose last marker is not EOI goes to Pillow, which
    decodes it or names it."""
    return (isinstance(content, (bytes, bytearray)) and content[:3] == b"\xff\xd8\xff"
            and content[-2:] == b"\xff\xd9")


def jpeg_frame(content) -> "Tuple[int, int, int] | None":
    """(width, height, components) that a JPEG's frame header (SOFn) declares, read by walking its segments from SOI,
    without PIL (a few microseconds, where PIL's open of a 400x350 photo costs ~25: the GPU decoder reads every row's
    header on the host before nvJPEG decodes the batch). None where the bytes are not a JPEG, or the walk meets
    anything unexpected before a frame header (scan data, a segment running past the end, a zero size): the caller
    then opens them with PIL, which decides and names what is wrong. No pixel is decoded here."""
    view = memoryview(content)
    end = len(view)
    if end < 4 or view[0] != 0xFF or view[1] != 0xD8:
        return None
    pos = 2
    while pos + 4 <= end:
        if view[pos] != 0xFF:
            return None
        marker = view[pos + 1]
        if marker == 0xFF:  # a fill byte before the marker
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        length = (view[pos + 2] << 8) | view[pos + 3]
        if length < 2 or pos + 2 + length > end:
            return None
        if marker in _SOF:
            if length < 8:
                return None
            height = (view[pos + 5] << 8) | view[pos + 6]
            width = (view[pos + 7] << 8) | view[pos + 8]
            components = view[pos + 9]
            return (width, height, components) if width and height else None
        if marker in (0xD8, 0xD9, 0xDA):  # SOI again, EOI or scan data before any frame header
            return None
        pos += 2 + length
    return None


@contextlib.contextmanager
def opened(content: bytes, max_pixels: int = MAX_PIXELS) -> Iterator["PIL.Image.Image"]:  # noqa: F821
    """The PIL image of `content` with only its header read, after its declared size passed `max_pixels`.

    Raises:
        TooManyPixelsError: the declared size is over the bound (nothing was decoded).
        ImageDecodeError: the bytes are not an image of ACCEPTED_FORMATS that PIL can open.
    """
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(content), formats=ACCEPTED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:  # over PIL's own, higher, limit
        raise TooManyPixelsError(f"too many pixels: {exc}; not decoded") from None
    except Exception as exc:  # PIL raises many types for bad data
        raise ImageDecodeError(_reason(exc)) from None
    with img:
        check_pixels(img.width, img.height, max_pixels)
        yield img


WIDE_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # 16-bit samples (PNG, TIFF) as Pillow opens them
WIDE_MAX = 65535


def to_mode(img: "PIL.Image.Image", mode: str) -> "PIL.Image.Image":  # noqa: F821
    """An opened image in `mode` ("L" or "RGB", 8 bits a sample): the one conversion of every decode path.

    16-bit samples (a 16-bit grayscale PNG or TIFF) are scaled to 8 bits (x 255 / 65535, rounded), where Pillow's own
    conversion clips them at 255 (a 16-bit picture came out almost all white). Floating-point pixels (mode F) and
    32-bit integers beyond 16 bits have no 8-bit reading to assume: ImageDecodeError names the mode."""
    from PIL import Image

    if img.mode == mode:
        return img
    if img.mode == "F":
        raise ImageDecodeError("floating-point pixels (mode F) have no 8-bit reading to assume; write the image "
                               "with 8 or 16 bits a sample")
    if img.mode in WIDE_MODES:
        wide = np.asarray(img)
        low, high = (int(wide.min()), int(wide.max())) if wide.size else (0, 0)
        if low < 0 or high > WIDE_MAX:
            raise ImageDecodeError(f"{img.mode} pixels from {low} to {high}: beyond 16 bits a sample, no 8-bit reading "
                                   "to assume")
        scaled = wide.astype(np.uint32)  # 65535 x 255 fits: one 4-byte copy (a 64 MP image: 256 MB), scaled in place
        scaled *= 255
        scaled += WIDE_MAX // 2
        scaled //= WIDE_MAX
        gray = Image.fromarray(scaled.astype(np.uint8))
        return gray if mode == "L" else gray.convert(mode)
    return img.convert(mode)


def inspect_image(content: bytes, max_pixels: int = MAX_PIXELS) -> Tuple[int, int, str]:
    """Return (width, height, mode) of an encoded image, decoding it fully to prove it is readable (a mode without an
    8-bit reading included: `to_mode`)."""
    with opened(content, max_pixels) as img:
        try:
            img.load()
        except Exception as exc:
            raise ImageDecodeError(_reason(exc)) from None
        if img.mode == "F" or img.mode in WIDE_MODES:
            to_mode(img, "L")
        return int(img.width), int(img.height), str(img.mode)


def decode_image(content: bytes, size: int, channels: int, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Decode encoded image bytes to a uint8 array of shape (channels, size, size)."""
    from PIL import Image

    with opened(content, max_pixels) as img:
        try:
            img = to_mode(img, "L" if channels == 1 else "RGB")
            if img.size != (size, size):
                img = img.resize((size, size), Image.BILINEAR)
            arr = np.asarray(img, dtype=np.uint8)
        except ImageDecodeError:
            raise
        except Exception as exc:
            raise ImageDecodeError(_reason(exc)) from None
    if channels == 1:
        arr = arr[None, :, :]
    else:
        arr = arr.transpose(2, 0, 1)
    return np.ascontiguousarray(arr)
