"""Where train()'s extra time per step goes: the product's train() and the plain loop of bench/step_overhead.py on the
same device-resident batches in Horovod or DDP ranks, each under cProfile, the CPU time per step summed by where the
code lives (Lightning, torch's Python, this project, Horovod, C builtins) and the functions that differ most.

    python -m bench.step_profile [--steps 400] [--out step_profile.json] [--conf conf/local.yaml] [key=value ...]
    horovodrun -np 2 -H localhost:2 python -m bench.step_profile ...   (each rank writes <out>.rank<r>.json)
    python -m torch.distributed.run --nproc_per_node 2 -m bench.step_profile --backend ddp ...   (DDP over gloo/NCCL)

cProfile slows Python code down (~2x), so the figures locate the cost; the milliseconds of the overhead itself are
`lakehouse bench --only step_overhead`'s.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import tempfile
from typing import Any, Dict, List

from bench.step_overhead import BATCH, CHANNELS, CLASSES, IMAGE_SIZE, ddp_process_group, plain_loop, tiny
from pipeline.config import load_config
from pipeline.log import get_logger, setup_logging

log = get_logger(__name__)

# the first that matches: Horovod before torch (its torch binding lives under horovod/torch/)
WHERE = (("lightning", ("pytorch_lightning", "lightning_fabric", "lightning_utilities")), ("horovod", ("/horovod/",)),
         ("torch", ("/torch/",)), ("project", ("/pipeline/", "/bench/")))


def where(filename: str) -> str:
    """The bucket of a profiled function's file (`~`: C builtins and methods, torch's ops among them)."""
    if filename == "~":
        return "builtins"
    for name, parts in WHERE:
        if any(p in filename for p in parts):
            return name
    return "python"


def per_step(stats: pstats.Stats, steps: int) -> Dict[str, Any]:
    """{buckets: {bucket: CPU ms per step}, functions: {"file:line(name)": (calls per step, ms per step)}}."""
    buckets: Dict[str, float] = collections.Counter()
    functions: Dict[str, tuple] = {}
    for (file, line, name), (_, calls, tottime, _, _) in stats.stats.items():
        buckets[where(file)] += 1000.0 * tottime / steps
        functions[f"{file.split('site-packages/')[-1]}:{line}({name})"] = (calls / steps, 1000.0 * tottime / steps)
    return {"buckets": {k: round(v, 4) for k, v in sorted(buckets.items())}, "functions": functions}


def difference(train: Dict[str, Any], plain: Dict[str, Any], top: int = 30) -> List[Dict[str, Any]]:
    """The `top` functions by train()'s CPU ms per step minus the plain loop's."""
    names = set(train["functions"]) | set(plain["functions"])
    rows = [{"function": n, "train_ms": train["functions"].get(n, (0, 0))[1],
             "plain_ms": plain["functions"].get(n, (0, 0))[1], "train_calls": train["functions"].get(n, (0, 0))[0]}
            for n in names]
    rows.sort(key=lambda r: r["plain_ms"] - r["train_ms"])
    return [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows[:top]]


def rank_path(out: str, rank: int, world: int) -> str:
    """Where a rank writes its profile: `out` itself in a job of one rank, else `<out without .json>.rank<r>.json`."""
    if world == 1:
        return out
    return f"{out[:-len('.json')] if out.endswith('.json') else out}.rank{rank}.json"


def start_ranks(backend: str):
    """This process's rank: (rank, world size, the strategy's factory, train()'s rank keywords, what ends it). Horovod:
    hvd.init() in a rank horovodrun started (or alone); DDP: the process group from torch.distributed.run's
    environment (alone: a group of one), with the strategy the bench's DDP ranks use."""
    if backend == "horovod":
        import horovod.torch as hvd

        from pipeline.distributed.horovod_strategy import HorovodStrategy

        hvd.init()
        kw = {"local_rank": hvd.local_rank(), "local_world_size": hvd.local_size()}
        return hvd.rank(), hvd.size(), HorovodStrategy, kw, lambda: None
    import os

    import torch.distributed as dist

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
        os.environ.setdefault(key, value)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    make_strategy, kw = ddp_process_group(rank, world, 600)
    return rank, world, make_strategy, kw, dist.destroy_process_group


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", default="step_profile.json")
    ap.add_argument("--conf", default=None)
    ap.add_argument("--backend", choices=("horovod", "ddp"), default="horovod",
                    help="ddp: ranks started by torch.distributed.run (its RANK/WORLD_SIZE/MASTER_* environment)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    setup_logging()
    import torch

    from bench.conversion import replan
    from bench.core import device
    from bench.datasets import converted_without_spark
    from bench.lightning_path import timed_train
    from bench.reference import memory_batch_list
    from pipeline.distributed.devices import cuda_capability, resolve_precision

    rank, world, make_strategy, kw, finish = start_ranks(args.backend)
    cfg = tiny(load_config(args.conf, args.overrides))
    if cfg.train.threads_per_rank is not None:  # as the bench's ranks (and the product's): both sides on these threads
        torch.set_num_threads(max(1, cfg.train.threads_per_rank))
    dev = device()
    precision = resolve_precision(cfg.train.precision, dev.type == "cuda",
                                  cuda_capability(dev.index or 0) if dev.type == "cuda" else None)
    data = converted_without_spark(tempfile.mkdtemp(prefix=f"step_profile_{rank}_"), BATCH * 2 * 256, IMAGE_SIZE,
                                   CHANNELS, CLASSES, batch_size=BATCH)
    if world > 1:
        data = replan(cfg, data, world, BATCH)
    batches = [(x.to(dev), y.to(dev)) for x, y in memory_batch_list(data, batch_size=BATCH)]

    def run_train(steps: int):
        return timed_train(cfg, data, rank, world, make_strategy, 50, steps, 1, batches=batches,
                           precision=precision, train_kwargs=kw)

    run_train(200)  # a process speeds up over its first hundreds of steps; the plain loop's imports happen here too
    plain_loop(cfg, data, batches, precision, 10, 50, 1, backend=args.backend)
    out: Dict[str, Any] = {"device": str(dev), "precision": precision, "steps": args.steps, "backend": args.backend,
                           "torch": torch.__version__, "rank": rank, "world_size": world}
    for name, fn in (("plain", lambda: plain_loop(cfg, data, batches, precision, 50, args.steps, 1,
                                                  backend=args.backend)),
                     ("train", lambda: run_train(args.steps))):
        prof = cProfile.Profile()
        prof.enable()
        timing = fn()
        prof.disable()
        out[name] = per_step(pstats.Stats(prof), args.steps + 50)
        out[name]["ms_per_step_profiled"] = 1000.0 * timing["window_s"][0] / args.steps
    out["differences"] = difference(out["train"], out["plain"])
    for side in ("train", "plain"):
        out[side]["functions"] = dict(sorted(out[side]["functions"].items(), key=lambda kv: -kv[1][1])[:40])
    with open(rank_path(args.out, rank, world), "w") as f:
        json.dump(out, f, indent=1)
    log.info("step profile: train %s, plain %s (CPU ms per step by bucket); top differences: %s",
             out["train"]["buckets"], out["plain"]["buckets"],
             [(d["function"], round(d["train_ms"] - d["plain_ms"], 3)) for d in out["differences"][:8]])
    finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
