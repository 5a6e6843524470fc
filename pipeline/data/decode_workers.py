"""The CPU decode's worker processes and what they share with the rank: the ring of shared slots a batch is decoded
in (`Ring`, anonymous shared memory made before the fork), who still uses a slot (`SlotUse`), a worker's task
(`RingTask`: a slot's rows and their offsets, never the bytes), the worker's initializer and its decode of a task,
the way of a batch too large for a slot (`_shared_chunk`), and the row each worker is on (`Doing`: a worker that
dies is named with its row). `pipeline.data.decode.Decoder` drives them."""
from __future__ import annotations

import mmap
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  (its reductions send a shared tensor between processes as a handle)

from pipeline.data.crops import crop_draws, decode_chunk


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
    batch: int = -1  # the batch's index in its stream (what `Doing` records)


class DecodeWorkerDied(BrokenProcessPool):
    """A decode worker process ended in the middle of its work (a signal: the host's out-of-memory killer, a crash
    inside a decoder library): the message names the row(s) it was decoding and how it ended. The pool cannot go on
    (it ends its other workers), so the job stops."""


class Doing:
    """The row each decode worker process is on, in anonymous shared memory made before the fork: per worker its pid,
    the batch's index in its stream and the row in the batch (-1: between tasks). A worker writes two integers before
    each row; the rank reads them only once a worker died, to name the row it died on (`died`)."""

    def __init__(self, workers: int) -> None:
        self.workers = max(1, int(workers))
        self.memory = mmap.mmap(-1, 8 * 3 * self.workers)  # MAP_SHARED | MAP_ANONYMOUS: shared with a fork
        self.table = np.frombuffer(self.memory, dtype=np.int64).reshape(self.workers, 3)
        self.table[:] = (0, -1, -1)
        self._claim = multiprocessing.get_context("fork").Lock()  # inherited by the fork as the mapping is

    def claim(self) -> int:
        """In a worker, once: the row of the table it writes to (-1: none left)."""
        with self._claim:
            for i in range(self.workers):
                if self.table[i, 0] == 0:
                    self.table[i] = (os.getpid(), -1, -1)
                    return i
        return -1

    def in_flight(self) -> List[Tuple[int, int, int]]:
        """(pid, batch, row) of every worker that is on a row."""
        return [(int(pid), int(batch), int(row)) for pid, batch, row in self.table.tolist() if pid and row >= 0]


def exit_text(code: int) -> str:
    """A process's exit code as multiprocessing reports it (-N: killed by signal N) in words."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def ended_how(pid: int) -> Optional[str]:
    """How process `pid` ended, read from /proc without reaping it (the pool reaps its own children: one reaped by
    anyone else it would wait for forever): "killed by SIGKILL", "exit code 1", "ended" (already reaped: unknown);
    None while it runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return "ended"
    if fields[0] == "X":  # dead, being reaped right now
        return "ended"
    if fields[0] != "Z":
        return None
    status = int(fields[49]) if len(fields) > 49 else -1  # exit_code (Linux >= 3.5), as waitpid reports it
    if status < 0:
        return "ended"
    return exit_text(-(status & 0x7F) if status & 0x7F else status >> 8)


def pool_ended_how(procs: Any, deadline: float) -> Callable[[int], Optional[str]]:
    """`died`'s how_of for the workers of pool `procs`: the exit code the pool collected (kept on its Process, read
    without a system call), else what /proc says without reaping (`ended_how`); None if it still runs at `deadline`.
    The pool learns of a death when the process's pipes close, which is before the kernel has made it a zombie: the
    dying process, or one the pool reaped a moment ago, gets until `deadline` to show how it ended."""
    processes = getattr(procs, "_processes", None) or {}

    def how_of(pid: int) -> Optional[str]:
        popen = getattr(processes.get(pid), "_popen", None)
        while True:
            code = getattr(popen, "returncode", None)
            if code is not None:
                return exit_text(code)
            how = ended_how(pid)
            if (how is not None and (how != "ended" or popen is None)) or time.monotonic() > deadline:
                return how
            time.sleep(0.01)

    return how_of


def died(doing: Optional[Doing], path_of: Callable[[int, int], Optional[str]],
         how_of: Callable[[int], Optional[str]] = ended_how) -> DecodeWorkerDied:
    """The error for a decode pool broken by a worker's end: the rows the ended workers were on (`path_of(batch,
    row)`: the row's path, None when the rank no longer holds that batch; `how_of(pid)`: how it ended, None while it
    runs), a SIGTERM last (the pool's own, to the workers left once one died)."""
    rows = []
    for pid, batch, row in (doing.in_flight() if doing is not None else []):
        how = how_of(pid)
        if how is None:
            continue
        path = path_of(batch, row)
        where = f"row {path!r} (batch {batch}, row {row})" if path is not None else f"batch {batch}, row {row}"
        rows.append((how.endswith("SIGTERM"), f"worker {pid} ({how}) on {where}"))
    rows.sort(key=lambda r: r[0])
    what = "; ".join(text for _, text in rows)
    if rows and all(term for term, _ in rows):  # only the pool's own SIGTERMs: none died on its own
        return DecodeWorkerDied(f"the decode pool broke without a worker dying on its own (its cause is chained "
                                f"below) and ended its workers, which were decoding: {what}")
    if rows:
        return DecodeWorkerDied(f"a decode worker process ended while decoding: {what}. The decode pool cannot go on: "
                                f"a row that crashes the decoder, or the host ending the worker (out of memory), "
                                f"stops the job here; the pool ends its other workers with SIGTERM")
    return DecodeWorkerDied("a decode worker process ended between rows (none was being decoded): the host ended it "
                            "(out of memory?) or it crashed; the decode pool cannot go on")


_worker_ring: Optional[Ring] = None  # in a decode worker process: the ring it was forked with
_worker_doing: Optional[Doing] = None  # ... the table of rows in flight, and its row there
_worker_row = -1


def _start_worker(parent: int, ring: Optional[Ring], doing: Optional[Doing] = None) -> None:
    """A decode worker process's initializer: `_exit_with_parent`, the ring of its pool (inherited by the fork, never
    pickled), its row of the pool's `Doing`, and one torch thread: the pool forks in the thread that submits first,
    the consumer's, whose OpenMP team the fork copies without its threads, so a parallel torch op in the worker (a
    shared tensor's copy) would wait on them forever (seen: a batch too large for a slot hung); DataLoader's workers
    take one thread too.

    Signals: SIGTERM back to its default, SIGINT ignored. The fork copies the rank's Python handlers (the graceful
    stop's SIGTERM handler, Lightning's), and a worker running one survives the SIGTERM with which the pool ends its
    workers once one of them died; left alive, it kept its rank (and a test session) waiting at exit for ever. A
    Ctrl-C reaches the whole process group: the rank handles it and ends the pool."""
    global _worker_ring, _worker_doing, _worker_row
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    _worker_ring = ring
    _worker_doing, _worker_row = doing, (doing.claim() if doing is not None else -1)
    _exit_with_parent(parent)


def _noting(batch: int, lo: int) -> Optional[Callable[[int], None]]:
    """In a decode worker: decode_chunk's `on_row`, writing (batch, lo + i) to this worker's row of `Doing`."""
    if _worker_doing is None or _worker_row < 0:
        return None
    table, row = _worker_doing.table, _worker_row

    def note(i: int) -> None:
        table[row, 1:] = (batch, lo + i)

    return note


def _done_noting() -> None:
    if _worker_doing is not None and _worker_row >= 0:
        _worker_doing.table[_worker_row, 1:] = (-1, -1)


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
    try:
        decode_chunk(contents, paths, draws, task.size, task.channels, task.max_pixels,
                     out=out.reshape(k, task.size, task.size, task.channels), on_row=_noting(task.batch, task.lo))
    finally:
        _done_noting()


class RingBatch(NamedTuple):
    """A batch decoding in a slot of the ring: its rows, the slot's users, and its chunks' futures in batch order."""

    n: int
    use: SlotUse
    futures: List[Any]


def _shared_chunk(contents: Sequence[Any], paths: Sequence[Any], draws: Optional[np.ndarray], size: int,
                  channels: int, max_pixels: int, batch: int = -1, lo: int = 0) -> torch.Tensor:
    """In a decode worker process: `crops.decode_chunk` into a tensor in shared memory, whose handle travels back (a
    file descriptor, which the rank fetches through a connection to the worker). The way of a batch that does not
    fit a slot of the ring: its rows' bytes are pickled through the pool's one call pipe."""
    out = torch.empty((len(contents), size, size, channels), dtype=torch.uint8).share_memory_()
    try:
        decode_chunk(contents, paths, draws, size, channels, max_pixels, out=out.numpy(), on_row=_noting(batch, lo))
    finally:
        _done_noting()
    return out
