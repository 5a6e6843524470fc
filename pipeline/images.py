"""The image codec: encoded bytes -> header checked against a pixel bound -> uint8 pixels, for every decode path.

Ingest's validation, the training conversion, `predict`, the served model and the export's reference preprocessing
all open images here, so one bound protects them all from a decompression bomb: a small file that declares a huge
image (a 164 KB PNG of 13000x13000 pixels decodes to ~500 MB). PIL reads only the header when it opens a file; the
declared width x height is checked against the bound before any pixel is decoded. PIL's own guard only warns below
2 x its `Image.MAX_IMAGE_PIXELS` (~179 MP); nothing here relies on it.

Only the formats in ACCEPTED_FORMATS are ever opened: PIL is told to try those plugins and no other, so bytes of any
other format (EPS, whose plugin hands the sender's PostScript to Ghostscript; PSD, ICO, JPEG 2000, ...) are refused
as undecodable before any plugin but the accepted ones has read them.

A JPEG of more than MAX_JPEG_SCANS scans is refused before it is decoded (TooManyScansError): a decoder makes a pass
over the whole image for each scan of a progressive JPEG, however few bytes the scan holds, so a small file with its
last scan repeated thousands of times (a scan bomb) costs seconds within the pixel bound. Every decode path counts
them: `opened` (PIL: ingest's validation, the CPU decode, the served model) refuses, and `jpeg_frame` (the fast
paths' header: simplejpeg, nvJPEG, the served model's pixel budget) answers None, which sends the row to `opened`.
"""
from __future__ import annotations

import contextlib
import io
import re
from typing import Any, Iterator, Optional, Tuple

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


class TooManyScansError(ImageDecodeError):
    """The JPEG holds more scans than MAX_JPEG_SCANS; it was not decoded. The message names the count."""


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
# ... of a sequential frame (baseline, extended, lossless; Huffman or arithmetic): when its first scan holds every
# component, it is the only one: libjpeg (Pillow, simplejpeg) refuses a second ("Didn't expect more than one scan")
_SEQUENTIAL_SOF = frozenset((0xC0, 0xC1, 0xC3, 0xC9, 0xCB))
_STANDALONE = frozenset((0x01, *range(0xD0, 0xD8)))  # TEM, RST0-7: markers without a length
_SOS, _EOI, _SOI = 0xDA, 0xD9, 0xD8
# The next marker after entropy-coded data (or bytes a decoder skips): 0xFF then a byte that is neither a stuffed
# zero (0xFF00, a data byte 0xFF) nor another 0xFF (a fill byte: the marker follows it). RST0-7 match, and are
# skipped as markers without a length. The search runs in C: ~40 us for a 100 KB progressive photo.
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xff]")

# The most scans (SOS segments) a JPEG may have to be decoded. A decoder makes a pass over the whole frame's
# coefficients for each scan of a progressive JPEG, whatever the scan's size: a refinement scan of a few bytes (an
# end-of-band run over every block) costs as much as one of megabytes, so a 94 KB file declaring 4 MP with its last
# scan repeated 5,000 times took 13 s to decode. Real encoders write few: a baseline JPEG one (or one per component
# when they are not interleaved), libjpeg's progressive script 10 for colour and 6 for grayscale (18 for CMYK),
# mozjpeg's and jpegli's about as many, Photoshop's 3 to 5. 100 is five times the most of those, and bounds a file's
# decode to 100 passes over its pixels (that 4 MP file cut to 100 scans: 0.28 s, where a 1.4 MB 4 MP grayscale photo
# of libjpeg's 6 scans takes 0.06 s); libjpeg-turbo's djpeg offers the same refusal (-maxscans N). A JPEG over it is
# refused with TooManyScansError, never decoded.
MAX_JPEG_SCANS = 100
# The count a refusal names stops here ("more than 1,000"): walking a file of a million tiny scans would cost
# ~0.4 s of segments; stopped, the walk of any file costs at most this many of them (~0.4 ms).
SCAN_COUNT_CAP = 1_000


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
    then opens them with PIL, which decides and names what is wrong. None, too, for a JPEG of more than
    MAX_JPEG_SCANS scans (`jpeg_scans`: tens of microseconds for a progressive photo, nothing more for a baseline
    one): `opened` refuses it, naming the count, so no fast path decodes it. No pixel is decoded here."""
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
            if not (width and height) or jpeg_scans(content, stop_after=MAX_JPEG_SCANS) > MAX_JPEG_SCANS:
                return None
            return width, height, components
        if marker in (0xD8, 0xD9, 0xDA):  # SOI again, EOI or scan data before any frame header
            return None
        pos += 2 + length
    return None


def jpeg_scans(content: Any, stop_after: Optional[int] = None) -> int:
    """How many scans (SOS segments) a decoder reads in the JPEG `content`: its segments walked from SOI to the first
    EOI (a multi-picture file's first picture, what is decoded), each segment skipped by its length, each scan's
    entropy-coded data by a search for the next marker (_NEXT_MARKER), as libjpeg finds it: O(segments), the data
    searched in C. A sequential frame whose first scan holds every component (a baseline photo) stops there: 1, its
    data not searched (a decoder refuses a second scan). 0 for bytes that do not start as a JPEG (SOI).
    `stop_after`: the walk stops once it has counted more scans than that (returns `stop_after` + 1)."""
    if not isinstance(content, (bytes, bytearray)):
        content = bytes(content)
    if content[:2] != b"\xff\xd8":
        return 0
    search, end = _NEXT_MARKER.search, len(content)
    scans, pos, frame = 0, 2, None
    while True:
        found = search(content, pos)
        if found is None:
            return scans  # the data ends (a truncated file: what is there is decoded before the decoder stops)
        pos = found.end()
        marker = content[pos - 1]
        if marker in (_EOI, _SOI):  # the picture's end; a second SOI is an error to a decoder
            return scans
        if marker in _STANDALONE or marker < 0xC0:  # RSTn, TEM; a reserved marker has no length libjpeg reads (it
            continue  # stops there between scans, and skips just the two bytes resyncing at a restart inside one)
        if pos + 2 > end:
            return scans
        if marker in _SOF and frame is None:
            frame = (marker, content[pos + 7] if pos + 7 < end else 0)  # (SOFn, components)
        elif marker == _SOS:
            scans += 1
            if stop_after is not None and scans > stop_after:
                return scans
            if (scans == 1 and frame is not None and frame[0] in _SEQUENTIAL_SOF and pos + 2 < end
                    and content[pos + 2] == frame[1]):
                return 1
        pos += (content[pos] << 8) | content[pos + 1]  # the segment's length (a scan's header: its data follows)


def check_jpeg_scans(content: Any, max_scans: int = MAX_JPEG_SCANS) -> None:
    """Raise TooManyScansError when the JPEG `content` has more than `max_scans` scans (`jpeg_scans`); any other
    bytes pass (0 scans)."""
    cap = max(SCAN_COUNT_CAP, max_scans)
    scans = jpeg_scans(content, stop_after=cap)
    if scans > max_scans:
        bound = "pipeline.images.MAX_JPEG_SCANS" if max_scans == MAX_JPEG_SCANS else "the caller's bound"
        count = f"more than {cap:,}" if scans > cap else f"{scans:,}"
        raise TooManyScansError(
            f"too many scans: the JPEG holds {count} scans, over the {max_scans:,} ({bound}); not decoded (each scan "
            f"is a pass over the whole image: a scan bomb, or an encoder to fix)")


@contextlib.contextmanager
def opened(content: bytes, max_pixels: int = MAX_PIXELS) -> Iterator["PIL.Image.Image"]:  # noqa: F821
    """The PIL image of `content` with only its header read, after its declared size passed `max_pixels` and, for a
    JPEG, its scans MAX_JPEG_SCANS.

    Raises:
        TooManyPixelsError: the declared size is over the bound (nothing was decoded).
        TooManyScansError: a JPEG of more scans than MAX_JPEG_SCANS (nothing was decoded).
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
        if img.format in ("JPEG", "MPO"):
            check_jpeg_scans(content)
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
