"""The rank's decode stage: encoded image rows -> the ImageNet recipe's crops as uint8 batches, decoded on the CPU in
worker processes (libjpeg-turbo, torch) or on the rank's GPU (nvJPEG through torchvision), the same crops either way.

With `data.decode=cpu|gpu|auto` the converter keeps each row's encoded bytes and path; the batch assembler shuffles
them as it shuffles pixel rows and hands over `EncodedBatch`es, which a `Decoder` turns into tensors:

- Crops. Training takes a random resized crop (area 8-100 % of the image, aspect 3/4-4/3, torchvision's rule) and a
  horizontal flip; validation the central 87.5 % (the 224-of-256 "resize and center crop"). Either is a box in the
  source image resized to `data.image_size` square. The random draws of a batch depend only on (seed, batch index),
  never on the image sizes or the thread that decodes, so a batch is the same on every run, on the CPU or the GPU, and
  after a resume that skipped batches.
- CPU: libjpeg-turbo (simplejpeg; Pillow for other formats) decodes and torch's antialiased bilinear resizes the box
  (pipeline.data.crops), in `workers` processes (one: a thread). Each batch is cut into one chunk per worker, and the
  next batches are decoded while this one trains. The processes share a ring of slots with the rank (`Ring`:
  anonymous shared memory inherited at the fork): a batch's encoded bytes are written into a slot, each process is
  sent its rows' offsets (a few KB) and decodes them into the slot's pixel rows, and the rank copies the batch out of
  the slot.
- GPU (pipeline.data.gpu_decode): the JPEG rows of a batch are decoded in one batched nvJPEG call on the rank's
  device, then cropped, resized (bilinear, antialiased as the CPU path's) and flipped there, the whole batch in two
  matrix products; rows that are not JPEG, and the JPEG rows of a batch nvJPEG refused, are decoded on the CPU path
  within the same batch.
- Every row's header is read first (once, for its box and its decode, on the CPU path), through `pipeline.images`
  (the pixel bound and the format allow-list): an undecodable or over-large image stops the job with a
  `RowDecodeError` naming the row's path, on both paths. A worker process that dies on a row (a crash inside a
  decoder library, the host's out-of-memory killer) stops it with a `DecodeWorkerDied` naming that row and the signal.
"""
from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from pipeline.data.crops import (CROP_RATIO, CROP_SCALE, DECODE_MODES, DRAWS, VAL_CROP, RowDecodeError,  # noqa: F401
                                 boxes_for, center_crop_decode, crop_draws, decode_chunk, decode_crop, header,
                                 train_box, val_box)
from pipeline.data.decode_workers import (RING_INPUT_FACTOR, RING_MIN_INPUT, RING_SLOTS, DecodeWorkerDied,  # noqa: F401
                                          Doing, Ring, RingBatch, RingTask, SlotUse, _ring_chunk, _shared_chunk,
                                          _start_worker, died, input_bytes, pool_ended_how)
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


def _host_copy(out: torch.Tensor, src: torch.Tensor) -> None:
    """`src` into `out` (host tensors of one shape) on this thread alone, through numpy. torch's copy_ of a batch
    (~19 MB) splits it over the rank's intra-op threads, whose OpenMP team then spins waiting for more work: measured
    here, the spinning cost the rank ~85 us of CPU per photo, a third of a core on 2 cores, taken from the decode
    workers (docs/PERFORMANCE.md, 2026-11-29)."""
    np.copyto(out.numpy(), src.numpy())


class Decoder:
    """Decodes `EncodedBatch`es on the CPU into uint8 (N, C, size, size) tensors, batches decoded ahead of the
    consumer. `train`: random resized crops and flips (seeded by `seed` and the batch index); else the central crop.
    `pin`: the batches in pinned memory (a CUDA rank copies them asynchronously).

    `workers` 1: in a thread of the rank. More: in `workers` processes (forked once, as DataLoader's workers are),
    each decoding a share of every batch (headers, boxes, decodes: crops.decode_chunk) in a slot of the ring they
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
        self._doing: Optional[Doing] = None  # the row each worker process is on (names the row a dead worker was on)
        self._recent: "OrderedDict[int, np.ndarray]" = OrderedDict()  # batch index -> paths, of the last batches
        self._lock = threading.Lock()
        self.handovers: Counter = Counter()  # batches decoded by the processes: "ring" or "pickled" (did not fit)

    def processes(self, first: Optional[EncodedBatch] = None, start: bool = True) -> Optional[ProcessPoolExecutor]:
        """The decode worker processes (workers > 1), started on first use of a pass with the ring of slots sized by
        `first` (the first batch submitted; none: no ring, every batch pickled); None: decode in the rank's threads.
        Only the consumer's thread starts them (`start`; they are forked right here, in that thread): a decode thread
        asks with `start=False` and, once close() ended the pass under it, gets None and decodes in its own thread.
        The next pass (a resumed stream, the next fit) starts them again."""
        if self.workers <= 1:
            return None
        with self._lock:
            if self._procs is None and start:
                import multiprocessing

                self._ring = self._make_ring(first) if first is not None else None
                self._doing = Doing(self.workers)
                # fork, as DataLoader's workers on Linux: spawn and forkserver re-run the user's main module in
                # every worker (a notebook's or a script's without a __main__ guard fails); a worker only decodes
                # (numpy, simplejpeg, Pillow, torch on one thread), never touches CUDA or the rank's other threads'
                # state. The fork also gives the workers the ring's mapping, which no other start method could pass
                self._procs = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"),
                                                  initializer=_start_worker,
                                                  initargs=(os.getpid(), self._ring, self._doing))
                # a fork pool forks all its workers at its first submit: this one, in this thread, not a later
                # one in a decode thread (a fork beside a thread inside nvJPEG or torch copies its held locks)
                self._procs.submit(int)
            return self._procs

    def _make_ring(self, first: EncodedBatch) -> Optional[Ring]:
        """RING_SLOTS slots of len(first) rows, their input areas RING_INPUT_FACTOR times its bytes (where the host
        cannot map that much, once its bytes); None when it holds a row without bytes, or no ring can be mapped.

        Only the pages written cost memory, but the kernel's default overcommit refuses one mapping larger than the
        host's memory and swap: a first batch of ~10 MB photos (256 rows) asked ~30 GB of it. Without a ring every
        batch's rows are pickled to the workers (slower, never wrong)."""
        used = input_bytes(first.rows)
        if used is None or len(first.rows) == 0:
            return None
        row_bytes = self.size * self.size * self.channels
        for factor in (RING_INPUT_FACTOR, 1):
            try:
                return Ring(RING_SLOTS, len(first.rows), row_bytes, max(RING_MIN_INPUT, factor * used))
            except OSError as exc:
                wanted = RING_SLOTS * (len(first.rows) * row_bytes + max(RING_MIN_INPUT, factor * used))
                log.warning("the decode ring (%d slots, %.1f GB for batch %d's %d rows of %.1f MB of encoded bytes) "
                            "could not be mapped: %s", RING_SLOTS, wanted / 1e9, first.index, len(first.rows),
                            used / 1e6, exc)
        log.warning("decoding without the ring: each batch's rows are pickled to the decode workers")
        return None

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
        _host_copy(out, nchw)
        return out

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
            self._remember(batch)
            handle = self._submit_to_ring(procs, batch, chunk)
            self._count("ring" if handle is not None else "pickled")
            if handle is not None:
                return handle
        out, pool = self._empty(n), self.pool()
        if procs is not None:  # each process: its share's headers, boxes and decodes; a thread here copies it back
            draws = crop_draws(self.seed, batch.index, n) if self.train else None
            view = out.numpy()

            def share(lo: int) -> None:
                hi = min(n, lo + chunk)
                share_draws = None if draws is None else draws[lo:hi]
                try:
                    future = procs.submit(_shared_chunk, list(batch.rows[lo:hi, 0]), list(batch.rows[lo:hi, 1]),
                                          share_draws, self.size, self.channels, self.max_pixels, int(batch.index), lo)
                except RuntimeError as exc:
                    if self._procs is procs or isinstance(exc, BrokenProcessPool):  # a broken pool names its row
                        raise
                    # close() (another thread's) ended the pass after this batch was submitted: the shut pool refuses
                    # new work, so this thread decodes the share itself, as a pass's own threads do
                    log.debug("the decode pool closed under batch %d: its rows %d-%d decode in this thread",
                              batch.index, lo, hi - 1)
                    decode_chunk(batch.rows[lo:hi, 0], batch.rows[lo:hi, 1], share_draws, self.size, self.channels,
                                 self.max_pixels, out=view[lo:hi])
                    return
                view[lo:hi] = future.result().numpy()

            return out, [pool.submit(share, lo) for lo in range(0, n, chunk)]
        draws, view = (crop_draws(self.seed, batch.index, n) if self.train else None), out.numpy()

        def part(lo: int) -> None:  # each row's header read once, for its box and its decode
            hi = min(n, lo + chunk)
            decode_chunk(batch.rows[lo:hi, 0], batch.rows[lo:hi, 1], None if draws is None else draws[lo:hi],
                         self.size, self.channels, self.max_pixels, out=view[lo:hi])

        return out, [pool.submit(part, lo) for lo in range(0, n, chunk)]

    def _submit_to_ring(self, procs: ProcessPoolExecutor, batch: EncodedBatch, chunk: int,
                        start: int = 0) -> Optional[RingBatch]:
        """`batch`'s rows [start, n) written into a free slot of the ring and their chunks sent to the processes (each
        row decoded into the slot's row of its place in the batch, with its own crop draws); None when they do not fit
        a slot or no slot frees in time (`Ring.take`)."""
        ring, n = self._ring, len(batch.rows)
        if ring is None or n > ring.rows:
            return None
        used = input_bytes(batch.rows[start:])
        if used is None or used > ring.input_bytes:
            return None
        slot = ring.take()
        if slot is None:
            log.debug("no free slot in the decode ring for batch %d: its rows go pickled", batch.index)
            return None
        use, futures = SlotUse(ring, slot), []
        try:
            for task in self.ring_tasks(slot, batch, ring.write_input(slot, batch.rows[start:]), chunk, start):
                use.add_chunk()
                try:
                    future = procs.submit(_ring_chunk, task)
                except BaseException:
                    use.chunk_done()
                    raise
                future.add_done_callback(use.chunk_done)
                futures.append(future)
        except BaseException as exc:
            for f in futures:
                f.cancel()
            use.release()
            if isinstance(exc, RuntimeError) and not isinstance(exc, BrokenProcessPool) and self._procs is not procs:
                # close() ended the pass between this thread's ask and its submit (the pool refuses new work once
                # shut down): a decode thread's share decodes in that thread, as when it asks after close()
                log.debug("the decode pool closed under batch %d's share: its rows decode in this thread",
                          batch.index)
                return None
            raise
        return RingBatch(n, use, futures)

    def ring_tasks(self, slot: int, batch: EncodedBatch, offsets: np.ndarray, chunk: int,
                   start: int = 0) -> List[RingTask]:
        """What the processes are sent for `batch`'s rows [start, n) in `slot` (their `offsets` there, row `start`
        first): one task per `chunk` rows."""
        n = len(batch.rows)
        draws = (self.seed, int(batch.index), n) if self.train else None
        return [RingTask(slot, lo, min(n, lo + chunk), offsets[2 * (lo - start):2 * (min(n, lo + chunk) - start) + 1],
                         draws, self.size, self.channels, self.max_pixels, int(batch.index))
                for lo in range(start, n, chunk)]

    def submit_share(self, batch: EncodedBatch, start: int) -> Optional[RingBatch]:
        """Start decoding rows [start, n) of `batch` in the worker processes (the CPU's share of a batch the GPU
        decodes the rest of: `gpu_decode.GpuDecoder`), each row with its crop draws at its place in the batch; None
        where there are no processes or the rows do not go through the ring (the caller decodes them itself).
        `take_ring` waits for them."""
        n = len(batch.rows)
        procs = self.processes(batch, start=False) if start < n else None  # started by the consumer's submit
        if procs is None:
            return None
        self._remember(batch)
        handle = self._submit_to_ring(procs, batch, max(1, math.ceil((n - start) / self.workers)), start)
        if handle is not None:
            self._count("ring")
        return handle

    def _remember(self, batch: EncodedBatch, keep: int = 16) -> None:
        """`batch`'s paths, kept for its decode's errors while it is among the last `keep` batches sent to the
        processes (those decoding, a few at a time)."""
        with self._lock:
            self._recent[int(batch.index)] = batch.rows[:, 1].copy()  # the paths alone: a view would keep the bytes
            self._recent.move_to_end(int(batch.index))
            while len(self._recent) > keep:
                self._recent.popitem(last=False)

    def _path_of(self, batch: int, row: int) -> Optional[str]:
        with self._lock:
            paths = self._recent.get(batch)
        return str(paths[row]) if paths is not None and 0 <= row < len(paths) else None

    def _wait(self, futures: Iterable[Any]) -> None:
        """Each future's result, in batch order: the first error (a RowDecodeError naming its row) is raised here; a
        pool broken by a worker's end as DecodeWorkerDied, naming the row it was on."""
        try:
            for f in futures:
                f.result()
        except DecodeWorkerDied:
            raise
        except BrokenProcessPool as exc:
            # one deadline for all of them: the pool ends the others right after the first
            raise died(self._doing, self._path_of, pool_ended_how(self._procs, time.monotonic() + 2.0)) from exc

    def _count(self, handover: str) -> None:
        with self._lock:  # the share's batches are submitted from several decode threads
            self.handovers[handover] += 1

    def drop_share(self, handle: RingBatch) -> None:
        """`submit_share`'s rows are not wanted after all: its chunks not started are dropped, and its slot frees once
        the started ones end."""
        Decoder.cancel(self, handle)

    def take_ring(self, handle: RingBatch, start: int, consume: Callable[[torch.Tensor], Any]) -> Any:
        """Waits for a batch's rows [start, n) decoding in the ring (`_submit_to_ring`, `submit_share`) and returns
        `consume` of them, a uint8 (n - start, size, size, channels) view of the shared slot, valid only during the
        call: the slot is the next batches' once released, here, however the call ends."""
        try:
            self._wait(handle.futures)
            view = handle.use.ring.output(handle.use.slot, handle.n, (self.size, self.size, self.channels))
            return consume(view[start:])
        except BaseException:
            for f in handle.futures:
                f.cancel()
            raise
        finally:
            handle.use.release()

    def result(self, handle: Any) -> torch.Tensor:
        if isinstance(handle, RingBatch):
            try:
                out = self._empty(handle.n)  # a batch of its own, copied out of the slot
            except BaseException:
                self.cancel(handle)  # the slot goes back (take_ring would have released it)
                raise
            self.take_ring(handle, 0, lambda view: _host_copy(out, view))
            return self._layout(out)
        out, futures = handle
        self._wait(futures)
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
        """The end of a pass: the threads and processes go (a decode thread still running ends on its own); the next
        submit starts them again."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
            if self._procs is not None:
                self._procs.shutdown(wait=False, cancel_futures=True)
                self._procs = None
            self._ring = None  # unmapped when the last batch decoding in it is done with
