"""The hand-written references the pipeline is compared with: a bare pyarrow loop, plain training steps on batches
held in memory (one process, or several independent ones), and Horovod alone on such batches."""
from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

from bench.core import Sizes
from pipeline.config import Config
from pipeline.log import get_logger

log = get_logger(__name__)


def parquet_paths(converter) -> List[str]:
    """Local paths of a converter's Parquet files (file:// URLs or plain paths)."""
    from pipeline.lakehouse.delta import local_path

    paths = [local_path(u) for u in converter.file_urls]
    missing = [u for u, p in zip(converter.file_urls, paths) if p is None]
    if missing:
        raise ValueError(f"the bench reads converted files from the local filesystem only; {missing[0]} is not local")
    return paths


def pyarrow_batches(paths: List[str], transform, batch_size: int) -> Iterator[Tuple[Any, Any]]:
    """The hand-written reference: every row group of every file, then the same transform (the pixel rows of the
    row group, normalised per batch of rows) without shuffling; the last batch of a row group may be short.

    (Normalised per batch, not per row group: a float32 tensor for a whole row group is a fresh multi-MB allocation
    whose speed swings 4-10x with the allocator's state, which made the reference, not the loader, the noise.)
    """
    import pyarrow.parquet as pq
    import torch

    for path in paths:
        pf = pq.ParquetFile(path)
        for g in range(pf.num_row_groups):
            table = pf.read_row_group(g, columns=["pixels", "label_index"])
            pixels = transform.rows(table.column("pixels"))
            labels = torch.from_numpy(table.column("label_index").to_numpy().astype("int64"))
            for i in range(0, len(labels), batch_size):
                yield transform.normalize(pixels[i:i + batch_size]), labels[i:i + batch_size]


def pyarrow_pass(paths: List[str], transform, batch_size: int) -> int:
    """One timed pass of the reference; returns the rows read."""
    return sum(len(y) for _x, y in pyarrow_batches(paths, transform, batch_size))


def memory_batch_list(data, count: int = 32, batch_size: int = 0) -> List[Tuple[Any, Any]]:
    """Up to `count` full batches of real training rows (read as the reference loop reads them, gathered across row
    groups, which may be smaller than a batch), to be held in memory.

    The references train on the same images as the pipeline, so that only the loader and the framework differ.
    """
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from pipeline.data.batches import PixelsToTensor

    bs = batch_size or data.plan.train.batch_size
    transform = PixelsToTensor(data.channels, data.image_size)
    pixels, labels, rows = [], [], 0
    for path in parquet_paths(data.train):
        pf = pq.ParquetFile(path)
        for g in range(pf.num_row_groups):
            table = pf.read_row_group(g, columns=["pixels", "label_index"])
            pixels.append(np.array(transform.rows(table.column("pixels"))))
            labels.append(table.column("label_index").to_numpy().astype("int64"))
            rows += len(labels[-1])
            if rows >= count * bs:
                break
        if rows >= count * bs:
            break
    x, y = np.concatenate(pixels), np.concatenate(labels)
    full = min(count, len(y) // bs)
    if not full:
        raise ValueError(f"the bench needs at least one full batch of {bs} rows; {data.train.cache_dir_url} has "
                         f"{len(y)} train rows")
    return [(transform.normalize(x[i * bs:(i + 1) * bs]), torch.from_numpy(y[i * bs:(i + 1) * bs]))
            for i in range(full)]


def memory_batches(data, count: int = 32) -> Callable[[], Tuple[Any, Any]]:
    """The batches of `memory_batch_list`, served in turn."""
    cycle = itertools.cycle(memory_batch_list(data, count))
    return lambda: next(cycle)


def model_and_optimizer(cfg: Config, channels: int, classes: int, device):
    from pipeline.model.module import ImageClassifier

    model = ImageClassifier.from_config(cfg.model, channels, classes, cfg.model.lr)
    model.to(device).train()
    opt = model.configure_optimizers()["optimizer"]
    return model, opt


def step(model, opt, x, y) -> None:
    opt.zero_grad()
    loss = model.loss_fn(model(x), y)
    loss.backward()
    opt.step()


def timed_windows(step_fn, batch, warmup: int, steps: int, windows: int, sync: Callable[[], None],
                  device_sync: Callable[[], None] = lambda: None) -> Dict[str, Any]:
    """`warmup` untimed steps (their wall time apart, `warmup_s`), `sync()`, then `windows` timed stretches of `steps`
    steps: wall, wait and CPU time.
    `device_sync` (a GPU's queue drained) runs at every window's start and end, never inside a window."""
    times, waits, cpu_main, cpu_all = [], [], [], []
    t_warm = time.perf_counter()
    for _ in range(warmup):
        step_fn(*batch())
    device_sync()
    warmup_s = time.perf_counter() - t_warm
    sync()
    for _ in range(windows):
        device_sync()
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        wait = 0.0
        for _ in range(steps):
            tw = time.perf_counter()
            x, y = batch()
            wait += time.perf_counter() - tw
            step_fn(x, y)
        device_sync()
        times.append(time.perf_counter() - t0)
        cpu_all.append(time.process_time() - c0)
        cpu_main.append(time.thread_time() - m0)
        waits.append(wait)
    return {"steps": steps, "window_s": times, "wait_s": waits, "cpu_s": cpu_all, "main_thread_cpu_s": cpu_main,
            "warmup_s": warmup_s}


def horovod_alone(cfg: Config, data, warmup: int, steps: int, windows: int) -> Dict[str, Any]:
    """In a Horovod rank: the ImageClassifier's network with hvd.DistributedOptimizer on real batches held in memory,
    a hand-written loop (Horovod's own cost, without Lightning, the strategy or the loader)."""
    import horovod.torch as hvd
    import torch

    torch.manual_seed(cfg.train.seed)
    model, opt = model_and_optimizer(cfg, data.channels, max(2, len(data.class_names)), torch.device("cpu"))
    opt = hvd.DistributedOptimizer(opt, named_parameters=[("bench." + n, p) for n, p in model.named_parameters()])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    out = timed_windows(lambda x, y: step(model, opt, x, y), memory_batches(data), warmup, steps, windows,
                        lambda: hvd.allreduce(torch.zeros(1), name="bench.sync"))
    out["batch_size"] = data.plan.train.batch_size
    return out


def _solo_worker(cfg: Config, data, warmup: int, steps: int, windows: int, barrier, results) -> None:
    """Control: a plain process (no Horovod) training the same model on in-memory real batches, 1 thread."""
    import torch

    torch.set_num_threads(max(1, cfg.train.threads_per_rank))
    torch.manual_seed(cfg.train.seed)
    model, opt = model_and_optimizer(cfg, data.channels, max(2, len(data.class_names)), torch.device("cpu"))
    out = timed_windows(lambda x, y: step(model, opt, x, y), memory_batches(data), warmup, steps, windows,
                        lambda: barrier.wait(timeout=600))
    out["batch_size"] = data.plan.train.batch_size
    results.put(out)


def _collect(results, workers, timeout_s: float) -> List[Dict[str, Any]]:
    """One result per worker process; a worker that dies first (or the bound passing) is an error, not a wait."""
    import queue

    outs, deadline = [], time.monotonic() + timeout_s
    while len(outs) < len(workers):
        try:
            outs.append(results.get(timeout=2))
            continue
        except queue.Empty:
            pass
        dead = [w for w in workers if w.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"bench control process pid {dead[0].pid} exited with code {dead[0].exitcode} before "
                               f"reporting (its error is in the log above)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench control processes: {len(outs)} of {len(workers)} reported within {timeout_s:.0f} s")
    return outs


def solo_run(cfg: Config, data, procs: int, sizes: Sizes) -> Dict[str, Any]:
    """`procs` independent plain processes at once (their timed windows start together): samples/s per window."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_solo_worker, args=(cfg, data, sizes.warmup_steps, sizes.hvd_steps,
                                                      sizes.repeats, barrier, results)) for _ in range(procs)]
    for w in workers:
        w.start()
    try:
        outs = _collect(results, workers, cfg.train.start_timeout_s + 600)
    finally:
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
    return {"samples_per_s": [sum(o["batch_size"] * o["steps"] / o["window_s"][i] for o in outs)
                              for i in range(sizes.repeats)]}
