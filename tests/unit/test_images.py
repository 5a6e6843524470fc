"""The image codec's pixel bound: a decompression bomb is refused from its header, in milliseconds, undecoded."""
import io
import json
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
from PIL import Image

from pipeline.data.transforms import decode_batch
from pipeline.images import (MAX_PIXELS, ImageDecodeError, TooManyPixelsError, check_pixels, decode_image,
                             inspect_image, opened)

pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # PIL's, not relied on

SIDE = 13000  # 169 MP: over the bound (64 MP), under PIL's own error threshold (2 x 89.5 MP), so PIL only warns


@pytest.fixture(scope="module")
def bomb(tmp_path_factory):
    """The issue's file: a PNG of 13000x13000 grey pixels, almost all one value, ~164 KB on disk."""
    img = Image.new("L", (SIDE, SIDE), 0)
    img.paste(255, (0, 0, 64, 64))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    del img
    path = tmp_path_factory.mktemp("bomb") / "bomb.png"
    path.write_bytes(buf.getvalue())
    return path


def _png(w: int, h: int, mode: str = "L") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), 128).save(buf, format="PNG")
    return buf.getvalue()


def test_bomb_is_small_on_disk_and_refused_by_every_decode_path(bomb):
    content = bomb.read_bytes()
    assert len(content) < 400_000  # a few hundred KB that would decode to 169 MB
    for call in (lambda: inspect_image(content), lambda: decode_image(content, 32, 1),
                 lambda: decode_image(content, 32, 3), lambda: decode_batch([_png(8, 8), content], 32, 1)):
        with pytest.raises(TooManyPixelsError, match=rf"{SIDE}x{SIDE} = 169,000,000 pixels \(169\.0 MP\), "
                                                     r"over the 64,000,000 \(pipeline\.images\.MAX_PIXELS\)") as err:
            call()
        assert isinstance(err.value, ImageDecodeError)  # callers that catch the codec's error catch this one too


def test_the_bound_is_inclusive_and_configurable():
    check_pixels(8000, 8000)  # exactly 64 MP: allowed
    with pytest.raises(TooManyPixelsError, match="8000x8001"):
        check_pixels(8000, 8001)
    small = _png(40, 30)
    assert inspect_image(small, max_pixels=1200) == (40, 30, "L")
    with pytest.raises(TooManyPixelsError, match=r"40x30 = 1,200 pixels .*over the 1,199 \(the caller's bound\)"):
        decode_image(small, 8, 1, max_pixels=1199)
    assert MAX_PIXELS == 64_000_000


def test_over_pils_own_limit_is_the_same_error():
    """Past 2 x PIL's MAX_IMAGE_PIXELS, PIL's open itself raises: still a TooManyPixelsError, never decoded."""
    header_only = _png(1, 1)
    old = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = 0  # any image is over 2 x 0: PIL raises DecompressionBombError from open
    try:
        with pytest.raises(TooManyPixelsError, match="too many pixels"):
            inspect_image(header_only)
    finally:
        Image.MAX_IMAGE_PIXELS = old


def test_opened_reads_the_header_only():
    with opened(_png(20, 10, "RGB")) as img:
        assert img.size == (20, 10) and img.tile  # the tiles are still to decode: nothing decoded yet
        img.load()
        assert not img.tile


def test_served_model_and_reference_preprocess_name_the_row(bomb):
    from pipeline.model.nets import build_network
    from pipeline.serving.contract import preprocess, preprocessing_contract
    from pipeline.tracking.pyfunc import ImageClassifierModel, InvalidModelInput

    meta = {"arch": "cnn", "width": 4, "channels": 1, "image_size": 16, "class_names": ["a", "b"]}
    model = ImageClassifierModel()
    model.meta, model.class_names = dict(meta), list(meta["class_names"])
    model.network = build_network("cnn", 1, 2, width=4).eval()
    frame = pd.DataFrame({"content": [_png(16, 16), bomb.read_bytes()]})
    with pytest.raises(InvalidModelInput, match=rf"row 1, column 'content': too many pixels.*{SIDE}x{SIDE}") as err:
        model.predict(None, frame)
    assert err.value.get_http_status_code() == 400
    out = model.predict(None, frame, params={"on_error": "null"})
    assert out["error"][0] is None and "too many pixels" in out["error"][1] and out["label"][1] is None
    with pytest.raises(ValueError, match=rf"row 1: too many pixels.*{SIDE}x{SIDE}"):
        preprocess(list(frame["content"]), preprocessing_contract(meta))


_MEASURE = textwrap.dedent("""
    import io, json, sys, time
    from PIL import Image
    from pipeline.images import ImageDecodeError, decode_image

    def peak_kb():  # this process's own peak RSS (VmHWM: unlike ru_maxrss, not inherited from the forking parent)
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))

    content = open(sys.argv[1], "rb").read()
    max_pixels = int(sys.argv[2])
    small = io.BytesIO()
    Image.new("L", (8, 8)).save(small, format="PNG")
    decode_image(small.getvalue(), 32, 1)  # warm-up: PIL's plugins imported before measuring
    peak0 = peak_kb()
    t0 = time.perf_counter()
    try:
        decode_image(content, 32, 1, max_pixels=max_pixels)
        error = None
    except ImageDecodeError as exc:
        error = str(exc)
    elapsed = time.perf_counter() - t0
    print(json.dumps({"elapsed_s": elapsed, "peak_growth_kb": peak_kb() - peak0, "error": error}))
""")


def _measure(path, max_pixels: int):
    """Time and peak-memory growth (the process's peak RSS, which sees PIL's own buffers, unlike tracemalloc) of one
    decode_image of `path` in a new process."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path), str(max_pixels)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc/self/status (Linux)")
def test_bomb_is_refused_in_milliseconds_without_allocating_it(bomb):
    refused = _measure(bomb, MAX_PIXELS)
    assert refused["error"] and "too many pixels" in refused["error"]
    # measured ~1 ms (the header only), 158 ms once on a loaded machine: a bound against a hang, not a speed claim; the
    # memory figure below is what says nothing was decoded
    assert refused["elapsed_s"] < 5.0, refused
    assert refused["peak_growth_kb"] < 16 * 1024, refused  # measured ~0 MB: nothing of the 169 MB allocated
    # the control: the same measurement, with the bound lifted, sees the decode (so the numbers above mean something)
    decoded = _measure(bomb, 10 ** 9)
    assert decoded["error"] is None
    assert decoded["peak_growth_kb"] > 150 * 1024, decoded  # the 169 MB of pixels
    assert decoded["elapsed_s"] > 10 * refused["elapsed_s"], (decoded, refused)


# --- the format allow-list: only JPEG, PNG, GIF, BMP, TIFF and WebP are ever opened --------------------------------

ACCEPTED = ("JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP")
REFUSED_NEEDLE = r"accepted formats: JPEG, PNG, GIF, BMP, TIFF, WEBP"
# A valid EPS (PIL identifies it as EPS and would hand its PostScript to Ghostscript to rasterise it)
EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n%%EndComments\n"
       b"0 setgray 0 0 8 8 rectfill\nshowpage\n%%EOF\n")


def _psd() -> bytes:
    """An 8x8 greyscale Photoshop file (PIL reads PSD; nothing here writes it)."""
    import struct

    header = b"8BPS" + struct.pack(">H", 1) + b"\0" * 6 + struct.pack(">HIIHH", 1, 8, 8, 8, 1)
    return header + struct.pack(">IIIH", 0, 0, 0, 0) + b"\x80" * 64


def _encoded(fmt: str) -> bytes:
    if fmt == "EPS":
        return EPS
    if fmt == "PSD":
        return _psd()
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 120, 250)).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ACCEPTED)
def test_the_accepted_formats_decode(fmt):
    from pipeline.images import ACCEPTED_FORMATS

    assert ACCEPTED_FORMATS == ACCEPTED
    content = _encoded(fmt)
    assert inspect_image(content)[:2] == (8, 8)
    assert decode_image(content, 8, 3).shape == (3, 8, 8)


@pytest.mark.parametrize("fmt", ["EPS", "PSD", "ICO", "PPM", "TGA", "PCX", "SGI", "JPEG2000", "IM", "DDS", "QOI"])
def test_every_other_format_is_refused_before_its_plugin_reads_it(fmt, monkeypatch):
    from PIL import EpsImagePlugin

    content = _encoded(fmt)
    with Image.open(io.BytesIO(content)) as img:  # PIL alone takes it: the refusal below is the allow-list's
        assert img.format == fmt
    ghostscript = []
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *a, **k: ghostscript.append(a) or 1 / 0)
    for call in (lambda: opened(content).__enter__(), lambda: inspect_image(content),
                 lambda: decode_image(content, 8, 1), lambda: decode_batch([_png(8, 8), content], 8, 3)):
        with pytest.raises(ImageDecodeError, match=rf"not a decodable image .*{REFUSED_NEEDLE}"):
            call()
    assert ghostscript == []


def test_without_the_allow_list_pil_would_run_ghostscript_on_an_eps(monkeypatch):
    """The control of the test above: PIL's own open + load of the same bytes reaches Ghostscript."""
    from PIL import EpsImagePlugin

    ghostscript = []

    def fake(tile, size, fp, *args, **kwargs):
        ghostscript.append(size)
        raise OSError("Ghostscript would run here")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", fake)
    with Image.open(io.BytesIO(EPS)) as img, pytest.raises(OSError, match="Ghostscript would run here"):
        img.load()
    assert ghostscript == [(8, 8)]


def test_an_eps_row_is_refused_by_name_by_the_served_model_and_the_reference_preprocess():
    from pipeline.model.nets import build_network
    from pipeline.serving.contract import preprocess, preprocessing_contract
    from pipeline.tracking.pyfunc import ImageClassifierModel, InvalidModelInput

    meta = {"arch": "cnn", "width": 4, "channels": 1, "image_size": 16, "class_names": ["a", "b"]}
    model = ImageClassifierModel()
    model.meta, model.class_names = dict(meta), list(meta["class_names"])
    model.network = build_network("cnn", 1, 2, width=4).eval()
    frame = pd.DataFrame({"content": [_png(16, 16), EPS, _psd()]}, index=["ok", "eps", "psd"])
    with pytest.raises(InvalidModelInput, match=rf"row 'eps', column 'content': not a decodable image .*"
                                                rf"{REFUSED_NEEDLE}") as err:
        model.predict(None, frame)
    assert err.value.get_http_status_code() == 400
    out = model.predict(None, frame, params={"on_error": "null"})
    assert out["error"]["ok"] is None and out["label"]["ok"] is not None
    for row in ("eps", "psd"):
        assert "accepted formats: JPEG" in out["error"][row] and out["label"][row] is None
    with pytest.raises(ValueError, match=rf"row 1: not a decodable image .*{REFUSED_NEEDLE}"):
        preprocess(list(frame["content"]), preprocessing_contract(meta))


def _jpeg(mode: str = "RGB", size=(400, 350), **save) -> bytes:
    import numpy as np

    buf = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).convert(mode).save(buf, "JPEG", quality=90, **save)
    return buf.getvalue()


@pytest.mark.parametrize("mode,save", [("RGB", {}), ("L", {}), ("RGB", {"progressive": True}), ("CMYK", {}),
                                       ("RGB", {"exif": b"Exif\x00\x00" + bytes(5000)}),
                                       ("RGB", {"icc_profile": bytes(70_000)})])  # an ICC profile over 2 segments
def test_a_jpegs_frame_header_is_read_as_pil_reads_it(mode, save):
    from pipeline.images import jpeg_frame

    content = _jpeg(mode, (401, 353), **save)
    with Image.open(io.BytesIO(content)) as img:
        assert jpeg_frame(content) == (img.width, img.height, len(img.getbands())) == (401, 353, len(mode))


def test_what_is_not_a_whole_jpeg_frame_header_is_left_to_pil():
    from pipeline.images import jpeg_frame

    good = _jpeg()
    sof = good.index(b"\xff\xc0")
    for bad in (b"", b"\xff\xd8", b"GIF89a" + good[6:], good[:sof + 5],  # not a JPEG; cut inside the frame header
                b"\xff\xd8\xff\xe0\x00\x00" + good[6:],  # a segment of length 0
                b"\xff\xd8\xff\xda\x00\x08" + bytes(40),  # scan data before any frame header
                b"\xff\xd8\xff\xe0\xff\xff" + bytes(10),  # a segment running past the end
                good[:sof + 5] + b"\x00\x00\x00\x00" + good[sof + 9:]):  # a frame of 0 x 0 pixels
        assert jpeg_frame(bad) is None, bad[:12]


def _gradient16(fmt: str):
    """A 16-bit grayscale picture (a horizontal ramp over the whole 0-65535 range) in `fmt`, and the same picture
    written with 8 bits a sample."""
    import numpy as np

    ramp = np.tile(np.linspace(0, 65535, 64).round().astype(np.uint16), (48, 1))
    wide, narrow = io.BytesIO(), io.BytesIO()
    Image.fromarray(ramp).save(wide, format=fmt)  # uint16: mode I;16
    Image.fromarray(((ramp.astype(np.int64) * 255 + 32767) // 65535).astype(np.uint8)).save(narrow, format=fmt)
    return wide.getvalue(), narrow.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
@pytest.mark.parametrize("channels", [1, 3])
def test_16_bit_samples_are_scaled_to_8_bits_on_every_decode_path(fmt, channels):
    """Pillow's own conversion clips 16-bit samples at 255 (a 16-bit picture came out almost all white, and a model
    labelled the white); every path now reads them as the same picture written with 8 bits, within a level."""
    import numpy as np

    from pipeline.data.crops import crop_hwc, val_box

    wide, narrow = _gradient16(fmt)
    with Image.open(io.BytesIO(wide)) as img:
        assert img.mode in ("I;16", "I;16B", "I;16L", "I")  # as Pillow opens 16-bit grayscale
    for decode in (lambda c: decode_image(c, 32, channels),
                   lambda c: crop_hwc(c, val_box(64, 48), 24, channels)):
        got, want = decode(wide).astype(int), decode(narrow).astype(int)
        assert np.abs(got - want).max() <= 1, (np.abs(got - want).max(), got.mean(), want.mean())
        assert 100 < got.mean() < 155  # the ramp's middle, not white
    assert inspect_image(wide)[:2] == (64, 48)


def test_pixels_without_an_8_bit_reading_are_refused_naming_the_mode_at_ingest_and_decode():
    import numpy as np

    floats = io.BytesIO()
    Image.fromarray(np.linspace(0, 1, 64 * 48, dtype=np.float32).reshape(48, 64)).save(floats, format="TIFF")
    for check in (lambda c: inspect_image(c), lambda c: decode_image(c, 32, 1)):
        with pytest.raises(ImageDecodeError, match=r"floating-point pixels \(mode F\)"):
            check(floats.getvalue())
    deep = io.BytesIO()
    Image.fromarray(np.full((48, 64), 1 << 20, dtype=np.int32)).save(deep, format="TIFF")
    with pytest.raises(ImageDecodeError, match=r"beyond 16 bits"):
        inspect_image(deep.getvalue())
