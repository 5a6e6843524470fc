"""Ingest opens only the accepted image formats (pipeline.images.ACCEPTED_FORMATS): a file of any other format, even
under an image's name, is skipped as undecodable and named (real Spark local[2] and delta-rs)."""
import io
import os
import struct

import pytest

from conftest import make_config

pytestmark = [pytest.mark.integration, pytest.mark.datapath, pytest.mark.timeout(600)]

NEEDLE = "accepted formats: JPEG, PNG, GIF, BMP, TIFF, WEBP"
# PIL identifies this as EPS: with Ghostscript installed, decoding it runs the file's PostScript
EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n%%EndComments\n"
       b"0 setgray 0 0 8 8 rectfill\nshowpage\n%%EOF\n")
PSD = (b"8BPS" + struct.pack(">H", 1) + b"\0" * 6 + struct.pack(">HIIHH", 1, 8, 8, 8, 1)
       + struct.pack(">IIIH", 0, 0, 0, 0) + b"\x80" * 64)


def _image(fmt: str, shade: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (shade, shade, shade)).save(buf, format=fmt)
    return buf.getvalue()


def test_ingest_skips_and_names_files_of_a_refused_format(spark, tmp_path):
    from PIL import Image

    from pipeline.lakehouse.ingest import IngestError, ingest_folder

    src = tmp_path / "src"
    good = {"cat/a.png": _image("PNG", 10), "cat/b.tif": _image("TIFF", 20), "dog/c.jpg": _image("JPEG", 30),
            "dog/d.webp": _image("WEBP", 40), "dog/e.gif": _image("GIF", 50), "dog/f.bmp": _image("BMP", 60)}
    refused = {"cat/evil.png": EPS, "dog/layers.jpg": PSD, "cat/icon.gif": _image("ICO", 70),
               "dog/photo.tiff": _image("JPEG2000", 80)}
    for rel, content in {**good, **refused}.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(content)
    for rel, content in refused.items():  # PIL alone would have taken every one of them
        with Image.open(io.BytesIO(content)) as img:
            assert img.format in ("EPS", "PSD", "ICO", "JPEG2000"), (rel, img.format)

    res = ingest_folder(spark, make_config(tmp_path), str(src), mode="append")
    assert res.rows_written == len(good)
    skipped = {os.path.relpath(s.path, src): s for s in res.skipped}
    assert set(skipped) == set(refused)
    for rel, s in skipped.items():
        assert s.reason == "undecodable" and "not a decodable image" in s.detail and NEEDLE in s.detail, (rel, s)

    strict = make_config(tmp_path / "strict", "ingest.strict=true")
    with pytest.raises(IngestError) as err:
        ingest_folder(spark, strict, str(src), mode="append")
    assert str(src / "cat" / "evil.png") in str(err.value) and "nothing written" in str(err.value)
