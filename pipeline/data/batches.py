"""Row groups to batches: uint8 pixel bytes viewed without a Python object per row, shuffled in a reused buffer, and
normalised (or handed over as uint8) one batch at a time; encoded rows are shuffled the same way and handed over
undecoded, for the decode stage (pipeline.data.decode)."""
from __future__ import annotations

import numpy as np
import torch

from pipeline.data.decode import EncodedBatch
from pipeline.data.transforms import PIXEL_MEAN, PIXEL_STD


class PixelsToTensor:
    """Raw uint8 pixel bytes of a row group (an Arrow binary column) -> normalised float32 (N, C, H, W).

    The Arrow column's value buffer is already the rows' pixels back to back: it is viewed and checked without a
    Python object per row (Petastorm's own conversion makes one `bytes` per row through pandas: 0.77 ms of the
    consuming thread for a 353-row group, timed around its `read_next`; see docs/PERFORMANCE.md).
    """

    def __init__(self, channels: int, size: int) -> None:
        self.shape = (channels, size, size)
        self.row_bytes = int(np.prod(self.shape))

    encoded = False

    def __call__(self, column) -> torch.Tensor:
        return self.normalize(self.rows(column))

    def of_group(self, group) -> np.ndarray:
        """A row group's pixel rows (`rows` of its pixel column)."""
        return self.rows(group.pixels)

    def empty(self, n: int) -> np.ndarray:
        return np.empty((n, self.row_bytes), np.uint8)

    def rows(self, column) -> np.ndarray:
        """Arrow binary column (or a sequence of bytes) -> read-only uint8 (N, C*H*W) view of its values."""
        import pyarrow as pa

        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        elif not isinstance(column, pa.Array):
            column = pa.array(list(column), type=pa.binary())
        if len(column) == 0:
            return np.empty((0, self.row_bytes), dtype=np.uint8)
        if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
            raise ValueError(f"pixel column has Arrow type {column.type}, expected binary; convert again")
        if column.null_count:
            raise ValueError(f"row {column.is_null().to_numpy(zero_copy_only=False).argmax()} of the pixel column "
                             f"is null; convert again")
        _, offsets_buf, data_buf = column.buffers()
        offset_type = np.int64 if pa.types.is_large_binary(column.type) else np.int32
        offsets = np.frombuffer(offsets_buf, dtype=offset_type)[column.offset:column.offset + len(column) + 1]
        lengths = np.diff(offsets)
        bad = np.flatnonzero(lengths != self.row_bytes)
        if bad.size:
            raise ValueError(f"row {bad[0]} of the pixel column holds {lengths[bad[0]]} bytes, expected "
                             f"{self.row_bytes} (rows of shape {self.shape}); convert again with this "
                             f"data.image_size and data.channels")
        view = np.frombuffer(data_buf, dtype=np.uint8)[offsets[0]:offsets[-1]].reshape(len(column), self.row_bytes)
        view.flags.writeable = False  # Arrow's memory: never written through this view
        return view

    def normalize(self, rows: np.ndarray) -> torch.Tensor:
        """uint8 rows (N, C*H*W) -> normalised float32 (N, C, H, W), a new tensor."""
        out = torch.from_numpy(rows.astype(np.float32))
        return out.mul_(1.0 / (255.0 * PIXEL_STD)).sub_(PIXEL_MEAN / PIXEL_STD).view(len(rows), *self.shape)

    def as_uint8(self, rows: np.ndarray, pin: bool) -> torch.Tensor:
        """uint8 rows (N, C*H*W) -> a new uint8 (N, C, H, W) tensor, in pinned memory when `pin`: the model
        normalises it on its device (a quarter of the bytes of float32 cross to the GPU, and the copy can overlap)."""
        out = torch.from_numpy(np.ascontiguousarray(rows)).view(len(rows), *self.shape)
        return out.pin_memory() if pin else out.clone()


def int_values(column, name: str) -> np.ndarray:
    """An Arrow integer column (or a sequence) as a numpy view of its buffer. pyarrow 14's own `to_numpy` imports
    pandas, which a rank must not need."""
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if not isinstance(column, pa.Array):
        return np.asarray(column, dtype=np.int64)
    if not pa.types.is_integer(column.type):
        raise ValueError(f"column {name} has Arrow type {column.type}, expected an integer; convert again")
    if column.null_count:
        raise ValueError(f"column {name} holds {column.null_count} null(s); convert again")
    if len(column) == 0:
        return np.empty(0, np.int64)
    signed = pa.types.is_signed_integer(column.type)
    dtype = np.dtype(f"{'int' if signed else 'uint'}{column.type.bit_width}")
    return np.frombuffer(column.buffers()[1], dtype=dtype)[column.offset:column.offset + len(column)]


def normalize_uint8(x: torch.Tensor) -> torch.Tensor:
    """uint8 (N, C, H, W) -> normalised float32 on its own device and in its memory order (PixelsToTensor's
    formula): a decoded batch for a rank that does not normalise on its device."""
    return x.to(torch.float32).mul_(1.0 / (255.0 * PIXEL_STD)).sub_(PIXEL_MEAN / PIXEL_STD)


class BatchAssembler:
    """Turns row groups (Arrow columns `pixels`, `label_index`, optionally `row_id`) into batches of `batch_size`.

    Row groups stay uint8 views of the Arrow buffers until they are gathered, in a shuffle buffer of about
    `shuffle_buffer` rows, with one permutation (a quarter of the bytes of float32), into memory that is reused
    from one buffer to the next: a fresh multi-MB array page-faults on every write (measured 4-10x slower).
    Batches are normalised one at a time into new tensors, each as it is handed over (or handed over as uint8 with
    `uint8_out`). The last batch of a finite source may be short. With `with_ids` it yields (features, labels, row ids).

    With an encoded `transform` (pipeline.data.decode.EncodedRows) the rows are (encoded bytes, path) objects,
    shuffled alike, and each batch's features are an `EncodedBatch` carrying its index in the stream (batches skipped
    on a resume counted), which the decode stage turns into tensors.
    """

    def __init__(self, row_groups, batch_size: int, transform, shuffle_buffer: int, seed: int,
                 with_ids: bool = False, uint8_out: bool = False, pin: bool = False) -> None:
        self.row_groups = row_groups
        self.batch_size = batch_size
        self.transform = transform
        self.shuffle_buffer = shuffle_buffer
        self.generator = torch.Generator().manual_seed(seed)
        self.with_ids = with_ids
        self.uint8_out = uint8_out
        self.pin = pin
        self.skip = 0  # batches to drop without making tensors (a resumed stream fast-forwards through these)
        self.batches_made = 0  # full or final batches cut so far, skipped ones included (an encoded batch's index)
        self._scratch = [transform.empty(0), transform.empty(0)]

    def _buffer(self, k: int, n: int) -> np.ndarray:
        if len(self._scratch[k]) < n:
            self._scratch[k] = self.transform.empty(n)
        return self._scratch[k][:n]

    def _features(self, rows: np.ndarray, index: int):
        if getattr(self.transform, "encoded", False):
            return EncodedBatch(rows.copy(), index)  # out of the scratch memory, which the next buffer reuses
        return self.transform.as_uint8(rows, self.pin) if self.uint8_out else self.transform.normalize(rows)

    def _emit(self, xs, ms, final: bool):
        """A full shuffle buffer (the last, `final`, of a finite source) -> (its batches, the rows left over as the
        start of the next buffer). The buffer is gathered and permuted here, in the scratch memory; its batches come
        from a generator that makes each batch's tensor only when it is handed over, so one batch of float32 exists
        at a time, not a whole buffer of them (~616 MB a rank at 1024 rows of 224 px)."""
        n = sum(len(m) for m in ms)
        x = np.concatenate(xs, out=self._buffer(0, n))
        meta = np.concatenate(ms)  # (n, 2) int64: label, row id
        if self.shuffle_buffer > 0:
            perm = torch.randperm(n, generator=self.generator).numpy()
            x = np.take(x, perm, axis=0, out=self._buffer(1, n), mode="clip")  # clip: no temporary for `out`
            meta = meta[perm]
        full = n if final else (n // self.batch_size) * self.batch_size
        # the rest leaves the scratch memory now; the batches read it until the last is handed over, and the next
        # buffer (which reuses it) is gathered only after that
        return self._batches(x, meta, full), [x[full:].copy()], [meta[full:]]

    def _batches(self, x: np.ndarray, meta: np.ndarray, full: int):
        bs = self.batch_size
        for i in range(0, full, bs):
            index = self.batches_made
            self.batches_made += 1
            if self.skip:
                self.skip -= 1
                continue
            y = torch.from_numpy(np.ascontiguousarray(meta[i:i + bs, 0]))
            if self.pin:
                y = y.pin_memory()
            item = (self._features(x[i:i + bs], index), y)
            yield item + (meta[i:i + bs, 1].copy(),) if self.with_ids else item

    def __iter__(self):
        xs, ms, n = [], [], 0
        threshold = max(self.batch_size, self.shuffle_buffer)
        for chunk in self.row_groups:
            xs.append(self.transform.of_group(chunk))
            labels = int_values(chunk.label_index, "label_index")
            meta = np.empty((len(labels), 2), np.int64)
            meta[:, 0] = labels
            ids = getattr(chunk, "row_id", None)
            meta[:, 1] = int_values(ids, "row_id") if ids is not None else -1
            ms.append(meta)
            n += len(labels)
            if n >= threshold:
                batches, xs, ms = self._emit(xs, ms, final=False)
                n = len(ms[0])
                yield from batches
        if n:
            batches, _, _ = self._emit(xs, ms, final=True)
            yield from batches
