"""FSDP vs DDP peak memory per rank: the same wide model trained a few steps on 2 ranks with each strategy.

Run `python -m bench.fsdp_memory [--ranks 2] [--width 2048] [--layers 10] [--steps 4]`: each strategy runs in
its own torchrun job (ranks over gloo on CPU, NCCL on GPUs) through the product's ImageClassifier and the strategies
train() uses (Lightning's DDPStrategy, pipeline.distributed.fsdp.LakehouseFSDPStrategy); every rank reports its peak
RSS (and torch.cuda.max_memory_allocated on a GPU) and its RSS before the model was built (the interpreter and
libraries, the same for both). Prints one JSON line: per strategy the worst rank's figures, and FSDP / DDP ratios of
the peaks and of the peaks above that baseline (the part the model, its gradients and optimizer state take).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class _RssSampler:
    """The highest RSS seen every few milliseconds while it runs (the training steps' peak, not the model's build)."""

    def __init__(self, every_s: float = 0.002) -> None:
        import threading

        self.peak, self.every_s = 0.0, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        proc = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, proc.memory_info().rss / 2**20)
            self._stop.wait(self.every_s)

    def __enter__(self) -> "_RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def wide_network(width: int, layers: int, in_features: int, classes: int):
    """An MLP of `layers` width x width blocks (about layers * width^2 parameters) with a `head`."""
    from torch import nn

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            blocks: List[nn.Module] = [nn.Flatten(), nn.Linear(in_features, width), nn.ReLU()]
            for _ in range(layers):
                blocks += [nn.Linear(width, width), nn.ReLU()]
            self.body = nn.Sequential(*blocks)
            self.head = nn.Linear(width, classes)

        def forward(self, x):
            return self.head(self.body(x))

    return Wide()


def rank_job(strategy_name: str, out_dir: str, width: int, layers: int, steps: int) -> None:
    """One rank (under torchrun): build, train `steps` steps, write its memory figures to out_dir/<rank>.json."""
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from pipeline.config import ModelConfig
    from pipeline.distributed.devices import ddp_backend
    from pipeline.distributed.fsdp import LakehouseFSDPStrategy
    from pipeline.model.module import ImageClassifier

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    baseline = _rss_mb()
    backend = ddp_backend(cuda)
    strategy = (LakehouseFSDPStrategy(process_group_backend=backend) if strategy_name == "fsdp"
                else DDPStrategy(process_group_backend=backend))
    net = wide_network(width, layers, 32 * 32, 10)
    params = sum(p.numel() for p in net.parameters())
    model = ImageClassifier(net, 10, ModelConfig(optimizer="adam", lr=1e-4), 1e-4, steps_per_epoch=steps, max_epochs=1)
    g = torch.Generator().manual_seed(rank)
    ds = TensorDataset(torch.randn(steps * 8, 1, 32, 32, generator=g), torch.randint(0, 10, (steps * 8,), generator=g))
    trainer = pl.Trainer(max_epochs=1, accelerator="gpu" if cuda else "cpu", devices=size, strategy=strategy,
                         logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                         limit_val_batches=1)
    started = time.perf_counter()
    with _RssSampler() as sampled:
        trainer.fit(model, DataLoader(ds, batch_size=8), DataLoader(ds, batch_size=8))
    out = {"rank": rank, "strategy": strategy_name, "params": params, "baseline_rss_mb": baseline,
           "peak_rss_mb": _peak_rss_mb(), "fit_peak_rss_mb": sampled.peak, "seconds": time.perf_counter() - started}
    if cuda:
        out["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    with open(os.path.join(out_dir, f"{strategy_name}-{rank}.json"), "w") as fh:
        json.dump(out, fh)


def measure(ranks: int = 2, width: int = 2048, layers: int = 10, steps: int = 4,
            timeout_s: int = 900) -> Dict[str, Any]:
    """Both strategies, one torchrun job each; the worst rank's figures and the FSDP / DDP ratios."""
    results: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fsdp-memory-") as out_dir:
        for name in ("ddp", "fsdp"):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                   "-m", "bench.fsdp_memory", "--rank-job", name, "--out", out_dir, "--width", str(width),
                   "--layers", str(layers), "--steps", str(steps)]
            # glibc returns freed large blocks to the OS only when they were mmapped: a fixed threshold keeps RSS the
            # memory in use (its default threshold grows after the first large free, and RSS then keeps dead heap)
            env = dict(os.environ, OMP_NUM_THREADS="1", LAKEHOUSE_PROGRESS="0", MALLOC_MMAP_THRESHOLD_="131072")
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
            if done.returncode:
                raise RuntimeError(f"{name} ranks failed ({done.returncode}): {done.stderr[-3000:]}")
            per_rank = [json.load(open(os.path.join(out_dir, f"{name}-{r}.json"))) for r in range(ranks)]
            worst = max(per_rank, key=lambda r: r["peak_rss_mb"])
            results[name] = {**worst, "above_baseline_mb": max(r["peak_rss_mb"] - r["baseline_rss_mb"]
                                                                for r in per_rank),
                             "fit_peak_rss_mb": max(r["fit_peak_rss_mb"] for r in per_rank),
                             "fit_above_baseline_mb": max(r["fit_peak_rss_mb"] - r["baseline_rss_mb"]
                                                          for r in per_rank)}
    d, f = results["ddp"], results["fsdp"]
    results["ratio_peak_rss"] = f["peak_rss_mb"] / d["peak_rss_mb"]
    results["ratio_above_baseline"] = f["above_baseline_mb"] / d["above_baseline_mb"]
    results["ratio_fit_peak_rss"] = f["fit_peak_rss_mb"] / d["fit_peak_rss_mb"]
    results["ratio_fit_above_baseline"] = f["fit_above_baseline_mb"] / d["fit_above_baseline_mb"]
    if "cuda_max_allocated_mb" in d:
        results["ratio_cuda_max_allocated"] = f["cuda_max_allocated_mb"] / d["cuda_max_allocated_mb"]
    results["target"] = "FSDP peak memory per rank <= 0.6 x DDP's (>= 20M parameters, 2 ranks)"
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rank-job", choices=("ddp", "fsdp"))
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.rank_job:
        rank_job(args.rank_job, args.out, args.width, args.layers, args.steps)
        return
    print(json.dumps(measure(args.ranks, args.width, args.layers, args.steps)))


if __name__ == "__main__":
    main()
