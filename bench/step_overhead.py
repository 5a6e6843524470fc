"""Step overhead: the milliseconds per step the product's train() adds to a plain PyTorch loop on the same
device-resident batches, per backend (Horovod, DDP) and world size (1, 2).

How it is measured:
- A tiny network (model.arch=cnn, model.width=8) on 32x32 one-channel images, batch 32 per rank, so that the
  framework's per-step cost is not lost in the network's. The model's optimizer, loss and precision are the
  configured ones (train.precision resolved in the rank; 32-true on a CPU).
- The batches are made once per rank: 32 batches read from a data set written with pyarrow alone
  (`datasets.converted_without_spark`: no Spark, no loader), moved to the rank's device. The plain loop and train()
  take the same tensors in turn; train() gets them through lightning_path's MemoryLoader, so no loader runs.
- The plain loop (`plain_loop`): zero_grad, forward and loss under the precision's autocast, backward,
  optimizer step; over 2 ranks the gradients averaged the library's own way (hvd.DistributedOptimizer, or
  DistributedDataParallel) and nothing more. train() (`lightning_path.timed_train`) is timed between the starts of
  consecutive training steps inside an epoch (epoch ends, with their validation and checkpoints, are not steps).
- One job per backend and world size, its ranks started as the product starts them (horovod.run over Gloo; DDP:
  processes with torchrun's environment and a Gloo or NCCL process group). In those same processes, in this order:
  an untimed train() (a process speeds up over its first hundreds of steps), the plain loop, train(), train() again,
  the plain loop again, so that drifting load on a shared machine falls on both sides.
- Each timed run drops its first `WARMUP` steps, then times `repeats` windows of `STEPS` steps (400: a 0.05 ms
  difference per step is 20 ms per window). A step's time is the slowest rank's window / its steps. Window k's
  overhead: the mean of train()'s two runs' window k minus the mean of the plain loop's; the figure is the median
  over the windows (`overhead_per_window`).
- train.compile=true (`lakehouse bench --only step_overhead train.compile=true`): train() runs with the network
  compiled, the plain loop stays eager; the compilation happens in the dropped warm-up steps, so it is reported apart
  (`warmup_s` of both sides) and counted in the figure: (train()'s whole run - the plain loop's, warm-up included) /
  the run's steps (`counted_overhead_ms`), the steady difference beside it (`steady_overhead_ms`).
- Beside the wall-clock figure, the same difference in the rank processes' CPU time (`cpu_overhead_ms`): on a machine
  shared with other work the wall clock also measures who got the cores.

On a GPU the figures are `gpu_step_overhead_ms` (target 0.25 ms), on a CPU `step_overhead_ms` (0.5 ms).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import socket
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

from bench.core import Result, Sizes, median
from pipeline.config import Config
from pipeline.log import get_logger

log = get_logger(__name__)

BACKENDS = ("horovod", "ddp")
WORLDS = (1, 2)
STEPS, QUICK_STEPS = 400, 30  # per timed window
WARMUP, QUICK_WARMUP = 100, 5  # steps dropped at the start of each timed run
BATCH = 16  # per rank
WIDTH = 8  # model.width of the tiny cnn
IMAGE_SIZE, CHANNELS, CLASSES = 16, 1, 10
DATASET = f"tiny_cnn_{IMAGE_SIZE}px"


# ------------------------------------------------------------------ the arithmetic (pure)
def step_ms(ranks: List[Dict[str, Any]], key: str = "window_s") -> List[float]:
    """Milliseconds per step of each window of one run: the slowest rank's window wall time / its steps (`key`
    "cpu_s": the rank processes' CPU time, every thread, instead of the wall time)."""
    windows = len(ranks[0][key])
    return [1000.0 * max(r[key][w] for r in ranks) / ranks[0]["steps"] for w in range(windows)]


def mean_step_ms(runs: List[List[Dict[str, Any]]], key: str = "window_s") -> List[float]:
    """Per window, the mean over `runs` (each a list of per-rank results) of `step_ms`."""
    per_run = [step_ms(r, key) for r in runs]
    return [sum(v) / len(v) for v in zip(*per_run)]


def overhead_per_window(train_runs: List[List[Dict[str, Any]]], plain_runs: List[List[Dict[str, Any]]],
                        key: str = "window_s") -> List[float]:
    """Window k: mean ms/step of train()'s runs - mean ms/step of the plain loop's runs (>0: train() is slower)."""
    return [t - p for t, p in zip(mean_step_ms(train_runs, key), mean_step_ms(plain_runs, key))]


def run_total(ranks: List[Dict[str, Any]], warmup: int) -> Tuple[float, int]:
    """(seconds, steps) of one whole run, warm-up included: the slowest rank's warm-up + its windows."""
    seconds = max(r["warmup_s"] + sum(r["window_s"]) for r in ranks)
    return seconds, warmup + ranks[0]["steps"] * len(ranks[0]["window_s"])


def counted_overhead_ms(train_runs: List[List[Dict[str, Any]]], plain_runs: List[List[Dict[str, Any]]],
                        warmup: int) -> float:
    """ms per step over whole runs, warm-up (a compilation) counted: mean(train()'s run seconds) - mean(the plain
    loop's), over the steps of one run."""
    t = [run_total(r, warmup) for r in train_runs]
    p = [run_total(r, warmup) for r in plain_runs]
    steps = t[0][1]
    return 1000.0 * (sum(s for s, _ in t) / len(t) - sum(s for s, _ in p) / len(p)) / steps


def result_name(device_type: str) -> str:
    return "gpu_step_overhead_ms" if device_type == "cuda" else "step_overhead_ms"


def overhead_result(backend: str, world: int, job: List[Dict[str, Any]], device_type: str, warmup: int,
                    compiled: bool = False) -> Result:
    """The Result of one job (`rank_runs`'s output per rank: runs in the order of `RUNS`)."""
    runs = [[r["runs"][i] for r in job] for i in range(len(RUNS))]
    train_runs = [runs[i] for i, kind in enumerate(RUNS) if kind == "train"]
    plain_runs = [runs[i] for i, kind in enumerate(RUNS) if kind == "plain"]
    per = overhead_per_window(train_runs, plain_runs)
    counted = counted_overhead_ms(train_runs, plain_runs, warmup)
    parts = {"backend": backend, "world_size": world, "train_ms_per_step": median(mean_step_ms(train_runs)),
             "plain_ms_per_step": median(mean_step_ms(plain_runs)), "steady_overhead_ms": median(per),
             "overhead_ms_with_warmup_counted": counted,
             # the same from the rank processes' CPU time (all their threads): on a machine shared with other work the
             # wall clock also measures who got the cores (a loop that sleeps in a collective is woken promptly, a
             # busy one is not), CPU time only the work each side does
             "cpu_overhead_ms": median(overhead_per_window(train_runs, plain_runs, "cpu_s")),
             "train_cpu_ms_per_step": median(mean_step_ms(train_runs, "cpu_s")),
             "plain_cpu_ms_per_step": median(mean_step_ms(plain_runs, "cpu_s")), "steps_per_window": runs[0][0]["steps"],
             "warmup_steps": warmup, "batch_per_rank": runs[0][0]["batch_size"], "compile": compiled,
             "precision": runs[0][0].get("precision"),
             "warmup_s": {"train": [max(r["warmup_s"] for r in run) for run in train_runs],
                          "plain": [max(r["warmup_s"] for r in run) for run in plain_runs]},
             "train_thread_cpu_ms_per_step_rank0": median(mean_step_ms([run[:1] for run in train_runs],
                                                                       "main_thread_cpu_s")),
             "plain_thread_cpu_ms_per_step_rank0": median(mean_step_ms([run[:1] for run in plain_runs],
                                                                       "main_thread_cpu_s")),
             "network": f"cnn width {WIDTH}, {IMAGE_SIZE}x{IMAGE_SIZE}x{CHANNELS}"}
    figure = counted if compiled else median(per)
    variant = f"{backend}/np{world}" + ("/compile" if compiled else "")
    note = ("train.compile=true: the figure counts the compilation (whole runs, warm-up included); "
            "steady_overhead_ms leaves it out") if compiled else ""
    return Result(result_name(device_type), DATASET, figure, parts, len(per), per, variant=variant, note=note)


def failed_result(backend: str, world: int, device_type: str, error: str, compiled: bool = False) -> Result:
    """The Result of a job that raised: NaN (not a pass), with the error as its note, under the job's own key."""
    variant = f"{backend}/np{world}" + ("/compile" if compiled else "")
    return Result(result_name(device_type), DATASET, float("nan"),
                  {"backend": backend, "world_size": world, "compile": compiled, "error": error}, 0, [],
                  variant=variant, note=f"not measured: the job failed: {error}")


# ------------------------------------------------------------------ in a rank
def plain_loop(cfg: Config, data, batches: List[Tuple[Any, Any]], precision: Optional[str], warmup: int, steps: int,
               windows: int, backend: Optional[str] = None) -> Dict[str, Any]:
    """A plain PyTorch loop (zero_grad, forward, loss, backward, optimizer step) with the ImageClassifier's network,
    loss and optimizer on `batches` (already on this rank's device, served in turn), under `precision`'s autocast.

    Over several ranks the gradients are averaged the library's own way and nothing more: `backend` "horovod"
    (hvd.DistributedOptimizer, the parameters broadcast from rank 0) or "ddp" (DistributedDataParallel over the
    process group already initialised); the windows start together (one collective after the warm-up). On one rank
    (or `backend` None) nothing is wrapped: what train() adds over this loop is the framework's own cost."""
    import torch

    from bench.core import device, sync
    from bench.jobs import autocast_dtype
    from bench.reference import model_and_optimizer, timed_windows

    dev = device()
    torch.manual_seed(cfg.train.seed)
    model, opt = model_and_optimizer(cfg, data.channels, max(2, len(data.class_names)), dev)
    net, start = model, lambda: None
    if backend == "horovod":
        import horovod.torch as hvd

        if hvd.size() > 1:
            named = [("plain." + n, p) for n, p in model.named_parameters()]
            opt = hvd.DistributedOptimizer(opt, named_parameters=named)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            start = lambda: hvd.allreduce(torch.zeros(1, device=dev), name="plain.start")  # noqa: E731
    elif backend == "ddp":
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            ids = [dev.index] if dev.type == "cuda" else None
            net = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
            start = dist.barrier
    dtype = autocast_dtype(precision)
    it = itertools.count()

    def batch():
        return batches[next(it) % len(batches)]

    def fn(x, y):
        opt.zero_grad()
        with torch.autocast(dev.type, dtype=dtype or torch.float32, enabled=dtype is not None):  # as Lightning's
            loss = model.loss_fn(net(x), y)  # precision plugin: the forward and loss under autocast, not backward
        loss.backward()
        opt.step()

    def started():
        sync(dev)
        start()

    out = timed_windows(fn, batch, warmup, steps, windows, started, lambda: sync(dev))
    out["batch_size"] = len(batches[0][1])
    return out


RUNS = ("warmup", "plain", "train", "train", "plain")


def tiny(cfg: Config, compiled: Optional[bool] = None) -> Config:
    """`cfg` with the tiny network (the configured optimizer, rates and precision kept); `compiled`: train.compile."""
    model = dataclasses.replace(cfg.model, arch="cnn", width=WIDTH, pretrained=None, freeze_backbone=False,
                                unfreeze_at_epoch=None, backbone_lr=None, input_size=None)
    train = cfg.train if compiled is None else dataclasses.replace(cfg.train, compile=compiled)
    return dataclasses.replace(cfg, model=model, train=train)


def rank_runs(cfg: Config, data, backend: str, rank: int, size: int, make_strategy, train_kwargs: Dict[str, Any],
              warmups: Tuple[int, int], steps: int, windows: int) -> Dict[str, Any]:
    """`RUNS` in this rank: the same device-resident batches for every run (and every rank)."""
    import torch

    from bench.core import device
    from bench.lightning_path import timed_train
    from bench.reference import memory_batch_list
    from pipeline.distributed.devices import cuda_capability, resolve_precision

    if cfg.train.threads_per_rank is not None:
        torch.set_num_threads(max(1, cfg.train.threads_per_rank))
    dev = device()
    precision = resolve_precision(cfg.train.precision, dev.type == "cuda",
                                  cuda_capability(dev.index or 0) if dev.type == "cuda" else None)
    batches = [(x.to(dev), y.to(dev)) for x, y in memory_batch_list(data, batch_size=BATCH)]
    first, warmup = warmups
    outs = []
    for kind in RUNS:
        if kind == "plain":
            out = plain_loop(cfg, data, batches, precision, warmup, steps, windows, backend=backend)
        else:
            out = timed_train(cfg, data, rank, size, make_strategy, first if kind == "warmup" else warmup, steps,
                              1 if kind == "warmup" else windows, batches=batches, precision=precision,
                              train_kwargs=train_kwargs)
        outs.append({"kind": kind, "precision": precision, **out})
    return {"rank": rank, "size": size, "runs": outs}


def horovod_rank(cfg: Config, data, warmups: Tuple[int, int], steps: int, windows: int) -> Dict[str, Any]:
    """A Horovod rank (started by horovod.run): `rank_runs` with the product's HorovodStrategy."""
    from pipeline.log import setup_logging

    setup_logging()
    import horovod.torch as hvd

    from pipeline.distributed.horovod_strategy import HorovodStrategy
    from pipeline.distributed.rank_process import repair_horovod_env

    repair_horovod_env()
    hvd.init()
    return rank_runs(cfg, data, "horovod", hvd.rank(), hvd.size(), HorovodStrategy,
                     {"local_rank": hvd.local_rank(), "local_world_size": hvd.local_size()}, warmups, steps, windows)


def ddp_rank(rank: int, size: int, port: int, env: Dict[str, str], cfg: Config, data, warmups: Tuple[int, int],
             steps: int, windows: int, results) -> None:
    """A DDP rank (a spawned process with torchrun's environment): the process group, then `rank_runs` with the
    strategy rank_process.ddp_worker builds."""
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(size), "GROUP_RANK": "0",
                       "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "TORCHELASTIC_RUN_ID": "bench-step-overhead"})
    from pipeline.log import setup_logging

    setup_logging()
    import torch.distributed as dist

    make_strategy, kw = ddp_process_group(rank, size, cfg.train.stall_timeout_s)
    try:
        results.put(rank_runs(cfg, data, "ddp", rank, size, make_strategy, kw, warmups, steps, windows))
    finally:
        dist.destroy_process_group()


def ddp_process_group(rank: int, size: int, timeout_s: float):
    """A DDP rank's process group (gloo on a CPU, NCCL on CUDA), and what train() takes for it there: the strategy's
    factory (the one rank_process.ddp_worker builds) and train()'s rank keywords."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from pytorch_lightning.strategies import DDPStrategy

    from pipeline.distributed.devices import ddp_backend

    backend = ddp_backend(torch.cuda.is_available())
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout)
    return (lambda: DDPStrategy(process_group_backend=backend, timeout=timeout),
            {"devices": size, "num_nodes": 1, "local_rank": rank, "local_world_size": size})


# ------------------------------------------------------------------ the driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg: Config, data, backend: str, world: int, warmups: Tuple[int, int], steps: int,
           windows: int) -> List[Dict[str, Any]]:
    """One job of `world` ranks of `backend` on this machine, with the launcher's rank environment; results by rank."""
    from pipeline.distributed.loop import TrainJob
    from pipeline.distributed.rank_env import rank_env
    from pipeline.tracking.runs import temporary_env

    env = rank_env(cfg)
    t0 = time.perf_counter()
    if backend == "horovod":
        from bench.jobs import horovod_run  # the process's SIGINT/SIGTERM handlers as before afterwards

        with temporary_env(env):
            results = horovod_run(horovod_rank, (cfg, data, warmups, steps, windows), world, cfg.train.start_timeout_s)
    else:
        import multiprocessing as mp

        from bench.reference import _collect

        ctx = mp.get_context("spawn")
        queue, port = ctx.Queue(), _free_port()
        workers = [ctx.Process(target=ddp_rank, args=(r, world, port, env, cfg, data, warmups, steps, windows, queue))
                   for r in range(world)]
        for w in workers:
            w.start()
        try:
            results = _collect(queue, workers, cfg.train.start_timeout_s + 1800)
        finally:
            for w in workers:
                w.join(timeout=60)
                if w.is_alive():
                    w.kill()
    log.info("step overhead job: %s, %d rank(s): %.1f s", backend, world, time.perf_counter() - t0)
    return sorted(results, key=lambda r: r["rank"])


def placeable_worlds(worlds, gpus: Optional[int] = None) -> List[int]:
    """The world sizes whose ranks each get a device of their own: all of them on a CPU, at most one rank per GPU
    (NCCL refuses two ranks on one device); those left out are logged."""
    import torch

    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    kept = [w for w in worlds if not gpus or w <= gpus]
    if len(kept) < len(worlds):
        log.info("step overhead: world sizes %s not measured: %d GPU(s), one rank per GPU",
                 [w for w in worlds if w not in kept], gpus)
    return kept


def measure_step_overhead(cfg: Config, sizes: Sizes, work_dir: str, quick: bool = False,
                          backends=BACKENDS, worlds=WORLDS, compiled: Optional[bool] = None) -> List[Result]:
    """Every backend x world size: one job each (`launch`), a Result per job (NaN with the error as its note where the
    job raised: `failed_result`). `compiled`: train.compile for train() (None: the config's). Its scratch data set is
    written under `work_dir` and removed."""
    import shutil

    from bench.conversion import replan
    from bench.core import device
    from bench.datasets import converted_without_spark

    steps, warmup = (QUICK_STEPS, QUICK_WARMUP) if quick else (STEPS, WARMUP)
    windows = sizes.repeats
    warmups = (sizes.warmup_steps, warmup)
    compiled = cfg.train.compile if compiled is None else compiled
    bcfg = tiny(cfg, compiled)
    # 2 ranks x BATCH x steps_per_epoch rows: epochs long enough that most steps are inside one (epochs end apart)
    rows = BATCH * max(WORLDS) * (64 if quick else 512)
    folder = tempfile.mkdtemp(prefix="step_overhead_", dir=work_dir)
    results = []
    try:
        data1 = converted_without_spark(folder, rows, IMAGE_SIZE, CHANNELS, CLASSES, batch_size=BATCH)
        for backend in backends:
            for world in placeable_worlds(worlds):
                data = data1 if world == 1 else replan(bcfg, data1, world, BATCH)
                try:
                    job = launch(bcfg, data, backend, world, warmups, steps, windows)
                except Exception as exc:  # one job's failure costs its figure, not the others' (a one-shot GPU call)
                    error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
                    log.error("step overhead %s/np%d not measured: %s", backend, world, error)
                    results.append(failed_result(backend, world, device().type, error, compiled=compiled))
                    continue
                res = overhead_result(backend, world, job, device().type, warmup, compiled=compiled)
                log.info("step overhead %s: train() %.3f ms/step, plain loop %.3f, overhead %.3f ms (per window %s); "
                         "CPU time %.3f - %.3f = %.3f ms", res.variant, res.parts["train_ms_per_step"],
                         res.parts["plain_ms_per_step"], res.ratio, [round(v, 3) for v in res.per_repeat],
                         res.parts["train_cpu_ms_per_step"], res.parts["plain_cpu_ms_per_step"],
                         res.parts["cpu_overhead_ms"])
                results.append(res)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return results
