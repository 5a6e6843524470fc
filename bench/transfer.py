"""The transfer target: a timm backbone pretrained by the project on the synthetic bench table, fine-tuned on the
digits sample through `model.pretrained`, against the same architecture from random initialisation.

Two steps, because timm needs the vision venv and the tables need Spark:
  .venv/bin/python -m bench.transfer prepare --work DIR [--rows 4000]
      the synthetic bench table (Spark, as `lakehouse bench` makes it) and the digits sample, decoded once (the
      loader's normalised pixels) into DIR/transfer_data.npz
  .venv-vision/bin/python -m bench.transfer run --work DIR [--arch timm/resnet18] [--epochs 15]
      pretrain on the synthetic images, save the network as a model.pretrained file, fine-tune on 80 % of the digits
      and validate on 20 % each epoch, from that file and from scratch; prints one JSON line with both val_acc curves
      and the epochs each needs to reach --target (0.97).
The training runs through the product's ImageClassifier (network_from_config, optimizer, schedule) in one process.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Dict, List, Optional

import numpy as np

from pipeline.log import get_logger, setup_logging

log = get_logger(__name__)


def prepare(work: str, rows: int = 4000) -> Dict[str, Any]:
    import glob

    from deltalake import DeltaTable

    from bench.datasets import ensure_synthetic
    from pipeline.config import load_config
    from pipeline.data.transforms import decode_batch
    from pipeline.lakehouse.sample_data import CLASS_NAMES, render_digits
    from pipeline.lakehouse.spark import get_spark

    os.makedirs(work, exist_ok=True)
    cfg = load_config("conf/local.yaml", [f"delta.table={work}/delta/digits", "spark.master=local[2]"])
    spark = get_spark(cfg)
    try:
        table = ensure_synthetic(spark, cfg, rows)["table"]
    finally:
        spark.stop()
    syn = DeltaTable(table).to_pyarrow_table(columns=["content", "label_index"])
    digits_dir = os.path.join(work, "digits_png")
    if not os.path.isdir(digits_dir):
        render_digits(digits_dir)
    files = sorted(glob.glob(os.path.join(digits_dir, "*", "*.png")))
    dig_y = np.array([CLASS_NAMES.index(os.path.basename(os.path.dirname(f))) for f in files], dtype=np.int64)
    dig_x = decode_batch([open(f, "rb").read() for f in files], cfg.data.image_size, 1)
    syn_x = decode_batch(syn.column("content").to_pylist(), cfg.data.image_size, 1)
    syn_y = np.asarray(syn.column("label_index").to_pylist(), dtype=np.int64)
    out = os.path.join(work, "transfer_data.npz")
    np.savez(out, syn_x=syn_x, syn_y=syn_y, dig_x=dig_x, dig_y=dig_y)
    return {"file": out, "synthetic_rows": len(syn_y), "digits_rows": len(dig_y)}


def _fit(label: str, model_cfg, x, y, vx, vy, epochs: int, batch: int = 64, seed: int = 0) -> Dict[str, Any]:
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from pipeline.model.module import ImageClassifier

    class Curve(pl.Callback):
        def __init__(self) -> None:
            self.val_acc: List[float] = []

        def on_train_epoch_end(self, trainer, module) -> None:
            self.val_acc.append(float(trainer.callback_metrics["val_acc"]))
            log.info("%s epoch %d: val_acc %.4f", label, len(self.val_acc), self.val_acc[-1])  # a curve as it goes

    pl.seed_everything(seed, verbose=False)
    steps = -(-len(y) // batch)
    model = ImageClassifier.from_config(model_cfg, 1, 10, model_cfg.lr, steps_per_epoch=steps, max_epochs=epochs)
    curve = Curve()
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[curve])
    train = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=batch, shuffle=True)
    val = DataLoader(TensorDataset(torch.from_numpy(vx), torch.from_numpy(vy)), batch_size=256)
    started = time.perf_counter()
    trainer.fit(model, train, val)
    return {"model": model, "val_acc": curve.val_acc, "seconds": time.perf_counter() - started}


def _epochs_to(curve: List[float], target: float):
    return next((i + 1 for i, acc in enumerate(curve) if acc >= target), None)


def run(work: str, arch: str = "timm/resnet18", pretrain_epochs: int = 3, epochs: int = 15, target: float = 0.97,
        lr: float = 0.05, reuse: bool = False, only: Optional[str] = None) -> Dict[str, Any]:
    from pipeline.config import ModelConfig
    from pipeline.model.timm_backbone import save_pretrained

    data = np.load(os.path.join(work, "transfer_data.npz"))
    rng = np.random.default_rng(0)
    order = rng.permutation(len(data["dig_y"]))
    n_val = len(order) // 5
    vx, vy = data["dig_x"][order[:n_val]], data["dig_y"][order[:n_val]]
    x, y = data["dig_x"][order[n_val:]], data["dig_y"][order[n_val:]]

    syn_x, syn_y = data["syn_x"], data["syn_y"]
    weights = os.path.join(work, f"{arch.replace('/', '_')}_synthetic_{pretrain_epochs}ep.safetensors")
    if reuse and os.path.exists(weights):  # pretrained by an earlier run (--reuse)
        pre = {"val_acc": None, "seconds": None}
    else:
        pre = _fit("pretrain", ModelConfig(arch=arch, lr=lr), syn_x, syn_y, syn_x[:512], syn_y[:512], pretrain_epochs)
        save_pretrained(pre["model"].network, weights)
    none = {"val_acc": [], "seconds": None}
    tuned = (_fit("pretrained", ModelConfig(arch=arch, lr=lr, pretrained=weights), x, y, vx, vy, epochs)
             if only in (None, "pretrained") else none)
    scratch = _fit("scratch", ModelConfig(arch=arch, lr=lr), x, y, vx, vy, epochs) if only in (None, "scratch") else none
    return {"arch": arch, "pretrain": {"rows": int(len(data["syn_y"])), "epochs": pretrain_epochs,
                                       "val_acc": pre["val_acc"], "seconds": pre["seconds"], "weights": weights},
            "digits": {"train_rows": int(len(y)), "val_rows": int(len(vy))}, "target": target,
            "pretrained": {"val_acc": tuned["val_acc"], "epochs_to_target": _epochs_to(tuned["val_acc"], target),
                           "seconds": tuned["seconds"]},
            "scratch": {"val_acc": scratch["val_acc"], "epochs_to_target": _epochs_to(scratch["val_acc"], target),
                        "seconds": scratch["seconds"]}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=("prepare", "run"))
    p.add_argument("--work", default="work/bench/transfer")
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--arch", default="timm/resnet18")
    p.add_argument("--pretrain-epochs", type=int, default=3)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--target", type=float, default=0.97)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--only", choices=("pretrained", "scratch"), help="one of the two fine-tunes (run both in parallel)")
    p.add_argument("--reuse", action="store_true", help="reuse the pretrained weights an earlier run saved in --work")
    args = p.parse_args(argv)
    setup_logging()
    if args.step == "prepare":
        print(json.dumps(prepare(args.work, args.rows)))
    else:
        print(json.dumps(run(args.work, args.arch, args.pretrain_epochs, args.epochs, args.target, args.lr,
                             args.reuse, args.only)))


if __name__ == "__main__":
    main()
