"""The rank's decode stage: encoded image rows -> the ImageNet recipe's crops as uint8 batches, decoded on the CPU in
worker processes (Pillow) or on the rank's GPU (nvJPEG through torchvision), with the same crops either way.

With `data.decode=cpu|gpu|auto` the converter keeps each row's encoded bytes and path; the batch assembler shuffles
them as it shuffles pixel rows and hands over `EncodedBatch`es, which a `Decoder` turns into tensors:

- Crops. Training takes a random resized crop (area 8-100 % of the image, aspect 3/4-4/3, torchvision's rule) and a
  horizontal flip; validation the central 87.5 % (the 224-of-256 "resize and center crop"). Either is a box in the
  source image resized to `data.image_size` square. The random draws of a batch depend only on (seed, batch index),
  never on the image sizes or the thread that decodes, so a batch is the same on every run, on the CPU or the GPU, and
  after a resume that skipped batches.
- CPU: Pillow decodes and resizes the box (`Image.resize(box=)`, antialiased bilinear) in `workers` processes (one:
  a thread). Each batch is cut into one chunk per worker, and the next batches are decoded while this one trains.
- GPU (pipeline.data.gpu_decode): the JPEG rows of a batch are decoded in one batched nvJPEG call on the rank's device, then cropped, resized
  (bilinear, antialiased as Pillow's) and flipped there, the whole batch in two matrix products; rows that are not
  JPEG, and the JPEG rows of a batch nvJPEG refused, are decoded on the CPU path within the same batch.
- Every row's header is read first, through `pipeline.images` (the pixel bound and the format allow-list): an
  undecodable or over-large image stops the job with a `RowDecodeError` naming the row's path, on both paths.
"""
from __future__ import annotations

import math
import os
import threading
from collections import deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  (its reductions send a shared tensor between processes as a handle)

from pipeline.data.crops import (CROP_RATIO, CROP_SCALE, DECODE_MODES, DRAWS, VAL_CROP, RowDecodeError,  # noqa: F401
                                 boxes_for, center_crop_decode, crop_draws, decode_chunk, decode_crop, header,
                                 train_box, val_box)
from pipeline.images import MAX_PIXELS
from pipeline.log import get_logger

log = get_logger(__name__)


class EncodedBatch(NamedTuple):
    """A batch before decoding: (n, 2) object rows of (encoded bytes, path), and its index in the stream."""

    rows: np.ndarray
    index: int


class EncodedRows:
    """Encoded rows for the batch assembler: each row group's `content` and `path` columns as an (n, 2) object array
    (one Python bytes object per row: a decode costs milliseconds, the object microseconds)."""

    encoded = True

    def __init__(self, row_bytes: int = 110_000) -> None:
        self.row_bytes = int(row_bytes)  # the encoded size of a row on average (for data.memory_cache_mb)

    def of_group(self, group) -> np.ndarray:
        contents = group.pixels.to_pylist() if hasattr(group.pixels, "to_pylist") else list(group.pixels)
        paths = getattr(group, "path", None)
        paths = paths.to_pylist() if hasattr(paths, "to_pylist") else (list(paths) if paths is not None else
                                                                        [None] * len(contents))
        rows = np.empty((len(contents), 2), dtype=object)
        rows[:, 0] = contents
        rows[:, 1] = paths
        return rows

    def empty(self, n: int) -> np.ndarray:
        return np.empty((n, 2), dtype=object)


def ranks_on_host(world_size: int) -> int:
    """How many ranks share this host: the launcher's word (Horovod's HOROVOD_LOCAL_SIZE, torchrun's and
    TorchDistributor's LOCAL_WORLD_SIZE), else all `world_size` ranks."""
    for key in ("HOROVOD_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(key, "").isdigit() and int(os.environ[key]) >= 1:
            return int(os.environ[key])
    return max(1, world_size)


def default_workers(world_size: int) -> int:
    """data.decode_workers=0: this process's cores shared evenly by the ranks on its host, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // ranks_on_host(world_size))


def _exit_with_parent(parent: int, every_s: float = 0.2) -> None:
    """In a decode worker process: end within `every_s` of the rank's end. A rank may end without the interpreter's
    teardown (os._exit once its result is delivered, or a kill), which never tells the workers; left running they
    would hold the rank's stdout and stderr open, and a launcher reading them to their end would wait forever."""
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(0)

    threading.Thread(target=watch, name="decode-worker-watch", daemon=True).start()


def _shared_chunk(contents: Sequence[Any], paths: Sequence[Any], draws: Optional[np.ndarray], size: int,
                  channels: int, max_pixels: int) -> torch.Tensor:
    """In a decode worker process: `crops.decode_chunk` into a tensor in shared memory, so that what travels back to
    the rank is a handle (torch.multiprocessing's reduction: a file descriptor), not the pixels pickled through the
    pool's one result pipe (~150 KB an image, which on 16 workers decoded 4x what one did, not 16x)."""
    out = torch.empty((len(contents), size, size, channels), dtype=torch.uint8).share_memory_()
    decode_chunk(contents, paths, draws, size, channels, max_pixels, out=out.numpy())
    return out


class Decoder:
    """Decodes `EncodedBatch`es on the CPU into uint8 (N, C, size, size) tensors, batches decoded ahead of the
    consumer. `train`: random resized crops and flips (seeded by `seed` and the batch index); else the central crop.
    `pin`: the batches in pinned memory (a CUDA rank copies them asynchronously).

    `workers` 1: in a thread of the rank. More: in `workers` processes (forked once, as DataLoader's workers are),
    each decoding a share of every batch (headers, boxes, Pillow: crops.decode_chunk), while threads of the rank hand
    the shares over and copy them back.
    Threads alone do not scale: on the H100 machine 16 threads decoded 2.3x what one did, and here 2 threads of plain
    Pillow decoded no more than one (Pillow's JPEG path holds the GIL for most of a decode)."""

    name = "cpu"

    def __init__(self, size: int, channels: int, train: bool, seed: int, workers: int = 1, pin: bool = False,
                 channels_last: bool = False, max_pixels: int = MAX_PIXELS) -> None:
        self.size, self.channels, self.train, self.seed = int(size), int(channels), bool(train), int(seed)
        self.workers = max(1, int(workers))
        self.pin, self.channels_last, self.max_pixels = pin, channels_last, max_pixels
        self._pool: Optional[ThreadPoolExecutor] = None
        self._procs: Optional[ProcessPoolExecutor] = None
        self._lock = threading.Lock()

    def processes(self) -> Optional[ProcessPoolExecutor]:
        """The decode worker processes (workers > 1), started on first use; None: decode in the rank's threads."""
        if self.workers <= 1:
            return None
        with self._lock:
            if self._procs is None:
                import multiprocessing

                # fork, as DataLoader's workers on Linux: spawn and forkserver re-run the user's main module in
                # every worker (a notebook's or a script's without a __main__ guard fails); a worker only decodes
                # (numpy, Pillow), never touches CUDA or the rank's other threads' state
                self._procs = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"),
                                                  initializer=_exit_with_parent, initargs=(os.getpid(),))
            return self._procs

    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                # with processes, twice the threads: the shares of the next batch wait in the processes' queue
                threads = self.workers * (2 if self.workers > 1 and self.name == "cpu" else 1)
                self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"decode-{self.name}")
            return self._pool

    def _empty(self, n: int) -> torch.Tensor:
        """A batch's (n, size, size, channels) uint8 buffer: the decoders write Pillow's NHWC rows as they come."""
        return torch.empty((n, self.size, self.size, self.channels), dtype=torch.uint8,
                           pin_memory=self.pin and torch.cuda.is_available())

    def _layout(self, nhwc: torch.Tensor) -> torch.Tensor:
        """The batch as (n, channels, size, size): with channels_last, a view of the NHWC buffer (channels_last
        memory, no copy: converting an NCHW batch cost ~22 ms per 256 photos on one core); else one NCHW copy, pinned
        where the buffer was."""
        nchw = nhwc.permute(0, 3, 1, 2)
        if self.channels_last or self.channels == 1:
            return nchw
        out = torch.empty(nchw.shape, dtype=nchw.dtype, device=nchw.device,
                          pin_memory=nhwc.device.type == "cpu" and nhwc.is_pinned())
        return out.copy_(nchw)

    def boxes(self, batch: EncodedBatch) -> List[Tuple]:
        sizes = [header(c, p, self.max_pixels)[:2] for c, p in batch.rows]
        return boxes_for(sizes, self.train, self.seed, batch.index)

    def _decode_rows(self, out: torch.Tensor, rows: np.ndarray, boxes: Sequence[Tuple], idx: Iterable[int]) -> None:
        view = out.numpy()
        for i in idx:
            view[i] = decode_crop(rows[i, 0], rows[i, 1], boxes[i], self.size, self.channels, self.max_pixels)

    def submit(self, batch: EncodedBatch) -> Any:
        """Start decoding `batch`; `result(handle)` waits for its tensor."""
        n = len(batch.rows)
        out = self._empty(n)
        if n == 0:
            return out, []
        pool, procs = self.pool(), self.processes()
        chunk = max(1, math.ceil(n / self.workers))
        if procs is not None:  # each process: its share's headers, boxes and decodes; a thread here copies it back
            draws = crop_draws(self.seed, batch.index, n) if self.train else None
            view = out.numpy()

            def share(lo: int) -> None:
                hi = min(n, lo + chunk)
                view[lo:hi] = procs.submit(_shared_chunk, list(batch.rows[lo:hi, 0]), list(batch.rows[lo:hi, 1]),
                                           None if draws is None else draws[lo:hi], self.size, self.channels,
                                           self.max_pixels).result().numpy()

            return out, [pool.submit(share, lo) for lo in range(0, n, chunk)]
        boxes_f = pool.submit(self.boxes, batch)  # headers first (cheap), then the decodes split over the workers

        def part(lo: int) -> None:
            self._decode_rows(out, batch.rows, boxes_f.result(), range(lo, min(n, lo + chunk)))

        return out, [boxes_f] + [pool.submit(part, lo) for lo in range(0, n, chunk)]

    def result(self, handle: Any) -> torch.Tensor:
        out, futures = handle
        for f in futures:
            f.result()  # the first error (a RowDecodeError naming its row) is raised here, in batch order
        return self._layout(out)

    def decode(self, batch: EncodedBatch) -> torch.Tensor:
        """One batch, now (tests; the loader uses `batches`)."""
        return self.result(self.submit(batch))

    def batches(self, items: Iterator[Tuple], depth: int = 2) -> Iterator[Tuple]:
        """(EncodedBatch, labels, ...) items -> (tensor, labels, ...), `depth` batches decoded ahead, in order."""
        pending: deque = deque()
        it = iter(items)
        try:
            while True:
                while len(pending) < max(1, depth):
                    item = next(it, None)
                    if item is None:
                        break
                    pending.append((self.submit(item[0]), item[1:]))
                if not pending:
                    return
                handle, rest = pending.popleft()
                yield (self.result(handle), *rest)
        finally:
            for handle, _ in pending:  # a stream closed mid-way: the decodes not started are dropped
                self.cancel(handle)

    def cancel(self, handle: Any) -> None:
        for f in handle[1]:
            f.cancel()

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
            if self._procs is not None:
                self._procs.shutdown(wait=False, cancel_futures=True)
                self._procs = None
