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
  The processes share a ring of slots with the rank (`Ring`: anonymous shared memory inherited at the fork): a
  batch's encoded bytes are written into a slot, each process is sent its rows' offsets (a few KB) and decodes them
  into the slot's pixel rows, and the rank copies the batch out of the slot.
- GPU (pipeline.data.gpu_decode): the JPEG rows of a batch are decoded in one batched nvJPEG call on the rank's device, then cropped, resized
  (bilinear, antialiased as Pillow's) and flipped there, the whole batch in two matrix products; rows that are not
  JPEG, and the JPEG rows of a batch nvJPEG refused, are decoded on the CPU path within the same batch.
- Every row's header is read first, through `pipeline.images` (the pixel bound and the format allow-list): an
  undecodable or over-large image stops the job with a `RowDecodeError` naming the row's path, on both paths.
"""
from __future__ import annotations

import math
import mmap
import os
import threading
from collections import Counter, deque
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


RING_SLOTS = 3  # the batches decoded ahead (Decoder.batches' depth 2) and one more, for a slot still draining (the
#                 chunks of a batch cancelled mid-way run to their end) when the next batches are submitted; the batch
#                 handed over holds none: it is copied out of its slot first
RING_INPUT_FACTOR = 4  # a slot's input area: this many times the first batch's encoded bytes, and ...
RING_MIN_INPUT = 1 << 20  # ... at least 1 MiB (a first batch of a few thumbnails)
RING_WAIT_S = 10.0  # the longest a submit waits for a draining slot, then its batch goes the way of a batch too large


class Ring:
    """Slots of anonymous shared memory, made before the decode workers are forked (who inherit the mapping): each an
    output area of `rows` decoded rows of `row_bytes` (a batch's NHWC uint8) and an input area of `input_bytes`, a
    batch's encoded bytes and paths. The shared pages are backed as they are first written (here: a 1 GiB map added
    nothing to the host's Shmem until 10 MiB were written, then 10 MiB), so the input area costs what the largest
    batch wrote into it, not its size: 4x the first batch's bytes leaves room for batches of larger photos at no cost
    to the usual ones (256 ImageNet rows: ~28 MB written, 38.5 MB of pixels; 3 slots ~200 MB).

    A slot is taken by a submit and given back once the rank is done with its batch (copied out, or cancelled) and
    every chunk sent to the workers has ended (decoded, failed or cancelled): a worker still decoding a cancelled
    batch never writes into a slot that holds the next one."""

    def __init__(self, slots: int, rows: int, row_bytes: int, input_bytes: int) -> None:
        self.slots, self.rows, self.row_bytes = int(slots), int(rows), int(row_bytes)
        self.input_bytes = int(input_bytes)
        self.out_bytes = self.rows * self.row_bytes
        self.slot_bytes = self.out_bytes + self.input_bytes
        self.memory = mmap.mmap(-1, self.slots * self.slot_bytes)  # MAP_SHARED | MAP_ANONYMOUS: shared with a fork
        self._free = list(range(self.slots))
        self._draining: set = set()  # slots the rank is done with whose chunks still run
        self._cond = threading.Condition()

    def take(self, wait_s: float = RING_WAIT_S) -> Optional[int]:
        """A free slot; None when there is none within `wait_s`. It waits only while a slot is draining: a slot
        whose batch was not yet copied out frees when its consumer takes it, which may be this very thread."""
        with self._cond:
            self._cond.wait_for(lambda: self._free or not self._draining, timeout=wait_s)
            return self._free.pop(0) if self._free else None

    def give(self, slot: int) -> None:
        with self._cond:
            self._draining.discard(slot)
            self._free.append(slot)
            self._cond.notify_all()

    def draining(self, slot: int) -> None:
        with self._cond:
            self._draining.add(slot)

    def write_input(self, slot: int, rows: np.ndarray) -> np.ndarray:
        """(n, 2) rows of (bytes, path) into `slot`'s input area, a row's bytes then its path (str, UTF-8); the
        (2n + 1) offsets in the area: row i's bytes at [2i, 2i + 1), its path at [2i + 1, 2i + 2)."""
        base = slot * self.slot_bytes + self.out_bytes
        offsets = np.zeros(2 * len(rows) + 1, dtype=np.int64)
        pos = 0
        for i, (content, path) in enumerate(rows):
            for k, piece in enumerate((content, str(path).encode())):
                self.memory[base + pos:base + pos + len(piece)] = piece
                pos += len(piece)
                offsets[2 * i + 1 + k] = pos
        return offsets

    def output(self, slot: int, rows: int, shape: Tuple[int, ...]) -> torch.Tensor:
        """`slot`'s first `rows` decoded rows: a (rows, *shape) uint8 tensor over the shared memory (no copy)."""
        return torch.frombuffer(self.memory, dtype=torch.uint8, count=rows * self.row_bytes,
                                offset=slot * self.slot_bytes).view(rows, *shape)


def input_bytes(rows: np.ndarray) -> Optional[int]:
    """What (n, 2) rows of (bytes, path) take in a slot's input area; None when a row holds no bytes (the batch goes
    the old way, whose worker names the row)."""
    total = 0
    for content, path in rows:
        if not isinstance(content, (bytes, bytearray)):
            return None
        total += len(content) + len(str(path).encode())
    return total


class SlotUse:
    """Who still uses a taken slot: the rank (until `release`) and the chunks sent to the workers (`add_chunk`, then
    `chunk_done` as each future ends, however); the slot goes back to the ring with the last of them."""

    def __init__(self, ring: Ring, slot: int) -> None:
        self.ring, self.slot = ring, slot
        self._users, self._released = 1, False
        self._lock = threading.Lock()

    def add_chunk(self) -> None:
        with self._lock:
            self._users += 1

    def chunk_done(self, _future: Any = None) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self.ring.give(self.slot)

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            self._users -= 1
            if self._users == 0:
                self.ring.give(self.slot)
            else:
                self.ring.draining(self.slot)


class RingTask(NamedTuple):
    """What a decode worker is sent for its chunk of a batch in the ring: rows [lo, hi) of `slot`, their offsets in
    its input area (Ring.write_input's, 2 (hi - lo) + 1 of them), and the crop draws as (seed, batch index, batch
    rows), drawn again there in microseconds (the draws themselves are 184 bytes a row: 47 KB for 256 rows)."""

    slot: int
    lo: int
    hi: int
    offsets: np.ndarray
    draws: Optional[Tuple[int, int, int]]
    size: int
    channels: int
    max_pixels: int


_worker_ring: Optional[Ring] = None  # in a decode worker process: the ring it was forked with


def _start_worker(parent: int, ring: Optional[Ring]) -> None:
    """A decode worker process's initializer: `_exit_with_parent`, the ring of its pool (inherited by the fork, never
    pickled), and one torch thread: the pool forks in the thread that submits first, the consumer's, whose OpenMP
    team the fork copies without its threads, so a parallel torch op in the worker (a shared tensor's copy) would wait
    on them forever (seen: a batch too large for a slot hung); DataLoader's workers take one thread too."""
    global _worker_ring
    torch.set_num_threads(1)
    _worker_ring = ring
    _exit_with_parent(parent)


def _ring_chunk(task: RingTask) -> None:
    """In a decode worker process: `crops.decode_chunk` of the task's rows, read from its slot's input area and
    decoded into the slot's output rows. Raises RowDecodeError naming a row."""
    ring = _worker_ring
    assert ring is not None, "a ring task sent to a decode worker forked without a ring"
    base = task.slot * ring.slot_bytes
    mem, at, off = ring.memory, base + ring.out_bytes, task.offsets
    k = task.hi - task.lo
    contents = [mem[at + off[2 * j]:at + off[2 * j + 1]] for j in range(k)]
    paths = [mem[at + off[2 * j + 1]:at + off[2 * j + 2]].decode() for j in range(k)]
    draws = None if task.draws is None else crop_draws(*task.draws)[task.lo:task.hi]
    out = np.frombuffer(mem, dtype=np.uint8, count=k * ring.row_bytes, offset=base + task.lo * ring.row_bytes)
    decode_chunk(contents, paths, draws, task.size, task.channels, task.max_pixels,
                 out=out.reshape(k, task.size, task.size, task.channels))


class RingBatch(NamedTuple):
    """A batch decoding in a slot of the ring: its rows, the slot's users, and its chunks' futures in batch order."""

    n: int
    use: SlotUse
    futures: List[Any]


def _shared_chunk(contents: Sequence[Any], paths: Sequence[Any], draws: Optional[np.ndarray], size: int,
                  channels: int, max_pixels: int) -> torch.Tensor:
    """In a decode worker process: `crops.decode_chunk` into a tensor in shared memory, whose handle travels back (a
    file descriptor, which the rank fetches through a connection to the worker). The way of a batch that does not
    fit a slot of the ring: its rows' bytes are pickled through the pool's one call pipe."""
    out = torch.empty((len(contents), size, size, channels), dtype=torch.uint8).share_memory_()
    decode_chunk(contents, paths, draws, size, channels, max_pixels, out=out.numpy())
    return out


class Decoder:
    """Decodes `EncodedBatch`es on the CPU into uint8 (N, C, size, size) tensors, batches decoded ahead of the
    consumer. `train`: random resized crops and flips (seeded by `seed` and the batch index); else the central crop.
    `pin`: the batches in pinned memory (a CUDA rank copies them asynchronously).

    `workers` 1: in a thread of the rank. More: in `workers` processes (forked once, as DataLoader's workers are),
    each decoding a share of every batch (headers, boxes, Pillow: crops.decode_chunk) in a slot of the ring they
    share with the rank (`Ring`), from which the rank copies the batch out. A batch that does not fit a slot (more
    rows than the first batch, or more bytes than a slot's input area) has its shares' bytes pickled to the
    processes and their pixels handed back as shared tensors, through threads of the rank.
    Threads alone do not scale: on the H100 machine 16 threads decoded 2.3x what one did, and here 2 threads of plain
    Pillow decoded no more than one (Pillow's JPEG path holds the GIL for most of a decode). Nor did the shared tensor
    per share: 16 workers decoded fewer images than 4 (each share's file descriptor fetched through a connection to
    its worker, each share's bytes pickled through the pool's one call pipe)."""

    name = "cpu"

    def __init__(self, size: int, channels: int, train: bool, seed: int, workers: int = 1, pin: bool = False,
                 channels_last: bool = False, max_pixels: int = MAX_PIXELS) -> None:
        self.size, self.channels, self.train, self.seed = int(size), int(channels), bool(train), int(seed)
        self.workers = max(1, int(workers))
        self.pin, self.channels_last, self.max_pixels = pin, channels_last, max_pixels
        self._pool: Optional[ThreadPoolExecutor] = None
        self._procs: Optional[ProcessPoolExecutor] = None
        self._ring: Optional[Ring] = None
        self._lock = threading.Lock()
        self.handovers: Counter = Counter()  # batches decoded by the processes: "ring" or "pickled" (did not fit)

    def processes(self, first: Optional[EncodedBatch] = None) -> Optional[ProcessPoolExecutor]:
        """The decode worker processes (workers > 1), started on first use with the ring of slots sized by `first`
        (the first batch submitted; none: no ring, every batch pickled); None: decode in the rank's threads."""
        if self.workers <= 1:
            return None
        with self._lock:
            if self._procs is None:
                import multiprocessing

                self._ring = self._make_ring(first) if first is not None else None
                # fork, as DataLoader's workers on Linux: spawn and forkserver re-run the user's main module in
                # every worker (a notebook's or a script's without a __main__ guard fails); a worker only decodes
                # (numpy, Pillow), never touches CUDA or the rank's other threads' state. The fork also gives the
                # workers the ring's mapping, which no other start method could pass
                self._procs = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"),
                                                  initializer=_start_worker, initargs=(os.getpid(), self._ring))
            return self._procs

    def _make_ring(self, first: EncodedBatch) -> Optional[Ring]:
        """RING_SLOTS slots of len(first) rows, their input areas RING_INPUT_FACTOR times its bytes; None when it
        holds a row without bytes."""
        used = input_bytes(first.rows)
        if used is None or len(first.rows) == 0:
            return None
        return Ring(RING_SLOTS, len(first.rows), self.size * self.size * self.channels,
                    max(RING_MIN_INPUT, RING_INPUT_FACTOR * used))

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
        if n == 0:
            return self._empty(0), []
        procs = self.processes(batch)
        chunk = max(1, math.ceil(n / self.workers))
        if procs is not None:
            handle = self._submit_to_ring(procs, batch, chunk)
            if handle is not None:
                self.handovers["ring"] += 1
                return handle
            self.handovers["pickled"] += 1
        out, pool = self._empty(n), self.pool()
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

    def _submit_to_ring(self, procs: ProcessPoolExecutor, batch: EncodedBatch, chunk: int) -> Optional[RingBatch]:
        """`batch` written into a free slot of the ring and its chunks sent to the processes; None when it does not
        fit a slot or no slot frees in time (`Ring.take`)."""
        ring, n = self._ring, len(batch.rows)
        if ring is None or n > ring.rows:
            return None
        used = input_bytes(batch.rows)
        if used is None or used > ring.input_bytes:
            return None
        slot = ring.take()
        if slot is None:
            log.debug("no free slot in the decode ring for batch %d: its rows go pickled", batch.index)
            return None
        use, futures = SlotUse(ring, slot), []
        try:
            for task in self.ring_tasks(slot, batch, ring.write_input(slot, batch.rows), chunk):
                use.add_chunk()
                try:
                    future = procs.submit(_ring_chunk, task)
                except BaseException:
                    use.chunk_done()
                    raise
                future.add_done_callback(use.chunk_done)
                futures.append(future)
        except BaseException:
            for f in futures:
                f.cancel()
            use.release()
            raise
        return RingBatch(n, use, futures)

    def ring_tasks(self, slot: int, batch: EncodedBatch, offsets: np.ndarray, chunk: int) -> List[RingTask]:
        """What the processes are sent for `batch` in `slot` (its rows' `offsets` there): one task per `chunk` rows."""
        n = len(batch.rows)
        draws = (self.seed, int(batch.index), n) if self.train else None
        return [RingTask(slot, lo, min(n, lo + chunk), offsets[2 * lo:2 * min(n, lo + chunk) + 1], draws, self.size,
                         self.channels, self.max_pixels) for lo in range(0, n, chunk)]

    def result(self, handle: Any) -> torch.Tensor:
        if isinstance(handle, RingBatch):
            try:
                for f in handle.futures:
                    f.result()  # the first error (a RowDecodeError naming its row) is raised here, in batch order
                out = self._empty(handle.n)  # a batch of its own: the slot is the next batches' once released
                out.copy_(handle.use.ring.output(handle.use.slot, handle.n, out.shape[1:]))
            except BaseException:
                for f in handle.futures:
                    f.cancel()
                raise
            finally:
                handle.use.release()
            return self._layout(out)
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
        futures = handle.futures if isinstance(handle, RingBatch) else handle[1]
        for f in futures:
            f.cancel()
        if isinstance(handle, RingBatch):
            handle.use.release()  # the slot frees when its chunks that had started end

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
            if self._procs is not None:
                self._procs.shutdown(wait=False, cancel_futures=True)
                self._procs = None
            self._ring = None  # unmapped when the last batch decoding in it is done with
