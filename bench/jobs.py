"""Running bench work in Horovod rank processes: one job is a sequence of timed runs (the product's train() with the
HorovodStrategy, or a reference loop) in the same ranks, so that what is compared shares processes and conditions."""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional

from pipeline.config import Config
from pipeline.log import get_logger
from pipeline.tracking.runs import temporary_env

log = get_logger(__name__)

# run kinds: "train" = pipeline.distributed.loop.train() with HorovodStrategy, over the real ShardLoader
# (source "loader") or over real batches held in memory (source "memory"); "horovod_alone" = the hand-written loop
# with hvd.DistributedOptimizer on batches held in memory; "plain" = a plain PyTorch loop (no Horovod) on batches
# held in memory on this rank's device.


def run_spec(kind: str, warmup: int, source: str = "memory", precision: str = None, batch_size: int = 0) -> Dict[str, Any]:
    if kind not in ("train", "horovod_alone", "plain") or source not in ("loader", "memory"):
        raise ValueError(f"bench run kind {kind!r} / source {source!r} unknown")
    return {"kind": kind, "warmup": warmup, "source": source, "precision": precision, "batch_size": batch_size}


def autocast_dtype(precision: Optional[str]):
    """The autocast dtype of a Lightning precision for the plain loop: None (no autocast) for 32-bit."""
    import torch

    if precision in (None, "32-true", "32"):
        return None
    if precision == "bf16-mixed":
        return torch.bfloat16
    if precision == "16-mixed":
        return torch.float16
    raise ValueError(f"bench: precision {precision!r} is not 32-true, bf16-mixed or 16-mixed")


def _plain(cfg: Config, data, batches, precision, warmup: int, steps: int, windows: int) -> Dict[str, Any]:
    """A plain PyTorch loop (forward, loss, backward, optimizer step) on `batches`, autocast for bf16-mixed."""
    import torch

    from bench.core import device, sync
    from bench.reference import model_and_optimizer, step, timed_windows

    dev = device()
    torch.manual_seed(cfg.train.seed)
    model, opt = model_and_optimizer(cfg, data.channels, max(2, len(data.class_names)), dev)
    dtype = autocast_dtype(precision)
    it = iter(range(1 << 62))

    def batch():
        return batches[next(it) % len(batches)]

    def fn(x, y):
        with torch.autocast(dev.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            step(model, opt, x, y)

    out = timed_windows(fn, batch, warmup, steps, windows, lambda: sync(dev), lambda: sync(dev))
    out["batch_size"] = len(batches[0][1])
    return out


def rank_job(cfg: Config, data, runs: List[Dict[str, Any]], steps: int, windows: int) -> Dict[str, Any]:
    """One Horovod rank: `runs` in order, each `windows` timed windows of `steps` steps after its warm-up."""
    from pipeline.log import setup_logging

    setup_logging()
    import horovod.torch as hvd
    import torch

    from bench.core import device
    from bench.lightning_path import timed_train
    from bench.reference import horovod_alone, memory_batch_list
    from pipeline.distributed.horovod_strategy import HorovodStrategy
    from pipeline.distributed.rank_process import repair_horovod_env

    if os.environ.get("LAKEHOUSE_BENCH_RAW_HOROVOD_ENV") != "1":  # =1: what training got before the repair
        repair_horovod_env()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if cfg.train.threads_per_rank is not None:  # null: torch's default (one rank per GPU)
        torch.set_num_threads(max(1, cfg.train.threads_per_rank))
    dev = device()
    cache: Dict[int, list] = {}
    outs = []
    for spec in runs:
        bs = spec["batch_size"] or data.plan.train.batch_size
        if spec["source"] == "memory" and bs not in cache:
            cache[bs] = [(x.to(dev), y.to(dev)) for x, y in memory_batch_list(data, batch_size=bs)]
        batches = cache.get(bs) if spec["source"] == "memory" else None
        if spec["kind"] == "train":
            out = timed_train(cfg, data, rank, size, HorovodStrategy, spec["warmup"], steps, windows,
                              batches=batches, precision=spec["precision"])
        elif spec["kind"] == "horovod_alone":
            out = horovod_alone(cfg, data, spec["warmup"], steps, windows)
        else:
            out = _plain(cfg, data, batches, spec["precision"], spec["warmup"], steps, windows)
        outs.append({**spec, **out})  # what the run measured wins (its batch size, for one)
    return {"rank": rank, "size": size, "runs": outs,
            "horovod_env": {k: os.environ.get(k) for k in ("HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY")}}


def horovod_run(fn: Callable[..., Any], args: tuple, np_: int, start_timeout: int) -> List[Any]:
    """`fn(*args)` on `np_` local Horovod ranks (horovod.run over gloo), the process's SIGINT/SIGTERM handlers as
    before once it returned or raised: horovod.run's register_shutdown_event replaces them for good, and a bound's
    SIGTERM (`timeout`, scripts/device_gpu_run.sh) then no longer ended a bench that had launched ranks
    (pipeline.distributed.backends.horovod.signals_left_to_the_driver: during the launch SIGTERM stays the
    process's, and Horovod's middlemen end the ranks of a driver that died); no secret of the environment on the ranks'
    command lines, as in `lakehouse train` (secrets_off_the_command_line)."""
    import horovod

    from pipeline.distributed.backends.horovod import secrets_off_the_command_line, signals_left_to_the_driver

    with signals_left_to_the_driver(), secrets_off_the_command_line():
        return horovod.run(fn, args=args, num_proc=np_, use_gloo=True, hosts=f"localhost:{np_}",
                           start_timeout=start_timeout, verbose=0)


def launch(cfg: Config, data, np_: int, runs: List[Dict[str, Any]], steps: int, windows: int,
           rank_fn: Optional[Callable[..., Dict[str, Any]]] = None) -> List[Dict[str, Any]]:
    """`rank_job` (or `rank_fn`, of the same arguments) on `np_` local Horovod ranks (gloo) with the launcher's rank
    environment; results by rank."""
    from pipeline.distributed.rank_env import rank_env
    from pipeline.distributed.loop import TrainJob

    job = TrainJob(cfg=cfg, data=data, delta_table="", delta_version=0)
    t0 = time.perf_counter()
    with temporary_env({"LAKEHOUSE_PROGRESS": "0"}), temporary_env(rank_env(job.cfg)):
        results = horovod_run(rank_fn or rank_job, (cfg, data, runs, steps, windows), np_,
                              cfg.train.start_timeout_s)
    results = sorted(results, key=lambda r: r["rank"])
    log.info("bench job of %d rank(s), runs %s: %.1f s", np_,
             [f"{r['kind']}:{r['source']}" + (f":{r['precision']}" if r["precision"] else "") for r in runs],
             time.perf_counter() - t0)
    return results


def per_run(results: List[Dict[str, Any]], index: int) -> List[Dict[str, Any]]:
    """Run `index` of a job, one entry per rank."""
    return [r["runs"][index] for r in results]
