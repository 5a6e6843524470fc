"""The photo loader's figures alone, for a short device call: the loader of rank 0 of 1 with data.decode=gpu (nvJPEG
alone, then with each of `--cpu-shares` of every batch on the CPU's decode workers: data.decode_cpu_share) and =cpu
(`photos_gpu.loader_alone`, each in a fresh process) and the one-core Pillow reference, on the same ImageNet-shaped
JPEG rows as `lakehouse bench --gpu --only photos`, without its trainings (no Horovod build needed).

    python -m bench.photos_loader [--rows 4096] [--batches 16] [--cpu-shares 0.25,0.4] [--workers 1,16]
                                  [--out photos_loader.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from typing import Any, Dict

from bench.core import machine
from bench.photos_data import photos_without_spark, pillow_images_per_s, train_contents
from bench.photos_gpu import FULL, loader_alone, photo_config
from pipeline.config import load_config
from pipeline.data.gpu_decode import gpu_decode_problem
from pipeline.log import get_logger, setup_logging

log = get_logger(__name__)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=FULL.train_rows)
    ap.add_argument("--batches", type=int, default=FULL.loader_batches)
    ap.add_argument("--workers", default="0", help="data.decode_workers values for decode=cpu (0: one per core)")
    ap.add_argument("--cpu-shares", default="", help="data.decode_cpu_share values for decode=gpu beside nvJPEG alone "
                                                     "(the CPU's part with one decode worker per core)")
    ap.add_argument("--out", default="photos_loader.json")
    args = ap.parse_args(argv)
    setup_logging()
    cfg = load_config(None, ["data.reader=arrow"])
    data = photos_without_spark(tempfile.mkdtemp(prefix="photos_loader_"), args.rows, FULL.val_rows,
                                FULL.image_size, FULL.batch_size)
    rows = train_contents(data, FULL.reference_images)
    # machine(): the host, cores, torch and the GPU's name (torch.cuda.get_device_name), as the bench's reports
    out: Dict[str, Any] = {"machine": machine(), "rows": args.rows, "batch_size": FULL.batch_size,
                           "pillow_one_core_images_per_s": pillow_images_per_s([r[0] for r in rows])}

    def save() -> None:  # after every figure: a call cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    save()
    problem = gpu_decode_problem()
    if problem is None:
        out["gpu"] = loader_alone(data, photo_config(cfg, FULL, "cnn", "gpu"), "gpu", args.batches)
        save()
        for share in (float(v) for v in args.cpu_shares.split(",") if v.strip()):
            pcfg = _with_data(photo_config(cfg, FULL, "cnn", "gpu"), decode_cpu_share=share)
            out[f"gpu_cpu_share_{share:g}"] = loader_alone(data, pcfg, "gpu", args.batches)
            save()
    else:
        out["gpu"] = {"skipped": problem}
        save()
    for workers in (int(w) for w in args.workers.split(",")):
        pcfg = _with_data(photo_config(cfg, FULL, "cnn", "cpu"), decode_workers=workers)
        fig = out[f"cpu_workers_{workers}"] = loader_alone(data, pcfg, "cpu", args.batches)
        if "images_per_s" in fig:
            fig["per_core_over_pillow"] = fig["images_per_s"] / fig["workers"] / out["pillow_one_core_images_per_s"]
        save()
    log.info("photos loader: %s", json.dumps(out))
    return 0


def _with_data(cfg, **keys):
    """`cfg` with these data.* keys."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **keys))


if __name__ == "__main__":
    raise SystemExit(main())
