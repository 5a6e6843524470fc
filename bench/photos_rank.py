"""The photo figures' Horovod rank: a plain channels_last bf16 loop, train() on GPU-resident photo batches and train()
with the real ShardLoader per data.decode, in one process, each run's failure recorded and the next run run."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Tuple

from pipeline.config import Config
from pipeline.log import get_logger

log = get_logger(__name__)


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def resident_batches(data, count: int, dev, seed: int) -> List[Tuple[Any, Any]]:
    """Up to `count` batches of the first train rows decoded once with the CPU decoder (the training crops),
    uint8 channels_last, on `dev`: what the loader would hand train(), held on the device."""
    import numpy as np
    import torch

    from bench.photos_data import train_contents
    from pipeline.data.decode import Decoder, EncodedBatch, default_workers

    bs = data.plan.train.batch_size
    rows = train_contents(data, count * bs)
    decoder = Decoder(data.image_size, data.channels, train=True, seed=seed, workers=default_workers(1),
                      channels_last=True)
    out = []
    try:
        for b in range(len(rows) // bs):
            part = rows[b * bs:(b + 1) * bs]
            enc = np.empty((bs, 2), dtype=object)
            enc[:, 0] = [r[0] for r in part]
            enc[:, 1] = [r[1] for r in part]
            x = decoder.decode(EncodedBatch(enc, b))
            out.append((x.to(dev), torch.tensor([r[2] for r in part], dtype=torch.int64, device=dev)))
    finally:
        decoder.close()
    if not out:
        raise ValueError(f"the photos need a full batch of {bs} train rows; {len(rows)} were read")
    return out


def plain_photos(cfg: Config, data, batches, warmup: int, steps: int, windows: int) -> Dict[str, Any]:
    """A plain PyTorch loop as a user writes it for photos: the model and the batches channels_last, the uint8 batch
    normalised on the device (as train() does), forward and loss under bf16 autocast, backward, optimizer step."""
    import itertools

    import torch

    from bench.core import device, sync
    from bench.jobs import autocast_dtype
    from bench.reference import model_and_optimizer, timed_windows
    from pipeline.model.module import normalize_pixels

    dev = device()
    torch.manual_seed(cfg.train.seed)
    model, opt = model_and_optimizer(cfg, data.channels, max(2, len(data.class_names)), dev)
    model = model.to(memory_format=torch.channels_last)
    dtype = autocast_dtype(cfg.train.precision)
    it = itertools.count()

    def fn(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model.loss_fn(model(normalize_pixels(x)), y)
        loss.backward()
        opt.step()

    out = timed_windows(fn, lambda: batches[next(it) % len(batches)], warmup, steps, windows, lambda: sync(dev),
                        lambda: sync(dev))
    out["batch_size"] = len(batches[0][1])
    return out


def photo_rank_job(cfg: Config, data, runs: List[Dict[str, Any]], steps: int, windows: int,
                   horovod: bool = True) -> Dict[str, Any]:
    """One rank: `runs` in order ({kind: plain | train, source: memory | loader, decode, warmup, ...}); a run that
    fails is recorded as {error} and the next one runs. `horovod`: a Horovod rank with the product's HorovodStrategy;
    else the one process of train.backend=single (Lightning's single-device strategy)."""
    from pipeline.log import setup_logging

    setup_logging()
    import torch

    from bench.core import device
    from bench.lightning_path import timed_train

    if horovod:
        import horovod.torch as hvd

        from pipeline.distributed.horovod_strategy import HorovodStrategy
        from pipeline.distributed.rank_process import repair_horovod_env

        repair_horovod_env()
        hvd.init()
        rank, size, make_strategy = hvd.rank(), hvd.size(), HorovodStrategy
    else:
        rank, size, make_strategy = 0, 1, lambda: None  # train(): the single-device strategy
    dev = device()
    batches, outs = None, []
    for spec in runs:
        try:
            if spec["source"] == "memory" and batches is None:
                batches = resident_batches(data, spec["memory_batches"], dev, cfg.data.seed)
            rcfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, decode=spec.get("decode") or "cpu"))
            if spec["kind"] == "plain":
                out = plain_photos(rcfg, data, batches, spec["warmup"], steps, windows)
            else:
                out = timed_train(rcfg, data, rank, size, make_strategy, spec["warmup"], steps, windows,
                                  batches=batches if spec["source"] == "memory" else None,
                                  precision=spec["precision"])
            outs.append({**spec, **out})
        except Exception as exc:
            log.exception("photos: run %s failed", spec)
            outs.append({**spec, "error": error_text(exc)})
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return {"rank": rank, "size": size, "runs": outs}
