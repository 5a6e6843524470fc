"""The GPU decoder's host side reads a batch's JPEG headers without PIL (pipeline.images.jpeg_frame) and hands nvJPEG
the rows' own bytes: the same sizes, formats and errors as the CPU path's PIL header, on real photos. Runs where
torchvision imports (.venv-vision); skipped with the reason elsewhere."""
import io

import numpy as np
import pytest
from PIL import Image

from pipeline.data.crops import RowDecodeError, header


@pytest.fixture(scope="module")
def gpu_decoder_cls():
    from pipeline.data.gpu_decode import GpuDecoder, import_decode_jpeg

    try:
        import_decode_jpeg()
    except ImportError as exc:
        pytest.skip(f"the GPU path's code needs torchvision (run in .venv-vision): {exc}")
    return GpuDecoder


def _photos(n: int):
    from pipeline.lakehouse.sample_data import PHOTO_CLASSES, render_photo

    return [render_photo(PHOTO_CLASSES[i % len(PHOTO_CLASSES)], 5, i)[0] for i in range(n)]


def _encoded(fmt: str, mode: str = "RGB", size=(64, 48)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 128).save(buf, fmt)
    return buf.getvalue()


def test_the_gpu_decoders_header_is_pils_for_photos_and_other_formats(gpu_decoder_cls):
    dec = gpu_decoder_cls(32, 3, train=True, seed=0, device="cpu")
    rows = _photos(12) + [_encoded("PNG"), _encoded("JPEG", "L"), _encoded("JPEG", "CMYK"), _encoded("GIF", "P")]
    for i, content in enumerate(rows):
        assert dec.header(content, f"/p/{i}") == header(content, f"/p/{i}", dec.max_pixels)


def test_over_the_pixel_bound_or_unreadable_the_gpu_decoders_header_names_the_row_as_pil_does(gpu_decoder_cls):
    dec = gpu_decoder_cls(32, 3, train=True, seed=0, device="cpu", max_pixels=1000)
    big = _encoded("JPEG", size=(50, 40))  # 2,000 pixels over a bound of 1,000
    with pytest.raises(RowDecodeError, match=r"row /p/big\.jpg: too many pixels: the image declares 50x40"):
        dec.header(big, "/p/big.jpg")
    for bad in (b"\xff\xd8\xff" + bytes(100), big[:40] + b"\xff\xd9"):
        with pytest.raises(RowDecodeError, match=r"row /p/bad\.jpg") as gpu_err:
            dec.header(bad, "/p/bad.jpg")
        with pytest.raises(RowDecodeError) as cpu_err:
            header(bad, "/p/bad.jpg", 1000)
        assert str(gpu_err.value) == str(cpu_err.value)


def test_nvjpeg_is_given_the_rows_own_bytes_and_the_decode_matches_the_cpu_paths(gpu_decoder_cls):
    """The tensors handed to decode_jpeg are views of the rows' bytes objects (no copy) and the batch decodes as
    before: same shapes and labels-free pixels within the path's tolerance of the CPU decode."""
    import torch

    from pipeline.data.decode import Decoder, EncodedBatch

    contents = _photos(6)
    rows = np.empty((6, 2), dtype=object)
    rows[:, 0] = contents
    rows[:, 1] = [f"/p/{i}.jpg" for i in range(6)]
    batch = EncodedBatch(rows, 3)
    gpu = gpu_decoder_cls(64, 3, train=True, seed=4, device="cpu").decode(batch)
    cpu = Decoder(64, 3, train=True, seed=4).decode(batch)
    assert gpu.shape == cpu.shape == (6, 3, 64, 64)
    assert (gpu.float() - cpu.float()).abs().mean() < 3.0
    view = torch.frombuffer(contents[0], dtype=torch.uint8)  # what the decoder builds: a view, not a copy
    assert view.data_ptr() == np.frombuffer(contents[0], dtype=np.uint8).ctypes.data
