"""The rank's GPU decode and the choice of decoder: JPEG rows decoded by nvJPEG (torchvision) on the rank's device
and resized there as one batch (`GpuDecoder`, the CPU path of pipeline.data.decode for the other rows), and
`make_decoder`, which gives a rank the decoder data.decode=cpu|gpu|auto resolves to on it."""
from __future__ import annotations

import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional, Sequence, Tuple

import torch

from pipeline.data.crops import RowDecodeError, boxes_for, header
from pipeline.data.decode import Decoder, EncodedBatch, default_workers
from pipeline.images import MAX_PIXELS, is_jpeg, jpeg_frame
from pipeline.log import get_logger

log = get_logger(__name__)

# A row's bytes reach nvJPEG as a tensor over the bytes object itself (torch.frombuffer), not over a copy: a bytearray
# of every row cost ~4 ms per 256 photos on the host. torch warns that such a tensor is not writable; the decoder
# only reads it.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__)


# threads that decode batches on the device at once, each on its own stream: one batch's host work (headers, nvJPEG's
# Huffman stage, the padding copies) overlaps the next one's kernels; on an H100 one thread left the GPU 55-69 % busy
GPU_DECODE_THREADS = 2
# a batched resize pads its images to the tallest and widest among them: a batch's decoded images are resized in
# chunks (`resize_plan`) of at most RESIZE_CHUNK images (bounding their weights and outputs) whose padded size,
# count x (tallest + output size) x widest, stays within RESIZE_PIXELS positions (the padded copy and the row pass's
# product): at most ~290 MB of float32 at 3 channels, 64 ImageNet-sized photos (500 px) a chunk. A fixed count
# alone padded 64 mixed portrait and landscape 4032x3024 photos to 4032x4032 (12.5 GB of float32)
RESIZE_CHUNK = 64
RESIZE_PIXELS = 24_000_000


def resample_weights(start: torch.Tensor, length: torch.Tensor, size: int, total: int) -> torch.Tensor:
    """(n, size, total) weights that take each row's source span [start, start + length) along one axis to `size`
    outputs: bilinear with antialiasing, the triangle filter widened by the scale when shrinking, each output's window
    cut to the span and renormalised. Pillow's and torch's antialiased bilinear resize of the cropped span, as one
    matrix per row."""
    scale = length / size  # (n,)
    width = scale.clamp(min=1.0)
    centre = start[:, None] + (torch.arange(size, device=start.device, dtype=start.dtype) + 0.5) * scale[:, None]
    src = torch.arange(total, device=start.device, dtype=start.dtype) + 0.5  # pixel centres
    w = (1.0 - ((src[None, None, :] - centre[:, :, None]) / width[:, None, None]).abs()).clamp_(min=0.0)
    inside = (src[None, :] >= start[:, None]) & (src[None, :] < (start + length)[:, None])  # (n, total)
    w = w * inside[:, None, :]
    return w / w.sum(-1, keepdim=True).clamp_(min=1e-12)


def resize_plan(shapes: Sequence[Tuple[int, int]], size: int, budget: Optional[int] = None,
                most: Optional[int] = None) -> List[List[int]]:
    """The chunks in which images of (height, width) `shapes` are resized to `size` (`resized_crops`): lists of
    their indices (ascending within a chunk), every image in one. The images in order of (height, width), each chunk
    filled while it holds at most `most` images (RESIZE_CHUNK) and its padded size, count x (tallest + size) x widest,
    stays within `budget` positions (RESIZE_PIXELS); an image over the budget on its own is a chunk alone."""
    budget = RESIZE_PIXELS if budget is None else int(budget)
    most = max(1, RESIZE_CHUNK if most is None else int(most))
    chunks: List[List[int]] = []
    part: List[int] = []
    height = width = 0
    for k in sorted(range(len(shapes)), key=lambda i: (int(shapes[i][0]), int(shapes[i][1]))):
        h, w = int(shapes[k][0]), int(shapes[k][1])
        if part and (len(part) >= most or (len(part) + 1) * (max(height, h) + size) * max(width, w) > budget):
            chunks.append(sorted(part))
            part, height, width = [], 0, 0
        part.append(k)
        height, width = max(height, h), max(width, w)
    if part:
        chunks.append(sorted(part))
    return chunks


def put_rows(out: torch.Tensor, rows: Sequence[int], values: torch.Tensor) -> None:
    """`values` into rows `rows` (ascending) of `out`: a slice where they are consecutive, no index tensor."""
    if rows[-1] - rows[0] == len(rows) - 1:
        out[rows[0]:rows[-1] + 1] = values
    else:
        out[torch.tensor(list(rows), device=out.device)] = values


def padded_resize(images: Sequence[torch.Tensor], boxes: Sequence[Tuple], size: int) -> torch.Tensor:
    """One chunk of `resized_crops`: the images padded into one batch (to the tallest and widest of them) and resized
    by two batched matrix products (rows, then columns), a handful of kernels for the whole chunk."""
    device, channels = images[0].device, images[0].shape[0]
    height, width = max(int(i.shape[1]) for i in images), max(int(i.shape[2]) for i in images)
    padded = torch.zeros((len(images), channels, height, width), dtype=torch.uint8, device=device)
    # each image into its corner of the padded batch: a strided view per image and one multi-tensor copy, not a Python
    # slice assignment per image (~20 us of host time each, 5 ms per 256 photos)
    plane, frame = height * width, channels * height * width
    corners = [padded.as_strided(tuple(img.shape), (plane, width, 1), k * frame) for k, img in enumerate(images)]
    torch._foreach_copy_(corners, list(images))
    box = torch.tensor([b[:4] for b in boxes], dtype=torch.float32).to(device)
    rows = resample_weights(box[:, 1], box[:, 3], size, height)  # (n, size, height)
    cols = resample_weights(box[:, 0], box[:, 2], size, width)  # (n, size, width)
    flip = torch.tensor([bool(b[4]) for b in boxes]).to(device)
    cols = torch.where(flip[:, None, None], cols.flip(1), cols)  # a flipped box reads its columns right to left
    out = rows[:, None] @ padded.to(torch.float32) @ cols[:, None].transpose(-1, -2)  # (n, C, size, size)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def resized_crops(images: Sequence[torch.Tensor], boxes: Sequence[Tuple], size: int) -> torch.Tensor:
    """Each decoded (C, h, w) uint8 image's box (left, top, width, height, flip) resized to a (C, size, size) uint8
    square, flipped where its box says, in the images' order: the images resized in the chunks of `resize_plan`, each
    chunk padded into one batch and resized by two batched matrix products (`padded_resize`), a handful of kernels
    per chunk instead of several per image."""
    chunks = resize_plan([(int(i.shape[1]), int(i.shape[2])) for i in images], size)
    if len(chunks) == 1:  # one chunk holds every image, in order
        return padded_resize(images, boxes, size)
    out = torch.empty((len(images), images[0].shape[0], size, size), dtype=torch.uint8, device=images[0].device)
    for part in chunks:
        put_rows(out, part, padded_resize([images[i] for i in part], [boxes[i] for i in part], size))
    return out


class GpuDecoder(Decoder):
    """JPEG rows decoded by nvJPEG on `device` (one batched torchvision.io.decode_jpeg call per batch), cropped,
    resized and flipped there; the other rows on the CPU path (Decoder) within the same batch. The tensor comes back
    on `device`. `device` may be the CPU (torchvision's libjpeg-turbo decoder): the same code, for tests.

    `cpu_share` (data.decode_cpu_share): the last round(cpu_share x n) rows of each batch go to the CPU path's worker
    processes (`workers` > 1, the ring of pipeline.data.decode_workers) as the batch starts, and nvJPEG decodes the
    rest meanwhile: both decoders work on every batch (nvJPEG alone fed 5,100-5,600 img/s on an H200 while its 16
    cores sat idle). Which rows go where depends only on the share and the batch's size, never on timing, so a run
    gives the same tensors each time; a row gets the same box either way, its pixels within the two decoders'
    tolerance (tests/gpu/test_gpu_decode.py)."""

    name = "gpu"

    def __init__(self, size: int, channels: int, train: bool, seed: int, device: Any, workers: int = 1,
                 channels_last: bool = False, max_pixels: int = MAX_PIXELS, threads: int = GPU_DECODE_THREADS,
                 cpu_share: float = 0.0) -> None:
        super().__init__(size, channels, train, seed, workers, pin=False, channels_last=channels_last,
                         max_pixels=max_pixels)
        if not 0.0 <= float(cpu_share) <= 1.0:
            raise ValueError(f"config key 'data.decode_cpu_share': {cpu_share!r} is not between 0 and 1")
        self.cpu_share = float(cpu_share) if self.workers > 1 else 0.0  # one worker is a thread: no processes
        if float(cpu_share) > 0 and not self.cpu_share:
            log.warning("config key 'data.decode_cpu_share' is %g but this rank has 1 decode worker "
                        "(data.decode_workers or its cores per rank): nvJPEG decodes every row; the share needs 2 or "
                        "more workers",
                        float(cpu_share))
        self.device = torch.device(device)
        self.tv_io = import_decode_jpeg()
        self.threads = max(1, int(threads))
        self._streams = threading.local()  # each decode thread's own side stream
        self._gpu_pool: Optional[ThreadPoolExecutor] = None

    def header(self, content: Any, path: Any) -> Tuple[int, int, str]:
        """(width, height, format) of a row: a whole JPEG of 1 or 3 components within the pixel bound from its frame
        header alone (`jpeg_frame`, ~1 us: PIL's open cost ~27 us a row, 7 ms of host time per 256 photos on the H200),
        anything else through PIL (`crops.header`), which names the row where it cannot."""
        frame = jpeg_frame(content) if is_jpeg(content) else None
        if frame is None or frame[2] not in (1, 3) or frame[0] * frame[1] > self.max_pixels:
            return header(content, path, self.max_pixels)
        return frame[0], frame[1], "JPEG"

    def share_start(self, n: int) -> int:
        """The first row of a batch of `n` that the CPU's worker processes decode (`cpu_share`); n: none."""
        return n - int(round(self.cpu_share * n))

    def _decode_on_device(self, batch: EncodedBatch) -> torch.Tensor:
        n = len(batch.rows)
        start = self.share_start(n)
        share = self.submit_share(batch, start) if start < n else None
        if share is None:  # no share, or its rows do not go through the ring: this thread decodes them all
            start = n
        try:
            out = torch.empty((n, self.channels, self.size, self.size), dtype=torch.uint8, device=self.device,
                              memory_format=torch.channels_last if self.channels_last else torch.contiguous_format)
            self._decode_rows_on_device(out, batch, start)
        except BaseException:
            if share is not None:
                self.drop_share(share)
            raise
        if share is not None:  # the CPU's rows into their places (NHWC, as a channels_last batch holds them)
            self.take_ring(share, start, lambda host: out[start:].copy_(host.permute(0, 3, 1, 2)))
        return out

    def _decode_rows_on_device(self, out: torch.Tensor, batch: EncodedBatch, start: int) -> None:
        """Rows [0, start) of `batch` into `out`: the JPEG rows by nvJPEG and one batched resize, the others (and
        the JPEG rows of a batch nvJPEG refused) on the CPU in this thread."""
        rows, n = batch.rows[:start], len(batch.rows)
        headers = [self.header(c, p) for c, p in rows]
        boxes = boxes_for([h[:2] for h in headers], self.train, self.seed, batch.index, n)
        jpeg = [i for i in range(start) if headers[i][2] == "JPEG" and is_jpeg(rows[i, 0])]
        other = sorted(set(range(start)) - set(jpeg))
        decoded: List[Optional[torch.Tensor]] = [None] * start
        if jpeg:
            mode = self.tv_io.ImageReadMode.GRAY if self.channels == 1 else self.tv_io.ImageReadMode.RGB
            data = [torch.frombuffer(rows[i, 0], dtype=torch.uint8) for i in jpeg]
            try:
                images = self.tv_io.decode_jpeg(data, mode=mode, device=self.device)
            except RuntimeError as exc:  # one bad row fails the batched call: these rows go to the CPU path, which
                log.debug("nvJPEG refused a batch (%s); its JPEG rows are decoded on the CPU", exc)  # names it
                other, images = sorted(other + jpeg), []
            for i, img in zip(jpeg, images):
                decoded[i] = img
        done = [i for i in range(start) if decoded[i] is not None]
        for i in done:
            if decoded[i].shape[-2:] != (headers[i][1], headers[i][0]):  # the header and the decoder disagree
                raise RowDecodeError(f"row {rows[i, 1]}: decoded {tuple(decoded[i].shape[-2:])}, its header says "
                                     f"{headers[i][1]}x{headers[i][0]}")
        for chunk in resize_plan([tuple(decoded[i].shape[-2:]) for i in done], self.size):  # padding bounded
            part = [done[k] for k in chunk]
            put_rows(out, part, padded_resize([decoded[i] for i in part], [boxes[i] for i in part], self.size))
        if other:
            host = torch.empty((start, self.size, self.size, self.channels), dtype=torch.uint8)
            self._decode_rows(host, rows, boxes, other)
            idx = torch.tensor(other, device=self.device)
            out[idx] = host[other].permute(0, 3, 1, 2).to(self.device, non_blocking=False)

    def _run(self, batch: EncodedBatch) -> Tuple[torch.Tensor, Any]:
        if self.device.type != "cuda":
            return self._decode_on_device(batch), None
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(device=self.device)
        # a new thread's current device is cuda:0: the rank's device and this thread's stream are made current here
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            out = self._decode_on_device(batch)
            event = torch.cuda.Event()
            event.record(stream)
        return out, event

    def submit(self, batch: EncodedBatch) -> Any:
        if self.cpu_share and len(batch.rows):
            # the worker processes and their ring start here, in the consumer's thread and from the first batch in
            # order, not in whichever decode thread comes first (a short last batch would size the ring too small)
            self.processes(batch)
        with self._lock:
            if self._gpu_pool is None:  # batches are handed over in the order submitted, whichever thread ends first
                self._gpu_pool = ThreadPoolExecutor(self.threads, thread_name_prefix="decode-gpu")
            pool = self._gpu_pool
        return pool.submit(self._run, batch)

    def cancel(self, handle: Any) -> None:
        handle.cancel()

    def result(self, handle: Any) -> torch.Tensor:
        out, event = handle.result()
        if event is not None:  # the consumer's stream waits for the decode, and owns the memory from here
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            out.record_stream(current)
        return out.contiguous(memory_format=torch.channels_last) if self.channels_last else out

    def close(self) -> None:
        # the decode threads' queue goes; a thread still running ends on its own (its CPU share, should the processes
        # be gone by then, decoded in that thread)
        with self._lock:
            if self._gpu_pool is not None:
                self._gpu_pool.shutdown(wait=False, cancel_futures=True)
                self._gpu_pool = None
        super().close()


def import_decode_jpeg():
    """torchvision.io (decode_jpeg and ImageReadMode), or an ImportError saying what data.decode=gpu needs."""
    try:
        import torchvision.io as tv_io

        tv_io.decode_jpeg, tv_io.ImageReadMode  # noqa: B018  (present in torchvision >= 0.19's batched form)
    except Exception as exc:  # ImportError, or torchvision's RuntimeError when its build does not match torch
        raise ImportError(f"config key 'data.decode': gpu needs torchvision (torchvision.io.decode_jpeg) built for "
                          f"torch {torch.__version__}; importing it failed with {type(exc).__name__}: {exc}") from None
    return tv_io


def gpu_decode_problem() -> Optional[str]:
    """Why this process cannot decode on its GPU (no CUDA device, no usable torchvision), or None."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible to this rank"
    try:
        import_decode_jpeg()
    except ImportError as exc:
        return str(exc)
    return None


def resolve_decode(mode: str) -> str:
    """The decode this rank uses: data.decode, with auto made gpu on a CUDA rank that has torchvision, else cpu.

    Raises:
        ValueError: data.decode=gpu where the rank cannot (naming the key and why).
    """
    if mode not in ("cpu", "gpu", "auto"):
        raise ValueError(f"config key 'data.decode': {mode!r} is not cpu, gpu or auto for rows the ranks decode")
    if mode == "cpu":
        return "cpu"
    problem = gpu_decode_problem()
    if problem is None:
        return "gpu"
    if mode == "gpu":
        raise ValueError(f"config key 'data.decode' is gpu but {problem}; use data.decode=auto (gpu where it can) "
                         f"or cpu")
    return "cpu"


def make_decoder(mode: str, size: int, channels: int, train: bool, seed: int, world_size: int, workers: int = 0,
                 pin: bool = False, channels_last: bool = False, cpu_share: float = 0.0) -> Decoder:
    """The rank's decoder for data.decode=`mode` (cpu | gpu | auto, resolved here: `resolve_decode`); gpu on the
    current CUDA device, with `cpu_share` of each batch on the CPU's workers. `workers` 0: `default_workers`."""
    used = resolve_decode(mode)
    threads = workers or default_workers(world_size)
    if used == "gpu":
        return GpuDecoder(size, channels, train, seed, torch.device("cuda", torch.cuda.current_device()),
                          workers=threads, channels_last=channels_last, cpu_share=cpu_share)
    return Decoder(size, channels, train, seed, workers=threads, pin=pin, channels_last=channels_last)
