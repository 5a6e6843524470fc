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


IdChunk = namedtuple("IdChunk", ["pixels", "label_index", "row_id"])


def _id_groups(sizes, seed=0):
    """Row groups of random pixels (1 x 4 x 4), random labels and row ids counting from 0."""
    rng, groups, first = np.random.default_rng(seed), [], 0
    for rows in sizes:
        pixels = rng.integers(0, 256, (rows, ROW), dtype=np.uint8)
        groups.append(IdChunk(pa.array([r.tobytes() for r in pixels], type=pa.binary()),
                              pa.array(rng.integers(0, 10, rows), type=pa.int32()),
                              pa.array(np.arange(first, first + rows), type=pa.int64())))
        first += rows
    return groups


def _reference_batches(groups, batch_size, shuffle_buffer, seed, skip=0):
    """The assembler's rule, spelled out: rows gathered until a buffer holds max(batch_size, shuffle_buffer), one
    randperm of the buffer from the seeded generator, its full batches, the rest carried into the next buffer; the
    last buffer's batches all, the last one short. Each batch as (uint8 rows, labels, row ids)."""
    generator = torch.Generator().manual_seed(seed)
    threshold = max(batch_size, shuffle_buffer)
    out, rows, labels, ids = [], np.empty((0, ROW), np.uint8), np.empty(0, np.int64), np.empty(0, np.int64)

    def cut(final):
        nonlocal rows, labels, ids
        n = len(ids)
        if shuffle_buffer > 0:
            perm = torch.randperm(n, generator=generator).numpy()
            rows, labels, ids = rows[perm], labels[perm], ids[perm]
        full = n if final else n // batch_size * batch_size
        out.extend((rows[i:i + batch_size], labels[i:i + batch_size], ids[i:i + batch_size])
                   for i in range(0, full, batch_size))
        rows, labels, ids = rows[full:], labels[full:], ids[full:]

    for g in groups:
        rows = np.concatenate([rows, np.frombuffer(b"".join(g.pixels.to_pylist()), np.uint8).reshape(-1, ROW)])
        labels = np.concatenate([labels, np.asarray(g.label_index.to_pylist(), np.int64)])
        ids = np.concatenate([ids, np.asarray(g.row_id.to_pylist(), np.int64)])
        if len(ids) >= threshold:
            cut(final=False)
    if len(ids):
        cut(final=True)
    return out[skip:]


@pytest.mark.parametrize("uint8_out", [False, True])
@pytest.mark.parametrize("skip", [0, 5])
def test_the_batches_and_their_order_for_a_seed_are_the_shuffle_rules(uint8_out, skip):
    """Batches made as they are handed over are the ones the whole buffer's batches were: the same rows, labels and
    ids in the same order for a fixed seed, across buffers, a carried rest, skipped batches and a short last one."""
    groups = _id_groups([13, 7, 30, 64, 11, 50, 6])
    transform = PixelsToTensor(1, 4)
    assembler = BatchAssembler(iter(groups), 8, transform, 40, seed=7, with_ids=True, uint8_out=uint8_out)
    assembler.skip = skip
    got = list(assembler)
    want = _reference_batches(groups, 8, 40, seed=7, skip=skip)
    assert len(got) == len(want) == 23 - skip and len(want[-1][2]) == 181 % 8 == 5
    for (x, y, ids), (rows, labels, row_ids) in zip(got, want):
        expected = transform.as_uint8(rows, False) if uint8_out else transform.normalize(rows)
        assert torch.equal(x, expected) and y.tolist() == labels.tolist() and ids.tolist() == row_ids.tolist()
    assert assembler.batches_made == 23


@pytest.mark.parametrize("method", ["normalize", "as_uint8"])
def test_one_batch_tensor_is_made_before_the_first_batch_is_handed_over(method):
    """A full shuffle buffer (256 rows, batches of 4) makes each batch's tensor as it is handed over, not all 64 of
    them before the first (~616 MB of float32 a rank at 1024 rows of 224 px)."""
    transform, made = PixelsToTensor(1, 4), []
    original = getattr(transform, method)

    def counted(*args):
        made.append(1)
        return original(*args)

    setattr(transform, method, counted)
    groups = _id_groups([64] * 8)
    it = iter(BatchAssembler(iter(groups), 4, transform, 256, seed=0, uint8_out=method == "as_uint8"))
    next(it)
    assert len(made) == 1
    next(it)
    assert len(made) == 2
    assert len(list(it)) == 128 - 2 and len(made) == 128
