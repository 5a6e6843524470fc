"""A JPEG scan bomb (a small progressive JPEG with its last scan repeated thousands of times: every scan is a pass over
the whole image, so 94 KB declaring 4 MP took 13 s to decode) is refused from its segments, undecoded, by every decode
path that reads a user's bytes: ingest's validation, the CPU decode (Pillow and simplejpeg), the served model (its
pixel budget and its decode), the reference preprocessing and the GPU path's host header. Real encoders' files pass."""
import io
import time

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from pipeline.images import ImageDecodeError, decode_image, inspect_image, jpeg_frame, opened


def _segments(data: bytes):
    """(marker, start, end) of each segment from SOI's end to EOI, a scan's entropy-coded data included in it."""
    pos, out = 2, []
    while pos < len(data):
        marker = data[pos + 1]
        if marker == 0xD9:
            out.append((marker, pos, pos + 2))
            return out
        end = pos + 2 + ((data[pos + 2] << 8) | data[pos + 3])
        if marker == 0xDA:
            while not (data[end] == 0xFF and data[end + 1] != 0 and not 0xD0 <= data[end + 1] <= 0xD7):
                end += 1
        out.append((marker, pos, end))
        pos = end
    return out


def _progressive(side: int, mode: str = "L") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (side, side), 100 if mode == "L" else (100, 60, 20)).save(buf, "JPEG", progressive=True,
                                                                              quality=90)
    return buf.getvalue()


def scan_bomb(side: int, scans: int, mode: str = "L") -> bytes:
    """A progressive JPEG of `side` x `side` whose last scan is repeated until it holds `scans` scans in all."""
    data = _progressive(side, mode)
    segments = _segments(data)
    sos = [s for s in segments if s[0] == 0xDA]
    last, eoi = data[sos[-1][1]:sos[-1][2]], segments[-1][1]
    return data[:eoi] + last * (scans - len(sos)) + b"\xff\xd9"


def _photo(mode: str = "RGB", **save) -> bytes:
    rng = np.random.default_rng(0)
    blocks = np.kron(rng.integers(0, 255, (40, 50, 3)), np.ones((8, 8, 1)))
    pixels = np.clip(blocks + rng.normal(0, 10, blocks.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buf, "JPEG", quality=90, **save)
    return buf.getvalue()


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """1000x1000 grayscale, 3,000 scans, 42 KB: seconds to decode before it was refused."""
    return scan_bomb(1000, 3000)


def test_the_scans_of_real_encoders_files_are_counted_as_a_decoder_reads_them():
    from pipeline.images import jpeg_scans

    assert jpeg_scans(_photo()) == 1  # baseline, interleaved: one scan (its data is not even searched)
    assert jpeg_scans(_photo("L")) == 1
    assert jpeg_scans(_photo(progressive=True)) == 10  # libjpeg's progressive script for colour
    assert jpeg_scans(_photo("L", progressive=True)) == 6  # ... and for grayscale
    assert jpeg_scans(_photo("CMYK", progressive=True)) <= 20
    for other in (b"", b"\x89PNG\r\n\x1a\n", b"GIF89a"):
        assert jpeg_scans(other) == 0
    # bytes that look like scan markers inside a segment's payload (a comment, an ICC profile) are not scans
    photo = _photo(progressive=True)
    comment = b"\xff\xda" * 1000
    padded = photo[:2] + b"\xff\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment + photo[2:]
    assert jpeg_scans(padded) == 10
    assert decode_image(padded, 16, 3).shape == (3, 16, 16)
    # a multi-picture file is decoded as its first picture: the scans after its EOI are not its own
    assert jpeg_scans(photo + scan_bomb(64, 500)) == 10


def test_the_bound_is_inclusive():
    from pipeline.images import MAX_JPEG_SCANS, TooManyScansError, jpeg_scans

    assert MAX_JPEG_SCANS == 100
    at = scan_bomb(64, MAX_JPEG_SCANS)
    assert jpeg_scans(at) == MAX_JPEG_SCANS
    assert inspect_image(at)[:2] == (64, 64) and jpeg_frame(at) == (64, 64, 1)
    over = scan_bomb(64, MAX_JPEG_SCANS + 1)
    with pytest.raises(TooManyScansError, match=r"the JPEG holds 101 scans, over the 100 "
                                                r"\(pipeline\.images\.MAX_JPEG_SCANS\); not decoded"):
        inspect_image(over)
    assert jpeg_frame(over) is None  # the fast paths leave it to `opened`, which names it


def test_the_walk_of_a_scan_bomb_stops_once_the_count_is_known_to_be_over(bomb):
    from pipeline.images import SCAN_COUNT_CAP, jpeg_scans

    assert jpeg_scans(bomb) == 3000
    assert jpeg_scans(bomb, stop_after=100) == 101 and SCAN_COUNT_CAP == 1000
    huge = scan_bomb(64, 200_000)  # 2.6 MB of tiny scans: the refusal's walk stops after 1,001 of them
    started = time.perf_counter()
    with pytest.raises(ImageDecodeError, match=r"the JPEG holds more than 1,000 scans, over the 100"):
        inspect_image(huge)
    assert jpeg_frame(huge) is None
    assert time.perf_counter() - started < 0.5  # the whole walk: seconds of Python


def test_a_scan_bomb_is_refused_by_every_decode_path_in_milliseconds(bomb):
    from pipeline.data.crops import center_crop_decode, crop_hwc, header
    from pipeline.data.transforms import decode_batch
    from pipeline.serving.contract import preprocess, preprocessing_contract

    assert len(bomb) < 50_000
    paths = {
        "ingest's validation": lambda: inspect_image(bomb),
        "decode_image": lambda: decode_image(bomb, 16, 1),
        "decode_batch": lambda: decode_batch([bomb], 16, 1),
        "center crop (served, val)": lambda: center_crop_decode(bomb, 16, 1),
        "crop (train, simplejpeg's path)": lambda: crop_hwc(bomb, (0, 0, 1000, 1000, False), 16, 1),
        "header (cpu and gpu paths)": lambda: header(bomb, "/p/bomb.jpg", 64_000_000),
        "opened": lambda: opened(bomb).__enter__(),
    }
    for what, call in paths.items():
        started = time.monotonic()
        with pytest.raises(ImageDecodeError, match="too many scans: the JPEG holds more than 1,000 scans") as err:
            call()
        assert time.monotonic() - started < 1.0, what
        assert "row /p/bomb.jpg" in str(err.value) if what.startswith("header") else True
    assert jpeg_frame(bomb) is None
    contract = preprocessing_contract({"arch": "cnn", "width": 4, "channels": 1, "image_size": 16,
                                       "class_names": ["a", "b"]})
    with pytest.raises(ValueError, match="row 1: too many scans: the JPEG holds more than 1,000 "):
        preprocess([_photo("L"), bomb], contract)  # the export's reference preprocessing: the same codec


def test_the_served_model_counts_a_scan_bomb_nothing_and_refuses_it_by_row(bomb, tmp_path, monkeypatch):
    import json

    import torch
    from mlflow.pyfunc.model import PythonModelContext

    from pipeline.model.nets import build_network
    from pipeline.tracking.pyfunc import ImageClassifierModel, InvalidModelInput, declared_pixels

    monkeypatch.delenv("LAKEHOUSE_SERVING_MAX_PIXELS", raising=False)
    assert declared_pixels(bomb) == 0  # refused on its own, never decoded: it spends none of the pixel budget
    meta = {"arch": "cnn", "width": 4, "channels": 1, "image_size": 16, "class_names": ["a", "b", "c"]}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    torch.save(build_network("cnn", 1, 3, width=4).state_dict(), tmp_path / "weights.pt")
    model = ImageClassifierModel()
    model.load_context(PythonModelContext({"meta": str(tmp_path / "meta.json"),
                                           "weights": str(tmp_path / "weights.pt")}, None))
    started = time.monotonic()
    with pytest.raises(InvalidModelInput, match=r"model input row 1, column 'content': too many scans: the JPEG "
                                                r"holds more than 1,000 scans"):
        model.predict(None, pd.DataFrame({"content": [_photo("L"), bomb]}))
    out = model.predict(None, pd.DataFrame({"content": [_photo("L", progressive=True), bomb]}),
                        params={"on_error": "null"})
    assert time.monotonic() - started < 2.0
    assert out["error"].iloc[0] is None and "too many scans" in out["error"].iloc[1]
