"""Arrow pixel columns -> tensors and the shuffle-buffer batch assembly (pure logic, no Spark or Petastorm)."""
from collections import namedtuple

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipeline.data.batches import BatchAssembler, PixelsToTensor

Chunk = namedtuple("Chunk", ["pixels", "label_index"])
SHAPE = (1, 4, 4)
ROW = 16


def _row_group(first_id: int, rows: int) -> Chunk:
    """Rows whose every pixel byte is (id % 251) and whose label is the id, so pixels and labels can be matched."""
    ids = np.arange(first_id, first_id + rows)
    pixels = pa.array([bytes([i % 251]) * ROW for i in ids], type=pa.binary())
    return Chunk(pa.chunked_array([pixels]), pa.chunked_array([pa.array(ids, type=pa.int32())]))


def test_rows_are_a_view_of_the_arrow_values_and_respect_slices():
    col = pa.array([bytes([i]) * ROW for i in range(10)], type=pa.binary())
    rows = PixelsToTensor(*SHAPE[:2]).rows(col.slice(3, 4))
    assert rows.shape == (4, ROW) and rows.dtype == np.uint8
    assert [int(r[0]) for r in rows] == [3, 4, 5, 6]
    assert not rows.flags.writeable and not rows.flags.owndata  # a read-only view, no copy
    chunked = pa.chunked_array([col.slice(0, 2), col.slice(2, 3)])
    assert [int(r[0]) for r in PixelsToTensor(1, 4).rows(chunked)] == [0, 1, 2, 3, 4]


def test_rows_name_the_bad_row():
    col = pa.array([bytes(ROW), bytes(ROW), bytes(ROW - 1)], type=pa.binary())
    with pytest.raises(ValueError, match=r"row 2 of the pixel column holds 15 bytes, expected 16.*image_size"):
        PixelsToTensor(1, 4).rows(col)
    with pytest.raises(ValueError, match="row 1 of the pixel column is null"):
        PixelsToTensor(1, 4).rows(pa.array([bytes(ROW), None], type=pa.binary()))
    with pytest.raises(ValueError, match="Arrow type int64"):
        PixelsToTensor(1, 4).rows(pa.array([1, 2]))


def test_normalize_matches_the_formula():
    rows = np.array([[0] * ROW, [255] * ROW, [51] * ROW], dtype=np.uint8)
    out = PixelsToTensor(1, 4).normalize(rows)
    assert out.shape == (3, *SHAPE) and out.dtype == torch.float32
    assert torch.allclose(out[:, 0, 0, 0], torch.tensor([-1.0, 1.0, 51 / 127.5 - 1.0]))


@pytest.mark.parametrize("shuffle_buffer", [0, 20, 1000])
def test_every_row_once_with_its_label_across_reused_buffers(shuffle_buffer):
    groups = [_row_group(0, 13), _row_group(13, 7), _row_group(20, 30), _row_group(50, 11)]
    batches = list(BatchAssembler(iter(groups), 8, PixelsToTensor(1, 4), shuffle_buffer, seed=1))
    sizes = [len(y) for _, y in batches]
    assert sizes[:-1] == [8] * (len(sizes) - 1) and 0 < sizes[-1] <= 8
    ids = torch.cat([y for _, y in batches])
    assert sorted(ids.tolist()) == list(range(61))  # nothing lost or repeated, even when scratch memory is reused
    pixel_ids = torch.cat([((x[:, 0, 0, 0] + 1.0) * 127.5).round().long() for x, _ in batches])
    assert torch.equal(pixel_ids, ids % 251)  # every image stays with its label after the permutation
    assert all(x.dtype == torch.float32 and y.dtype == torch.int64 for x, y in batches)
    if shuffle_buffer == 0:
        assert ids.tolist() == list(range(61))
    else:
        assert ids.tolist() != list(range(61))


def test_shuffle_is_reproducible_by_seed():
    def order(seed):
        groups = [_row_group(0, 40), _row_group(40, 40)]
        return torch.cat([y for _, y in BatchAssembler(iter(groups), 16, PixelsToTensor(1, 4), 64, seed)]).tolist()

    assert order(3) == order(3) and order(3) != order(4)
